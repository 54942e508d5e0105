"""The CPU linear layers (``kernels.cpu_linear``): prepacked oneDNN weights, the rule that picks a path
from the CPU's flags (never from timings), the float32 path, and the engine's own bfloat16 GEMM
(``kernels/csrc/gemm_bf16_cpu.cpp``) against its exact torch reference. Tests that need the C++ extension
or an AVX-512 CPU are skipped without them."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import cpu_ops, torch_ops


def _seed() -> int:
    return random.SystemRandom().randrange(2**31)


# ------------------------------------------------------------------------------------------------
# prepacked oneDNN linear layers
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prepack_linears_gives_equal_logits(dtype):
    """Packing only happens where results are bit-identical, so logits stay equal."""
    import copy

    from kernels import cpu_linear
    from tests.conftest import make_tiny_model

    if not cpu_linear.available():
        pytest.skip("torch without oneDNN (mkldnn)")
    base = make_tiny_model(vocab_size=300, seed=1).to(dtype)
    packed = copy.deepcopy(base)
    n = cpu_linear.prepack_linears(packed)
    ids = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(_seed()))
    with torch.no_grad():
        want = base(ids).logits
        got = packed(ids).logits
    assert torch.equal(got, want)
    replaced = [m for m in packed.modules() if isinstance(m, cpu_linear.PackedLinear)]
    assert len(replaced) == n
    if dtype == torch.bfloat16 and torch.backends.mkldnn.is_available() and n == 0:
        pytest.skip("no bfloat16 shape packs bit-identically on this CPU")
    if n:  # the replaced modules are the decoder layers' projections (and lm_head)
        names = {name for name, m in packed.named_modules() if isinstance(m, cpu_linear.PackedLinear)}
        assert all(".layers." in name or name == "lm_head" for name in names), names
        # generation through transformers still works on the packed model
        with torch.no_grad():
            out = packed.generate(ids[:1], attention_mask=torch.ones_like(ids[:1]), max_new_tokens=3, do_sample=False)
        assert out.shape == (1, 20)


def test_prepack_linears_skips_unequal_shapes(monkeypatch):
    from kernels import cpu_linear
    from tests.conftest import make_tiny_model

    model = make_tiny_model(vocab_size=100, seed=2).to(torch.bfloat16)
    monkeypatch.setattr(cpu_linear, "native_bf16", lambda: True)
    monkeypatch.setattr(cpu_linear, "packed_equal", lambda weight, bias=None: False)
    assert cpu_linear.prepack_linears(model) == 0
    assert not any(isinstance(m, cpu_linear.PackedLinear) for m in model.modules())


def test_packing_is_decided_by_features_and_dtype_not_timings(monkeypatch):
    """The rule: a bfloat16 weight on a CPU with native bfloat16, whose packed call is bit-identical;
    never a float32 weight, never without native bfloat16; and the same answer on every call."""
    from kernels import cpu_linear

    if not cpu_linear.available():
        pytest.skip("torch without oneDNN (mkldnn)")
    w = torch.randn(48, 32, generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(cpu_linear, "packed_equal", lambda weight, bias=None: True)
    monkeypatch.setattr(cpu_linear, "native_bf16", lambda: True)
    assert cpu_linear.packs(w.bfloat16()) and not cpu_linear.packs(w)
    monkeypatch.setattr(cpu_linear, "native_bf16", lambda: False)
    assert not cpu_linear.packs(w.bfloat16())
    assert "time" not in cpu_linear.__dict__  # no timing module in the decision path


def test_engine_linear_matches_f_linear():
    """kernels.cpu_linear.Linear (what the engine's own forward calls) equals F.linear bit for bit,
    packed or not, with and without bias."""
    import torch.nn.functional as F

    from kernels.cpu_linear import Linear

    g = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(40, 64, generator=g).to(dtype)
        b = torch.randn(40, generator=g).to(dtype)
        x = torch.randn(7, 64, generator=g).to(dtype)
        for bias in (None, b):
            assert torch.equal(Linear(w, bias)(x), F.linear(x, w, bias))


# ------------------------------------------------------------------------------------------------
# the logits pass of the sampler and the fault check
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("vendor,flags,fast,dp", [
    ("GenuineIntel", "avx2 avx512f avx512_bf16 amx_bf16 amx_tile", True, False),
    ("AuthenticAMD", "avx2 avx512f avx512_bf16", True, True),
    ("GenuineIntel", "avx2 avx512f avx512_bf16", False, False),
    ("AuthenticAMD", "avx2 avx512f", False, False),
    ("AuthenticAMD", "avx2 fma", False, False),
    ("", "", False, False),
])
def test_bf16_matmul_rule_is_decided_by_flags_and_vendor(monkeypatch, vendor, flags, fast, dp):
    """Both flag rules: whether bfloat16 matmuls outrun float32 ones, and whether the own GEMM uses
    VDPBF16PS (AMD CPUs with AVX512-BF16 only)."""
    from kernels import cpu_linear

    monkeypatch.setattr(cpu_linear, "_cpuinfo", lambda: (vendor, flags))
    cpu_linear.bf16_matmul_outruns_f32.cache_clear()
    cpu_linear.gemm_dot_products.cache_clear()
    try:
        assert cpu_linear.gemm_dot_products() is dp
        assert cpu_linear.bf16_matmul_outruns_f32() is fast
        w = torch.zeros(4, 4, dtype=torch.bfloat16)
        assert cpu_linear.f32_compute(w) is (not fast)
        assert not cpu_linear.f32_compute(w.float())  # float32 weights are float32 already
        monkeypatch.setenv("CBP_CPU_F32_LINEARS", "0")
        assert not cpu_linear.f32_compute(w)
    finally:
        cpu_linear.bf16_matmul_outruns_f32.cache_clear()
        cpu_linear.gemm_dot_products.cache_clear()


def test_linear_multiplies_many_rows_in_float32_where_bf16_matmuls_are_slow(monkeypatch):
    """Where f32_compute holds, a bfloat16 Linear gives, bit for bit, F.linear in float32 rounded to
    bfloat16 from F32_MIN_ROWS rows, and its bfloat16 call below; no float32 copy in a fixed row tile
    below F32_MIN_ROWS (batch-invariant mode) or with CBP_CPU_F32_LINEARS=0."""
    import torch.nn.functional as F

    from kernels import cpu_linear
    from kernels.cpu_linear import F32_MIN_ROWS, Linear

    monkeypatch.setattr(cpu_linear, "bf16_matmul_outruns_f32", lambda: False)
    monkeypatch.setattr(cpu_linear, "own_gemm_cpu", lambda: False)  # the fallback where the own GEMM is missing
    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 64, generator=g).bfloat16()
    b = torch.randn(40, generator=g).bfloat16()
    for bias in (None, b):
        lin = Linear(w, bias)
        assert lin.weight32 is not None and lin.weight32.dtype == torch.float32
        big = torch.randn(F32_MIN_ROWS + 3, 64, generator=g).bfloat16()
        b32 = None if bias is None else bias.float()
        assert torch.equal(lin(big), F.linear(big.float(), w.float(), b32).bfloat16())
        small = big[: F32_MIN_ROWS - 1]
        assert torch.equal(lin(small), F.linear(small, w, bias))
    assert Linear(w, b, row_tile=32).weight32 is None
    assert Linear(w, b, row_tile=64).weight32 is not None
    monkeypatch.setenv("CBP_CPU_F32_LINEARS", "0")
    assert Linear(w, b).weight32 is None


def test_kv_budget_fraction_leaves_room_for_the_float32_copies(monkeypatch):
    """A KV budget given as a fraction of free memory is taken after the float32 weight copies that the
    engine's own forward will make (4 bytes per parameter of the layers' linears and the LM head)."""
    from engine.config import EngineConfig
    from engine.model_runner import float32_copy_bytes
    from kernels import cpu_linear
    from tests.conftest import make_tiny_model

    model = make_tiny_model(vocab_size=100, seed=2).to(torch.bfloat16)
    cpu = torch.device("cpu")
    params = sum(m.weight.numel() for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and (".layers." in f".{n}." or n == "lm_head"))
    monkeypatch.setattr(cpu_linear, "bf16_matmul_outruns_f32", lambda: False)
    monkeypatch.setattr(cpu_linear, "own_gemm_cpu", lambda: False)
    assert float32_copy_bytes(EngineConfig(), model, cpu, torch.bfloat16) == 4 * params > 0
    assert float32_copy_bytes(EngineConfig(batch_invariant=True), model, cpu, torch.bfloat16) == 0
    assert float32_copy_bytes(EngineConfig(forward="transformers"), model, cpu, torch.bfloat16) == 0
    assert float32_copy_bytes(EngineConfig(), model.float(), cpu, torch.float32) == 0
    monkeypatch.setattr(cpu_linear, "own_gemm_cpu", lambda: True)  # the own GEMM needs no float32 copy
    # ... except for the LM head: 100 columns are not a multiple of 16, so it keeps the float32 path
    assert float32_copy_bytes(EngineConfig(), model, cpu, torch.bfloat16) == 4 * model.lm_head.weight.numel()
    monkeypatch.setattr(cpu_linear, "own_gemm_cpu", lambda: False)
    monkeypatch.setattr(cpu_linear, "bf16_matmul_outruns_f32", lambda: True)
    assert float32_copy_bytes(EngineConfig(), model, cpu, torch.bfloat16) == 0


needs_gemm = pytest.mark.skipif(not (cpu_ops.available() and cpu_ops.gemm_bf16_available()),
                                reason="the own bfloat16 GEMM needs the C++ extension on an AVX-512 CPU")
# both arithmetic paths of the own GEMM: float32 FMAs, and VDPBF16PS where the build has it (AVX512-BF16)
GEMM_PATHS = [False, pytest.param(True, marks=pytest.mark.skipif(
    not (cpu_ops.available() and cpu_ops.gemm_bf16_dp_available()),
    reason="the own GEMM's VDPBF16PS path needs an AVX512-BF16 CPU"))]


@needs_gemm
@pytest.mark.parametrize("dp", GEMM_PATHS)
@pytest.mark.parametrize("m,n,k", [(1, 16, 2), (2, 16, 64), (5, 48, 10), (6, 96, 64), (7, 32, 30), (13, 80, 96),
                                   (200, 32, 24), (0, 16, 8), (16, 80, 64), (23, 48, 96), (400, 112, 24),
                                   (64, 576, 32), (40, 240, 16)])
def test_gemm_bf16_equals_its_torch_reference_bit_for_bit(m, n, k, dp):
    """The own GEMM equals kernels.torch_ops.gemm_bf16 (one float32 accumulator per output in k order,
    bias last, one rounding; with dot_products each pair odd element first), with and without a bias,
    for row counts on and off the 8-row micro-tile (and, from 16 rows on the VDPBF16PS path, the 7 x 4
    tile in tiles of near-equal height: 16 = 6 + 5 + 5 rows, 64 = 4 x 7 + 6 x 6), 1-4 column blocks per
    thread, more than one panel, and columns cut into chunks of unequal size (36 blocks at 64 rows: 4 and
    3; 15 at 40); also for a strided view of x."""
    from kernels.cpu_linear import pack_gemm_weight

    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    packed = pack_gemm_weight(w)
    for bias in (None, b):
        assert torch.equal(cpu_ops.gemm_bf16(x, packed, bias, dp), torch_ops.gemm_bf16(x, w, bias, dp))
    wide = torch.randn(m, 2 * k, generator=g).bfloat16()
    view = wide[:, ::2]  # not contiguous: copied first
    assert torch.equal(cpu_ops.gemm_bf16(view, packed, b, dp), torch_ops.gemm_bf16(view, w, b, dp))
    rows = wide[:, :k]  # contiguous rows, row stride 2k: read in place
    assert torch.equal(cpu_ops.gemm_bf16(rows, packed, b, dp), torch_ops.gemm_bf16(rows, w, b, dp))


@needs_gemm
@pytest.mark.parametrize("dp", GEMM_PATHS)
def test_gemm_bf16_row_results_do_not_depend_on_other_rows_or_threads(dp):
    """A row's output is the same whatever rows share the call, at any place in the tile, and with 1 or
    more threads (batch invariant by construction), and it is close to the float64 product."""
    from kernels.cpu_linear import pack_gemm_weight

    g = torch.Generator().manual_seed(3)
    w = torch.randn(960, 576, generator=g).bfloat16()
    x = torch.randn(64, 576, generator=g).bfloat16()
    packed = pack_gemm_weight(w)
    full = cpu_ops.gemm_bf16(x, packed, None, dp)
    for lo, hi in ((10, 11), (10, 15), (3, 10), (0, 37), (61, 64)):
        assert torch.equal(cpu_ops.gemm_bf16(x[lo:hi], packed, None, dp), full[lo:hi])
    shuffled = torch.randperm(64, generator=g)
    assert torch.equal(cpu_ops.gemm_bf16(x[shuffled], packed, None, dp), full[shuffled])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_ops.gemm_bf16(x, packed, None, dp), full)
    finally:
        torch.set_num_threads(threads)
    exact = x.double() @ w.double().T
    assert ((full.double() - exact).abs() <= 2 ** -7 * exact.abs() + 1e-3).all()  # one bfloat16 rounding


@needs_gemm
@pytest.mark.parametrize("dp", GEMM_PATHS)
def test_gemm_bf16_keeps_nan_and_inf_and_rounds_halfway_sums_to_even(dp):
    """NaN stays NaN, infinities stay infinite, overflow gives an infinity, and a float32 sum halfway
    between two bfloat16 values goes to the even one, as torch's conversion does."""
    from kernels.cpu_linear import pack_gemm_weight

    w = torch.zeros(16, 2, dtype=torch.bfloat16)
    w[:, 0] = 1
    w[:, 1] = 2 ** -8
    x = torch.tensor([[1, 1], [1, 3], [float("inf"), 1], [float("-inf"), 1], [float("nan"), 1], [3e38, 3e38 * 256]],
                     dtype=torch.float32).bfloat16()
    y = cpu_ops.gemm_bf16(x, pack_gemm_weight(w), None, dp)[:, 0].float()
    # 1 + 2^-8 ties to 1 (even); 1 + 3 * 2^-8 ties to 1 + 2^-6 (even)
    assert y[0] == 1 and y[1] == 1 + 2 ** -6
    assert y[2] == float("inf") and y[3] == float("-inf") and y[4].isnan() and y[5] == float("inf")
    ref = torch_ops.gemm_bf16(x, w, None, dp)[:, 0].float()
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y[~y.isnan()], ref[~ref.isnan()])


