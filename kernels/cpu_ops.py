"""Fused CPU kernels for the paged KV cache: a C++ extension (``kernels/csrc/paged_attention_cpu.cpp``)
built with ``torch.utils.cpp_extension.load`` the first time it is needed, then cached.

Same signatures and KV layout as :mod:`kernels.torch_ops` (``[num_blocks, num_kv_heads, block_size,
head_dim]``). :func:`paged_attention` reads each K/V block in place through the block table (no gather
copy), with an online (flash-attention style) softmax in float32, GQA query heads processed together
per KV head, decode rows and causal prefill chunks in one call, parallel over (sequence, KV head, query
tile) with OpenMP. See the C++ source for the tiling.

Build: compiled with ``-O3 -march=native -fopenmp`` (kept within ``CBP_CPU_MAX_ISA`` when set:
:mod:`kernels.cpu_features`) by the system C++ compiler (``$CXX`` or ``c++``) and the pinned ninja, into
``$CBP_KERNEL_BUILD_DIR`` or torch's extensions folder (``$TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``), under an OS file lock so that concurrent starts share one build
(:mod:`kernels.cpu_build`). The extension name carries a tag of this CPU's vector features, so a cache
directory shared by different CPUs never loads a binary built for another one, and a tag of the sources,
the flags and the checkout's path, so two checkouts (or two versions, or two forced CPU classes) on one
machine keep one build each instead of rebuilding each other's at every start. The first build takes 1-2
minutes on two idle cores; later processes load it in about a second.

:func:`load` returns the module or raises :class:`BuildError`; :func:`available` says whether it loads
(and remembers the reason when it does not). ``kernels/__init__.py`` falls back to the torch path then.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import torch

from kernels import cpu_features, envs, torch_ops
from kernels.cpu_build import BuildError, build_and_load

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / "paged_attention_cpu.cpp", _CSRC / "fused_ops_cpu.cpp", _CSRC / "logits_cpu.cpp",
            _CSRC / "gemm_bf16_cpu.cpp", _CSRC / "gemm_f32_cpu.cpp", _CSRC / "decoder_cpu.cpp"]
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-DNDEBUG"]
_LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_module = None
_error: str | None = None


def _cpu_tag() -> str:
    """A short tag of the CPU's vector features (the extension is compiled with -march=native)."""
    flags = cpu_features.native_cpu_info()[1]
    words = sorted(w for w in flags.split() if w.startswith(("avx", "sse", "fma", "f16c", "amx", "asimd", "sve")))
    return hashlib.sha1(" ".join(words).encode()).hexdigest()[:8]


def cflags() -> list[str]:
    """The compiler flags of the build: ``-O3 -march=native -fopenmp``, and those that keep it within
    ``CBP_CPU_MAX_ISA`` (:func:`kernels.cpu_features.build_cflags`)."""
    return _CFLAGS + cpu_features.build_cflags()


def _source_tag() -> str:
    """A short hash of the extension's sources, the compiler flags and the sources' folder: a build
    folder per version, per forced CPU class and per checkout (torch keeps one folder per extension name,
    and a folder built from other sources or another checkout's absolute paths is rebuilt from scratch)."""
    h = hashlib.sha1()
    for src in sorted(_CSRC.iterdir()):
        if src.suffix in (".cpp", ".h"):
            h.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    h.update(" ".join(cflags() + _LDFLAGS).encode() + b"\0" + str(_CSRC.resolve()).encode())
    return h.hexdigest()[:8]


def extension_name() -> str:
    """The extension's name: ``cbp_cpu_attention_<CPU tag>_<sources and flags tag>``."""
    return f"cbp_cpu_attention_{_cpu_tag()}_{_source_tag()}"


LOAD_INFO: dict = {}  # how the extension was loaded: name, seconds, compiled, waited, isa, directory


def _build():
    mod, info = build_and_load(extension_name(), [str(s) for s in _SOURCES], extra_cflags=cflags(),
                               extra_ldflags=_LDFLAGS, extra_include_paths=[str(_CSRC)])
    LOAD_INFO.update(info, isa=mod.isa())
    return mod


