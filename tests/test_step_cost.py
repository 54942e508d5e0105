"""The step cost model (engine/step_cost.py) and prompt chunks sized by a target step time."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import SamplingParams
from engine.step_cost import StepCostModel, attention_pairs


def test_the_fit_recovers_a_line_and_waits_for_spread():
    m = StepCostModel()
    for _ in range(20):
        m.observe(8, 0.037 + 0.0011 * 8)  # every step alike: nothing separates the two parts yet
    assert not m.ready() and m.chunk_tokens(8, 3.0, 2048) is None
    for i, n in enumerate((8, 88, 8, 200, 8, 48, 8, 500) * 5):  # a machine whose attention is free
        m.observe(n, 0.037 + 0.0011 * n, attention_pairs(100 * (i % 7), n))
    assert m.fixed == pytest.approx(0.037, rel=1e-4) and m.per_token == pytest.approx(0.0011, rel=1e-4)
    assert m.per_pair == pytest.approx(0.0, abs=1e-9)
    # target 3x the decode-only step (0.0458 s): 2 x 0.0458 / 0.0011 = 83 prompt tokens
    assert m.chunk_tokens(8, 3.0, 2048) == 83
    assert m.chunk_tokens(8, 3.0, 50) == 50  # never past the budget


def test_a_step_cost_that_does_not_grow_with_tokens_gives_the_whole_budget():
    m = StepCostModel()
    for n in (1, 64, 512, 2048) * 4:
        m.observe(n, 0.040)  # a host-bound GPU step: the tokens are free
    assert m.per_token == pytest.approx(0.0, abs=1e-12) and m.chunk_tokens(64, 3.0, 2048) == 2048


def test_bad_observations_are_ignored_and_bad_settings_refused():
    m = StepCostModel()
    m.observe(0, 1.0)
    m.observe(5, 0.0)
    m.observe(5, float("nan"))
    assert not m.ready() and m.predict(5) is None
    with pytest.raises(ValueError):
        StepCostModel(decay=1.0)
    with pytest.raises(ValueError, match="prefill_step_target"):
        EngineConfig(prefill_step_target=1.0)


def test_the_scheduler_sizes_prompt_tokens_from_the_model(tiny_model, tokenizer):
    cfg = EngineConfig(num_blocks=256, block_size=4, max_num_seqs=4, prefill_step_target=3.0)
    core = EngineCore(cfg, model=tiny_model, tokenizer=tokenizer)
    for i, n in enumerate((8, 88, 8, 200) * 5):  # a machine where a step costs 10 ms + 1 ms per token
        core.scheduler.step_cost.observe(n, 0.010 + 0.001 * n, attention_pairs(50 * (i % 3), n))
    core.scheduler.step_cost.observe = lambda *a: None  # type: ignore[method-assign]  # keep that machine
    core.add_request("chat", "hello", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    core.step()  # the chat's prefill; from now on it decodes
    core.add_request("long", list(range(300, 800)), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    core.step()
    chunks = {s.request_id: s.num_scheduled_tokens for s in core.telemetry.latest().batch_slots if s.request_id}
    # decode alone: 10 + 1 = 11 ms; target 33 ms: 22 prompt tokens (not the fixed 80)
    assert chunks == {"chat": 1, "long": 22}


def test_the_attention_term_makes_later_chunks_of_a_long_prompt_smaller():
    m = StepCostModel()
    for start, n in ((0, 8), (0, 500), (1000, 200), (0, 64), (3000, 100), (200, 8), (2000, 300), (0, 2048)) * 6:
        pairs = attention_pairs(start, n)
        m.observe(n, 0.030 + 0.0005 * n + 2e-7 * pairs, pairs)
    assert (m.fixed, m.per_token, m.per_pair) == (pytest.approx(0.030, rel=1e-3), pytest.approx(0.0005, rel=1e-3),
                                                  pytest.approx(2e-7, rel=1e-3))
    early = m.chunk_tokens(8, 3.0, 2048, decode_pairs=8 * 200, prompt_start=0)
    late = m.chunk_tokens(8, 3.0, 2048, decode_pairs=8 * 200, prompt_start=3500)
    assert early is not None and late is not None and late < early
    for start, x in ((0, early), (3500, late)):  # each fills the target: 3x the decode rows alone
        step = m.predict(8 + x, 8 * 200 + attention_pairs(start, x))
        assert step == pytest.approx(3 * m.predict(8, 8 * 200), rel=0.02)


def test_infinite_or_nan_values_are_refused_or_ignored():
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="prefill_step_target"):
            EngineConfig(prefill_step_target=bad)
    m = StepCostModel()
    for i, n in enumerate((8, 300, 8, 900) * 4):
        m.observe(n, 0.01 + 5e-5 * n, attention_pairs(10 * i, n))
    before = (m.fixed, m.per_token, m.per_pair)
    m.observe(10, float("inf"))
    m.observe(10, 0.02, float("inf"))
    assert (m.fixed, m.per_token, m.per_pair) == before
    assert m.chunk_tokens(8, 1e308, 2048) == 2048  # an overflowing target gives the whole budget
