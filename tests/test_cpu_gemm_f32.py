"""The engine's own float32 GEMM (``kernels/csrc/gemm_f32_cpu.cpp``) against its exact torch reference
(``kernels.torch_ops.gemm_f32``), its batch invariance, and the rule that picks it from the CPU's flags
(``kernels.cpu_linear.own_gemm_f32_cpu``). Tests of the kernel are skipped where the C++ extension is
missing or was built without AVX2 + FMA or AVX-512."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_linear, cpu_ops, torch_ops
from kernels.cpu_linear import Linear, pack_gemm_weight_f32

needs_gemm_f32 = pytest.mark.skipif(not (cpu_ops.available() and cpu_ops.gemm_f32_available()),
                                    reason="the own float32 GEMM needs the C++ extension built with AVX2 + FMA or AVX-512")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@needs_gemm_f32
@pytest.mark.parametrize("m,n,k", [(1, 16, 1), (2, 16, 64), (5, 48, 10), (6, 96, 64), (7, 32, 30), (13, 80, 96),
                                   (9, 160, 7), (200, 32, 24), (0, 16, 8), (7, 32, 600), (33, 16, 8),
                                   (450, 400, 48), (64, 1552, 20), (64, 576, 16)])
def test_gemm_f32_equals_its_torch_reference_bit_for_bit(m, n, k):
    """One float32 accumulator per output in k order, one FMA each, bias last: equal to the reference bit
    for bit, with and without a bias, for row counts on and off the micro-tile (6 rows on AVX2, 8 on
    AVX-512), 1-10 column blocks, more than one 192-row panel, and for strided views of x. From 32 rows the
    threads take units of panel x column blocks from a counter: 25 blocks over 3 panels and 97 blocks over
    one leave a short last unit."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g)
    x = torch.randn(m, k, generator=g)
    packed = pack_gemm_weight_f32(w)
    for bias in (None, b):
        assert torch.equal(_bits(cpu_ops.gemm_f32(x, packed, bias)), _bits(torch_ops.gemm_f32(x, w, bias)))
    wide = torch.randn(m, 2 * k, generator=g)
    view = wide[:, ::2]  # not contiguous: copied first
    assert torch.equal(cpu_ops.gemm_f32(view, packed, b), torch_ops.gemm_f32(view, w, b))
    rows = wide[:, :k]  # contiguous rows, row stride 2k: read in place
    assert torch.equal(cpu_ops.gemm_f32(rows, packed, b), torch_ops.gemm_f32(rows, w, b))


