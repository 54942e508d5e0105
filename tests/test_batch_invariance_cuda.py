"""Batch invariance on CUDA (``EngineConfig.batch_invariant``): the same property as
``tests/test_batch_invariance.py`` on the GPU path: the own forward with cuBLAS linears in fixed row
tiles, the Triton RMSNorm (one program per row) and the Triton attention in its one batch-invariant
launch configuration, with decode steps replayed from CUDA graphs. A SmolLM2-shaped model (hidden 576,
9 query and 3 KV heads) with 2 layers and random weights; up to 63 neighbours and prompts long enough
that the automatic attention plan would split the keys. Skipped without CUDA."""

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.conftest import invariance_target, smollm2_shaped_model, target_alone_and_beside, word_tokenizer

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

VOCAB = 2048


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def model(request):
    return smollm2_shaped_model(VOCAB, 2, 2048, seed=3, device="cuda", dtype=request.param)


@pytest.fixture(scope="module")
def tok():
    return word_tokenizer(VOCAB)


def _prompt(max_size):
    """Token-id prompts whose length is drawn first (uniform in 1..max_size), so long prompts are common."""
    return st.integers(1, max_size).flatmap(
        lambda n: st.lists(st.integers(3, VOCAB - 1), min_size=n, max_size=n))


def _ids(n, start):
    return [3 + (start + 7 * i) % (VOCAB - 3) for i in range(n)]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=_prompt(700), neighbours=st.integers(0, 63).flatmap(lambda n: st.lists(
           st.tuples(_prompt(300), st.integers(1, 12), st.sampled_from([0.0, 0.9])), min_size=n, max_size=n)),
       budget=st.sampled_from([8192, 64, 512]), after=st.integers(0, 3), twice=st.booleans(),
       seed=st.integers(0, 2**31 - 1), greedy=st.booleans())
@example(prompt=_ids(700, 0), neighbours=[(_ids(40 + 4 * i, i), 1 + i % 12, 0.9) for i in range(63)], budget=64,
         after=2, twice=True, seed=1, greedy=False)  # long context, 63 neighbours, chunked, a prefix-cache hit
def test_cuda_target_tokens_do_not_depend_on_the_batch(model, tok, prompt, neighbours, budget, after, twice, seed,
                                                       greedy):
    alone, mixed = target_alone_and_beside(model, tok, prompt, invariance_target(greedy, seed), neighbours,
                                           alone_blocks=512, mixed_blocks=2048, budget=budget, chunk_cap=256,
                                           after=after, twice=twice)
    assert mixed == alone
