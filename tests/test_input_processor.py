"""The input processor (engine/input_processor.py) and the typed errors: every refusal names its field
(``param``) and, for prompts that cannot fit, the code the API reports; the engine core never tokenizes
on the stepping thread for AsyncEngine or LLM."""

from __future__ import annotations

import threading
import time

import pytest

from engine.core import EngineCore
from engine.errors import PROMPT, ContextLengthError, RequestError
from engine.request import SamplingParams


@pytest.fixture(scope="module")
def core(tiny_model, tokenizer):
    return EngineCore(model=tiny_model, tokenizer=tokenizer, max_num_seqs=4, num_blocks=16, block_size=16)


@pytest.mark.parametrize("kwargs,param", [
    ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"), ({"stop": [""]}, "stop"), ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"), ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"logit_bias": {10**9: 1.0}}, "logit_bias"), ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"), ({"n": 5}, "n"),
])
def test_bad_sampling_values_name_their_field(core, kwargs, param):
    with pytest.raises(RequestError) as err:
        core.input_processor.process("r", "hello", SamplingParams(**kwargs))
    assert err.value.param == param and err.value.code is None
    assert isinstance(err.value, ValueError)  # callers that catch ValueError keep working


@pytest.mark.parametrize("prompt", ["", [], "bad \ud800 text", [{"role": "user"}], 3.5, [10**9]])
def test_bad_prompts_are_prompt_errors(core, prompt):
    with pytest.raises(RequestError) as err:
        core.input_processor.process("r", prompt)
    assert err.value.param == PROMPT and not isinstance(err.value, ContextLengthError)


def test_prompts_that_cannot_fit_are_context_length_errors(core):
    cap = core.max_model_len  # 16 blocks x 16 tokens
    for prompt in (list(range(1, cap + 1)), "x" * (cap * 1000)):  # too many tokens; too many characters
        with pytest.raises(ContextLengthError) as err:
            core.input_processor.process("r", prompt)
        assert err.value.param == PROMPT and err.value.code == "context_length_exceeded"


def test_chat_flags_and_template_arguments_name_their_field(core):
    from engine.request import ChatPrompt

    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(RequestError) as err:
        core.input_processor.process("r", ChatPrompt(msgs, add_generation_prompt=True, continue_final_message=True))
    assert err.value.param == "continue_final_message"
    with pytest.raises(RequestError) as err:
        core.input_processor.process("r", ChatPrompt(msgs, chat_template_kwargs={"tokenize": True}))
    assert err.value.param == "chat_template_kwargs"
    with pytest.raises(RequestError) as err:
        core.input_processor.process("a#b", "hello")
    assert err.value.param is None  # the request as a whole


def test_the_llm_and_async_engine_tokenize_off_the_stepping_thread(tiny_model, tokenizer, monkeypatch):
    import asyncio

    from engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_args(model=tiny_model, tokenizer=tokenizer, max_num_seqs=2, num_blocks=32)
    seen: list[str] = []
    real = engine.core.input_processor.tokenize
    monkeypatch.setattr(engine.core.input_processor, "tokenize",
                        lambda *a, **k: seen.append(threading.current_thread().name) or real(*a, **k))
    try:
        out = asyncio.run(engine.generate_text("hello", SamplingParams(max_tokens=2)))
        assert len(out.token_ids) == 2
    finally:
        engine.shutdown()
    assert seen and "engine-core" not in seen  # the stepping thread's name


def test_async_requests_join_the_queue_in_the_order_they_were_submitted(tiny_model, tokenizer):
    """Input processing runs in one worker, so a long prompt submitted first is not overtaken by a short one
    (first come, first served), however the threads are scheduled."""
    import asyncio

    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.request import SamplingParams

    eng = AsyncEngine(EngineCore(EngineConfig(num_blocks=128, block_size=4, max_num_seqs=1), model=tiny_model,
                                 tokenizer=tokenizer))

    async def main():
        eng.pause()
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        prompts = ["word " * 200, "hi", "x " * 50, "ok"]
        tasks = [asyncio.create_task(eng.generate_text(p, params, request_id=f"r{i}")) for i, p in enumerate(prompts)]
        deadline = time.monotonic() + 30
        while len(eng.telemetry.queue) < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        queue = eng.telemetry.queue
        eng.resume()
        await asyncio.gather(*tasks)
        return queue

    try:
        assert asyncio.run(main()) == ("r0", "r1", "r2", "r3")
    finally:
        eng.shutdown()
