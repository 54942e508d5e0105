"""Torch implementation of the paged-KV-cache kernels: the CPU path and the test oracle.

Layout: see ``kernels/__init__.py`` (``[num_blocks, num_kv_heads, block_size, head_dim]``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new K/V rows into the paged cache.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, same dtype as the caches.
        key_cache, value_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]`` (modified in place).
        slot_mapping: ``[num_tokens]`` int32/int64 slot per token; -1 means "do not write".
    """
    num_blocks, num_kv_heads, block_size, head_dim = key_cache.shape
    slots = slot_mapping.to(torch.int64)
    if bool((slots < 0).any()):
        keep = slots >= 0
        key, value, slots = key[keep], value[keep], slots[keep]
    if slots.numel() == 0:
        return
    block = slots // block_size
    offset = slots % block_size
    # flat row index of (block, head, offset) in a [num_blocks * num_kv_heads * block_size, head_dim] view
    heads = torch.arange(num_kv_heads, device=slots.device) * block_size
    rows = ((block * (num_kv_heads * block_size) + offset)[:, None] + heads[None, :]).reshape(-1)
    key_cache.view(-1, head_dim).index_copy_(0, rows, key.reshape(-1, head_dim).to(key_cache.dtype))
    value_cache.view(-1, head_dim).index_copy_(0, rows, value.reshape(-1, head_dim).to(value_cache.dtype))


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """``[n, max_blocks]`` block ids -> ``[n, num_kv_heads, max_blocks * block_size, head_dim]``."""
    n, mb = block_ids.shape
    _, kvh, bs, d = cache.shape
    g = cache.index_select(0, block_ids.reshape(-1)).view(n, mb, kvh, bs, d)
    return g.transpose(1, 2).reshape(n, kvh, mb * bs, d)


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
    """Causal attention of a packed (varlen) batch over the paged KV cache, with GQA.

    Sequence ``b`` owns query rows ``query_start_loc[b]:query_start_loc[b+1]`` (its ``q_len`` new
    tokens, already written to the cache) and has ``seq_lens[b]`` tokens of context in all, so its
    query row ``i`` sits at position ``seq_lens[b] - q_len + i`` and attends keys ``0..position``.
    Query head ``h`` uses KV head ``h // (num_heads // num_kv_heads)``.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``.
        key_cache, value_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32/int64 (entries past a sequence's
            blocks are ignored).
        seq_lens: ``[num_seqs]`` int32, context length per sequence including its new tokens (tokens).
        query_start_loc: ``[num_seqs + 1]`` int32, cumulative query lengths.
        scale: softmax scale (usually ``head_dim ** -0.5``).
        out: optional ``[num_tokens, num_heads, head_dim]`` output buffer.
        seq_lens_list, query_start_loc_list: the same metadata as Python lists, if the caller has
            them (saves device->host reads).
        batch_invariant: accepted for signature compatibility and ignored: this reference is *not*
            batch invariant (decode rows share one batched matmul).

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``query.dtype``. Decode rows (``q_len == 1``) are
        computed together in one batched matmul; longer chunks one sequence at a time with SDPA.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, num_kv_heads, block_size, _ = key_cache.shape
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    lens = seq_lens_list if seq_lens_list is not None else seq_lens.tolist()
    qsl = query_start_loc_list if query_start_loc_list is not None else query_start_loc.tolist()
    qlens = [qsl[i + 1] - qsl[i] for i in range(len(lens))]

    decode = [i for i, q in enumerate(qlens) if q == 1]
    if decode:
        _decode_attention(query, key_cache, value_cache, block_tables, lens, qsl, decode, scale, group, out)
    for b, q_len in enumerate(qlens):
        if q_len <= 1:
            continue
        ctx = lens[b]
        nblk = (ctx + block_size - 1) // block_size
        bt = block_tables[b : b + 1, :nblk].to(torch.int64)
        k = _gather(key_cache, bt)[0, :, :ctx]  # [kvh, ctx, d]
        v = _gather(value_cache, bt)[0, :, :ctx]
        q = query[qsl[b] : qsl[b + 1]]  # [q_len, h, d]
        # fold each KV head's query heads into the query-length dimension: [kvh, group * q_len, d]
        q = q.view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv_heads, group * q_len, head_dim)
        qpos = torch.arange(q_len, device=query.device) + (ctx - q_len)
        mask = torch.arange(ctx, device=query.device)[None, :] <= qpos[:, None]  # [q_len, ctx]
        mask = mask.repeat(group, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [kvh, group*q_len, d]
        o = o.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim)
        out[qsl[b] : qsl[b + 1]] = o
    return out


def _decode_attention(query, key_cache, value_cache, block_tables, lens, qsl, decode, scale, group, out):
    """All single-token (decode) rows at once, one KV head at a time: gather that head's blocks of
    every row with one ``index_select`` (``cache[:, h]`` is ``[num_blocks, block_size, head_dim]``, so
    the gathered rows are already ``[n, L, head_dim]``: no second copy), batched matmuls with a length
    mask, softmax in float32. Faster on the CPU than gathering all heads and transposing (measured in
    docs/performance.md)."""
    _, num_heads, head_dim = query.shape
    _, num_kv_heads, block_size, _ = key_cache.shape
    dev = query.device
    n = len(decode)
    dlens = [lens[i] for i in decode]
    mb = (max(dlens) + block_size - 1) // block_size
    L = mb * block_size
    if len(decode) == len(lens):
        bt = block_tables[:, :mb]
    else:
        bt = block_tables.index_select(0, torch.tensor(decode, device=dev))[:, :mb]
    flat = bt.to(torch.int64).reshape(-1)
    tok = [qsl[i] for i in decode]
    contiguous = tok == list(range(tok[0], tok[0] + n))
    q = query[tok[0] : tok[0] + n] if contiguous else query[torch.tensor(tok, device=dev)]
    q = q.reshape(n, num_kv_heads, group, head_dim)
    scores = torch.empty(n, num_kv_heads, group, L, dtype=query.dtype, device=dev)
    for h in range(num_kv_heads):
        k = key_cache[:, h].index_select(0, flat).view(n, L, head_dim)
        torch.bmm(q[:, h], k.transpose(1, 2), out=scores[:, h])
    scores = scores.float().mul_(scale)
    if min(dlens) < L:
        lens_t = torch.tensor(dlens, device=dev)
        pad = torch.arange(L, device=dev)[None, :] >= lens_t[:, None]  # [n, L]
        scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(value_cache.dtype)
    o = torch.empty(n, num_kv_heads, group, head_dim, dtype=value_cache.dtype, device=dev)
    for h in range(num_kv_heads):
        v = value_cache[:, h].index_select(0, flat).view(n, L, head_dim)
        torch.bmm(probs[:, h], v, out=o[:, h])
    o = o.view(n, num_heads, head_dim).to(out.dtype)
    if contiguous:
        out[tok[0] : tok[0] + n] = o
    else:
        out[torch.tensor(tok, device=dev)] = o


# --- the elementwise operations of a Llama-family decoder layer (the C++ path's oracle) -------------
# Each computes what transformers' modules compute, rounding to the storage dtype at the same places.


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of each row: ``weight * round(x / sqrt(mean(x^2) + eps))``, the sum in float32.

    Args:
        x: ``[num_tokens, hidden]``; weight: ``[hidden]``, same dtype; eps: added to the mean square.
        out: optional ``[num_tokens, hidden]`` destination.

    Returns:
        ``[num_tokens, hidden]`` in ``x.dtype`` (``out`` when given).
    """
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * h.to(x.dtype)
    return y if out is None else out.copy_(y)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: ``residual = x + residual`` (rounded to the dtype), then ``x = rms_norm(residual)``.
    Both ``[num_tokens, hidden]``; returns None."""
    residual.add_(x)
    rms_norm(residual, weight, eps, out=x)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, head_dim: int) -> None:
    """Rotary position embedding in place, rotate-half (GPT-NeoX) layout, as transformers' Llama applies it.

    Args:
        positions: ``[num_tokens]`` int64 token positions (rows of the tables).
        q: ``[num_tokens, num_heads * head_dim]``; k: ``[num_tokens, num_kv_heads * head_dim]``; rows
            may be strided (views into one fused QKV output), elements contiguous.
        cos, sin: ``[max_positions, head_dim // 2]`` tables in ``q.dtype``.
        head_dim: elements per head.
    """
    half = head_dim // 2
    c = cos[positions][:, None, :]
    s = sin[positions][:, None, :]
    for t in (q, k):
        v = t.view(t.shape[0], -1, head_dim) if t.is_contiguous() else t.unflatten(1, (-1, head_dim))
        x1, x2 = v[..., :half], v[..., half:]
        o1 = x1 * c - x2 * s
        o2 = x2 * c + x1 * s
        x1.copy_(o1)
        x2.copy_(o2)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for ``x`` ``[num_tokens, 2 * I]`` (gate then up); returns ``[num_tokens, I]``."""
    i = x.shape[-1] // 2
    y = F.silu(x[..., :i]) * x[..., i:]
    return y if out is None else out.copy_(y)


def logits_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's first argmax and whether the row is all finite (the reference of the C++ op).

    Args:
        logits: ``[num_rows, vocab]``, any floating dtype.

    Returns:
        ``(index int64 [num_rows], finite bool [num_rows])``; ``index`` equals
        ``torch.argmax(logits.float(), dim=-1)`` (ties: the lowest position; a NaN counts as the maximum).
    """
    x = logits.float()
    return x.argmax(dim=-1), torch.isfinite(x).all(dim=-1)


_FLT_MIN = 2.0 ** -126  # the smallest normal float32


def _flush(t: torch.Tensor) -> torch.Tensor:
    """Values below the normal float32 range set to a zero of their sign (denormals-are-zero /
    flush-to-zero, as the instruction does: -tiny becomes -0)."""
    return torch.where(t.abs() < _FLT_MIN, t * 0, t)


def gemm_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              dot_products: bool = False) -> torch.Tensor:
    """``x W^T (+ bias)`` in the arithmetic of the C++ ``gemm_bf16`` (the reference of that op): one
    float32 accumulator per output, k = 0, 1, .. K-1 in order, one FMA each (the product is not rounded;
    emulated exactly in float64 with the sum rounded to odd, see ``_fma_chain``), then the bias, then one
    rounding to bfloat16. NaN bits are not compared (the kernel writes the canonical 0x7fc0). One Python
    step per k: for tests, not for speed.

    ``dot_products=True`` is the arithmetic of its VDPBF16PS path (AVX512-BF16): the same accumulator,
    but each pair of k is added odd element first, ``acc + x[2p+1] W[2p+1]`` then ``+ x[2p] W[2p]``, with
    inputs below the normal range read as zero and every sum below it flushed to zero (Intel's
    definition of the instruction; checked on an AMD EPYC's, bit for bit).

    Args:
        x: ``[M, K]`` bfloat16 (K even for ``dot_products``); weight: ``[N, K]`` bfloat16; bias: ``[N]``
            bfloat16 or None; dot_products: the VDPBF16PS arithmetic.

    Returns:
        ``[M, N]`` bfloat16.

    Raises:
        ValueError: ``dot_products`` with an odd K.
    """
    xd, wd = x.double(), weight.double()
    if dot_products:
        if x.shape[1] % 2:
            raise ValueError(f"gemm_bf16: dot_products needs an even K, got {x.shape[1]}")
        xd, wd = _flush(xd), _flush(wd)
        order = [k for p in range(x.shape[1] // 2) for k in (2 * p + 1, 2 * p)]
    else:
        order = list(range(x.shape[1]))
    return _fma_chain(xd, wd, order, bias, _flush if dot_products else None).to(torch.bfloat16)


def gemm_f32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T (+ bias)`` in the arithmetic of the C++ ``gemm_f32`` (the reference of that op): one float32
    accumulator per output, k = 0, 1, .. K-1 in order, one exact FMA each (emulated in float64 with the sum
    rounded to odd, see ``_fma_chain``), then the bias (one float32 add). One Python step per k: for
    tests, not for speed.

    Args:
        x: ``[M, K]`` float32; weight: ``[N, K]`` float32; bias: ``[N]`` float32 or None.

    Returns:
        ``[M, N]`` float32.
    """
    return _fma_chain(x.double(), weight.double(), range(x.shape[1]), bias, None)


def _fma_chain(xd: torch.Tensor, wd: torch.Tensor, order, bias: torch.Tensor | None, flush) -> torch.Tensor:
    """The float32 accumulators ``[M, N]`` of :func:`gemm_bf16` / :func:`gemm_f32`: for k in ``order``,
    ``acc = fma(x[:, k], w[:, k], acc)`` (``flush`` applied after each step if given), then ``+ bias`` in
    float32. The FMA is exact: the product of two float32 values is exact in float64, and the float64 sum
    is rounded to odd (Boldo and Melquiond, "Emulation of FMA and correctly rounded sums: proved
    algorithms using rounding to odd", IEEE TC 2008: the error of the sum from TwoSum, and an inexact
    sum with an even last bit moved to its odd neighbour), so its rounding to float32 is the single
    rounding of the exact value (double rounding through float64 was wrong in about one sum in 2^29)."""
    acc = torch.zeros(xd.shape[0], wd.shape[0], dtype=torch.float32)
    for k in order:
        a = acc.double()
        p = xd[:, k : k + 1] * wd[None, :, k]
        s = a + p
        b = s - a
        err = (a - (s - b)) + (p - b)  # TwoSum: s + err == a + p exactly (finite values)
        inexact_even = (err != 0) & ((s.view(torch.int64) & 1) == 0) & s.isfinite()
        s = torch.where(inexact_even, torch.nextafter(s, torch.where(err > 0, torch.inf, -torch.inf).double()), s)
        acc = s.float()
        if flush is not None:
            acc = flush(acc)
    if bias is not None:
        acc = acc + bias.float()
    return acc