def test_linear_uses_the_own_gemm_where_the_rule_says_so(monkeypatch):
    """Where own_gemm_cpu holds, a bfloat16 Linear with a 16-column multiple runs the own GEMM (no oneDNN
    pack, no float32 copy; its VDPBF16PS path where gemm_dot_products holds) and ignores a row tile (the
    GEMM is batch invariant as it is); other shapes and float32 weights keep the other paths;
    CBP_CPU_OWN_GEMM=0 and AMX turn it off, and AMD's AVX512-BF16 needs the VDPBF16PS path."""
    from kernels import cpu_linear
    from kernels.cpu_linear import Linear

    g = torch.Generator().manual_seed(8)
    w = torch.randn(48, 64, generator=g).bfloat16()
    b = torch.randn(48, generator=g).bfloat16()
    x = torch.randn(9, 64, generator=g).bfloat16()
    if cpu_ops.available() and cpu_ops.gemm_bf16_available():
        monkeypatch.setattr(cpu_linear, "own_gemm_cpu", lambda: True)
        for dp in (False, True) if cpu_ops.gemm_bf16_dp_available() else (False,):
            monkeypatch.setattr(cpu_linear, "gemm_dot_products", lambda dp=dp: dp)
            lin = Linear(w, b, row_tile=4)
            assert lin.gemm is not None and lin.packed is None and lin.weight32 is None and lin.gemm_dp is dp
            assert torch.equal(lin(x), torch_ops.gemm_bf16(x, w, b, dp))
        monkeypatch.setattr(cpu_linear, "gemm_dot_products", lambda: False)
        with monkeypatch.context() as m:
            m.setattr(cpu_linear, "bf16_matmul_outruns_f32", lambda: False)
            odd = Linear(torch.randn(40, 64).bfloat16())  # 40 columns: not a multiple of 16
            assert odd.gemm is None and odd.weight32 is not None  # the float32 path, decided per weight
        assert Linear(w.float()).gemm is None
    monkeypatch.setattr(cpu_linear, "own_gemm_cpu", lambda: False)
    assert Linear(w, b).gemm is None
    monkeypatch.undo()
    monkeypatch.delenv("CBP_CPU_OWN_GEMM", raising=False)  # the rule as it reads the CPU (a CI pass sets it to 0)
    rule = cpu_linear.own_gemm_cpu.__wrapped__  # the uncached rule
    monkeypatch.setattr(cpu_linear, "gemm_dot_products", lambda: False)
    monkeypatch.setattr(cpu_linear, "bf16_matmul_outruns_f32", lambda: True)
    assert rule() is False
    monkeypatch.setattr(cpu_linear, "bf16_matmul_outruns_f32", lambda: False)
    assert rule() is (cpu_ops.available() and cpu_ops.gemm_bf16_available())
    monkeypatch.setattr(cpu_linear, "gemm_dot_products", lambda: True)
    monkeypatch.setattr(cpu_linear, "bf16_matmul_outruns_f32", lambda: True)
    assert rule() is (cpu_ops.available() and cpu_ops.gemm_bf16_dp_available())
    monkeypatch.setenv("CBP_CPU_OWN_GEMM", "0")
    assert rule() is False


