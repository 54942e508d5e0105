"""The fused C++ CPU kernels (``kernels.cpu_ops``) against the torch reference, the dispatch and its
fallback, and the logits pass; the linear layers (``kernels.cpu_linear``) are in tests/test_cpu_linear.py.

The extension is compiled on first use (about a minute once, then loaded from the build cache). Without
a C++ compiler the kernel tests skip; with one, a build failure fails them (so a broken source cannot
pass silently). Every check draws fresh random inputs (seed in the failure message), shuffled block
tables whose unused entries point at other sequences' blocks, random data in unused cache slots, and a
NaN-poisoned output buffer with trailing rows no sequence owns (which must stay untouched).
"""

from __future__ import annotations

import logging
import os
import random
import shutil

import pytest
import torch

import kernels
from kernels import cpu_ops, torch_ops
from tests.test_kernels import TOL, Batch, assert_close, random_seqs

HAVE_CXX = shutil.which(os.environ.get("CXX", "c++")) is not None
# float32 against a float64 reference: (relative L2, max abs); the other dtypes as in test_kernels
CPU_TOL = {torch.float32: (1e-5, 2e-5), torch.bfloat16: TOL[torch.bfloat16], torch.float16: TOL[torch.float16]}


@pytest.fixture(scope="module")
def ext():
    if not HAVE_CXX:
        pytest.skip("no C++ compiler: the CPU kernels cannot be built (the engine falls back to the torch path)")
    try:
        return cpu_ops.load()
    except cpu_ops.BuildError as e:
        pytest.fail(f"a C++ compiler is present but the extension did not build: {e}")


def _seed() -> int:
    return random.SystemRandom().randrange(2**31)


def check(b: Batch, **kw) -> torch.Tensor:
    """Run the kernel on batch ``b`` into a NaN-poisoned buffer; compare with the float64 reference."""
    rows = sum(q for _, q in b.seqs)
    out = b.poisoned_out()
    res = cpu_ops.paged_attention(*b.args(), out=out, **kw)
    assert res is out
    got, ref = out[:rows].double(), b.reference()[:rows]
    assert torch.isfinite(got).all(), f"{b}: non-finite output (unwritten rows?) at {(~torch.isfinite(got)).nonzero()[:5].tolist()}"
    rel = ((got - ref).norm() / ref.norm()).item()
    mx = (got - ref).abs().max().item()
    rel_tol, abs_tol = CPU_TOL[b.dtype]
    assert rel < rel_tol and mx < abs_tol, f"{b}: relative error {rel:.2e} (bound {rel_tol:.0e}), max abs {mx:.2e} (bound {abs_tol:.0e})"
    assert torch.isnan(out[rows:]).all(), "rows past query_start_loc[-1] must not be written"
    return out


