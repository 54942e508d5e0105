"""Triton kernels for the paged KV cache, host side: ``reshape_and_cache`` and ``paged_attention``; and the
decoder layer's RMSNorm (``rms_norm``, ``fused_add_rms_norm``).

Same signatures and semantics as :mod:`kernels.torch_ops` (the CPU path and the test oracle); the cache
layout is stated once in ``kernels/__init__.py``. The device code, and the design of the unified
attention kernel (query tiles, GQA folding, online softmax, split-KV), is in :mod:`kernels.triton_kernels`;
this module plans each launch (tile sizes, number of splits) from the shapes and launches it.

Host-side metadata: ``seq_lens_list`` / ``query_start_loc_list`` (optional keyword arguments, as in
the torch path) are used only for tile-size and split decisions; without them safe upper bounds from
the tensor shapes are used, so no device-to-host read happens either way. Tuning keywords
(``num_splits``, ``block_m``, ``tile_n``, ``num_warps``, ``num_stages``) may be passed to force a
configuration (tests and the bench use them); any other keyword argument is accepted and ignored.
The launch grid depends on those decisions, so a CUDA-graph capture must fix them (e.g. pass
``num_splits``) for the captured shapes.
"""

from __future__ import annotations

import math

import torch
import triton

from kernels.triton_kernels import (  # noqa: F401  (re-exported: the bench compiles them by name)
    LOG2E,
    _reduce_splits_kernel,
    _reshape_and_cache_kernel,
    _rms_norm_kernel,
    _unified_attention_kernel,
)

