"""Linear layers on weights prepacked for oneDNN (CPU inference).

:class:`PackedLinear` keeps a weight reordered once into oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``) and calls ``torch.ops.mkldnn._linear_pointwise``: no
per-call weight reorder. Whether a weight is packed is decided by the CPU's features, the dtype and one
deterministic check, never by timings taken at start-up (two starts on a busy machine would otherwise
run different kernels): :func:`packs` says yes for bfloat16 weights on CPUs with native bfloat16
(AVX512-BF16 or AMX-BF16), where the packed call measured faster at every row count the engine runs
(docs/performance.md), when the packed call gives results bit-identical to ``F.linear`` on a fixed
input (:func:`packed_equal`). float32 results differ in the last bits (oneDNN's summation order differs
from MKL's), so float32 stays on ``F.linear``; float16 packing needs AVX512-FP16 / AVX-NE-CONVERT.

On CPUs whose bfloat16 matmul does not outrun float32 (:func:`bf16_matmul_outruns_f32` is False: Intel
CPUs with AVX512-BF16 but no AMX, and CPUs without native bfloat16), :class:`Linear` also keeps a float32
copy of a bfloat16 weight and multiplies calls of at least :data:`F32_MIN_ROWS` rows in float32 (MKL), where
that measured faster; below, the packed bfloat16 call, which reads half the bytes, is faster. A product of two
bfloat16 values is exact in float32 and both GEMMs accumulate in float32, so the float32 call is the same
arithmetic in another summation order; its output is rounded to bfloat16. The copy costs 4 bytes per
parameter; ``CBP_CPU_F32_LINEARS=0`` turns it off.

On those same CPUs, where the C++ extension has its AVX-512 GEMM (:func:`own_gemm_cpu`), a bfloat16
:class:`Linear` uses the engine's own GEMM instead of both (``kernels/csrc/gemm_bf16_cpu.cpp``): the
weight packed once into 16-column blocks of k pairs (:func:`pack_gemm_weight`, 2 bytes per parameter,
as oneDNN's packed copy), widened to float32 in registers, float32 FMAs with one accumulator per output
in k order, so a row's result does not depend on the other rows (batch-invariant mode needs no row tiles
there). On AMD CPUs with AVX512-BF16 (:func:`gemm_dot_products`) the same GEMM multiplies the packed pairs
with VDPBF16PS instead, still one accumulator per output, k pair by pair (the odd element of a pair first).
``CBP_CPU_OWN_GEMM=0`` turns it off.

On CPUs with AVX2 and FMA but no AVX-512 (:func:`own_gemm_f32_cpu`), where float32 is the engine's dtype, a
float32 :class:`Linear` uses the engine's own float32 GEMM (``kernels/csrc/gemm_f32_cpu.cpp``): the weight
packed once into 16-column blocks (:func:`pack_gemm_weight_f32`, 4 bytes per parameter), 6 x 16 register
tiles of float32 FMAs, one accumulator per output in k order, so batch invariant as it is.

Each choice's speed against the library call it replaces, per CPU class: ``python -m bench.cpu_linears``
(figures in docs/performance.md; the choices in docs/kernels.md).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_features, cpu_ops, envs

_log = logging.getLogger(__name__)


def available() -> bool:
    """Whether torch has oneDNN (mkldnn) support on this CPU."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


class PackedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` prepacked for oneDNN. Same inputs and outputs as the ``nn.Linear``
    it replaces (any leading dimensions). ``weight`` stays readable (the original tensor, not a
    parameter, no copy), so the engine's own forward can still be built from a packed model."""

    def __init__(self, linear: nn.Linear, packed: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight.detach()
        with torch.no_grad():
            self.register_buffer("packed_weight", _pack(linear.weight) if packed is None else packed, persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, oneDNN-packed"


def _cpuinfo() -> tuple[str, str]:
    """``(vendor_id, flags)`` of the CPU as the kernels see it (capped by ``CBP_CPU_MAX_ISA``:
    :func:`kernels.cpu_features.cpu_info`; empty strings off Linux)."""
    return cpu_features.cpu_info()


@functools.cache
def native_bf16() -> bool:
    """Whether this CPU has native bfloat16 arithmetic (AVX512-BF16 or AMX-BF16; Linux CPU flags; read once
    per process)."""
    words = set(_cpuinfo()[1].split())
    return "avx512_bf16" in words or "amx_bf16" in words


@functools.cache
def bf16_matmul_outruns_f32() -> bool:
    """Whether this CPU's bfloat16 matmul is faster than its float32 one at the engine's row counts,
    decided from the CPU's flags and vendor (read once per process), never from a timing: AMX-BF16 (tile
    matmuls: about 2,400 GFLOP/s measured on 2 cores against about 260 for float32), or AVX512-BF16 on an
    AMD CPU (Zen 4 / 5: a bf16 matmul measured 318 GFLOP/s on 2 vCPUs, above their float32 FMA peak).
    False on Intel CPUs with AVX512-BF16 but no AMX (there oneDNN's bf16 GEMM ran at 125-171 GFLOP/s
    against MKL's float32 at 155-275, same shapes) and on CPUs without native bfloat16."""
    vendor, flags = _cpuinfo()
    words = set(flags.split())
    return "amx_bf16" in words or ("avx512_bf16" in words and vendor == "AuthenticAMD")


F32_MIN_ROWS = 48  # rows from which a bfloat16 Linear multiplies in float32 where bf16 matmuls are slow


@functools.cache
def gemm_dot_products() -> bool:
    """Whether the own GEMM multiplies with VDPBF16PS on this CPU (decided from its flags and vendor,
    read once per process, never from a timing): an AMD CPU with AVX512-BF16 and no AMX, where the
    instruction runs at twice the float32 FMA rate (Zen 4 / 5). Elsewhere it multiplies widened weights
    with float32 FMAs: on Intel CPUs without AMX VDPBF16PS retires at about a quarter of the FMA rate."""
    vendor, flags = _cpuinfo()
    words = set(flags.split())
    return vendor == "AuthenticAMD" and "avx512_bf16" in words and "amx_bf16" not in words


@functools.cache
def own_gemm_cpu() -> bool:
    """Whether bfloat16 linears on this CPU use the engine's own GEMM (``kernels/csrc/gemm_bf16_cpu.cpp``).
    With :func:`gemm_dot_products` (AMD's AVX512-BF16) when the extension has the VDPBF16PS path: measured
    1.2-1.4x oneDNN's bfloat16 GEMM at 8-128 rows and level at 512 on a 2-vCPU EPYC. Otherwise when
    :func:`bf16_matmul_outruns_f32` is False (AMX keeps oneDNN's tile GEMM, far faster) and the extension
    loads with its AVX-512 ``gemm_bf16``. Decided from the CPU's flags and the build, never from a timing;
    ``CBP_CPU_OWN_GEMM=0`` turns it off. Read once per process (may build the extension, about a minute
    on a CPU's first start)."""
    if not envs.CBP_CPU_OWN_GEMM:
        return False
    if gemm_dot_products():
        return cpu_ops.gemm_bf16_dp_available()
    if bf16_matmul_outruns_f32():
        return False
    return cpu_ops.gemm_bf16_available()


@functools.cache
def own_gemm_f32_cpu() -> bool:
    """Whether float32 linears on this CPU use the engine's own float32 GEMM (``kernels/csrc/gemm_f32_cpu.cpp``):
    on CPUs with AVX2 and FMA but no AVX-512, where float32 is the engine's dtype, when the extension has
    ``gemm_f32``. Measured on a 2-vCPU AMD EPYC (Zen 3, AVX2 only): the decode step's 121 linears 1.3-3.8x
    faster than torch's float32 ``F.linear`` (MKL) at 1-96 rows, 0.95-1.6x at 128-512 (docs/performance.md). AVX-512 CPUs run bfloat16 by
    default and keep ``F.linear`` for float32 unless ``CBP_CPU_OWN_GEMM_F32=1`` (not measured there). Decided
    from the CPU's flags and the build, never from a timing; ``CBP_CPU_OWN_GEMM=0`` or
    ``CBP_CPU_OWN_GEMM_F32=0`` turns it off. Read once per process."""
    if not envs.CBP_CPU_OWN_GEMM:
        return False
    forced = envs.CBP_CPU_OWN_GEMM_F32
    if forced is False:
        return False
    words = set(_cpuinfo()[1].split())
    if forced is not True and not ("avx2" in words and "fma" in words and "avx512f" not in words):
        return False
    return cpu_ops.gemm_f32_available()


def uses_own_gemm(weight: torch.Tensor) -> bool:
    """Whether :class:`Linear` multiplies by ``weight`` ``[out_features, in_features]`` with the own GEMM:
    a CPU weight with ``out_features`` a multiple of 16 and, in bfloat16, ``in_features`` even, where
    :func:`own_gemm_cpu` holds; in float32, where :func:`own_gemm_f32_cpu` holds."""
    if not (weight.device.type == "cpu" and weight.dim() == 2 and weight.shape[0] % 16 == 0):
        return False
    if weight.dtype == torch.bfloat16:
        return weight.shape[1] % 2 == 0 and own_gemm_cpu()
    return weight.dtype == torch.float32 and own_gemm_f32_cpu()


def pack_gemm_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` (N a multiple of 16, K even) as the own GEMM reads it: ``[N/16, K/2, 16, 2]``,
    for each block of 16 output columns and each pair of k the 16 columns' two values (a new tensor of
    the same bytes)."""
    n, k = weight.shape
    return weight.detach().reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def pack_gemm_weight_f32(weight: torch.Tensor) -> torch.Tensor:
    """A float32 ``weight`` ``[N, K]`` (N a multiple of 16) as the own float32 GEMM reads it: ``[N/16, K, 16]``,
    for each block of 16 output columns and each k the 16 columns' values (a new tensor of the same bytes)."""
    n, k = weight.shape
    return weight.detach().reshape(n // 16, 16, k).transpose(1, 2).contiguous()


def f32_compute(weight: torch.Tensor) -> bool:
    """The float32-compute rule of :class:`Linear`: a CPU bfloat16 weight on a CPU where
    :func:`bf16_matmul_outruns_f32` is False, unless ``CBP_CPU_F32_LINEARS=0``."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and not bf16_matmul_outruns_f32()
            and bool(envs.CBP_CPU_F32_LINEARS))


def makes_float32_copy(weight: torch.Tensor, row_tile: int | None = None) -> bool:
    """Whether :class:`Linear` keeps a float32 copy of ``weight``: :func:`f32_compute` holds and its calls
    can reach :data:`F32_MIN_ROWS` rows (no fixed ``row_tile`` below that, as in batch-invariant mode), and
    the own GEMM does not take this weight (:func:`uses_own_gemm`)."""
    return f32_compute(weight) and (row_tile is None or row_tile >= F32_MIN_ROWS) and not uses_own_gemm(weight)


_EQUAL: dict[tuple, bool] = {}  # per process: (out, in, dtype, bias) -> packed_equal()


def packed_equal(weight: torch.Tensor, bias: torch.Tensor | None = None, rows=(1, 16, 64), seed: int = 0) -> bool:
    """Whether the packed oneDNN call gives outputs bit-identical to ``F.linear`` for ``weight``
    ``[out, in]`` (and ``bias``) on fixed random inputs of each row count in ``rows``; False when the
    packed call is not supported here. Deterministic: no timing."""
    key = (*weight.shape, weight.dtype, bias is not None, tuple(rows))
    if key in _EQUAL:
        return _EQUAL[key]
    ok = True
    try:
        packed = _pack(weight)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for r in rows:
                x = torch.randn(r, weight.shape[1], generator=g).to(weight.dtype)
                y = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
                if not torch.equal(y, F.linear(x, weight, bias)):
                    ok = False
                    break
    except RuntimeError:
        ok = False
    _EQUAL[key] = ok
    _log.debug("prepack %s %s: equal=%s", tuple(weight.shape), weight.dtype, ok)
    return ok


def packs(weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """The packing rule: a CPU bfloat16 weight, on a CPU with native bfloat16, whose packed call is
    bit-identical to ``F.linear`` (:func:`packed_equal`)."""
    return (available() and weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and native_bf16()
            and packed_equal(weight, bias))


BATCH_INVARIANT_ROWS = 32  # the fixed row tile of batch-invariant linears (rows)


class Linear:
    """``y = x W^T + b`` for the engine's forward: the own GEMM (bfloat16, or float32 on AVX2-only CPUs) on a
    packed copy where :func:`uses_own_gemm` says so (``gemm``); else prepacked for oneDNN where :func:`packs`
    says so, else ``F.linear`` on the weight as given (no copy); calls of at least :data:`F32_MIN_ROWS` rows in float32 on a float32 copy
    of a bfloat16 weight where :func:`makes_float32_copy` says so (``weight32``).

    Batch invariance (``row_tile``): a GEMM library picks its kernel and its summation order from the
    row count M (MKL's float32 ``M = 1`` is a GEMV; oneDNN's bfloat16 LM head changes order from
    M = 63), so a row's result depends on how many other rows share the call. With ``row_tile = R`` every
    call has exactly R rows (the input is cut into tiles of R rows, the last one padded with zeros): a
    row's result then depends on its own values only, whatever its neighbours and its place in the tile
    (checked for R = 16, 32, 64 in tests/test_batch_invariance.py). The idea is that of Thinking
    Machines' "Defeating Nondeterminism in LLM Inference" (2025), done here by fixing the shape
    instead of writing batch-invariant kernels. The own GEMM is batch invariant by construction (one
    accumulator per output in k order), so a Linear on it ignores ``row_tile``: one call on all rows.

    Args:
        weight: ``[out_features, in_features]``; bias: ``[out_features]`` or None.
        row_tile: None (one call on all rows: fastest), or the fixed rows of every call.

    Call with ``x`` ``[num_tokens, in_features]`` -> ``[num_tokens, out_features]`` in the weight's dtype.
    """

    __slots__ = ("weight", "bias", "gemm", "gemm_dp", "packed", "out_features", "row_tile", "weight32", "bias32")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, row_tile: int | None = None) -> None:
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.out_features = weight.shape[0]
        own = uses_own_gemm(self.weight)
        f32 = self.weight.dtype == torch.float32
        self.gemm = (pack_gemm_weight_f32 if f32 else pack_gemm_weight)(self.weight) if own else None
        self.gemm_dp = own and not f32 and gemm_dot_products()  # the own bfloat16 GEMM's VDPBF16PS path
        self.packed = _pack(self.weight) if self.gemm is None and packs(self.weight, self.bias) else None
        self.row_tile = row_tile
        # float32 copies for calls of >= F32_MIN_ROWS rows (see the module docstring)
        use32 = makes_float32_copy(self.weight, row_tile)
        self.weight32 = self.weight.float() if use32 else None
        # the float32 bias of that path, and of the own GEMM (which adds it in float32), made once here
        self.bias32 = None if (self.bias is None or not (use32 or self.gemm is not None)) else self.bias.float()

    def _call(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemm is not None and x.dtype == self.gemm.dtype:
            if x.dtype == torch.float32:
                return cpu_ops.gemm_f32(x, self.gemm, self.bias32)
            return cpu_ops.gemm_bf16(x, self.gemm, self.bias32, self.gemm_dp)
        if self.weight32 is not None and x.shape[0] >= F32_MIN_ROWS:
            return F.linear(x.float(), self.weight32, self.bias32).to(x.dtype)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        r = None if self.gemm is not None else self.row_tile  # the own GEMM is batch invariant as it is
        if r is None or x.shape[0] in (0, r):  # 0 rows: a step of partial prefill chunks samples nothing
            return self._call(x)
        m = x.shape[0]
        pad = -m % r
        if pad:
            x = torch.cat([x, x.new_zeros((pad, x.shape[1]))])
        return torch.cat([self._call(x[i : i + r]) for i in range(0, m + pad, r)])[:m]


def _targets(model: nn.Module, lm_head: bool):
    """``(parent, attr, name, module)`` of each plain nn.Linear in the decoder layers (and lm_head)."""
    out = []
    for pname, parent in model.named_modules():
        for attr, child in parent.named_children():
            if type(child) is not nn.Linear:
                continue
            name = f"{pname}.{attr}" if pname else attr
            in_layers = ".layers." in f".{name}"
            if in_layers or (lm_head and attr == "lm_head"):
                out.append((parent, attr, name, child))
    return out


def prepack_linears(model: nn.Module, *, lm_head: bool = True) -> int:
    """Replace the decoder layers' ``nn.Linear`` modules (and ``lm_head`` if ``lm_head``) by
    :class:`PackedLinear` where :func:`packs` says so for their weight. CPU models only.

    Returns:
        The number of modules replaced (0 when oneDNN is unavailable, the model is not on the CPU, or
        no weight qualifies).
    """
    if not available():
        return 0
    targets = _targets(model, lm_head)
    if not targets or any(m.weight.device.type != "cpu" for *_, m in targets):
        return 0
    n = 0
    for parent, attr, _name, lin in targets:
        if packs(lin.weight, lin.bias):
            setattr(parent, attr, PackedLinear(lin))
            n += 1
    return n
