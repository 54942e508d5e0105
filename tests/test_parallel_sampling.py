"""Parallel sampling at the front (engine/parallel_sampling.py): the core reports each child sequence under
its own id, AsyncEngine and LLM merge them into one output per step with n completions."""

from __future__ import annotations

import asyncio
import time

from engine.async_engine import AsyncEngine
from engine.llm import LLM
from engine.parallel_sampling import ParentRequest
from engine.request import CompletionOutput, Request, RequestOutput, SamplingParams


def _out(rid, index, text, delta, finished=False, error=None):
    return RequestOutput(rid, "p", [1, 2], [CompletionOutput(index, text, [0] * len(text), delta,
                                                              "length" if finished else None)], finished, error)


def test_merge_keeps_every_child_and_gives_deltas_only_to_the_updated_ones():
    first = Request("r#0", [1, 2], SamplingParams(n=1))
    first.group_id = "r"
    first.pending_forks = [Request("r#1", [1, 2], SamplingParams(n=1))]
    parent = ParentRequest(first)
    assert parent.children == ["r#0", "r#1"] and parent.n == 2
    m = parent.merge([_out("r#0", 0, "a", "a")])
    assert m.request_id == "r" and [c.index for c in m.outputs] == [0, 1] and not m.finished
    assert (m.outputs[0].delta, m.outputs[1].text) == ("a", "")
    m = parent.merge([_out("r#1", 1, "x", "x", finished=True, error="boom")])
    assert (m.outputs[0].delta, m.outputs[0].text, m.outputs[1].delta) == ("", "a", "x")
    assert m.error == "boom" and not m.finished
    m = parent.merge([_out("r#0", 0, "ab", "b", finished=True)])
    assert m.finished and m.outputs[0].text == "ab"


def test_async_engine_streams_one_merged_output_per_step_and_abort_frees_every_child(tiny_model, tokenizer):
    engine = AsyncEngine.from_args(model=tiny_model, tokenizer=tokenizer, max_num_seqs=4, num_blocks=64, block_size=4)
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)

    async def stream():
        texts, outs = ["", "", ""], []
        async for out in engine.generate("hello there", params, request_id="par"):
            assert out.request_id == "par" and [c.index for c in out.outputs] == [0, 1, 2]
            for c in out.outputs:
                texts[c.index] += c.delta
            outs.append(out)
        return texts, outs

    async def abort_midway():
        agen = engine.generate("hello there", SamplingParams(n=2, max_tokens=50, ignore_eos=True), request_id="ab")
        await agen.__anext__()
        await agen.aclose()  # leaving the stream aborts every child

    try:
        texts, outs = asyncio.run(stream())
        assert outs[-1].finished and all(len(c.token_ids) == 6 for c in outs[-1].outputs)
        assert texts == [c.text for c in outs[-1].outputs]  # the deltas add up: no child's text is sent twice
        asyncio.run(abort_midway())
        deadline = time.monotonic() + 30
        while (engine.core.kv.pool.num_used_blocks or engine._parents) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.core.kv.pool.num_used_blocks == 0 and not engine._parents
    finally:
        engine.shutdown()


def test_llm_returns_one_merged_output_per_prompt(tiny_model, tokenizer):
    llm = LLM(model=tiny_model, tokenizer=tokenizer, max_num_seqs=4, num_blocks=64, block_size=4)
    a, b = llm.generate(["hi", "bye"], [SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=4, ignore_eos=True),
                                        SamplingParams(max_tokens=3, ignore_eos=True)])
    assert [c.index for c in a.outputs] == [0, 1] and a.finished and all(len(c.token_ids) == 4 for c in a.outputs)
    assert len(b.outputs) == 1 and len(b.token_ids) == 3
    assert llm.engine.kv.pool.num_used_blocks == 0
