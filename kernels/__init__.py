"""Paged-KV-cache kernels: write new K/V into the cache, and attention over it.

KV cache layout (the single place it is stated; every path uses it):

    key_cache, value_cache: [num_blocks, num_kv_heads, block_size, head_dim]   (head-major)

Token position ``p`` of a request whose block table is ``block_ids`` lives in slot
``block_ids[p // block_size] * block_size + p % block_size``; slot ``s`` is
``cache[s // block_size, :, s % block_size, :]``.

Head-major was chosen over vLLM's ``[num_blocks, block_size, num_kv_heads, head_dim]`` because the CPU
path's vectorised decode attention measured faster with it (see DESIGN.md and docs/performance.md).

Dispatch: CUDA tensors use the Triton kernels (``kernels.triton_ops``), CPU tensors use the torch path
(``kernels.torch_ops``), which is also the test oracle. Set the environment variable
``CBP_ATTENTION_BACKEND`` to ``torch`` or ``triton`` (or call :func:`set_backend`) to force one.
"""

from __future__ import annotations

import os

import torch

from kernels import torch_ops

_FORCED: str | None = os.environ.get("CBP_ATTENTION_BACKEND") or None


def set_backend(name: str | None) -> None:
    """Force ``"torch"`` or ``"triton"`` for every call, or ``None`` for automatic dispatch.

    Raises:
        ValueError: for any other name.
    """
    global _FORCED
    if name not in (None, "torch", "triton"):
        raise ValueError(f"unknown attention backend {name!r}; use 'torch', 'triton' or None")
    _FORCED = name


def backend_for(t: torch.Tensor) -> str:
    """The backend that a call on tensor ``t`` would use: ``"triton"`` or ``"torch"``."""
    if _FORCED is not None:
        return _FORCED
    return "triton" if t.is_cuda else "torch"


def _impl(t: torch.Tensor):
    if backend_for(t) == "triton":
        from kernels import triton_ops  # imported lazily: triton is optional on CPU-only machines

        return triton_ops
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