@needs_gemm
@pytest.mark.parametrize("dp", GEMM_PATHS)
def test_gemm_bf16_extreme_products_follow_one_fma_per_step(dp):
    """Products that overflow float32 or fall below its normal range are not rounded before the sum (one
    FMA per step), as the reference emulates: found by a break-it review, where a rounded-product
    reference disagreed. With dot_products: subnormal inputs read as zero and subnormal sums flushed."""
    from kernels.cpu_linear import pack_gemm_weight

    cases = [([-(2.0 ** 63), 2.0 ** 64], [2.0 ** 64, 2.0 ** 64]),  # an overflowing product, then back in range
             ([2.0 ** 64, -(2.0 ** 64)], [2.0 ** 64, 2.0 ** 64]),  # inf - inf inside one FMA chain
             ([2.0 ** -67, 2.0 ** -75, 3 * 2.0 ** -75, 0.0], [2.0 ** -67, -(2.0 ** -74), 2.0 ** -75, 0.0]),
             ([2.0 ** -64, 0.0], [2.0 ** -64, 0.0]),  # a subnormal product
             ([2.0 ** -64, 1.0], [2.0 ** -64, 2.0 ** -120]),  # a subnormal product plus a small normal one
             ([2.0 ** -127, 1.0], [1.0, 0.0]),  # a subnormal input
             ([1.0, 2.0 ** -60], [2.0 ** -100, -(2.0 ** -100)]),  # the pair order decides the rounding
             ([-(2.0 ** -70), 0.0], [2.0 ** -70, 0.0])]  # a negative sum flushed: -0, sign kept
    for xv, wv in cases:
        x = torch.tensor([xv]).bfloat16()
        w = torch.tensor([wv] * 16).bfloat16()
        y16 = cpu_ops.gemm_bf16(x, pack_gemm_weight(w), None, dp)
        r16 = torch_ops.gemm_bf16(x, w, None, dp)
        y, ref = y16.float(), r16.float()
        assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y[~y.isnan()], ref[~ref.isnan()]), (xv, y, ref)
        finite = ~y.isnan()
        assert torch.equal(y16.view(torch.int16)[finite], r16.view(torch.int16)[finite]), (xv, y16, r16)  # signed zeros