MIN_SPLIT_TOKENS = 256  # a split-KV share is never shorter than this many keys
MAX_SPLITS = 64
_SM_COUNT: dict[int, int] = {}  # CUDA device index -> number of SMs


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new K/V rows into the paged cache (in place; returns None).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]`` (any float dtype, any strides with a
            contiguous last dimension; cast to the cache dtype on store).
        key_cache, value_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``, contiguous last
            dimension, modified in place.
        slot_mapping: ``[num_tokens]`` int32/int64; token ``t`` goes to slot ``slot_mapping[t]``,
            i.e. ``cache[slot // block_size, :, slot % block_size, :]``; ``-1`` means "do not write".
    """
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, num_kv_heads, block_size, head_dim = key_cache.shape
    assert key.shape == (num_tokens, num_kv_heads, head_dim), (key.shape, key_cache.shape)
    assert value.shape == key.shape and value_cache.shape == key_cache.shape
    assert slot_mapping.shape[0] == num_tokens
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    if slot_mapping.stride(0) != 1:
        slot_mapping = slot_mapping.contiguous()
    assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1, "cache needs a contiguous last dim"
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        H_PAD=triton.next_power_of_2(num_kv_heads),
        D_PAD=triton.next_power_of_2(head_dim),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 2,
    )


# ----------------------------------------------------------------------------------------------

def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: small, so that the automatic choice also exercises split-KV in tests
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _default_config(is_fp32: bool, head_dim: int, group: int, max_q_len: int) -> dict:
    """Tile sizes and launch options for one call: ``block_m`` query rows per program (16 when only
    short queries are present, as in decode; 64 when a prefill chunk is), ``tile_n`` keys per inner
    step, ``num_warps`` and ``num_stages``. Chosen so that the Hopper build (sm_90) spills no
    registers; see ``python -m bench.compile_report``. Not tuned on hardware yet."""
    group_pad = triton.next_power_of_2(group)
    if is_fp32:
        # true-float32 dots run on the FMA units, not the tensor cores: small tiles, or registers spill
        return {"block_m": max(16, group_pad), "tile_n": 32, "num_warps": 8, "num_stages": 2}
    block_m = max(64 if max_q_len * group_pad >= 64 else 16, group_pad)
    tile_n = 64
    num_warps = 8 if (block_m >= 64 and head_dim >= 128) else 4
    num_stages = 3
    return {"block_m": block_m, "tile_n": tile_n, "num_warps": num_warps, "num_stages": num_stages}


def _choose_num_splits(active_programs: int, max_kv_len: int, sm_count: int) -> int:
    """Flash-Decoding split count: enough programs for about two waves on the device, but no split
    shorter than ``MIN_SPLIT_TOKENS`` keys; a power of two (one compiled variant per value)."""
    target = 2 * sm_count
    if active_programs >= target:
        return 1
    want = math.ceil(target / max(active_programs, 1))
    cap = max(1, max_kv_len // MIN_SPLIT_TOKENS)
    n = min(want, cap, MAX_SPLITS)
    if n <= 1:
        return 1
    return 1 << (n.bit_length() - 1)  # round down to a power of two


def plan_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    num_seqs: int,
    seq_lens_list: list[int] | None = None,
    query_start_loc_list: list[int] | None = None,
    num_splits: int | None = None,
    block_m: int | None = None,
    tile_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    batch_invariant: bool = False,
) -> dict:
    """The launch configuration :func:`paged_attention` uses for these inputs (host-side only).

    Returns a dict with ``group``, ``group_pad``, ``d_pad``, ``block_m``, ``block_q``, ``tile_n``,
    ``num_warps``, ``num_stages``, ``num_splits`` and ``num_q_tiles`` (the grid's first dimension).
    Without the host lists, safe bounds from the shapes are used: every query may be long (so
    ``block_m`` = 64 for 16-bit inputs) and every context may fill its block-table row.
    With ``batch_invariant`` the configuration depends on the model's shapes and dtype only (the tiles
    of a prefill chunk, no split-KV): a query row is then reduced over its keys in the same tiles and
    order whatever else the batch holds (see :func:`paged_attention`).

    Raises:
        ValueError: ``batch_invariant`` together with a forced ``num_splits`` > 1, ``block_m``, ``tile_n``,
            ``num_warps`` or ``num_stages``.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, num_kv_heads, block_size, _ = key_cache.shape
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    if query_start_loc_list is not None:
        qlens = [query_start_loc_list[i + 1] - query_start_loc_list[i] for i in range(num_seqs)]
        max_q_len = max(qlens)
    else:
        qlens = None
        max_q_len = num_tokens - num_seqs + 1
    max_kv_len = max(seq_lens_list) if seq_lens_list is not None else block_tables.shape[1] * block_size

    if batch_invariant:
        if num_splits not in (None, 1) or any(v is not None for v in (block_m, tile_n, num_warps, num_stages)):
            raise ValueError("batch_invariant fixes the launch configuration: pass no num_splits, block_m, tile_n, "
                             "num_warps or num_stages with it")
        max_q_len = 1 << 30  # the configuration of a batch with a prefill chunk, whatever this one holds
        num_splits = 1
    cfg = _default_config(query.dtype == torch.float32, head_dim, group, max_q_len)
    block_m = max(block_m or cfg["block_m"], group_pad, 16)
    assert block_m & (block_m - 1) == 0, "block_m must be a power of two"
    block_q = block_m // group_pad
    tile_n = tile_n or cfg["tile_n"]
    assert tile_n >= 16 and tile_n & (tile_n - 1) == 0, "tile_n must be a power of two >= 16"
    num_q_tiles = num_tokens // block_q + num_seqs
    if num_splits is None:
        active = sum((q + block_q - 1) // block_q for q in qlens) if qlens is not None else num_q_tiles
        num_splits = _choose_num_splits(active * num_kv_heads, max_kv_len, _sm_count(query.device))
    assert num_splits >= 1 and num_splits & (num_splits - 1) == 0, "num_splits must be a power of two"
    return {
        "group": group,
        "group_pad": group_pad,
        "d_pad": triton.next_power_of_2(head_dim),
        "block_m": block_m,
        "block_q": block_q,
        "tile_n": tile_n,
        "num_warps": num_warps or cfg["num_warps"],
        "num_stages": num_stages or cfg["num_stages"],
        "num_splits": num_splits,
        "num_q_tiles": num_q_tiles,
    }


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
    num_splits: int | None = None,
    block_m: int | None = None,
    tile_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    batch_invariant: bool = False,
    **_unused,
) -> torch.Tensor:
    """Causal attention of a packed (varlen) batch over the paged KV cache, with GQA.

    Same semantics as :func:`kernels.torch_ops.paged_attention`: sequence ``b`` owns query rows
    ``query_start_loc[b]:query_start_loc[b+1]`` (its ``q_len`` new tokens, already in the cache) and
    has ``seq_lens[b]`` tokens of context in all; its query row ``i`` sits at position
    ``seq_lens[b] - q_len + i`` and attends keys ``0..position``. Query head ``h`` uses KV head
    ``h // (num_heads // num_kv_heads)``. Rows past ``query_start_loc[-1]`` are not written.

    Args:
        query: ``[num_tokens, num_heads, head_dim]`` float32/float16/bfloat16 (last dim contiguous).
        key_cache, value_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``, same dtype.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32/int64; entries past a sequence's
            blocks are never read.
        seq_lens: ``[num_seqs]`` int32/int64 context lengths (tokens, including the new ones).
        query_start_loc: ``[num_seqs + 1]`` int32/int64 cumulative query lengths.
        scale: softmax scale (usually ``head_dim ** -0.5``).
        out: optional ``[num_tokens, num_heads, head_dim]`` output buffer.
        seq_lens_list, query_start_loc_list: the same metadata as host lists (optional): used only to
            pick tile sizes and the split count.
        num_splits, block_m, tile_n, num_warps, num_stages: force a configuration (tests, bench);
            ``num_splits`` and ``tile_n`` must be powers of two, ``block_m`` a power of two >= 16.
        batch_invariant: one launch configuration for every batch (no split-KV; the tiles of a prefill
            chunk also for decode): a row's output then depends on its own query and keys only, not on
            the other sequences, their lengths or how the prompt was chunked. Costs the split-KV
            speed-up of long contexts at small batches and decode tiles with more padding rows.

    Returns:
        ``out`` (allocated if not given), ``[num_tokens, num_heads, head_dim]`` in ``query.dtype``.
    """
    num_seqs = _check_attention_inputs(query, key_cache, value_cache, seq_lens, query_start_loc)
    if out is None:
        out = torch.empty_like(query)
    if query.shape[0] == 0 or num_seqs == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    seq_lens, query_start_loc = seq_lens.contiguous(), query_start_loc.contiguous()
    target = out
    if out.stride(-1) != 1:
        out = out.contiguous()  # a copy (rows this call does not write keep their values)
    plan = plan_attention(
        query, key_cache, block_tables, num_seqs, seq_lens_list, query_start_loc_list,
        num_splits=num_splits, block_m=block_m, tile_n=tile_n, num_warps=num_warps, num_stages=num_stages,
        batch_invariant=batch_invariant,
    )
    _launch_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out, scale, plan)
    if target is not out:
        target.copy_(out)
        out = target
    return out


