"""Kernel tests: the Triton kernels against the torch reference, and the torch reference against a naive
per-token loop.

Without CUDA the Triton kernels run through Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``
is set by ``tests/conftest.py`` before triton is first imported); with CUDA the same checks run on the
GPU with compiled kernels, and a few larger CUDA-only checks run too. The interpreter costs tens of
milliseconds per program instance, so shapes are small and the parameter lists short.

Every check draws fresh random inputs (the seed is printed in the failure message), uses shuffled
block tables whose unused entries point at other sequences' blocks, partly filled last blocks, and an
output buffer poisoned with NaN, so an element the kernel fails to write fails the test.
"""

from __future__ import annotations

import importlib
import math
import os
import random
import subprocess
import sys

import pytest
import torch

import kernels
from kernels import torch_ops

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

# (relative L2 error bound, max abs error bound) against a float64 reference
TOL = {
    torch.float32: (2e-5, 2e-4),
    torch.float16: (3e-3, 1e-2),
    torch.bfloat16: (2e-2, 8e-2),
}


@pytest.fixture(scope="module")
def tops():
    """``kernels.triton_ops``, imported lazily (triton is optional on CPU-only machines)."""
    pytest.importorskip("triton")
    return importlib.import_module("kernels.triton_ops")


def _seed() -> int:
    return random.SystemRandom().randrange(2**31)


# ------------------------------------------------------------------------------------------------
# random paged batches
# ------------------------------------------------------------------------------------------------
class Batch:
    """A packed batch over a paged cache. ``seqs`` is a list of ``(context_len, q_len)``: the sequence
    has ``context_len`` tokens in the cache, the last ``q_len`` of which are this step's queries."""

    def __init__(self, seed, seqs, *, block_size, num_kv_heads, group, head_dim, dtype, device=DEVICE,
                 extra_rows=0, index_dtype=torch.int32, strided_query=False):
        g = torch.Generator().manual_seed(seed)
        self.seed, self.seqs, self.dtype = seed, seqs, dtype
        self.block_size, self.num_kv_heads, self.head_dim = block_size, num_kv_heads, head_dim
        self.num_heads = num_kv_heads * group
        nblk = [math.ceil(c / block_size) for c, _ in seqs]
        num_blocks = sum(nblk) + 3
        width = max(nblk) + 2
        perm = torch.randperm(num_blocks, generator=g)
        # entries past a sequence's blocks hold valid ids of *other* blocks: reading them gives wrong
        # numbers (caught by the comparison) rather than a crash
        bt = torch.randint(0, num_blocks, (len(seqs), width), generator=g)
        i = 0
        for b, n in enumerate(nblk):
            bt[b, :n] = perm[i : i + n]
            i += n
        # random data in every slot: positions past a sequence's length must be masked, not zero
        self.key_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=g).to(dtype)
        self.value_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, generator=g).to(dtype)
        qlens = [q for _, q in seqs]
        self.num_tokens = sum(qlens) + extra_rows
        H, D = self.num_heads, head_dim
        if strided_query:  # a view into a fused qkv projection output, as the model produces it
            qkv = torch.randn(self.num_tokens, (H + 2 * num_kv_heads) * D, generator=g).to(dtype).to(device)
            self.query = qkv[:, : H * D].view(self.num_tokens, H, D)
        else:
            self.query = torch.randn(self.num_tokens, H, D, generator=g).to(dtype).to(device)
        self.scale = random.Random(seed).uniform(0.5, 3.0) / math.sqrt(D)  # includes peaky softmaxes
        self.device = torch.device(device)
        self.key_cache = self.key_cache.to(device)
        self.value_cache = self.value_cache.to(device)
        self.block_tables = bt.to(index_dtype).to(device)
        self.seq_lens = torch.tensor([c for c, _ in seqs], dtype=index_dtype, device=device)
        self.qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=index_dtype, device=device)

    def args(self):
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens, self.qsl, self.scale)

    def lists(self):
        return {"seq_lens_list": self.seq_lens.tolist(), "query_start_loc_list": self.qsl.tolist()}

    def reference(self) -> torch.Tensor:
        """The torch path on float64 CPU copies: the ground truth."""
        q, kc, vc, bt, sl, qsl, scale = self.args()
        return torch_ops.paged_attention(
            q.double().cpu(), kc.double().cpu(), vc.double().cpu(), bt.cpu(), sl.cpu(), qsl.cpu(), scale
        )

    def poisoned_out(self) -> torch.Tensor:
        return torch.full((self.num_tokens, self.num_heads, self.head_dim), float("nan"), dtype=self.dtype, device=self.device)

    def __repr__(self):
        return (f"Batch(seed={self.seed}, seqs={self.seqs}, bs={self.block_size}, kvh={self.num_kv_heads}, "
                f"H={self.num_heads}, D={self.head_dim}, {self.dtype})")


