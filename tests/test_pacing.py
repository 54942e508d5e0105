"""Talk-mode pacing of the async engine: pause, single steps, slow motion; aborts free blocks while paused."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import SamplingParams


@pytest.fixture
def engine(tiny_model, tokenizer):
    eng = AsyncEngine(EngineCore(EngineConfig(num_blocks=64, block_size=4, max_num_seqs=4), model=tiny_model,
                                 tokenizer=tokenizer))
    yield eng
    eng.shutdown()


async def _until(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_pause_queues_requests_and_single_steps_run_exactly_one_step(engine):
    async def main():
        engine.pause()
        assert engine.paused and engine.core.pacing.paused  # one pacing object; telemetry holds none of it
        assert "paused" not in engine.telemetry.stats()
        before = engine.step_count
        tokens = []

        async def consume():
            async for out in engine.generate("hello there", SamplingParams(max_tokens=6, ignore_eos=True),
                                             request_id="p"):
                tokens.append(len(out.token_ids))
                states.append(out.state.kind)
            return out

        states: list[str] = []
        task = asyncio.create_task(consume())
        await _until(lambda: engine.core.stats().num_waiting == 1)  # queued, not run
        await _until(lambda: states)  # (a loaded machine may take a while to deliver the first output)
        await asyncio.sleep(0.2)
        # no step ran; the stream says where the request stands (one channel: its outputs carry its state)
        assert engine.step_count == before and tokens == [0] and states == ["queued"]
        for k in range(1, 4):  # each press: exactly one step, one more token
            engine.step_once()
            await _until(lambda k=k: engine.step_count == before + k)
            await _until(lambda k=k: tokens[-1] == k)
            await asyncio.sleep(0.1)
            assert engine.step_count == before + k and tokens[-1] == k
        engine.resume()
        out = await task
        assert not engine.paused and len(out.token_ids) == 6

    asyncio.run(main())


def test_abort_while_paused_frees_blocks_without_a_step(engine):
    async def main():
        async def consume():
            async for out in engine.generate("a longer prompt to hold blocks", SamplingParams(max_tokens=500,
                                                                                            ignore_eos=True)):
                if len(out.token_ids) >= 3:
                    paused_at = time.monotonic()
                    engine.pause()
                    # the stepping thread holds (a step it was running has ended): no step runs from here on
                    await _until(lambda t=paused_at: engine.pacing.held_time(t, math.inf) > 0)
                    return engine.step_count  # leaving the stream aborts the request

        steps = await consume()
        await _until(lambda: engine.core.stats().num_used_blocks == 0)
        assert engine.paused and engine.step_count == steps  # freed while paused, no step ran
        assert engine.telemetry.finished_requests()[-1].finish_reason == "abort"
        # the panels see it at once: the newest snapshot (same step) was amended
        await _until(lambda: not engine.telemetry.latest().block_tables)
        snap = engine.telemetry.latest()
        assert snap.step == steps and snap.kv_usage == 0 and snap.num_running == 0
        assert engine.telemetry.stats()["kv_usage"] == 0 and len(engine.telemetry.snapshots()) == steps
        engine.resume()

    asyncio.run(main())


def test_slow_motion_sets_a_minimum_time_per_step(engine):
    with pytest.raises(ValueError):
        engine.set_min_step_time(-1)
    with pytest.raises(ValueError):
        engine.step_once(0)
    engine.set_min_step_time(0.1)
    assert engine.min_step_time == 0.1

    async def main():
        t = time.monotonic()
        out = await engine.generate_text("slowly", SamplingParams(max_tokens=4, ignore_eos=True))
        return out, time.monotonic() - t

    out, elapsed = asyncio.run(main())
    assert len(out.token_ids) == 4 and elapsed >= 0.3  # four steps of at least 0.1 s (the last one's wait may follow)
    engine.set_min_step_time(0)


def test_abort_during_a_slow_step_frees_blocks_at_once(engine):
    engine.set_min_step_time(5.0)

    async def main():
        async for out in engine.generate("hold some blocks", SamplingParams(max_tokens=50, ignore_eos=True)):
            if out.token_ids:
                break  # leaving the stream aborts it, in the middle of a 5 s step
        t = time.monotonic()
        await _until(lambda: engine.core.stats().num_used_blocks == 0, timeout=2.0)
        return time.monotonic() - t

    try:
        assert asyncio.run(main()) < 2.0
    finally:
        engine.set_min_step_time(0)


def test_a_request_id_is_free_again_only_once_the_core_is_done_with_it(engine):
    """Reusing an id right after its stream was left must not hand the old request's output to the new
    caller: the id stays in use until the abort has gone through."""

    async def main():
        async for out in engine.generate("old prompt", SamplingParams(max_tokens=50, ignore_eos=True), request_id="x"):
            if out.token_ids:
                break
        outs = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # at once: the old request's abort may not have gone through yet
            try:
                async for out in engine.generate("a new prompt", SamplingParams(max_tokens=3, ignore_eos=True),
                                                 request_id="x"):
                    outs.append(out)
                break
            except ValueError as e:
                assert "already in use" in str(e)
                await asyncio.sleep(0.01)
        return outs

    outs = asyncio.run(main())
    assert outs and outs[-1].finished and outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 3
    assert outs[-1].prompt == "a new prompt"


def test_requests_queued_while_paused_know_their_place(engine):
    async def main():
        engine.pause()
        tasks = [asyncio.create_task(engine.generate_text("hi", SamplingParams(max_tokens=2), request_id=rid))
                 for rid in ("q1", "q2")]
        await _until(lambda: engine.telemetry.queue == ("q1", "q2"))
        assert engine.telemetry.request_state("q2") == {"state": "queued", "position": 2, "waiting": 2}
        assert engine.telemetry.request_state("nope") is None
        engine.step_once()
        await _until(lambda: engine.telemetry.request_state("q1") and
                     engine.telemetry.request_state("q1")["state"] in ("decoding", "finished"))
        engine.resume()
        await asyncio.gather(*tasks)

    asyncio.run(main())