@needs_gemm
@pytest.mark.parametrize("dp", GEMM_PATHS)
def test_gemm_bf16_pair_order_is_the_references_on_long_sums(dp):
    """On 65,536 sums of 1,536 products each, the own GEMM and its reference agree bit for bit, while the
    reference of the other pair order does not (so the tests above would notice a wrong order)."""
    from kernels.cpu_linear import pack_gemm_weight

    g = torch.Generator().manual_seed(11)
    x = torch.randn(64, 1536, generator=g).bfloat16()
    w = torch.randn(1024, 1536, generator=g).bfloat16()
    y = cpu_ops.gemm_bf16(x, pack_gemm_weight(w), None, dp)
    assert torch.equal(y.view(torch.int16), torch_ops.gemm_bf16(x, w, None, dp).view(torch.int16))
    assert not torch.equal(y, torch_ops.gemm_bf16(x, w, None, not dp))
    tiny = (x.float() * 1e-19).bfloat16()  # sums below float32's normal range: flushed with their sign
    yt = cpu_ops.gemm_bf16(tiny, pack_gemm_weight(w), None, dp)
    assert torch.equal(yt.view(torch.int16), torch_ops.gemm_bf16(tiny, w, None, dp).view(torch.int16))
    if dp:
        with pytest.raises(ValueError, match="even K"):
            torch_ops.gemm_bf16(x[:, :3], w[:, :3], None, True)


@needs_gemm
def test_gemm_bf16_refuses_bad_arguments_with_a_clear_error():
    """Wrong dtypes and shapes raise RuntimeError naming the argument, also for an empty batch."""
    from kernels.cpu_linear import pack_gemm_weight

    packed = pack_gemm_weight(torch.randn(32, 8).bfloat16())
    x = torch.randn(3, 8).bfloat16()
    bad = [(x.float(), packed, None), (torch.randn(3, 6).bfloat16(), packed, None), (x, torch.empty(5), None),
           (x, torch.empty(()), None), (x, packed, torch.zeros(2, 16).bfloat16()), (x, packed, torch.zeros(31)),
           (x[:0].float(), packed, None), (torch.randn(0, 6).bfloat16(), packed, None)]
    for args in bad:
        with pytest.raises(RuntimeError, match="gemm_bf16"):
            cpu_ops.gemm_bf16(*args)
    assert cpu_ops.gemm_bf16(x[:0], packed).shape == (0, 32)
