"""Fault injection, second part: faults around the step (telemetry, a paused engine, the batch sampler
with seeded requests) and what the engine reports after failing everything. Same set-up as
``tests/test_faults.py`` (tiny random-weight Llama, float32; faults patched in at run time)."""

from __future__ import annotations

import asyncio
import time

from engine.async_engine import AsyncEngine
from engine.request import SamplingParams
from tests.test_faults import GREEDY, PROMPTS, assert_no_leak, new_core, run_all


def _seeded(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, seed=seed, max_tokens=12, ignore_eos=True)


def test_sampler_fault_leaves_the_other_seeded_requests_reproducible(tiny_model, tokenizer, monkeypatch):
    """The batch sampler raises after every row drew its number: the per-row retry draws the same numbers
    again (generators restored), so the other seeded requests equal their solo runs."""
    solo = {}
    for i in range(3):
        eng = new_core(tiny_model, tokenizer)
        eng.add_request(f"r{i}", PROMPTS[i], _seeded(100 + i))
        solo[f"r{i}"] = run_all(eng)[f"r{i}"].token_ids
    eng = new_core(tiny_model, tokenizer)
    poison = _seeded(999)
    real, calls = eng.sampler._sample_random, {"n": 0}

    def sample_random(x, params, u):
        if any(p is poison for p in params):
            calls["n"] += 1
            if calls["n"] >= 3:
                raise RuntimeError("injected sampler fault")
        return real(x, params, u)

    monkeypatch.setattr(eng.sampler, "_sample_random", sample_random)
    for i in range(3):
        eng.add_request(f"r{i}", PROMPTS[i], _seeded(100 + i))
    eng.add_request("bad", PROMPTS[3], poison)
    final = run_all(eng)
    assert final["bad"].finish_reason == "error"
    for rid, tokens in solo.items():
        assert final[rid].token_ids == tokens, rid
    assert_no_leak(eng)


def test_telemetry_fault_loses_no_output(tiny_model, tokenizer, monkeypatch):
    """Recording telemetry raises in the step where a request finishes: that request still gets its
    final output (telemetry only observes), and its id can be used again."""
    eng = AsyncEngine(new_core(tiny_model, tokenizer))
    real, armed = eng.core.telemetry.record, {"on": True}

    def record(snap):
        if armed["on"] and "short" in snap.finished:
            armed["on"] = False
            raise RuntimeError("injected telemetry fault")
        return real(snap)

    monkeypatch.setattr(eng.core.telemetry, "record", record)

    async def main():
        short = eng.generate_text(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                                  request_id="short")
        long = eng.generate_text(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        outs = await asyncio.wait_for(asyncio.gather(short, long), 60)
        again = await asyncio.wait_for(eng.generate_text(PROMPTS[0], GREEDY, request_id="short"), 60)
        return outs, again

    try:
        (short, long), again = asyncio.run(main())
        assert not armed["on"]
        assert short.finish_reason == "length" and long.finish_reason == "length"
        assert again.finish_reason == "length"
    finally:
        eng.shutdown()


def test_fault_while_paused_keeps_the_engine_thread(tiny_model, tokenizer, monkeypatch):
    """Applying a queued request raises while the engine is paused: what was in flight fails, the thread
    goes on (still running), and a later request is served."""
    eng = AsyncEngine(new_core(tiny_model, tokenizer))

    async def one(max_tokens=2):
        return await asyncio.wait_for(
            eng.generate_text(PROMPTS[1], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)), 60)

    try:
        asyncio.run(one())  # a first snapshot exists
        real, armed = eng.core.telemetry.amend_latest, {"on": True}

        def amend(snap):
            if armed["on"]:
                armed["on"] = False
                raise RuntimeError("injected fault while paused")
            return real(snap)

        monkeypatch.setattr(eng.core.telemetry, "amend_latest", amend)
        eng.pause()

        async def during_pause():
            t = asyncio.ensure_future(one(4))
            deadline = time.monotonic() + 30
            while armed["on"]:  # the queued request is applied (and the fault fires) while paused
                assert time.monotonic() < deadline, "the queued request was not applied while paused"
                await asyncio.sleep(0.01)
            eng.resume()
            return await t

        out = asyncio.run(during_pause())
        assert not armed["on"] and out.finish_reason == "error"
        assert eng.is_running
        assert asyncio.run(one(3)).finish_reason == "length"
    finally:
        eng.shutdown()


def test_fail_all_updates_telemetry_and_counts_the_failures(tiny_model, tokenizer, monkeypatch):
    """After an engine-level fault fails everything, the newest snapshot shows an empty engine (what
    /health and /metrics read) and the failed requests are counted with finish reason error."""
    eng = new_core(tiny_model, tokenizer)
    for i in range(4):
        eng.add_request(f"r{i}", PROMPTS[i], GREEDY)
    for _ in range(3):
        eng.step()
    assert eng.telemetry.latest().num_running == 4
    outs = eng.fail_all("engine error: injected")
    assert len(outs) == 4 and all(o.finish_reason == "error" for o in outs)
    last = eng.telemetry.latest()
    assert last.num_running == 0 and last.num_waiting == 0 and not last.block_tables
    reasons = [f.finish_reason for f in eng.telemetry.finished_requests()]
    assert reasons.count("error") == 4
    assert_no_leak(eng)