def random_seqs(rng: random.Random, block_size: int, *, decode=2, chunks=1, prompts=1, max_ctx=300, max_q=24):
    """Decode rows (context 1..max_ctx), prompt chunks that start mid-block after cached context, and
    fresh prompts starting at position 0, shuffled together."""
    seqs = [(rng.randint(1, max_ctx), 1) for _ in range(decode)]
    for _ in range(chunks):
        before = rng.randint(1, max_ctx - max_q)
        if before % block_size == 0:
            before += rng.randint(1, block_size - 1)  # start mid-block
        q = rng.randint(2, max_q)
        seqs.append((before + q, q))
    seqs += [(q, q) for q in (rng.randint(2, max_q) for _ in range(prompts))]
    rng.shuffle(seqs)
    return seqs


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype, what, rows=None):
    out = out.detach().double().cpu()
    if rows is not None:
        out, ref = out[:rows], ref[:rows]
    assert torch.isfinite(out).all(), f"{what}: non-finite output (unwritten or NaN) at {(~torch.isfinite(out)).nonzero()[:5].tolist()}"
    rel_tol, abs_tol = TOL[dtype]
    err = out - ref
    rel = (err.norm() / ref.norm()).item()
    mx = err.abs().max().item()
    assert rel < rel_tol and mx < abs_tol, f"{what}: relative error {rel:.2e} (bound {rel_tol:.0e}), max abs {mx:.2e} (bound {abs_tol:.0e})"


