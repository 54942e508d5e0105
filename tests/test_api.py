"""The OpenAI-compatible API end to end: the official ``openai`` client (streaming and not) and raw HTTP
against uvicorn on a loopback port, on the tiny random model (one real-model test at the end).

Checks: usage and finish reasons, streamed deltas equal the non-streamed text, stop strings across
token boundaries, ``max_tokens=1``, ``n > 1``, multi-byte characters, ``/metrics``, and the Gradio UI and
the API on one port. Errors, overload, rate limits, disconnects and faults: ``tests/test_api_errors.py``.
Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import os

import httpx
import openai
import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core import EngineCore
from server import ServerThread, build_server, create_api
from tests._api_helpers import CHAT, MODEL, normal_request_works, serve_tiny_api, wait_idle


@pytest.fixture(scope="module")
def api(tiny_model, tokenizer):
    """The API of a tiny-model engine on 127.0.0.1 (free port): ``url``, ``engine``, ``client``, ``http``."""
    yield from serve_tiny_api(tiny_model, tokenizer)


# ---------------------------------------------------------------------------------------------- basics
def test_models_and_health(api):
    models = api.client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert api.http.get(f"/v1/models/{MODEL}").status_code == 200
    assert api.http.get("/v1/models/other").status_code == 404
    health = api.http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert health.json()["paused"] is False and isinstance(health.json()["step"], int)
    assert {k: health.json()[k] for k in ("running", "waiting", "in_flight")} == {"running": 0, "waiting": 0,
                                                                                  "in_flight": 0}
    api.engine.pause()
    try:
        assert api.http.get("/health").json()["paused"] is True
    finally:
        api.engine.resume()


def test_chat_streaming_equals_non_streaming_with_usage(api):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    full = api.client.chat.completions.create(**kw)
    choice = full.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.role == "assistant"
    assert full.usage.prompt_tokens > 0 and 1 <= full.usage.completion_tokens <= 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion" and full.model == MODEL

    chunks = list(api.client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    # without include_usage: no usage chunk
    plain = list(api.client.chat.completions.create(**kw, stream=True))
    assert all(c.choices for c in plain) and all(c.usage is None for c in plain)
    assert wait_idle(api.engine)


def test_completions_seeded_sampling_stream_equals_non_stream(api):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0.9, top_p=0.95, seed=7,
              extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1})
    full = api.client.completions.create(**kw)
    assert full.object == "text_completion" and full.usage.completion_tokens == 20
    assert full.choices[0].finish_reason == "length"
    chunks = list(api.client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 20
    # token ids as the prompt give the same answer as the text they encode
    ids = api.engine.tokenizer("Once upon a time")["input_ids"]
    assert api.client.completions.create(**(kw | {"prompt": ids})).choices[0].text == full.choices[0].text
    assert wait_idle(api.engine)


def test_parallel_sampling_n(api):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=6, temperature=1.0, seed=3, n=3)
    full = api.client.chat.completions.create(**kw)
    assert [c.index for c in full.choices] == [0, 1, 2]
    assert full.usage.completion_tokens == sum(6 for _ in full.choices)
    texts = {i: "" for i in range(3)}
    reasons = {}
    for c in api.client.chat.completions.create(**kw, stream=True):
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                assert ch.index not in reasons, "a finish reason was sent twice"
                reasons[ch.index] = ch.finish_reason
    assert texts == {c.index: c.message.content for c in full.choices}
    assert reasons == {c.index: c.finish_reason for c in full.choices}
    assert wait_idle(api.engine)


def test_max_tokens_one(api):
    for stream in (False, True):
        r = api.client.completions.create(model=MODEL, prompt="Hello", max_tokens=1, temperature=0, stream=stream,
                                          **({"stream_options": {"include_usage": True}} if stream else {}))
        if stream:
            chunks = list(r)
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
            assert chunks[-1].usage.completion_tokens == 1
        else:
            assert r.usage.completion_tokens == 1 and r.choices[0].finish_reason == "length"
    chat = api.client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=1, temperature=0)
    assert chat.usage.completion_tokens == 1 and chat.choices[0].finish_reason == "length"
    assert wait_idle(api.engine)


def test_stop_string_across_token_boundary(api):
    """A stop string that starts inside one token and ends inside the next: the text ends right before
    it, streamed or not, and no delta ever carries any of it."""
    from engine.request import SamplingParams

    prompt, tok, stop = "The weather today is", api.engine.tokenizer, None
    for seed in range(20):  # seeded sampling: the same tokens through the engine and through the API
        out = asyncio.run(api.engine.generate_text(prompt, SamplingParams(temperature=1.0, seed=seed, max_tokens=24,
                                                                          ignore_eos=True)))
        full = out.text
        for k in range(2, len(out.token_ids) - 1):
            head = tok.decode(out.token_ids[:k])
            nxt = tok.decode(out.token_ids[: k + 1])
            if "\ufffd" in nxt or not full.startswith(nxt) or len(head) < 2 or len(nxt) - len(head) < 2:
                continue
            cand = full[len(head) - 2 : len(head) + 2]
            if full.find(cand) == len(head) - 2 and cand.strip():
                stop = cand
                break
        if stop is not None:
            break
    assert stop is not None, f"no token boundary to put a stop string across in {full!r}"
    expected = full[: full.find(stop)]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=1.0, seed=seed, stop=[stop],
              extra_body={"ignore_eos": True})
    r = api.client.completions.create(**kw)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    deltas = [c.choices[0].text for c in api.client.completions.create(**kw, stream=True) if c.choices]
    assert "".join(deltas) == expected
    assert all(stop not in d for d in deltas)
    assert wait_idle(api.engine)


MULTIBYTE = "你好，世界！🚀🎉 Ünïcödé 数据"


def test_multibyte_characters_stream_whole(tokenizer):
    """A model forced to write CJK, emoji and accented text whose characters are split over byte-level
    tokens: no delta ever carries half a character (U+FFFD), the deltas join to the non-streamed text,
    and a stop string made of multi-byte characters across tokens is cut cleanly."""
    import torch

    from tests.conftest import make_tiny_model

    ids = tokenizer(MULTIBYTE, add_special_tokens=False)["input_ids"]
    assert sum(tokenizer.decode([i]).count("\ufffd") for i in ids) >= 10  # characters split across tokens
    forced = ids + [tokenizer.eos_token_id]
    state = {"k": 0}

    def force(module, args, out):  # one request at a time: logits row k -> the k-th forced token
        if out.shape[-2] == 0:  # a partial prefill chunk samples nothing
            return out
        out = torch.full_like(out, -1e4)
        out[..., forced[min(state["k"], len(forced) - 1)]] = 1e4
        state["k"] += 1
        return out

    model = make_tiny_model(len(tokenizer), seed=1)
    model.lm_head.register_forward_hook(force)
    # forward="transformers": the hook sits on transformers' lm_head module, which the engine's own forward
    # does not call
    engine = AsyncEngine(EngineCore(EngineConfig(num_blocks=32, block_size=16, max_num_seqs=2, forward="transformers"),
                                    model=model, tokenizer=tokenizer))
    try:
        with ServerThread(create_api(engine, MODEL)) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
            for stop, expected in ((None, MULTIBYTE), (["界！🚀"], "你好，世")):
                kw = dict(model=MODEL, prompt="x", max_tokens=64, temperature=0, stop=stop)
                state["k"] = 0
                full = client.completions.create(**kw).choices[0]
                state["k"] = 0
                deltas = [c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices]
                assert full.text == expected and full.finish_reason == "stop"
                assert "".join(deltas) == expected
                assert not any("\ufffd" in d for d in deltas), deltas
                assert len([d for d in deltas if d]) > 3  # it really streamed piece by piece
    finally:
        engine.shutdown()


# ---------------------------------------------------------------------------------------------- metrics
def test_metrics(api):
    from prometheus_client.parser import text_string_to_metric_families

    normal_request_works(api)
    api.client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0)
    r = api.http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in ("cbp:num_requests_running", "cbp:num_requests_waiting", "cbp:kv_cache_usage_perc",
                 "cbp:prefix_cache_hits", "cbp:prefix_cache_queries", "cbp:num_preemptions", "cbp:prompt_tokens",
                 "cbp:generation_tokens", "cbp:time_to_first_token_seconds", "cbp:time_per_output_token_seconds",
                 "cbp:e2e_request_latency_seconds", "cbp:request_success"):
        assert name in fams, name

    def value(name, suffix=""):
        return sum(s.value for s in fams[name].samples if s.name == name + suffix)

    assert value("cbp:num_requests_running") == 0 and value("cbp:num_requests_waiting") == 0
    assert value("cbp:generation_tokens", "_total") == api.engine.telemetry.total_generated_tokens
    assert value("cbp:prefix_cache_hits", "_total") > 0  # the same chat prompt was sent many times
    n = len(api.engine.telemetry.finished_requests())
    assert value("cbp:e2e_request_latency_seconds", "_count") == n
    assert 0 < value("cbp:time_to_first_token_seconds", "_count") <= n


# ---------------------------------------------------------------------------------------------- one port
def test_gradio_ui_and_api_on_one_port(api):
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    import gradio as gr

    with gr.Blocks() as demo:
        gr.Markdown("playground")
    app = build_server(api.engine, demo, MODEL, mount_kwargs={"css": None, "i18n": None})
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        page = http.get("/")
        assert page.status_code == 200 and "gradio" in page.text.lower()
        assert http.get("/config").status_code == 200
        assert http.get("/v1/models").json()["data"][0]["id"] == MODEL
        assert http.get("/health").status_code == 200
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    demo.close()


# ---------------------------------------------------------------------------------------------- real model
def test_real_model_streaming_equals_non_streaming(real_model):
    """The embedded SmolLM2 (float32): a greedy chat answer streams and equals the non-streamed one;
    a stop string across two tokens; Chinese characters split over byte tokens stream whole."""
    model, tok = real_model
    engine = AsyncEngine(EngineCore(EngineConfig(num_blocks=64, block_size=16, max_num_seqs=8),
                                    model=model, tokenizer=tok))
    try:
        with ServerThread(create_api(engine)) as server:
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
            france = [{"role": "user", "content": "What is the capital of France?"}]
            chinese = [{"role": "user", "content": "Write the word 'hello' in Chinese characters."}]

            async def full(messages, **kw):
                r = await client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                                         temperature=0, **kw)
                return r.choices[0]

            async def streamed(messages, **kw):
                deltas, reason = [], None
                async for c in await client.chat.completions.create(model="SmolLM2-135M-Instruct",
                                                                    messages=messages, temperature=0, stream=True,
                                                                    **kw):
                    if c.choices:
                        deltas.append(c.choices[0].delta.content or "")
                        reason = c.choices[0].finish_reason or reason
                return deltas, reason

            async def main():
                return await asyncio.gather(full(france, max_tokens=16), streamed(france, max_tokens=16),
                                            full(chinese, max_tokens=40), streamed(chinese, max_tokens=40),
                                            full(france, max_tokens=16, stop=["is Par"]),
                                            streamed(france, max_tokens=16, stop=["is Par"]))

            f_full, (f_deltas, f_reason), c_full, (c_deltas, c_reason), s_full, (s_deltas, s_reason) = \
                asyncio.run(main())
    finally:
        engine.shutdown()
    assert "Paris" in f_full.message.content and f_full.finish_reason == "stop"
    assert "".join(f_deltas) == f_full.message.content and f_reason == "stop"
    assert "".join(c_deltas) == c_full.message.content and c_reason == c_full.finish_reason
    assert any(ord(ch) > 0x2E80 for ch in c_full.message.content), c_full.message.content  # CJK came out
    assert not any("\ufffd" in d for d in c_deltas)
    assert s_full.message.content == f_full.message.content.split("is Par")[0] and s_full.finish_reason == "stop"
    assert "".join(s_deltas) == s_full.message.content and s_reason == "stop"
