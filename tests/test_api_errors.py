"""The OpenAI-compatible API's refusals and failures, against uvicorn on a loopback port (tiny random
model): every validation case's 4xx followed by a request that works, malformed bodies, overload and
per-client rate limits (429 + Retry-After), disconnects (streaming or not) abort within a step and free
every block, a failing forward fails that request alone, ``/health`` 503 on a stopped engine. Every wait
is bounded.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest

from engine.async_engine import AsyncEngine
from server import ServerThread, create_api
from tests._api_helpers import CHAT, MODEL, finished_record, normal_request_works, serve_tiny_api, wait_idle


@pytest.fixture(scope="module")
def api(tiny_model, tokenizer):
    """The API of a tiny-model engine on 127.0.0.1 (free port): ``url``, ``engine``, ``client``, ``http``."""
    yield from serve_tiny_api(tiny_model, tokenizer)


# ---------------------------------------------------------------------------------------------- validation
LONG = "hello " * 1100  # over the 1024-token context of the tiny engine
BAD = [
    # (endpoint, body, status, param or None, words in the message)
    ("chat", {"messages": []}, 400, "messages", "empty"),
    ("chat", {}, 400, "messages", "required"),
    ("chat", {"messages": "hi"}, 400, "messages", "list"),
    ("chat", {"messages": [{"role": "user"}]}, 400, "messages[0].content", "content"),
    ("chat", {"messages": [{"content": "hi"}]}, 400, "messages[0].role", "role"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", "wizard"),
    ("chat", {"messages": ["hi"]}, 400, "messages[0]", "object"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages[0].content", "text"),
    ("chat", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages", "1024"),
    ("chat", {"messages": CHAT, "temperature": -0.5}, 400, "temperature", "temperature"),
    ("chat", {"messages": CHAT, "top_p": 0}, 400, "top_p", "top_p"),
    ("chat", {"messages": CHAT, "top_p": 1.5}, 400, "top_p", "top_p"),
    ("chat", {"messages": CHAT, "top_k": -2}, 400, "top_k", "top_k"),
    ("chat", {"messages": CHAT, "min_p": 2}, 400, "min_p", "min_p"),
    ("chat", {"messages": CHAT, "repetition_penalty": 0}, 400, "repetition_penalty", "repetition_penalty"),
    ("chat", {"messages": CHAT, "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    ("chat", {"messages": CHAT, "max_completion_tokens": -3}, 400, "max_completion_tokens", "max_tokens"),
    ("chat", {"messages": CHAT, "max_tokens": "many"}, 400, "max_tokens", "integer"),
    ("chat", {"messages": CHAT, "n": 0}, 400, "n", "n must"),
    ("chat", {"messages": CHAT, "n": 1000}, 400, "n", "n too large"),
    ("chat", {"messages": CHAT, "n": 9}, 400, "n", "batch slots"),  # 8 slots in the test engine
    ("chat", {"messages": CHAT, "stop": [""]}, 400, "stop", "stop"),
    ("chat", {"messages": CHAT, "presence_penalty": 2.5}, 400, "presence_penalty", "[-2, 2]"),
    ("chat", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "top_logprobs"),
    ("chat", {"model": "gpt-17", "messages": CHAT}, 404, "model", "gpt-17"),
    ("completions", {"prompt": ""}, 400, "prompt", "empty"),
    ("completions", {"prompt": []}, 400, "prompt", "empty"),
    ("completions", {}, 400, "prompt", "required"),
    ("completions", {"prompt": ["a", "b"]}, 400, "prompt", "one prompt"),
    ("completions", {"prompt": [1, -5]}, 400, "prompt", "token ids"),
    ("completions", {"prompt": LONG}, 400, "prompt", "1024"),
    ("completions", {"prompt": "hi", "temperature": -1}, 400, "temperature", ">= 0"),
    ("completions", {"prompt": "hi", "echo": True, "logprobs": 1}, 400, "echo", "not supported"),
    ("completions", {"model": "nope", "prompt": "hi"}, 404, "model", "nope"),
]


@pytest.mark.parametrize("endpoint,body,status,param,words", BAD,
                         ids=[f"{e}-{i}" for i, (e, *_rest) in enumerate(BAD)])
def test_validation_error_then_normal_request(api, endpoint, body, status, param, words):
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    r = api.http.post(path, json={"model": MODEL} | body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and words in err["message"], err
    assert api.engine.num_pending == 0 and api.engine.core.kv.pool.num_used_blocks == 0
    normal_request_works(api)


def test_context_length_message_gives_both_numbers(api):
    with pytest.raises(openai.BadRequestError) as e:
        api.client.completions.create(model=MODEL, prompt=LONG, max_tokens=4)
    msg = e.value.body["message"]
    n = len(api.engine.tokenizer(LONG)["input_ids"])
    assert f"{n} tokens" in msg and "1024" in msg and e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        api.client.chat.completions.create(model="not-" + MODEL, messages=CHAT)
    normal_request_works(api)


@pytest.mark.parametrize("raw,ctype", [
    (b"{not json", "application/json"),
    (b"[1, 2]", "application/json"),
    (b'{"messages": [{"role": "user", "content": "hi"}]', "application/json"),
    (b'{"messages": [{"role": "user", "content": "hi"}]}', "text/plain"),
])
def test_malformed_body(api, raw, ctype):
    r = api.http.post("/v1/chat/completions", content=raw, headers={"content-type": ctype})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    normal_request_works(api)


# ---------------------------------------------------------------------------------------------- overload
def _open_stream(api, max_tokens=800):
    """A long streaming request held open (its first event read); returns (line iterator, context, id)."""
    ctx = api.http.stream("POST", "/v1/completions", json={
        "model": MODEL, "prompt": "Count with me:", "max_tokens": max_tokens, "stream": True, "ignore_eos": True})
    resp = ctx.__enter__()
    assert resp.status_code == 200
    lines = resp.iter_lines()  # keep it: dropping a half-read iterator closes the connection
    line = next(lines)
    return lines, ctx, json.loads(line.removeprefix("data: "))["id"]


def test_overload_gives_429_with_retry_after(api):
    engine = api.engine
    engine.max_pending = 2
    opened = []
    try:
        opened = [_open_stream(api) for _ in range(2)]
        r = api.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "engine_overloaded" and "busy" in r.json()["error"]["message"]
        with pytest.raises(openai.RateLimitError):
            api.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, stream=True)
        assert engine.num_pending == 2
    finally:
        for _lines, ctx, _rid in opened:
            ctx.__exit__(None, None, None)
        engine.max_pending = None
    assert wait_idle(engine)
    normal_request_works(api)


def test_rate_limit_per_client(api):
    limited = ServerThread(create_api(api.engine, MODEL, rate_limit=3, rate_period=60)).start()
    try:
        with httpx.Client(base_url=limited.url, timeout=30) as http:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
            assert [http.post("/v1/completions", json=body).status_code for _ in range(3)] == [200] * 3
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 429 and r.headers["retry-after"] == "60"
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
            assert http.get("/health").status_code == 200 and http.get("/v1/models").status_code == 200
            metrics = http.get("/metrics").text
            assert 'cbp:api_rejected_requests_total{model_name="tiny-test",reason="rate_limited"} 1.0' in metrics
    finally:
        limited.stop()
    normal_request_works(api)  # the other app (no limit) on the same engine is not limited


# ---------------------------------------------------------------------------------------------- disconnects
def test_streaming_disconnect_aborts_within_a_step(api):
    lines, ctx, rid = _open_stream(api, max_tokens=900)
    for _ in range(3):
        next(lines)
    ctx.__exit__(None, None, None)  # the client goes away mid-answer
    assert wait_idle(api.engine)
    rec = finished_record(api.engine, rid)
    assert rec is not None and rec.finish_reason == "abort" and rec.num_output_tokens < 900
    normal_request_works(api)


def test_non_streaming_disconnect_aborts(api):
    t0 = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        api.http.post("/v1/completions", json={"model": MODEL, "prompt": "Go on:", "max_tokens": 900,
                                               "ignore_eos": True}, timeout=0.5)
    assert wait_idle(api.engine)
    rec = api.engine.telemetry.finished_requests()[-1]
    assert rec.finish_reason == "abort" and rec.num_output_tokens < 900
    assert rec.e2e < time.monotonic() - t0  # ended before we looked, not by running to its end
    normal_request_works(api)


def test_disconnect_while_waiting_for_a_slot(api):
    """Fill every slot, then a request that waits for one goes away: it is aborted while waiting."""
    slots = api.engine.config.max_num_seqs
    opened = [_open_stream(api, max_tokens=900) for _ in range(slots)]
    try:
        # a raw connection, closed once the engine holds the request: a client timeout could instead fire
        # before a busy server has read the request at all (then there is nothing to abort)
        body = json.dumps({"model": MODEL, "prompt": "Wait:", "max_tokens": 5, "stream": True}).encode()
        url = httpx.URL(api.url)
        with socket.create_connection((url.host, url.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (url.host.encode(), len(body), body))
            end = time.monotonic() + 30
            while api.engine.num_pending <= slots and time.monotonic() < end:
                time.sleep(0.01)
            assert api.engine.num_pending == slots + 1  # admitted, waiting for a slot
        rec = None
        end = time.monotonic() + 30
        while time.monotonic() < end:
            recs = api.engine.telemetry.finished_requests()
            rec = recs[-1] if recs else None
            if rec is not None and rec.finish_reason == "abort" and rec.num_output_tokens == 0:
                break
            time.sleep(0.01)
        assert rec is not None and rec.finish_reason == "abort" and rec.num_output_tokens == 0 and rec.ttft is None
    finally:
        for _lines, ctx, _rid in opened:
            ctx.__exit__(None, None, None)
    assert wait_idle(api.engine)


# ---------------------------------------------------------------------------------------------- faults
def test_failing_forward_fails_that_request_alone(api):
    """A forward that fails on its retry too (a lone request: nothing to split) fails the request with a
    500 (streamed: an error event); the engine keeps serving. More faults: ``tests/test_faults.py``."""
    runner = api.engine.core.runner
    real = runner.execute_model
    calls = {"n": 0}

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] <= 2:  # the forward and its retry
            raise RuntimeError("injected fault")
        return real(*a, **kw)

    assert wait_idle(api.engine)
    runner.execute_model = flaky
    try:
        with pytest.raises(openai.InternalServerError) as e:
            api.client.completions.create(model=MODEL, prompt="hi", max_tokens=4)
        assert "injected fault" in str(e.value)
        calls["n"] = 0
        with pytest.raises(openai.APIError, match="injected fault"):
            list(api.client.completions.create(model=MODEL, prompt="hi", max_tokens=4, stream=True))
    finally:
        runner.execute_model = real
    assert api.http.get("/health").status_code == 200
    assert wait_idle(api.engine)
    normal_request_works(api)


def test_health_503_when_the_engine_is_not_running(api):
    from fastapi.testclient import TestClient

    stopped = AsyncEngine(api.engine.core, start=False)  # never stepped: reads only
    with TestClient(create_api(stopped, MODEL)) as http:
        assert http.get("/health").status_code == 503
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_not_running"
        assert http.get("/metrics").text.count("cbp:engine_healthy{") == 1
