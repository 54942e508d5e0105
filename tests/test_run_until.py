"""Talk mode: run to the next hand-over of a batch slot or of a KV block (AsyncEngine.run_until with the
conditions of engine.handover), and paused time left out of TTFT / TPOT."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.handover import NextBlockReuse, NextHandover
from engine.pacing import Pacing
from engine.request import SamplingParams


@pytest.fixture
def engine(tiny_model, tokenizer):
    eng = AsyncEngine(EngineCore(EngineConfig(num_blocks=16, block_size=4, max_num_seqs=1, free_block_order="mru",
                                              enable_prefix_caching=False), model=tiny_model, tokenizer=tokenizer))
    yield eng
    eng.shutdown()


async def _until(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_run_to_the_next_hand_over_then_to_the_next_block_reuse(engine):
    """One slot: A runs, D and E wait. The run stops paused at the step D takes A's slot (with MRU, A's
    blocks too); the next block reuse is E taking D's blocks."""

    async def main():
        engine.pause()
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        tasks = [asyncio.create_task(engine.generate_text(list(range(10 + 20 * i, 19 + 20 * i)), params,
                                                          request_id=rid)) for i, rid in enumerate("ADE")]
        await _until(lambda: engine.telemetry.queue == ("A", "D", "E"))
        cond = NextHandover(engine.telemetry.snapshots())
        engine.run_until(cond)
        assert engine.seeking and not engine.paused
        await _until(lambda: not engine.seeking)
        snap = engine.telemetry.latest()
        assert engine.paused and engine.until_met is True and engine.until_condition is cond
        assert cond.found == (snap.step, 0, "A", "D") and snap.admitted == ("D",)
        await asyncio.sleep(0.2)
        assert engine.step_count == snap.step  # it stays paused on that step
        a_finished = [s for s in engine.telemetry.snapshots() if "A" in s.finished][0].step
        assert {(t.previous_owner, t.freed_step, t.kind) for t in snap.block_takes} == {("A", a_finished, "reused")}
        reuse = NextBlockReuse()
        engine.run_until(reuse)
        await _until(lambda: not engine.seeking)
        snap = engine.telemetry.latest()
        step, block, prev, freed, new, kind = reuse.found
        assert (step, prev, new, kind) == (snap.step, "D", "E", "reused") and snap.admitted == ("E",)
        assert block in snap.block_tables["E"] and engine.paused and engine.step_count == snap.step
        engine.resume()
        return await asyncio.gather(*tasks)

    outs = asyncio.run(main())
    assert [len(o.token_ids) for o in outs] == [4, 4, 4]


def test_run_until_stops_after_max_steps_and_pause_calls_it_off(engine):
    with pytest.raises(ValueError):
        engine.run_until(lambda snap: True, max_steps=0)
    with pytest.raises(ValueError):
        engine.run_until("not callable")

    async def main():
        task = asyncio.create_task(engine.generate_text("a prompt", SamplingParams(max_tokens=20, ignore_eos=True)))
        engine.run_until(lambda snap: False, max_steps=3)
        await _until(lambda: not engine.seeking)
        assert engine.paused and engine.until_met is False and engine.step_count == 3
        engine.run_until(lambda snap: False)  # nothing will match: Pause ends it
        await _until(lambda: engine.step_count > 3)
        engine.pause()
        assert not engine.seeking and engine.until_met is False and engine.paused
        engine.resume()
        return await task

    assert len(asyncio.run(main()).token_ids) == 20


def test_held_time_counts_the_paused_intervals_overlapping_a_span():
    tel = Pacing()
    tel.set_held(True, now=10.0)
    tel.set_held(True, now=11.0)  # no change: the interval still starts at 10
    tel.set_held(False, now=14.0)
    tel.set_held(True, now=20.0)
    tel.set_held(False, now=21.0)
    assert tel.held_time(0, 100) == pytest.approx(5.0)
    assert tel.held_time(12, 20.5) == pytest.approx(2.5)  # 12-14 and 20-20.5
    assert tel.held_time(14, 20) == 0.0
    tel.set_held(True, now=30.0)  # held now: counts up to now
    assert tel.held_time(25, 40, now=32.0) == pytest.approx(2.0)


def test_ttft_and_tpot_leave_out_the_time_the_engine_was_paused(engine):
    async def main():
        engine.pause()
        task = asyncio.create_task(engine.generate_text("waits while paused", SamplingParams(max_tokens=4,
                                                                                           ignore_eos=True)))
        await _until(lambda: engine.core.stats().num_waiting == 1)  # (a loaded machine may take a while)
        await asyncio.sleep(0.6)  # queued, engine held
        engine.step_once()
        await _until(lambda: engine.step_count == 1)
        await asyncio.sleep(0.6)  # first token out, held again before the next
        engine.resume()
        return await task

    out = asyncio.run(main())
    rec = engine.telemetry.finished_requests()[-1]
    assert len(out.token_ids) == 4 and rec.ttft is not None and rec.tpot is not None
    assert rec.ttft < 0.3 and rec.tpot < 0.15 and rec.e2e < 0.5  # 1.2 s of pause left out
    assert out.metrics["ttft"] > 0.5  # the request's own timings still say what the client waited