# ------------------------------------------------------------------------------------------------
# paged attention
# ------------------------------------------------------------------------------------------------
# (block_size, num_kv_heads, group, head_dim, dtype): every block size with GQA groups 1, 3 and 4, head
# dims 64 and 128 and float32 / bfloat16 alternating, then float16 and the odd head dims
CASES = []
for _i, (_bs, (_kvh, _g)) in enumerate((bs, kg) for bs in (1, 8, 16, 32) for kg in ((2, 1), (3, 3), (1, 4))):
    CASES.append((_bs, _kvh, _g, (64, 128)[_i % 2], (torch.float32, torch.bfloat16)[(_i // 2) % 2]))
CASES += [
    (16, 3, 3, 64, torch.float16),
    (8, 2, 4, 128, torch.float16),
    (16, 2, 2, 16, torch.float32),  # the tiny test model's head_dim
    (8, 2, 2, 16, torch.bfloat16),
    (32, 1, 3, 80, torch.bfloat16),  # head_dim not a multiple of 32: the scalar packing paths
    (16, 1, 2, 32, torch.bfloat16),
]


def _case_id(c):
    bs, kvh, g, d, dt = c
    return f"bs{bs}-kvh{kvh}-g{g}-d{d}-{str(dt).removeprefix('torch.')}"


@pytest.mark.parametrize("block_size,num_kv_heads,group,head_dim,dtype", CASES, ids=[_case_id(c) for c in CASES])
def test_paged_attention_mixed_batch(ext, block_size, num_kv_heads, group, head_dim, dtype):
    """Decode rows, chunked-prefill chunks starting mid-block after cached context (q_len < seq_len),
    fresh prompts and one long prompt chunk (several query tiles and key chunks), in one call."""
    seed = _seed()
    rng = random.Random(seed)
    seqs = random_seqs(rng, max(block_size, 2), decode=3, chunks=1, prompts=1, max_ctx=300, max_q=24)
    seqs.append((rng.randint(260, 420), rng.randint(100, 250)))  # q_len < seq_len, spans key chunks
    rng.shuffle(seqs)
    b = Batch(seed, seqs, block_size=block_size, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
              dtype=dtype, device="cpu", extra_rows=3, strided_query=(group == 4))
    check(b, **(b.lists() if seed % 2 else {}))


@pytest.mark.parametrize("dtype,num_kv_heads,group,head_dim", [
    (torch.bfloat16, 3, 3, 64), (torch.float32, 2, 1, 128), (torch.float16, 4, 2, 64)])
def test_paged_attention_many_decode_rows(ext, dtype, num_kv_heads, group, head_dim):
    """Enough decode rows that each work item takes all KV heads of its sequence (the decode layout
    for large batches), next to a prompt chunk (one KV head per item)."""
    seed = _seed()
    rng = random.Random(seed)
    seqs = [(rng.randint(1, 300), 1) for _ in range(20)] + [(90, 40)]
    rng.shuffle(seqs)
    b = Batch(seed, seqs, block_size=16, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, dtype=dtype,
              device="cpu", extra_rows=2)
    check(b)


def test_paged_attention_matches_torch_path_float32(ext):
    """Directly against the torch path in float32 (SmolLM2 shapes), decode and prefill together."""
    seed = _seed()
    rng = random.Random(seed)
    seqs = [(rng.randint(1, 200), 1) for _ in range(6)] + [(300, 300), (257, 129)]
    b = Batch(seed, seqs, block_size=16, num_kv_heads=3, group=3, head_dim=64, dtype=torch.float32, device="cpu")
    got = cpu_ops.paged_attention(*b.args())
    want = torch_ops.paged_attention(*b.args())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{b}: {m}")


def test_paged_attention_edge_cases(ext):
    """Single-token context, a prompt exactly filling its blocks, a one-block chunk, int64 metadata,
    out=None, a zero-length sequence (no rows)."""
    seed = _seed()
    bs = 8
    seqs = [(1, 1), (2 * bs, 2 * bs), (bs + 3, 1), (bs, 2), (5, 0)]
    for dtype in (torch.float32, torch.bfloat16):
        b = Batch(seed, seqs, block_size=bs, num_kv_heads=1, group=2, head_dim=64, dtype=dtype, device="cpu",
                  extra_rows=3, index_dtype=torch.int64)
        check(b)
        res = cpu_ops.paged_attention(*b.args())
        assert res.shape == b.query.shape and res.dtype == b.query.dtype


def test_paged_attention_long_prefill_chunks(ext):
    """A prompt in two chunks of chunked prefill (the second attends to the first through the cache):
    many query tiles and key chunks, every block size's partial last block."""
    seed = _seed()
    for bs in (16, 32):
        b = Batch(seed, [(700, 380)], block_size=bs, num_kv_heads=3, group=3, head_dim=64, dtype=torch.bfloat16,
                  device="cpu")
        check(b)


def _has_bf16dp(ext) -> bool:
    return "+bf16dp" in ext.isa()


@pytest.mark.parametrize("bf16_dot,qk_dot", [("0", "0"), ("0", "1"), ("1", "0")])
def test_bfloat16_paths_mixed_batch_and_long_chunks(ext, monkeypatch, bf16_dot, qk_dot):
    """The bfloat16 paths: float32 products, and where the CPU has AVX512-BF16 the Q K^T dot products
    (``CBP_CPU_QK_DOT=1``, the default on AMD) and the opt-in bf16 dot products (``CBP_CPU_BF16_DOT=1``),
    on decode rows mixed with long chunked-prefill chunks."""
    if "1" in (bf16_dot, qk_dot) and not _has_bf16dp(ext):
        pytest.skip("the dot-product paths need an AVX512-BF16 build")
    monkeypatch.setenv("CBP_CPU_BF16_DOT", bf16_dot)
    monkeypatch.setenv("CBP_CPU_QK_DOT", qk_dot)
    seed = _seed()
    rng = random.Random(seed)
    seqs = random_seqs(rng, 16, decode=4, chunks=1, prompts=1, max_ctx=300, max_q=24) + [(700, 380)]
    b = Batch(seed, seqs, block_size=16, num_kv_heads=3, group=3, head_dim=64, dtype=torch.bfloat16, device="cpu")
    check(b)


def test_qk_dot_products_switch_changes_the_path(ext, monkeypatch):
    """CBP_CPU_QK_DOT=1 and =0 run different Q K^T arithmetic on bfloat16 caches (some output bits
    differ, all within the oracle's tolerance), where the build has AVX512-BF16."""
    if not _has_bf16dp(ext):
        pytest.skip("the Q K^T dot products need an AVX512-BF16 build")
    seed = _seed()
    b = Batch(seed, [(300, 1)] * 8 + [(400, 200)], block_size=16, num_kv_heads=3, group=3, head_dim=64,
              dtype=torch.bfloat16, device="cpu")
    out = {}
    for v in ("0", "1"):
        monkeypatch.setenv("CBP_CPU_QK_DOT", v)
        out[v] = cpu_ops.paged_attention(*b.args())
        check(b)
    assert not torch.equal(out["0"], out["1"]), seed


def test_thread_count_does_not_change_results(ext):
    """Each work item is computed by one thread: 1 and 2 threads give identical bits."""
    seed = _seed()
    rng = random.Random(seed)
    seqs = [(rng.randint(1, 300), 1) for _ in range(8)] + [(200, 150)]
    b = Batch(seed, seqs, block_size=16, num_kv_heads=3, group=3, head_dim=64, dtype=torch.bfloat16, device="cpu")
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_ops.paged_attention(*b.args())
        torch.set_num_threads(2)
        two = cpu_ops.paged_attention(*b.args())
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(one, two), seed


@pytest.mark.parametrize("dtype,head_dim,qk_dot", [(torch.bfloat16, 64, "0"), (torch.bfloat16, 80, "0"),
                                                   (torch.bfloat16, 64, "1"), (torch.bfloat16, 80, "1"),
                                                   (torch.float16, 64, "0"), (torch.float32, 64, "0")])
def test_decode_row_equals_the_same_row_in_a_prefill_chunk(ext, monkeypatch, dtype, head_dim, qk_dot):
    """The last query row of a prefill chunk and the same row run as a decode row (q_len 1, the decode
    tiles' own packing and P V paths) give identical bits, with float32 Q K^T and with the Q K^T dot
    products (``CBP_CPU_QK_DOT``): chunked prefill and prefix-cache hits, which turn a prompt's last row
    into a one-row step, cannot change a token."""
    if qk_dot == "1" and not _has_bf16dp(ext):
        pytest.skip("the Q K^T dot products need an AVX512-BF16 build")
    monkeypatch.setenv("CBP_CPU_QK_DOT", qk_dot)
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    kvh, group, bs, ctx, qlen = 3, 3, 16, 203, 37
    nblocks = (ctx + bs - 1) // bs
    kc = torch.randn(nblocks + 5, kvh, bs, head_dim, generator=g).to(dtype)
    vc = torch.randn(nblocks + 5, kvh, bs, head_dim, generator=g).to(dtype)
    bt = torch.randperm(nblocks + 5, generator=g)[:nblocks].to(torch.int32).view(1, -1)
    q = torch.randn(qlen, kvh * group, head_dim, generator=g).to(dtype)
    sl = torch.tensor([ctx], dtype=torch.int32)
    chunk = cpu_ops.paged_attention(q, kc, vc, bt, sl, torch.tensor([0, qlen], dtype=torch.int32), head_dim ** -0.5)
    one = cpu_ops.paged_attention(q[-1:].clone(), kc, vc, bt, sl, torch.tensor([0, 1], dtype=torch.int32),
                                  head_dim ** -0.5)
    assert torch.equal(chunk[-1:], one), seed


def test_unsupported_shapes_use_the_torch_path(ext):
    """head_dim not a multiple of 16 goes to the torch path (same results as calling it)."""
    seed = _seed()
    b = Batch(seed, [(20, 1), (9, 5)], block_size=8, num_kv_heads=1, group=2, head_dim=24, dtype=torch.float32,
              device="cpu")
    torch.testing.assert_close(cpu_ops.paged_attention(*b.args()), torch_ops.paged_attention(*b.args()))


# ------------------------------------------------------------------------------------------------
# reshape_and_cache
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype,block_size,num_kv_heads,head_dim,slot_dtype,strided",
    [
        (torch.float32, 8, 3, 64, torch.int64, False),
        (torch.bfloat16, 16, 3, 64, torch.int32, True),
        (torch.float16, 1, 2, 128, torch.int64, True),
        (torch.bfloat16, 32, 1, 16, torch.int64, False),
    ],
)
def test_reshape_and_cache(ext, dtype, block_size, num_kv_heads, head_dim, slot_dtype, strided):
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    nb, T = 6, 40
    kc = torch.randn(nb, num_kv_heads, block_size, head_dim, generator=g).to(dtype)
    vc = torch.randn(nb, num_kv_heads, block_size, head_dim, generator=g).to(dtype)
    if strided:  # K and V as views into a [heads, tokens, dim] tensor, as the model hands them over
        k = torch.randn(num_kv_heads, T, head_dim, generator=g).to(dtype).transpose(0, 1)
        v = torch.randn(num_kv_heads, T, head_dim, generator=g).to(dtype).transpose(0, 1)
    else:
        k = torch.randn(T, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(T, num_kv_heads, head_dim, generator=g).to(dtype)
    T = min(T, nb * block_size)
    k, v = k[:T], v[:T]
    slots = torch.randperm(nb * block_size, generator=g)[:T]
    slots[torch.randperm(T, generator=g)[: T // 4]] = -1
    slots = slots.to(slot_dtype)
    want_k, want_v = kc.clone(), vc.clone()
    torch_ops.reshape_and_cache(k, v, want_k, want_v, slots)
    assert cpu_ops.reshape_and_cache(k, v, kc, vc, slots) is None
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v), f"seed {seed}"


# ------------------------------------------------------------------------------------------------
# dispatch and fallback
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def restore_dispatch(monkeypatch):
    saved = (kernels._FORCED, kernels._cpp_ok, cpu_ops._module, cpu_ops._error)
    yield monkeypatch
    kernels._FORCED, kernels._cpp_ok, cpu_ops._module, cpu_ops._error = saved


def test_dispatch(ext, restore_dispatch):
    b = Batch(_seed(), [(20, 1), (9, 5)], block_size=16, num_kv_heads=1, group=2, head_dim=64, dtype=torch.float32,
              device="cpu")
    kernels.set_backend(None)
    assert kernels.backend_for(torch.zeros(1)) == "cpp"
    for name in ("cpp", "torch"):
        kernels.set_backend(name)
        assert kernels.backend_for(torch.zeros(1)) == name
        out = b.poisoned_out()
        kernels.paged_attention(*b.args(), out=out)
        assert_close(out, b.reference(), torch.float32, b)
    with pytest.raises(ValueError):
        kernels.set_backend("cuda")


def test_env_var_forces_backend(ext, monkeypatch):
    import importlib

    try:
        for name in ("torch", "cpp"):
            monkeypatch.setenv("CBP_ATTENTION_BACKEND", name)
            importlib.reload(kernels)
            assert kernels.backend_for(torch.zeros(1)) == name
    finally:
        monkeypatch.delenv("CBP_ATTENTION_BACKEND", raising=False)
        importlib.reload(kernels)


def test_build_failure_falls_back_to_torch_with_one_warning(restore_dispatch, caplog):
    """Simulated build failure: CPU calls give the torch path's results, after exactly one warning."""
    mp = restore_dispatch

    def broken_build():
        raise cpu_ops.BuildError("simulated: no compiler")

    mp.setattr(cpu_ops, "_build", broken_build)
    cpu_ops._module, cpu_ops._error = None, None
    kernels._cpp_ok = None
    kernels.set_backend(None)
    b = Batch(_seed(), [(30, 1), (12, 6)], block_size=8, num_kv_heads=1, group=3, head_dim=64, dtype=torch.float32,
              device="cpu")
    want = torch_ops.paged_attention(*b.args())
    with caplog.at_level(logging.WARNING, logger="kernels"):
        for _ in range(3):
            assert kernels.backend_for(torch.zeros(1)) == "torch"
            got = kernels.paged_attention(*b.args())
            assert torch.equal(got, want)
            kc, vc = b.key_cache.clone(), b.value_cache.clone()
            kernels.reshape_and_cache(torch.ones(2, 1, 64), torch.ones(2, 1, 64), kc, vc, torch.tensor([0, -1]))
            assert torch.equal(kc[0, :, 0], torch.ones(1, 64))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "simulated: no compiler" in warnings[0].getMessage()
    assert not cpu_ops.available() and cpu_ops.unavailable_reason() == "simulated: no compiler"
    # forcing the C++ backend when it cannot be built is an error, not a silent fallback
    kernels.set_backend("cpp")
    with pytest.raises(cpu_ops.BuildError):
        kernels.paged_attention(*b.args())


def test_missing_compiler_is_reported(restore_dispatch):
    """The loader names a missing compiler as the reason (without trying to build)."""
    mp = restore_dispatch
    mp.setenv("CXX", "no-such-compiler-cbp")
    cpu_ops._module, cpu_ops._error = None, None
    assert not cpu_ops.available()
    assert "no-such-compiler-cbp" in cpu_ops.unavailable_reason()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows,vocab", [(64, 49152), (3, 17), (1, 1), (6, 1003), (2, 15)])
def test_logits_argmax_matches_torch(ext, dtype, rows, vocab):
    """kernels.logits_argmax equals torch.argmax over the float32 values and torch.isfinite(...).all
    per row: ties (the lowest position), NaN rows (the first NaN), +inf / -inf, rows of -inf only, a
    vocab that is not a multiple of the vector width, and rows with a stride."""
    g = torch.Generator().manual_seed(rows * 131 + vocab)
    x = torch.randn(rows, vocab + 5, generator=g).to(dtype)[:, :vocab]  # rows with a stride
    if rows >= 3:
        x[0, :] = x[0, vocab // 2]                 # every value tied
        x[1, vocab // 3] = float("nan")
        x[1, vocab - 1] = float("nan")
        x[2, vocab - 1] = float("inf")             # the maximum is an infinity, in the scalar tail
    if rows >= 6:
        x[3, :] = float("-inf")
        x[4, 7] = float("-inf")                    # finite check sees a -inf that is not the maximum
        x[5, vocab - 8] = x[5].max() + 1           # the maximum in the last whole vector
    index, finite = kernels.logits_argmax(x)
    ref_index, ref_finite = torch_ops.logits_argmax(x)
    assert index.dtype == torch.int64 and finite.dtype == torch.bool
    assert torch.equal(index, ref_index)
    assert torch.equal(finite, ref_finite)
    assert torch.equal(index, x.float().argmax(dim=-1))


def test_logits_argmax_no_rows(ext):
    index, finite = kernels.logits_argmax(torch.empty(0, 10))
    assert index.shape == (0,) and finite.shape == (0,)


def test_metadata_outside_the_cache_is_refused_not_a_crash(ext):
    """A block id outside the cache, query_start_loc past the query's rows, or a value cache of another
    shape than the key cache raise a RuntimeError (read or written outside the tensors before: a crash)."""
    kc = torch.zeros(4, 2, 16, 16)
    vc = torch.zeros_like(kc)
    q = torch.randn(3, 4, 16)
    out = torch.empty_like(q)
    bt = torch.tensor([[1]], dtype=torch.int32)
    lens = torch.tensor([3], dtype=torch.int32)
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    ext.paged_attention(out, q, kc, vc, bt, lens, qsl, 0.25, False, False)  # valid: runs
    with pytest.raises(RuntimeError, match="block table entry"):
        ext.paged_attention(out, q, kc, vc, torch.tensor([[10**6]], dtype=torch.int32), lens, qsl, 0.25, False, False)
    with pytest.raises(RuntimeError, match="query_start_loc"):
        ext.paged_attention(out, q, kc, vc, bt, torch.tensor([5], dtype=torch.int32),
                            torch.tensor([2, 5], dtype=torch.int32), 0.25, False, False)
    k = torch.randn(3, 2, 16)
    with pytest.raises(RuntimeError, match="same shape"):
        ext.reshape_and_cache(k, k.clone(), kc, vc[:2], torch.tensor([0, 1, 2]))


# ------------------------------------------------------------------------------------------------
# the build folder: one per version and checkout; a lock left by a killed build
# ------------------------------------------------------------------------------------------------
def test_build_name_has_a_tag_of_the_sources_and_the_checkout(tmp_path, monkeypatch):
    """Two checkouts, or two versions of the sources, build into folders of their own (torch rebuilds a
    folder whose sources or absolute paths changed, so sharing one made them rebuild each other)."""
    tag = cpu_ops._source_tag()
    assert len(tag) == 8 and tag == cpu_ops._source_tag()
    copy = tmp_path / "csrc"
    shutil.copytree(cpu_ops._CSRC, copy)
    monkeypatch.setattr(cpu_ops, "_CSRC", copy)
    other_checkout = cpu_ops._source_tag()
    assert other_checkout != tag
    (copy / "decoder_cpu.cpp").write_text((copy / "decoder_cpu.cpp").read_text() + "\n// changed\n")
    assert cpu_ops._source_tag() not in (tag, other_checkout)


def test_a_forced_cpu_class_builds_in_a_folder_of_its_own(monkeypatch):
    """``CBP_CPU_MAX_ISA`` below this CPU's class changes the compiler flags, so the build folder: a forced
    class never loads (or overwrites) the native build. (The build's lock and concurrency:
    tests/test_kernel_build.py.)"""
    from kernels import cpu_features

    monkeypatch.delenv("CBP_CPU_MAX_ISA", raising=False)
    native = cpu_ops.extension_name()
    for cap in cpu_features.executable_classes()[:-1]:  # the classes below this CPU's own
        monkeypatch.setenv("CBP_CPU_MAX_ISA", cap)
        assert cpu_ops.cflags()[-1].startswith("-mno-") and cpu_ops.extension_name() != native
