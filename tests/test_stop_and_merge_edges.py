"""Edge cases found by a break-it pass: a stop string that the held-back text completes, the state of a
merged n > 1 output while children still run, the paused part of an output's TTFT, the cost of a
deep waiting queue."""

from __future__ import annotations

import asyncio
import time

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core import QUEUE_REFRESH_STEPS, EngineCore
from engine.request import SamplingParams


def script(core: EngineCore, scripts: dict[str, list[int]]) -> None:
    """Make the sampler emit ``scripts[request or group id]`` in order (the real draw still runs)."""
    real = core.sampler.sample

    def sample(logits, requests):
        drawn = real(logits, requests)
        out = []
        for r, t in zip(requests, drawn):
            s = scripts.get(r.request_id, scripts.get(r.group_id))
            out.append(t if s is None else s[min(len(r.output_token_ids), len(s) - 1)])
        return out

    core.sampler.sample = sample  # type: ignore[method-assign]


def new_core(model, tok, **kw) -> EngineCore:
    return EngineCore(EngineConfig(**({"num_blocks": 64, "block_size": 4, "max_num_seqs": 4} | kw)), model=model,
                      tokenizer=tok)


def test_a_stop_string_completed_by_the_flushed_text_is_the_stop_reason(tiny_model, tokenizer):
    """Tokens "a", " " + the first bytes of an emoji; max_tokens=2 ends it by length, and the flush of the
    held-back text completes the stop string " ": the text is cut and the reason is that stop string."""
    core = new_core(tiny_model, tokenizer)
    ids = tokenizer("a 😀", add_special_tokens=False)["input_ids"]
    script(core, {"x": ids})
    core.add_request("x", "hello", SamplingParams(temperature=0, max_tokens=2, stop=[" "]))
    final = None
    while core.has_unfinished_requests():
        final = next((o for o in core.step() if o.finished), final)
    assert final is not None and final.text == "a"
    assert (final.finish_reason, final.outputs[0].stop_reason) == ("stop", " ")
    assert core.kv.pool.num_used_blocks == 0


def test_a_merged_output_is_not_finished_in_state_while_a_child_runs(tiny_model, tokenizer):
    eng = AsyncEngine(new_core(tiny_model, tokenizer))
    a = tokenizer("a", add_special_tokens=False)["input_ids"][0]
    script(eng.core, {"p#0": [2], "p#1": [a] * 50})  # child 0 ends at once (EOS), child 1 goes on

    async def main():
        return [o async for o in eng.generate("hello", SamplingParams(n=2, max_tokens=10), request_id="p")]

    try:
        outs = asyncio.run(main())
    finally:
        eng.shutdown()
    assert outs[-1].finished and outs[-1].state.kind == "finished"
    assert all(o.state.kind != "finished" for o in outs if not o.finished)


def test_an_outputs_ttft_says_which_part_the_engine_was_paused(tiny_model, tokenizer):
    eng = AsyncEngine(new_core(tiny_model, tokenizer))

    async def main():
        eng.pause()
        agen = eng.generate("hello", SamplingParams(max_tokens=2, ignore_eos=True), request_id="held")
        first = asyncio.ensure_future(agen.__anext__())
        deadline = time.monotonic() + 30
        while not first.done():  # its first output (queued): the request has arrived, the pause counts from here
            assert time.monotonic() < deadline, "the request was not queued"
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.8)
        eng.resume()
        outs = [await first] + [o async for o in agen]
        return outs[-1]

    try:
        out = asyncio.run(main())
    finally:
        eng.shutdown()
    assert out.metrics["ttft"] > 0.7, out.metrics  # what the client waited
    assert 0.7 < out.metrics["paused_time"] <= out.metrics["ttft"], out.metrics
    assert out.metrics["ttft"] - out.metrics["paused_time"] < 0.4, out.metrics


def test_a_deep_queue_costs_outputs_for_its_head_only_between_refreshes(tiny_model, tokenizer):
    core = new_core(tiny_model, tokenizer, num_blocks=512, max_num_batched_tokens=256)
    for i in range(300):
        core.add_request(f"w{i}", "hello", SamplingParams(max_tokens=2, ignore_eos=True))
    counts = [(core.step_count, len(core.step())) for _ in range(QUEUE_REFRESH_STEPS + 2)]
    small = [n for step, n in counts if step % QUEUE_REFRESH_STEPS != 0]
    assert max(small) <= 32 + 8, counts  # the head of the queue and the running requests
    assert max(n for _, n in counts) > 200  # the periodic refresh reports every waiting request's place
