"""Triton JIT kernels of the paged KV cache (the device code); the host side that plans and launches
them is :mod:`kernels.triton_ops`.

The host functions have the signatures and semantics of :mod:`kernels.torch_ops` (the test oracle). The
cache layout is head-major, stated once in ``kernels/__init__.py``::

    key_cache, value_cache: [num_blocks, num_kv_heads, block_size, head_dim]

so one KV head's ``block_size x head_dim`` slice of a block is contiguous in memory.

Design: one unified attention kernel for both phases, plus a small reduction kernel
-----------------------------------------------------------------------------------
There is no separate decode kernel. A program of :func:`_unified_attention_kernel` owns a *query
tile*: ``BLOCK_Q`` consecutive new tokens of one sequence times the ``GROUP`` query heads that share
one KV head (GQA), i.e. ``BLOCK_M = BLOCK_Q * GROUP_PAD`` rows. Row ``r`` is token ``r // GROUP_PAD``
and query head ``kv_head * GROUP + r % GROUP_PAD`` (rows whose head slot is ``>= GROUP``, the
power-of-two padding, are masked). Folding the group into the row dimension means every K/V tile is
loaded once for all the query heads that use it, and it lets a decode step (one token per sequence)
use the same ``tl.dot`` as a prefill chunk: both are just tiles with fewer or more valid rows.
``BLOCK_M`` is at least 16 and ``TILE_N`` (keys per inner step) at least 16, so every ``tl.dot`` has
all dimensions >= 16 as the tensor-core paths require.

Why unified rather than two kernels: the scheduler mixes decode rows and prefill chunks (which may
start mid-block, after cached context) in one packed batch; one kernel handles any mix in a single
launch with one code path to test, and a decode tile is simply a tile whose last valid row is row
``GROUP - 1``. The cost is wasted rows in decode tiles (``BLOCK_M = 16`` rows for ``GROUP`` valid
ones), which is arithmetic, and decode attention is bound by memory traffic, not arithmetic.

Finding a program's sequence without host work: sequence ``b`` owns the query tiles numbered
``query_start_loc[b] // BLOCK_Q + b`` up to (not including) the same number for ``b + 1``: that is
at least ``ceil(q_len / BLOCK_Q)`` tiles, and the surplus tiles exit at once. The grid's first
dimension is ``num_tokens // BLOCK_Q + num_seqs`` (known from shapes alone) and each program finds its
sequence by binary search over ``query_start_loc``. This numbering scheme is the one vLLM's unified
Triton attention uses; the code here is our own.

Inner loop (FlashAttention-2, Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism
and Work Partitioning", Algorithm 1): for each tile of ``TILE_N`` key positions, the tile's block
numbers are read from the block table (one per position, so tiles may span several blocks and block
tables may be in any order), K and V rows are gathered, ``S = Q K^T * scale`` is computed in float32,
causally masked (query row at absolute position ``p`` sees keys ``0..p``), and the running row max
``m``, row sum ``l`` and unnormalised output ``acc`` (all float32) are rescaled online
(``exp2`` with ``log2(e)`` folded into the scale). No score matrix is ever materialised beyond one
``BLOCK_M x TILE_N`` tile in registers.

Split-KV for long decodes (Flash-Decoding: Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context
inference", PyTorch blog, October 2023): with few sequences, ``num_q_tiles x num_kv_heads`` programs
cannot fill 132 SMs. The grid then gets a third dimension of ``NUM_SPLITS`` programs per query tile,
each taking a contiguous share of the tile's key tiles and writing its partial ``(m, l, acc)`` to
float32 scratch buffers; :func:`_reduce_splits_kernel` combines them (rescale by ``exp2(m_s - max m)``,
sum, divide). ``NUM_SPLITS`` is chosen on the host from the shapes and the sequence lengths (see
:func:`_choose_num_splits`); with ``NUM_SPLITS == 1`` the attention kernel writes ``out`` directly.

Tile sizes (:func:`_default_config`, :func:`plan_attention`): for 16-bit inputs ``BLOCK_M = 16`` when
every query in the batch is short (decode) and 64 when a prefill chunk is present (then decode tiles
of that mixed batch carry more padding rows), ``TILE_N = 64``; float32 uses smaller tiles because its
exact dots run on the FMA units. These compile for sm_90 without register spills (checked offline by
``python -m bench.compile_report``, which needs no GPU) but are not yet tuned on hardware:
``python -m bench.kernels --sweep`` on the GPU prints the alternatives.

Precision: scores, softmax statistics and the output accumulator are float32; P is cast to the cache
dtype before ``P @ V`` (as FlashAttention does). For float32 inputs the dots run with
``input_precision="ieee"`` (true float32, not TF32), so float32 results match the torch reference
closely on GPU too.

RMSNorm (``_rms_norm_kernel``, host :func:`kernels.triton_ops.rms_norm` and ``fused_add_rms_norm``): one
program per row with the whole row in one tile, the residual add fused in (one pass instead of torch's
six); per row by construction, so batch invariant.

``reshape_and_cache``: one program per new token writes its ``num_kv_heads x head_dim`` K and V rows
to slot ``slot_mapping[t]`` (``-1``: skipped), casting to the cache dtype.

Interpreter (``TRITON_INTERPRET=1``, CPU tests): Triton 3.9's interpreter multiplies bfloat16 operands
of ``tl.dot`` as raw integer bits; :func:`_fix_interpreter_dot` patches the interpreter (only in that
mode) so the same kernel source is tested on CPU as runs on the GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def _fix_interpreter_dot() -> None:
    """Work around a Triton interpreter bug (seen in triton 3.9, ``TRITON_INTERPRET=1`` only): the
    interpreter stores bfloat16 values as their raw ``uint16`` bits and its ``tl.dot`` multiplies
    those bits as integers. Here 16-bit float operands are widened first (exact), the product goes
    through BLAS in float64 and is rounded to float32 (the tensor cores' 16-bit products with float32
    accumulation, closely; the interpreter's ``np.matmul(..., dtype=...)`` is a slow non-BLAS loop).
    Float32 operands take the same path (``input_precision="ieee"``, one rounding per output). Compiled
    kernels are unaffected; the patch is applied only when the kernels run through the interpreter,
    and only once."""
    try:
        import numpy as np
        from triton.runtime import interpreter as interp
    except Exception:  # pragma: no cover - layout of triton internals changed
        return
    builder = getattr(interp, "interpreter_builder", None)
    if builder is None:
        return
    builder_cls = type(builder)
    orig = getattr(builder_cls, "create_dot", None)
    if orig is None or getattr(orig, "_cbp_fix", False):
        return

    def widen(x):
        if x.dtype == tl.bfloat16 and x.data.dtype == np.uint16:
            return (x.data.astype(np.uint32) << 16).view(np.float32)
        if x.data.dtype in (np.float16, np.float32):
            return x.data.astype(np.float32, copy=False)
        return None

    def create_dot(self, a, b, d, *args, **kwargs):
        a32, b32 = widen(a), widen(b)
        if a32 is None or b32 is None or d.data.dtype != np.float32:
            return orig(self, a, b, d, *args, **kwargs)
        # in float64 (every float32 product exact): BLAS may sum a row at the edge of its register tile
        # in another order than one inside it, which would make a row's result depend on its place in
        # the tile (a batch-invariance test would then fail on CPU for the interpreter's sake alone)
        prod = np.matmul(a32.astype(np.float64), b32.astype(np.float64)).astype(np.float32)
        return interp.TensorHandle(prod + d.data, d.dtype.scalar)

    create_dot.__dict__["_cbp_fix"] = True  # marks the patched method: it is applied only once
    builder_cls.create_dot = create_dot


# ----------------------------------------------------------------------------------------------
# reshape_and_cache
# ----------------------------------------------------------------------------------------------
@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, num_kv_heads, block_size, head_dim]
    value_cache_ptr,  # [num_blocks, num_kv_heads, block_size, head_dim]
    slot_ptr,  # [num_tokens] int32/int64, -1 = skip
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kch,
    stride_kct,
    stride_vcb,
    stride_vch,
    stride_vct,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(key_ptr + tok * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(
        key_cache_ptr + blk * stride_kcb + h * stride_kch + off * stride_kct + d,
        k.to(key_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        value_cache_ptr + blk * stride_vcb + h * stride_vch + off * stride_vct + d,
        v.to(value_cache_ptr.dtype.element_ty),
        mask=mask,
    )


# paged attention
# ----------------------------------------------------------------------------------------------
@triton.jit
def _unified_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, num_kv_heads, block_size, head_dim]
    v_cache_ptr,  # [num_blocks, num_kv_heads, block_size, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32/int64, contiguous last dim
    seq_lens_ptr,  # [num_seqs] context length incl. new tokens
    qsl_ptr,  # [num_seqs + 1] query_start_loc
    out_ptr,  # [num_tokens, num_heads, head_dim]            (NUM_SPLITS == 1)
    part_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, D_PAD] f32 (NUM_SPLITS > 1)
    part_m_ptr,  # [num_tokens, num_heads, NUM_SPLITS] f32, row max in log2 units
    part_l_ptr,  # [num_tokens, num_heads, NUM_SPLITS] f32, row sum
    qk_scale,  # softmax scale * log2(e)
    num_seqs,
    num_heads,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_bt,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # --- which sequence owns this query tile: the last b with qsl[b] // BLOCK_Q + b <= tile
    lo = tl.zeros([], dtype=tl.int32)
    hi = lo + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first_tile = tl.load(qsl_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        right = first_tile <= tile
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    seq = lo

    q_start = tl.load(qsl_ptr + seq).to(tl.int32)
    q_len = tl.load(qsl_ptr + seq + 1).to(tl.int32) - q_start
    q0 = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first query index (within the seq) of the tile
    if q0 >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    pos0 = ctx_len - q_len  # absolute position of the sequence's first new token

    rows = tl.arange(0, BLOCK_M)
    q_idx = q0 + rows // GROUP_PAD
    h_in_group = rows % GROUP_PAD
    head = kv_head * GROUP + h_in_group
    row_ok = (q_idx < q_len) & (h_in_group < GROUP)
    q_pos = pos0 + q_idx
    tok = (q_start + q_idx).to(tl.int64)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM

    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    # keys this tile needs: 0 .. position of its last valid token (causal)
    kv_end = pos0 + tl.minimum(q0 + BLOCK_Q, q_len)
    num_tiles = tl.cdiv(kv_end, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    t_begin = split * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: a fully masked row stays NaN-free
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_cache_ptr + kv_head.to(tl.int64) * stride_vh
    cols = tl.arange(0, TILE_N)
    for t in range(t_begin, t_end):
        k_pos = t * TILE_N + cols
        k_ok = k_pos < kv_end
        blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        off = k_pos % BLOCK_SIZE
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_base + blk[:, None] * stride_kb + off[:, None] * stride_kt + d[None, :], mask=kv_mask, other=0.0
        )
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N] f32
        allowed = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + blk[:, None] * stride_vb + off[:, None] * stride_vt + d[None, :], mask=kv_mask, other=0.0
        )
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        part = (tok * num_heads + head) * NUM_SPLITS + split  # int64 [BLOCK_M]
        tl.store(part_acc_ptr + part[:, None] * D_PAD + d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)


@triton.jit
def _reduce_splits_kernel(
    part_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, D_PAD] f32
    part_m_ptr,  # [num_tokens, num_heads, NUM_SPLITS] f32
    part_l_ptr,  # [num_tokens, num_heads, NUM_SPLITS] f32
    out_ptr,  # [num_tokens, num_heads, head_dim]
    qsl_ptr,  # [num_seqs + 1]
    num_seqs,
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if tok >= tl.load(qsl_ptr + num_seqs).to(tl.int64):  # trailing rows no sequence owns: untouched
        return
    base = (tok * num_heads + head) * NUM_SPLITS
    s = tl.arange(0, NUM_SPLITS)
    m = tl.load(part_m_ptr + base + s)
    l = tl.load(part_l_ptr + base + s)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - m_max)  # splits that saw no key have m = -1e30: weight 0
    denom = tl.sum(w * l, 0)
    d = tl.arange(0, D_PAD)
    acc = tl.load(part_acc_ptr + (base + s)[:, None] * D_PAD + d[None, :])
    o = tl.sum(acc * w[:, None], 0) / denom
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)



@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_tokens, hidden] input; the normalised rows are written to out_ptr
    res_ptr,  # [num_tokens, hidden] residual (read and written when HAS_RESIDUAL)
    w_ptr,  # [hidden] weight
    out_ptr,  # [num_tokens, hidden]
    stride_x,
    stride_r,
    stride_o,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per row, the whole row in one tile: the sum of squares is one fixed reduction of
    # BLOCK (next power of two >= hidden) lanes, so a row's result depends on its own values only,
    # whatever the number of rows (torch's reduction picks its thread layout from the row count).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
        # residual + x, rounded to nearest as torch's add_ (the interpreter's float32 -> bfloat16 truncates)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
        tl.store(res_ptr + row * stride_r + cols, x, mask=ok)
    h = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(h * h, 0) / hidden + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    y = w.to(tl.float32) * (h * inv).to(x.dtype).to(tl.float32)  # weight * round(x / rms), as torch
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def _interpreted() -> bool:
    """True when ``triton.jit`` returned interpreter wrappers (``TRITON_INTERPRET=1`` at import)."""
    from triton.runtime.jit import JITFunction

    return not isinstance(_unified_attention_kernel, JITFunction)


if _interpreted():
    _fix_interpreter_dot()