def _check_attention_inputs(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> int:
    """The shapes, dtypes and strides :func:`paged_attention` needs (AssertionError otherwise); returns the
    number of sequences."""
    num_tokens, num_heads, head_dim = query.shape
    _, num_kv_heads, block_size, kd = key_cache.shape
    assert kd == head_dim and value_cache.shape == key_cache.shape, (query.shape, key_cache.shape)
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert key_cache.dtype == value_cache.dtype == query.dtype, (query.dtype, key_cache.dtype)
    assert key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1, "cache needs a contiguous last dim"
    num_seqs = seq_lens.shape[0]
    assert query_start_loc.shape[0] == num_seqs + 1
    return num_seqs


def _launch_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      out: torch.Tensor, scale: float, plan: dict) -> None:
    """Launch the attention kernel on ``plan`` (:func:`plan_attention`) into ``out`` (last dim contiguous), and,
    with split-KV, the kernel that merges the splits' partial results (float32 buffers of this call)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    num_seqs, num_splits, d_pad = seq_lens.shape[0], plan["num_splits"], plan["d_pad"]
    if num_splits > 1:
        part_acc = torch.empty((num_tokens, num_heads, num_splits, d_pad), dtype=torch.float32, device=query.device)
        part_m = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused
    _unified_attention_kernel[(plan["num_q_tiles"], num_kv_heads, num_splits)](
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out, part_acc, part_m, part_l,
        float(scale) * LOG2E, num_seqs, num_heads,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        BLOCK_SIZE=block_size,
        GROUP=plan["group"],
        GROUP_PAD=plan["group_pad"],
        BLOCK_Q=plan["block_q"],
        BLOCK_M=plan["block_m"],
        TILE_N=plan["tile_n"],
        NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=plan["num_warps"],
        num_stages=plan["num_stages"],
    )
    if num_splits > 1:
        _reduce_splits_kernel[(num_tokens, num_heads)](
            part_acc, part_m, part_l, out, query_start_loc, num_seqs, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim,
            D_PAD=d_pad,
            NUM_SPLITS=num_splits,
            num_warps=4 if d_pad * num_splits >= 2048 else 2,
        )


def rms_norm_warps(block: int) -> int:
    """Warps of one RMSNorm program over a row tile of ``block`` lanes (the launch and bench.compile_report)."""
    return min(16, max(1, block // 256))


def _rms_norm_launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     out: torch.Tensor) -> None:
    n, hidden = x.shape
    if n == 0:
        return
    assert weight.shape == (hidden,) and out.shape == x.shape, (x.shape, weight.shape, out.shape)
    assert x.stride(-1) == 1 and out.stride(-1) == 1 and weight.stride(-1) == 1, "rows need a contiguous last dim"
    block = triton.next_power_of_2(hidden)
    res = residual if residual is not None else x
    assert res.stride(-1) == 1 and res.shape == x.shape
    _rms_norm_kernel[(n,)](
        x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), hidden, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=rms_norm_warps(block),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of each row in one Triton program per row (same contract as :func:`kernels.torch_ops.rms_norm`).

    Args:
        x: ``[num_tokens, hidden]`` float32/float16/bfloat16, contiguous last dim; weight: ``[hidden]``.
        out: optional ``[num_tokens, hidden]`` destination (may be ``x``).

    Returns:
        ``[num_tokens, hidden]`` in ``x.dtype``. The sum of squares is one fixed reduction per row, so a
        row's result does not depend on how many rows the call has (batch invariant).
    """
    if out is None:
        out = torch.empty_like(x)
    _rms_norm_launch(x, None, weight, eps, out)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place, one pass: ``residual = x + residual`` (rounded to the dtype), then ``x = rms_norm(residual)``
    (as :func:`kernels.torch_ops.fused_add_rms_norm`). Both ``[num_tokens, hidden]``, contiguous last dim."""
    _rms_norm_launch(x, residual, weight, eps, x)