def load():
    """The compiled extension (built on first use, then cached). Raises :class:`BuildError`."""
    global _module, _error
    if _module is not None:
        return _module
    with _lock:
        if _module is None:
            if _error is not None:
                raise BuildError(_error)
            try:
                _module = _build()
            except BuildError as e:
                _error = str(e)
                raise
    return _module


def available() -> bool:
    """True when the extension builds/loads (tries once per process; see :func:`unavailable_reason`)."""
    try:
        load()
        return True
    except BuildError:
        return False


def unavailable_reason() -> str | None:
    """Why the extension is not available (None if it is, or has not been tried yet)."""
    return _error


def isa() -> str:
    """The instruction set the extension was compiled for, e.g. ``"avx512+bf16dp vl16"``."""
    return load().isa()


def attention_takes(dtype: torch.dtype, head_dim: int, key_cache: torch.Tensor) -> bool:
    """Whether the C++ paged attention takes queries of ``dtype`` with ``head_dim`` (elements) over
    ``key_cache`` (else :func:`paged_attention` takes the torch path): one dtype for both, float32, bfloat16
    or float16, head_dim a multiple of 16 up to 512, a contiguous cache."""
    return (
        dtype == key_cache.dtype
        and dtype in (torch.float32, torch.bfloat16, torch.float16)
        and head_dim % 16 == 0
        and head_dim <= 512
        and key_cache.is_contiguous()
    )


def _supported(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    return query.stride(-1) == 1 and attention_takes(query.dtype, query.shape[-1], key_cache)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the paged caches at
    ``slot_mapping`` (-1: skip). Same contract as :func:`kernels.torch_ops.reshape_and_cache`."""
    if (
        key.dtype != key_cache.dtype
        or value.dtype != value_cache.dtype
        or key.stride(-1) != 1
        or value.stride(-1) != 1
        or not key_cache.is_contiguous()
        or not value_cache.is_contiguous()
    ):
        return torch_ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    load().reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    seq_lens_list: list[int] | None = None,
    query_start_loc_list: list[int] | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Causal paged attention of a packed batch; same contract as :func:`kernels.torch_ops.paged_attention`.

    The lists are accepted for signature compatibility and not needed (the kernel reads the tensors);
    so is ``batch_invariant``: the kernel reads each sequence's keys in one fixed order whatever the batch,
    so it is batch invariant as it is. Shapes the kernel does not handle (head_dim not a multiple of 16, mixed dtypes, non-contiguous
    caches) go to the torch path.
    """
    if not _supported(query, key_cache) or (out is not None and (out.dtype != query.dtype or out.stride(-1) != 1)):
        return torch_ops.paged_attention(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out=out,
            seq_lens_list=seq_lens_list, query_start_loc_list=query_start_loc_list,
        )
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    load().paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, float(scale),
                           *attention_dot_products())
    return out


def attention_dot_products() -> tuple[bool, bool]:
    """``(bf16_dot, qk_dot)``: how the C++ attention multiplies bfloat16 caches (read at each call).
    ``bf16_dot``: Q K^T and P V with VDPBF16PS (``CBP_CPU_BF16_DOT``, off by default); ``qk_dot``: Q K^T
    with VDPBF16PS, P V in float32 (``CBP_CPU_QK_DOT``; by default on AMD CPUs, where the instruction runs
    at twice the float32 FMA rate, and off on Intel's, where it runs at a quarter). Both need an
    AVX512-BF16 build; other builds ignore them."""
    qk = envs.CBP_CPU_QK_DOT
    if qk is None:
        qk = cpu_features.cpu_info()[0] == "AuthenticAMD"
    return bool(envs.CBP_CPU_BF16_DOT), bool(qk)


