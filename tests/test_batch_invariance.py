"""Batch invariance (``EngineConfig.batch_invariant``): a request's tokens and logprobs are identical
whatever else shares its steps, however its prompt is chunked, and with or without prefix-cache hits,
in float32 and bfloat16 on CPU (the engine's own forward, linears in fixed row tiles, the C++ paged
attention). Hypothesis draws the batch mixes."""

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import kernels
from kernels.cpu_linear import BATCH_INVARIANT_ROWS, Linear
from tests.conftest import invariance_target, make_tiny_model, target_alone_and_beside

pytestmark = pytest.mark.skipif(not kernels.cpp_available(), reason="needs the C++ CPU kernels")

VOCAB = 512


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def model(request):
    return make_tiny_model(VOCAB, seed=7).to(request.param)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(96, 64), (512, 64), (64, 128)])
def test_tiled_linear_row_depends_on_its_own_values_only(dtype, shape):
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(shape, generator=g) * 0.1).to(dtype)
    lin = Linear(w, None, BATCH_INVARIANT_ROWS)
    x = torch.randn(3 * BATCH_INVARIANT_ROWS + 5, shape[1], generator=g).to(dtype)
    alone = lin(x[:1])
    assert lin(x[:0]).shape == (0, shape[0])  # no row samples (a step of partial prefill chunks)
    for m in (2, 7, BATCH_INVARIANT_ROWS - 1, BATCH_INVARIANT_ROWS, BATCH_INVARIANT_ROWS + 1, x.shape[0] - 1):
        for j in {0, m // 2, m - 1}:
            xx = x[1 : m + 1].clone()
            xx[j] = x[0]
            assert torch.equal(lin(xx)[j], alone[0]), (m, j)


prompt_st = st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=70)
neighbour_st = st.tuples(prompt_st, st.integers(1, 12), st.sampled_from([0.0, 0.9]))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=prompt_st, neighbours=st.lists(neighbour_st, max_size=12), budget=st.sampled_from([2048, 9, 24]),
       after=st.integers(0, 3), twice=st.booleans(), seed=st.integers(0, 2**31 - 1), greedy=st.booleans())
@example(prompt=[3] * 10, neighbours=[], budget=9, after=0, twice=False, seed=0, greedy=False)  # a chunk samples nothing
def test_target_tokens_do_not_depend_on_the_batch(model, tokenizer, prompt, neighbours, budget, after, twice, seed, greedy):
    alone, mixed = target_alone_and_beside(model, tokenizer, prompt, invariance_target(greedy, seed), neighbours,
                                           alone_blocks=128, mixed_blocks=128, budget=budget, chunk_cap=80,
                                           after=after, twice=twice)
    assert mixed == alone