@needs_gemm_f32
def test_gemm_f32_row_results_do_not_depend_on_other_rows_or_threads():
    """A row's output is the same whatever rows share the call, at any place in the tile, and with 1 or
    more threads (batch invariant by construction), and it is close to the float64 product."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(960, 576, generator=g)
    x = torch.randn(64, 576, generator=g)
    packed = pack_gemm_weight_f32(w)
    full = cpu_ops.gemm_f32(x, packed)
    for lo, hi in ((10, 11), (10, 15), (3, 10), (0, 37), (61, 64)):
        assert torch.equal(cpu_ops.gemm_f32(x[lo:hi], packed), full[lo:hi])
    shuffled = torch.randperm(64, generator=g)
    assert torch.equal(cpu_ops.gemm_f32(x[shuffled], packed), full[shuffled])
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):  # one thread walks every unit; three share units that two threads split differently
            torch.set_num_threads(n)
            assert torch.equal(cpu_ops.gemm_f32(x, packed), full)
    finally:
        torch.set_num_threads(threads)
    exact = x.double() @ w.double().T
    assert ((full.double() - exact).abs() <= 1e-4 * exact.abs() + 1e-4).all()


@needs_gemm_f32
def test_gemm_f32_keeps_nan_and_inf_and_does_not_round_products():
    """NaN stays NaN, infinities stay infinite, an overflowing sum gives an infinity, and a product is not
    rounded before its sum (one FMA per step): -(1 + 2^-11) + (1 + 2^-12)^2 is 2^-24, where a rounded
    product would give 0."""
    w = torch.zeros(16, 2)
    w[:, 0] = 1
    w[:, 1] = 1 + 2.0 ** -12
    x = torch.tensor([[-(1 + 2.0 ** -11), 1 + 2.0 ** -12], [float("inf"), 1.0], [float("-inf"), 1.0],
                      [float("nan"), 1.0], [3e38, 3e38]])
    y = cpu_ops.gemm_f32(x, pack_gemm_weight_f32(w))[:, 0]
    ref = torch_ops.gemm_f32(x, w)[:, 0]
    assert y[0] == 2.0 ** -24
    assert y[1] == float("inf") and y[2] == float("-inf") and y[3].isnan() and y[4] == float("inf")
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y[~y.isnan()], ref[~ref.isnan()])


@needs_gemm_f32
def test_gemm_f32_and_reference_round_once_where_a_float64_sum_would_round_twice():
    """1 (1 + 2^-23) + (1 + 2^-23) 2^-24 (1 - 2^-23) = 1 + 2^-23 + 2^-24 - 2^-70 rounds to 1 + 2^-23 in one
    FMA; a float64 sum rounded to float32 gives 1 + 2^-22 (found by a break-it review). The reference
    rounds its float64 sums to odd, so it gives the single rounding as the kernel does."""
    x = torch.tensor([[1.0, 1 + 2.0 ** -23]])
    w = torch.tensor([[1 + 2.0 ** -23, 2.0 ** -24 * (1 - 2.0 ** -23)]]).repeat(16, 1)
    y = cpu_ops.gemm_f32(x, pack_gemm_weight_f32(w))
    assert y[0, 0] == 1 + 2.0 ** -23
    assert torch.equal(_bits(y), _bits(torch_ops.gemm_f32(x, w)))


@needs_gemm_f32
def test_gemm_f32_refuses_bad_arguments_with_a_clear_error():
    """Wrong dtypes and shapes raise RuntimeError naming the op, also for an empty batch."""
    packed = pack_gemm_weight_f32(torch.randn(32, 8))
    x = torch.randn(3, 8)
    bad = [(x.bfloat16(), packed, None), (torch.randn(3, 6), packed, None), (x, torch.empty(5), None),
           (x, torch.empty(2, 8, 8), None), (x, packed, torch.zeros(2, 16)), (x, packed, torch.zeros(31)),
           (x[:0].double(), packed, None), (torch.randn(0, 6), packed, None), (x, packed.bfloat16(), None),
           (x, packed, torch.zeros(0))]
    for args in bad:
        with pytest.raises(RuntimeError, match="gemm_f32"):
            cpu_ops.gemm_f32(*args)


def test_pack_gemm_weight_f32_layout():
    """Block b, row k, lane j of the packed weight is W[16 b + j, k]."""
    w = torch.arange(32 * 5, dtype=torch.float32).reshape(32, 5)
    p = pack_gemm_weight_f32(w)
    assert p.shape == (2, 5, 16) and p.is_contiguous()
    for b in range(2):
        for k in range(5):
            assert torch.equal(p[b, k], w[16 * b : 16 * b + 16, k])


def test_own_gemm_f32_rule_reads_the_cpu_flags(monkeypatch):
    """AVX2 + FMA without AVX-512 takes the own float32 GEMM (where the extension has it); AVX-512 CPUs
    and CPUs without FMA do not unless CBP_CPU_OWN_GEMM_F32=1; CBP_CPU_OWN_GEMM_F32=0 or
    CBP_CPU_OWN_GEMM=0 turn it off. No timing is involved."""
    rule = cpu_linear.own_gemm_f32_cpu.__wrapped__  # the uncached rule
    monkeypatch.setattr(cpu_ops, "gemm_f32_available", lambda: True)
    monkeypatch.delenv("CBP_CPU_OWN_GEMM", raising=False)
    monkeypatch.delenv("CBP_CPU_OWN_GEMM_F32", raising=False)
    for flags, want in [("sse4_2 avx avx2 fma", True), ("avx avx2 fma avx512f avx512bw", False),
                        ("avx avx2", False), ("neon asimd", False)]:
        monkeypatch.setattr(cpu_linear, "_cpuinfo", lambda flags=flags: ("GenuineIntel", flags))
        assert rule() is want, flags
        monkeypatch.setenv("CBP_CPU_OWN_GEMM_F32", "1")
        assert rule() is True, flags
        monkeypatch.setenv("CBP_CPU_OWN_GEMM_F32", "0")
        assert rule() is False, flags
        monkeypatch.delenv("CBP_CPU_OWN_GEMM_F32")
        monkeypatch.setenv("CBP_CPU_OWN_GEMM", "0")
        assert rule() is False, flags
        monkeypatch.delenv("CBP_CPU_OWN_GEMM")
    monkeypatch.setattr(cpu_linear, "_cpuinfo", lambda: ("AuthenticAMD", "avx2 fma"))
    monkeypatch.setattr(cpu_ops, "gemm_f32_available", lambda: False)  # a build without it
    assert rule() is False


def test_linear_uses_the_own_float32_gemm_where_the_rule_says_so(monkeypatch):
    """Where own_gemm_f32_cpu holds, a float32 Linear with a 16-column multiple runs the own float32 GEMM
    (equal to the reference) and ignores a row tile (the GEMM is batch invariant as it is); other column
    counts, bfloat16 weights and a False rule keep their other paths."""
    g = torch.Generator().manual_seed(8)
    w = torch.randn(48, 64, generator=g)
    b = torch.randn(48, generator=g)
    x = torch.randn(9, 64, generator=g)
    monkeypatch.setattr(cpu_linear, "own_gemm_f32_cpu", lambda: False)
    lin = Linear(w, b)
    assert lin.gemm is None and torch.equal(lin(x), torch.nn.functional.linear(x, w, b))
    if not (cpu_ops.available() and cpu_ops.gemm_f32_available()):
        return
    monkeypatch.setattr(cpu_linear, "own_gemm_f32_cpu", lambda: True)
    monkeypatch.setattr(cpu_linear, "own_gemm_cpu", lambda: False)
    lin = Linear(w, b, row_tile=4)
    assert lin.gemm is not None and lin.gemm.dtype == torch.float32 and not lin.gemm_dp and lin.weight32 is None
    assert torch.equal(lin(x), torch_ops.gemm_f32(x, w, b))
    assert Linear(torch.randn(40, 64)).gemm is None  # 40 columns: not a multiple of 16
    assert Linear(w.bfloat16()).gemm is None  # the float32 rule says nothing of bfloat16 weights


def test_kv_budget_leaves_room_for_the_packed_copies(monkeypatch):
    """A KV budget given as a fraction of free memory subtracts the packed copies the own GEMMs will make:
    4 bytes per parameter of each float32 linear they take (engine.model_runner.packed_copy_bytes), none
    where the rule is off, with transformers' modules, or on another device."""
    from engine.config import EngineConfig
    from engine.model_runner import linear_parameters, packed_copy_bytes
    from tests.conftest import make_tiny_model

    model = make_tiny_model(vocab_size=320, seed=1)  # every linear has a multiple of 16 outputs
    cpu = torch.device("cpu")
    monkeypatch.setattr(cpu_linear, "own_gemm_f32_cpu", lambda: True)
    assert packed_copy_bytes(EngineConfig(), model, cpu, torch.float32) == 4 * linear_parameters(model) > 0
    assert packed_copy_bytes(EngineConfig(forward="transformers"), model, cpu, torch.float32) == 0
    assert packed_copy_bytes(EngineConfig(), model, torch.device("meta"), torch.float32) == 0
    monkeypatch.setattr(cpu_linear, "own_gemm_f32_cpu", lambda: False)
    assert packed_copy_bytes(EngineConfig(), model, cpu, torch.float32) == 0