def _rows_ok(*ts: torch.Tensor) -> bool:
    """2-D CPU tensors of one supported dtype with contiguous rows (what the C++ layer ops take)."""
    dt = ts[0].dtype
    return all(t.dim() == 2 and t.stride(1) == 1 and t.dtype == dt and t.device.type == "cpu" for t in ts) and \
        dt in (torch.float32, torch.bfloat16, torch.float16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as :func:`kernels.torch_ops.rms_norm`, one pass per row in C++."""
    if out is None:
        out = torch.empty_like(x)
    if not (_rows_ok(x, out) and weight.dtype == x.dtype and weight.is_contiguous()):
        return torch_ops.rms_norm(x, weight, eps, out=out)
    load().rms_norm(out, x, weight, float(eps))
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """Same contract as :func:`kernels.torch_ops.fused_add_rms_norm`, one pass per row in C++."""
    if not (_rows_ok(x, residual) and weight.dtype == x.dtype and weight.is_contiguous()):
        return torch_ops.fused_add_rms_norm(x, residual, weight, eps)
    load().fused_add_rms_norm(x, residual, weight, float(eps))


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, head_dim: int) -> None:
    """Same contract as :func:`kernels.torch_ops.rotary_embedding`, in place in C++."""
    if not (_rows_ok(q, k, cos, sin) and positions.dtype == torch.int64 and positions.is_contiguous()):
        return torch_ops.rotary_embedding(positions, q, k, cos, sin, head_dim)
    load().rotary_embedding(positions, q, k, cos, sin, int(head_dim))


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as :func:`kernels.torch_ops.silu_and_mul`, one pass in C++."""
    if out is None:
        out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype, device=x.device)
    if not _rows_ok(x, out):
        return torch_ops.silu_and_mul(x, out=out)
    load().silu_and_mul(out, x)
    return out


def _gemm_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the own GEMMs read it: a 2-D ``x`` with contiguous rows as it is, else a copy with
    contiguous rows (an empty view may keep a column stride: a fresh empty tensor, so the op's checks
    still run); anything else unchanged, for the op to refuse."""
    if x.dim() == 2 and x.shape[0] == 0:
        return x.new_empty((0, x.shape[1]))
    if x.dim() == 2 and x.stride(-1) != 1:
        return x.contiguous()
    return x


def gemm_bf16_available() -> bool:
    """Whether the extension loads and has the AVX-512 ``gemm_bf16`` (False off AVX-512 CPUs)."""
    return available() and bool(load().gemm_bf16_available())


def gemm_bf16_dp_available() -> bool:
    """Whether ``gemm_bf16`` also has its VDPBF16PS path (``dot_products=True``: an AVX512-BF16 build)."""
    return gemm_bf16_available() and bool(load().gemm_bf16_dp_available())


def gemm_bf16(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
              dot_products: bool = False) -> torch.Tensor:
    """``x W^T (+ bias)`` for a bfloat16 weight packed by :func:`kernels.cpu_linear.pack_gemm_weight`:
    float32 FMAs on weights widened in registers, or with ``dot_products`` VDPBF16PS on the bfloat16
    pairs as they are; one accumulator per output in k order either way (so a row's result never depends
    on the other rows: see ``kernels/csrc/gemm_bf16_cpu.cpp``). Bit-identical to
    :func:`kernels.torch_ops.gemm_bf16` with the same ``dot_products`` (except the bits of a NaN).

    Args:
        x: ``[M, K]`` bfloat16 (a copy is made if its rows are not contiguous); packed: ``[N/16, K/2, 16, 2]``
            bfloat16; bias: ``[N]`` (bfloat16 or float32) or None; dot_products: the VDPBF16PS path.

    Returns:
        ``[M, N]`` bfloat16.

    Raises:
        RuntimeError: on shapes or dtypes that do not match, where :func:`gemm_bf16_available` is False,
            or with ``dot_products`` where :func:`gemm_bf16_dp_available` is False.
    """
    if packed.dim() != 4:
        raise RuntimeError("gemm_bf16: packed must be [N/16, K/2, 16, 2] bfloat16")
    out = torch.empty((x.shape[0], packed.shape[0] * 16), dtype=torch.bfloat16)
    x = _gemm_rows(x)
    load().gemm_bf16(out, x, packed, torch.Tensor() if bias is None else bias, bool(dot_products))
    return out


def gemm_f32_available() -> bool:
    """Whether the extension loads and has ``gemm_f32`` (an AVX2-with-FMA or AVX-512 build)."""
    return available() and bool(load().gemm_f32_available())


def gemm_f32(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T (+ bias)`` for a float32 weight packed by :func:`kernels.cpu_linear.pack_gemm_weight_f32`:
    one float32 FMA chain per output in k order (so a row's result never depends on the other rows: see
    ``kernels/csrc/gemm_f32_cpu.cpp``). Bit-identical to :func:`kernels.torch_ops.gemm_f32` (except the
    bits of a NaN).

    Args:
        x: ``[M, K]`` float32 (a copy is made if its rows are not contiguous); packed: ``[N/16, K, 16]``
            float32; bias: ``[N]`` float32 or None.

    Returns:
        ``[M, N]`` float32.

    Raises:
        RuntimeError: on shapes or dtypes that do not match, or where :func:`gemm_f32_available` is False.
    """
    if packed.dim() != 3:
        raise RuntimeError("gemm_f32: packed must be [N/16, K, 16] float32")
    if bias is not None and bias.numel() != packed.shape[0] * 16:  # the op reads an empty bias as none
        raise RuntimeError(f"gemm_f32: bias must be [{packed.shape[0] * 16}]")
    out = torch.empty((x.shape[0], packed.shape[0] * 16), dtype=torch.float32)
    x = _gemm_rows(x)
    load().gemm_f32(out, x, packed, torch.Tensor() if bias is None else bias)
    return out