# ------------------------------------------------------------------------------------------------
# the torch reference against a naive per-token loop
# ------------------------------------------------------------------------------------------------
def naive_paged_attention(q, key_cache, value_cache, block_tables, seq_lens, qsl, scale):
    """One query row and one head at a time, keys looked up slot by slot: obviously right, slow."""
    T, H, D = q.shape
    _, kvh, bs, _ = key_cache.shape
    group = H // kvh
    out = torch.full_like(q, float("nan"))
    for b in range(len(seq_lens)):
        ctx, start, end = int(seq_lens[b]), int(qsl[b]), int(qsl[b + 1])
        for i in range(end - start):
            pos = ctx - (end - start) + i
            for h in range(H):
                ks, vs = [], []
                for p in range(pos + 1):
                    blk, off = int(block_tables[b, p // bs]), p % bs
                    ks.append(key_cache[blk, h // group, off])
                    vs.append(value_cache[blk, h // group, off])
                s = torch.stack(ks) @ q[start + i, h] * scale
                out[start + i, h] = torch.softmax(s, 0) @ torch.stack(vs)
    return out


@pytest.mark.parametrize("block_size,num_kv_heads,group", [(8, 3, 3), (16, 2, 4), (32, 1, 1)])
def test_torch_reference_matches_naive_loop(block_size, num_kv_heads, group):
    seed = _seed()
    seqs = random_seqs(random.Random(seed), block_size, decode=3, chunks=2, prompts=1, max_ctx=70, max_q=12)
    b = Batch(seed, seqs, block_size=block_size, num_kv_heads=num_kv_heads, group=group, head_dim=16,
              dtype=torch.float64, device="cpu")
    got = torch_ops.paged_attention(*b.args())
    want = naive_paged_attention(*b.args())
    # float64 inputs; the reference's decode path takes its softmax in float32 by design
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-6), b


def test_torch_reshape_and_cache_matches_naive_loop():
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    nb, kvh, bs, D, T = 6, 3, 8, 16, 20
    kc, vc = torch.randn(nb, kvh, bs, D, generator=g), torch.randn(nb, kvh, bs, D, generator=g)
    k, v = torch.randn(T, kvh, D, generator=g), torch.randn(T, kvh, D, generator=g)
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[::4] = -1
    want_k, want_v = kc.clone(), vc.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want_k[s // bs, :, s % bs] = k[t]
            want_v[s // bs, :, s % bs] = v[t]
    torch_ops.reshape_and_cache(k, v, kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v), seed


# ------------------------------------------------------------------------------------------------
# Triton: reshape_and_cache
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype,block_size,num_kv_heads,head_dim,slot_dtype,strided",
    [
        (torch.float32, 8, 3, 64, torch.int64, False),
        (torch.bfloat16, 32, 2, 128, torch.int32, True),
        (torch.float16, 16, 1, 64, torch.int64, True),
    ],
)
def test_reshape_and_cache(tops, dtype, block_size, num_kv_heads, head_dim, slot_dtype, strided):
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    nb, T = 5, 24
    kc = torch.randn(nb, num_kv_heads, block_size, head_dim, generator=g).to(dtype)
    vc = torch.randn(nb, num_kv_heads, block_size, head_dim, generator=g).to(dtype)
    if strided:  # K and V as views into a fused qkv output
        qkv = torch.randn(T, (4 + 2 * num_kv_heads) * head_dim, generator=g).to(dtype)
        k = qkv[:, 4 * head_dim : (4 + num_kv_heads) * head_dim].view(T, num_kv_heads, head_dim)
        v = qkv[:, (4 + num_kv_heads) * head_dim :].view(T, num_kv_heads, head_dim)
    else:
        k = torch.randn(T, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(T, num_kv_heads, head_dim, generator=g).to(dtype)
    slots = torch.randperm(nb * block_size, generator=g)[:T]
    slots[torch.randperm(T, generator=g)[: T // 4]] = -1
    slots = slots.to(slot_dtype)
    want_k, want_v = kc.clone(), vc.clone()
    torch_ops.reshape_and_cache(k, v, want_k, want_v, slots)
    dk, dv = kc.to(DEVICE), vc.to(DEVICE)
    if strided:
        qkv_d = qkv.to(DEVICE)
        k_d = qkv_d[:, 4 * head_dim : (4 + num_kv_heads) * head_dim].view(T, num_kv_heads, head_dim)
        v_d = qkv_d[:, (4 + num_kv_heads) * head_dim :].view(T, num_kv_heads, head_dim)
    else:
        k_d, v_d = k.to(DEVICE), v.to(DEVICE)
    assert tops.reshape_and_cache(k_d, v_d, dk, dv, slots.to(DEVICE)) is None
    assert torch.equal(dk.cpu(), want_k), f"key cache differs (seed {seed})"
    assert torch.equal(dv.cpu(), want_v), f"value cache differs (seed {seed})"


# ------------------------------------------------------------------------------------------------
# Triton: paged attention
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "block_size,head_dim,num_kv_heads,group,dtype,num_splits,pass_lists",
    [
        (16, 64, 3, 3, torch.bfloat16, None, True),  # SmolLM2-135M's heads: 9 query, 3 KV, dim 64
        (8, 128, 2, 4, torch.bfloat16, 1, False),
        (32, 64, 2, 1, torch.float16, 2, True),
        (8, 64, 1, 3, torch.float32, 4, False),
        (32, 128, 1, 4, torch.float32, 1, True),
        (16, 128, 1, 1, torch.float16, None, False),
    ],
)
def test_paged_attention_mixed_batch(tops, block_size, head_dim, num_kv_heads, group, dtype, num_splits, pass_lists):
    """Decode rows, a chunk starting mid-block after cached context and a fresh prompt, in one batch."""
    seed = _seed()
    seqs = random_seqs(random.Random(seed), block_size)
    b = Batch(seed, seqs, block_size=block_size, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
              dtype=dtype, strided_query=(group == 4))
    out = b.poisoned_out()
    kw = b.lists() if pass_lists else {}
    res = tops.paged_attention(*b.args(), out=out, num_splits=num_splits, **kw)
    assert res is out
    assert_close(out, b.reference(), dtype, b)


@pytest.mark.parametrize("dtype,num_splits", [(torch.bfloat16, None), (torch.float16, 8)])
def test_paged_attention_split_kv_decode(tops, dtype, num_splits):
    """Flash-decoding: long decode contexts split across programs, then reduced."""
    seed = _seed()
    rng = random.Random(seed)
    seqs = [(rng.randint(600, 900), 1) for _ in range(2)] + [(rng.randint(1, 40), 1)]
    b = Batch(seed, seqs, block_size=16, num_kv_heads=1, group=4, head_dim=128, dtype=dtype)
    if num_splits is None:  # the automatic choice must split here (few programs, long contexts)
        plan = tops.plan_attention(b.query, b.key_cache, b.block_tables, len(seqs), **b.lists())
        assert plan["num_splits"] > 1 and plan["block_m"] == 16, plan
    out = b.poisoned_out()
    tops.paged_attention(*b.args(), out=out, num_splits=num_splits, **b.lists())
    assert_close(out, b.reference(), dtype, b)


def test_paged_attention_edge_cases(tops):
    """Single-token context, a prompt that exactly fills its blocks, more splits than key tiles (empty
    splits), trailing rows no sequence owns (left untouched), int64 metadata, out=None."""
    seed = _seed()
    bs = 8
    seqs = [(1, 1), (2 * bs, 2 * bs), (bs + 3, 1), (bs, 2)]
    b = Batch(seed, seqs, block_size=bs, num_kv_heads=1, group=2, head_dim=64, dtype=torch.float32,
              extra_rows=3, index_dtype=torch.int64)
    ref = b.reference()
    rows = sum(q for _, q in seqs)
    for num_splits in (1, 4):  # with 4, most splits of the short sequences see no key at all
        out = b.poisoned_out()
        tops.paged_attention(*b.args(), out=out, num_splits=num_splits, tile_n=16)
        assert_close(out, ref, torch.float32, f"{b} splits={num_splits}", rows=rows)
        assert torch.isnan(out[rows:]).all(), "rows past query_start_loc[-1] must not be written"
    res = tops.paged_attention(*b.args())
    assert res.shape == b.query.shape and res.dtype == b.query.dtype
    assert_close(res, ref, torch.float32, b, rows=rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_paged_attention_batch_invariant(tops, dtype):
    """``batch_invariant=True``: a row's output is bit-equal whatever shares the launch: a decode row
    alone or beside a prefill chunk and long contexts (which would pick split-KV and prefill tiles), and
    the last row of a prompt chunk equal to the same row computed as a decode step."""
    seed = _seed()
    rng = random.Random(seed)
    chunk = rng.randint(16, 24) if dtype == torch.bfloat16 else rng.randint(5, 12)  # 16-bit: a chunk of 64 rows
    seqs = [(rng.randint(520, 700), 1), (rng.randint(2, 40), 1), (rng.randint(40, 60), chunk), (rng.randint(8, 20), 1)]
    b = Batch(seed, seqs, block_size=16, num_kv_heads=1, group=3, head_dim=64, dtype=dtype)
    plan = tops.plan_attention(b.query, b.key_cache, b.block_tables, len(seqs), **b.lists())
    assert plan["num_splits"] > 1, plan  # the automatic choice would split this batch
    if dtype == torch.bfloat16:  # and run a decode row alone in a smaller tile than beside the chunk
        alone_plan = tops.plan_attention(b.query[:1], b.key_cache, b.block_tables[:1], 1, [seqs[0][0]], [0, 1])
        assert alone_plan["block_m"] < plan["block_m"], (alone_plan, plan)
    fixed = ("block_m", "tile_n", "num_splits", "num_warps", "num_stages")
    p_mixed = tops.plan_attention(b.query, b.key_cache, b.block_tables, len(seqs), batch_invariant=True, **b.lists())
    p_alone = tops.plan_attention(b.query[:1], b.key_cache, b.block_tables[:1], 1, [seqs[0][0]], [0, 1],
                                  batch_invariant=True)
    assert [p_mixed[k] for k in fixed] == [p_alone[k] for k in fixed] and p_mixed["num_splits"] == 1
    mixed = tops.paged_attention(*b.args(), batch_invariant=True, **b.lists())
    assert_close(mixed, b.reference(), dtype, b)
    qsl = b.qsl.tolist()
    for i, (ctx, _) in enumerate(seqs):
        last = qsl[i + 1] - 1  # the sequence's last query row, attending keys 0..ctx-1
        alone = tops.paged_attention(
            b.query[last : last + 1], b.key_cache, b.value_cache, b.block_tables[i : i + 1],
            b.seq_lens[i : i + 1], torch.tensor([0, 1], dtype=b.qsl.dtype, device=b.device), b.scale,
            batch_invariant=True, seq_lens_list=[ctx], query_start_loc_list=[0, 1])
        assert torch.equal(alone[0], mixed[last]), (b, i)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 576])
def test_rms_norm_matches_torch_and_is_per_row(tops, dtype, hidden):
    """The Triton RMSNorm (plain and with the residual add fused) against the torch reference; the
    residual bit-equal (on the GPU); each row's output the same alone as in a batch of 7."""
    g = torch.Generator().manual_seed(_seed())
    x = (torch.randn(7, hidden, generator=g) * 3).to(dtype).to(DEVICE)
    r = torch.randn(7, hidden, generator=g).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(DEVICE)
    ulp = 1e-6 if dtype == torch.float32 else 2 ** -7
    ref = torch_ops.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(tops.rms_norm(x, w, 1e-5), ref, rtol=2 * ulp, atol=1e-6)
    xa, ra, xb, rb = x.clone(), r.clone(), x.clone(), r.clone()
    tops.fused_add_rms_norm(xa, ra, w, 1e-5)
    torch_ops.fused_add_rms_norm(xb, rb, w, 1e-5)
    if CUDA or dtype == torch.float32:
        assert torch.equal(ra, rb)
    else:  # the interpreter rounds float32 -> bfloat16 towards zero (the GPU to nearest): one step apart
        torch.testing.assert_close(ra, rb, rtol=ulp, atol=0)
    torch.testing.assert_close(xa, torch_ops.rms_norm(ra, w, 1e-5), rtol=2 * ulp, atol=1e-6)
    batch = tops.rms_norm(x, w, 1e-5)
    for i in (0, 3, 6):
        assert torch.equal(tops.rms_norm(x[i : i + 1], w, 1e-5)[0], batch[i])
    assert tops.rms_norm(x[:0], w, 1e-5).shape == (0, hidden)


def test_choose_num_splits(tops):
    # plenty of programs: no split; few programs and long contexts: a power of two, capped
    assert tops._choose_num_splits(active_programs=1000, max_kv_len=8192, sm_count=132) == 1
    n = tops._choose_num_splits(active_programs=8, max_kv_len=8192, sm_count=132)
    assert n == 32 and n * tops.MIN_SPLIT_TOKENS <= 8192
    assert tops._choose_num_splits(active_programs=8, max_kv_len=300, sm_count=132) == 1
    assert tops._choose_num_splits(active_programs=1, max_kv_len=10**6, sm_count=132) == tops.MAX_SPLITS
    for active in range(1, 300, 7):
        for L in (1, 255, 256, 700, 5000):
            n = tops._choose_num_splits(active, L, 132)
            assert n >= 1 and n & (n - 1) == 0


# ------------------------------------------------------------------------------------------------
# dispatch
# ------------------------------------------------------------------------------------------------
def test_dispatch(tops, monkeypatch):
    t = torch.zeros(1, device=DEVICE)
    saved = kernels._FORCED
    try:
        kernels.set_backend(None)
        cpu = "cpp" if kernels.cpp_available() else "torch"
        assert kernels.backend_for(t) == ("triton" if CUDA else cpu)
        assert kernels.backend_for(torch.zeros(1)) == cpu
        with pytest.raises(ValueError):
            kernels.set_backend("cuda")
        kernels.set_backend("triton")
        seed = _seed()
        b = Batch(seed, [(20, 1), (9, 5)], block_size=16, num_kv_heads=1, group=2, head_dim=64, dtype=torch.float32)
        out = b.poisoned_out()
        kernels.paged_attention(*b.args(), out=out)
        assert_close(out, b.reference(), torch.float32, b)
        kernels.set_backend("torch")
        assert kernels.backend_for(t) == "torch"
        monkeypatch.setenv("CBP_ATTENTION_BACKEND", "triton")
        importlib.reload(kernels)
        assert kernels.backend_for(torch.zeros(1)) == "triton"
    finally:
        monkeypatch.delenv("CBP_ATTENTION_BACKEND", raising=False)
        importlib.reload(kernels)
        kernels.set_backend(saved)


# ------------------------------------------------------------------------------------------------
# the Hopper build, checked on any machine (triton ships ptxas)
# ------------------------------------------------------------------------------------------------
@pytest.mark.skipif(CUDA, reason="on a GPU the tests above compile and run the real kernels")
def test_kernels_compile_for_hopper(tops):
    """Every kernel compiles to sm_90 machine code (the interpreter alone would not catch code that
    only the compiler rejects). Runs in a subprocess: the compiler cannot work in interpreter mode."""
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this triton wheel ships no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "bench.compile_report", "--check"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("attention", "reduce", "reshape_and_cache", "rms_norm"))]
    assert len(lines) == 8, r.stdout


# ------------------------------------------------------------------------------------------------
# CUDA only: realistic sizes against the torch path on the same GPU
# ------------------------------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize(
    "num_kv_heads,group,head_dim,dtype",
    [(3, 3, 64, torch.bfloat16), (8, 4, 128, torch.bfloat16), (8, 4, 128, torch.float16), (2, 4, 128, torch.float32)],
)
def test_cuda_large_batch_matches_torch(tops, num_kv_heads, group, head_dim, dtype):
    """Decodes with contexts up to 8192 (split-KV chosen automatically), a 1024-token prompt and a
    chunk starting mid-block at position 3000, on the GPU, against the torch path in float32."""
    seed = _seed()
    rng = random.Random(seed)
    bs = rng.choice([8, 16, 32])
    seqs = [(rng.randint(1, 8192), 1) for _ in range(12)] + [(1024, 1024), (3001 + 512, 512)]
    rng.shuffle(seqs)
    b = Batch(seed, seqs, block_size=bs, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, dtype=dtype)
    q, kc, vc, bt, sl, qsl, scale = b.args()
    ref = torch_ops.paged_attention(q.float(), kc.float(), vc.float(), bt, sl, qsl, scale).double().cpu()
    for kw in ({}, b.lists()):
        out = b.poisoned_out()
        tops.paged_attention(*b.args(), out=out, **kw)
        assert_close(out, ref, dtype, f"{b} {list(kw)}")


@needs_cuda
def test_cuda_decode_only_long_contexts(tops):
    """Small decode batches with long contexts (the flash-decoding case) and the dispatch on CUDA."""
    seed = _seed()
    rng = random.Random(seed)
    for n in (1, 4, 16):
        seqs = [(rng.randint(4096, 8192), 1) for _ in range(n)]
        b = Batch(seed + n, seqs, block_size=16, num_kv_heads=8, group=4, head_dim=128, dtype=torch.bfloat16)
        q, kc, vc, bt, sl, qsl, scale = b.args()
        ref = torch_ops.paged_attention(q.float(), kc.float(), vc.float(), bt, sl, qsl, scale).double().cpu()
        out = b.poisoned_out()
        kernels.paged_attention(*b.args(), out=out, **b.lists())  # CUDA tensors -> triton
        assert_close(out, ref, torch.bfloat16, b)
