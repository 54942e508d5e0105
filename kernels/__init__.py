"""Paged-KV-cache kernels: write new K/V into the cache, and attention over it.

KV cache layout (the single place it is stated; every path uses it):

    key_cache, value_cache: [num_blocks, num_kv_heads, block_size, head_dim]   (head-major)

Token position ``p`` of a request whose block table is ``block_ids`` lives in slot
``block_ids[p // block_size] * block_size + p % block_size``; slot ``s`` is
``cache[s // block_size, :, s % block_size, :]``.

Head-major was chosen over vLLM's ``[num_blocks, block_size, num_kv_heads, head_dim]`` because the CPU
path's vectorised decode attention measured faster with it, and the C++ kernels read one KV head's
``block_size x head_dim`` slice of a block as one contiguous tile (see docs/performance.md).

Dispatch (backends):

* ``"triton"``: CUDA tensors (``kernels.triton_ops``); on CUDA the RMSNorm is Triton's too (one program
  per row), the other decoder-layer ops (RoPE, SiLU-and-mul) are torch's.
* ``"cpp"``: CPU tensors, the fused C++ kernels (``kernels.cpu_ops``), compiled on first use and cached.
  If the extension cannot be built (no compiler, build error), CPU calls fall back to ``"torch"``
  after one warning naming the reason.
* ``"torch"``: the torch path (``kernels.torch_ops``): the test oracle.

Set the switch ``CBP_ATTENTION_BACKEND`` (:mod:`kernels.envs`) to ``torch``, ``cpp`` or ``triton`` (or call
:func:`set_backend`) to force one for every call; a forced ``cpp`` that cannot be built raises.
``CBP_CPU_MAX_ISA`` makes the C++ build and every CPU choice behave as on a lower CPU class
(:mod:`kernels.cpu_features`).
"""

from __future__ import annotations

import logging

import torch

from kernels import cpu_ops as _cpu_ops  # plain Python: the C++ is built on the first CPU call
from kernels import envs, torch_ops

BACKENDS = ("torch", "cpp", "triton")
_FORCED: str | None = envs.CBP_ATTENTION_BACKEND
_log = logging.getLogger(__name__)
_cpp_ok: bool | None = None  # None: not tried yet in this process


def set_backend(name: str | None) -> None:
    """Force ``"torch"``, ``"cpp"`` or ``"triton"`` for every call, or ``None`` for automatic dispatch.

    Raises:
        ValueError: for any other name.
    """
    global _FORCED
    if name not in (None, *BACKENDS):
        raise ValueError(f"unknown attention backend {name!r}; use 'torch', 'cpp', 'triton' or None")
    _FORCED = name


def cpp_available() -> bool:
    """Whether the C++ CPU kernels load (built on the first call; tried once per process). When they
    do not, logs one warning with the reason."""
    global _cpp_ok
    if _cpp_ok is None:
        _cpp_ok = _cpu_ops.available()
        if not _cpp_ok:
            _log.warning("CPU attention: C++ kernels unavailable (%s); using the torch path",
                         _cpu_ops.unavailable_reason())
    return _cpp_ok


def backend_for(t: torch.Tensor) -> str:
    """The backend that a call on tensor ``t`` would use: ``"triton"``, ``"cpp"`` or ``"torch"``.
    On a CPU tensor this builds the C++ extension the first time (about a minute, then cached)."""
    if _FORCED is not None:
        return _FORCED
    if t.is_cuda:
        return "triton"
    if t.device.type == "cpu" and cpp_available():
        return "cpp"
    return "torch"


def _impl(t: torch.Tensor):
    if _FORCED is None and _cpp_ok and t.device.type == "cpu":  # the common CPU case, decided once
        return _cpu_ops
    name = backend_for(t)
    if name == "triton":
        from kernels import triton_ops  # imported lazily: triton is optional on CPU-only machines

        return triton_ops
    if name == "cpp":
        return _cpu_ops  # when forced and unbuildable, its calls raise cpu_ops.BuildError
    return torch_ops


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the paged caches at
    ``slot_mapping`` ``[num_tokens]`` (int32/int64; -1 = skip). In place; returns None."""
    return _impl(key).reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out=None, **kw):
    """Causal attention of a packed batch over the paged cache; see :func:`kernels.torch_ops.paged_attention`."""
    return _impl(query).paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out=out, **kw
    )


def _layer_impl(t: torch.Tensor):
    """The decoder-layer elementwise ops: the C++ ones on CPU tensors when the attention backend there is
    ``cpp`` (or automatic and built), else torch (CUDA tensors too)."""
    if t.device.type == "cpu" and _FORCED != "torch" and (_FORCED == "cpp" or cpp_available()):
        return _cpu_ops
    return torch_ops


def _norm_impl(t: torch.Tensor):
    """RMSNorm: Triton's one-program-per-row kernel on CUDA tensors (unless the torch backend is forced),
    else as :func:`_layer_impl`."""
    if t.is_cuda and _FORCED in (None, "triton"):
        from kernels import triton_ops

        return triton_ops
    return _layer_impl(t)


def rms_norm(x, weight, eps, out=None):
    """RMSNorm of each row of ``x`` ``[num_tokens, hidden]``; see :func:`kernels.torch_ops.rms_norm`."""
    return _norm_impl(x).rms_norm(x, weight, eps, out=out)


def fused_add_rms_norm(x, residual, weight, eps) -> None:
    """In place ``residual += x; x = rms_norm(residual)``; see :func:`kernels.torch_ops.fused_add_rms_norm`."""
    return _norm_impl(x).fused_add_rms_norm(x, residual, weight, eps)


def rotary_embedding(positions, q, k, cos, sin, head_dim) -> None:
    """RoPE in place on ``q`` and ``k``; see :func:`kernels.torch_ops.rotary_embedding`."""
    return _layer_impl(q).rotary_embedding(positions, q, k, cos, sin, head_dim)


def silu_and_mul(x, out=None):
    """``silu(gate) * up`` of ``x`` ``[num_tokens, 2 * I]``; see :func:`kernels.torch_ops.silu_and_mul`."""
    return _layer_impl(x).silu_and_mul(x, out=out)


def logits_argmax(logits):
    """``(index int64 [S], finite bool [S])`` of ``logits`` ``[S, vocab]``: each row's first argmax (as
    ``torch.argmax(logits.float(), dim=-1)``) and whether the row is all finite; one pass in C++ on CPU.
    See :func:`kernels.torch_ops.logits_argmax`."""
    return _layer_impl(logits).logits_argmax(logits)