def logits_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`kernels.torch_ops.logits_argmax`, one pass per row in C++."""
    if not (_rows_ok(logits) and logits.shape[0] > 0 and logits.shape[1] > 0):
        return torch_ops.logits_argmax(logits)
    index = torch.empty(logits.shape[0], dtype=torch.int64)
    finite = torch.empty(logits.shape[0], dtype=torch.bool)
    load().logits_argmax(index, finite, logits)
    return index, finite


def decoder_layers_available() -> bool:
    """Whether the extension loads and has ``decoder_layers`` (every build of this source has it)."""
    return available() and hasattr(load(), "decoder_layers")


def decoder_layers(h: torch.Tensor, positions: torch.Tensor, weights: list[torch.Tensor], kv_caches: list[torch.Tensor],
                   block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                   slot_mapping: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                   head_dim: int, scale: float, eps: list[float], dot_products: bool,
                   timings: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every decoder layer of a Llama-family forward in one C++ call (``kernels/csrc/decoder_cpu.cpp``): the
    same kernels in the same order as :class:`engine.models.llama.LlamaLayer` calls them, so bit-identical to
    that loop, without the Python between them.

    Args:
        h: ``[T, hidden]`` contiguous bfloat16 or float32, the embedded tokens; used as the first layer's
            residual and updated in place.
        positions: ``[T]`` int64, contiguous.
        weights: 10 per layer: input norm, QKV (packed for the own GEMM), its float32 bias or an empty
            tensor, O and bias, post-attention norm, gate/up and bias, down and bias.
        kv_caches: key and value cache of each layer, ``[num_blocks, num_kv_heads, block_size, head_dim]``.
        block_tables, seq_lens, query_start_loc, slot_mapping: the step's attention metadata (int32, int32,
            int32, int64).
        cos, sin: ``[max_positions, head_dim // 2]`` RoPE tables in ``h``'s dtype.
        eps: each layer's norm epsilon (its input and post-attention norms use the same, as
            :class:`engine.models.llama.LlamaLayer` does).
        dot_products: the bfloat16 GEMM's VDPBF16PS path (as :class:`kernels.cpu_linear.Linear`'s ``gemm_dp``);
            the attention's dot products follow :func:`attention_dot_products`.
        timings: float64 ``[3]`` or None: seconds in the linears, the attention (with its cache write) and
            the rest are added to it.

    Returns:
        ``(h, residual)``, each ``[T, hidden]``: the last layer's output and the residual stream.

    Raises:
        RuntimeError: on shapes, dtypes or layouts the kernels do not take (the message names the check).
    """
    return load().decoder_layers(h, positions, weights, kv_caches, block_tables, seq_lens, query_start_loc,
                                 slot_mapping, cos, sin, int(num_heads), int(num_kv_heads), int(head_dim), float(scale),
                                 [float(e) for e in eps], bool(dot_products), *attention_dot_products(),
                                 torch.Tensor() if timings is None else timings)
