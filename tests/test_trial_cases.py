"""Cases the trials of a hostile user and a new user found, each failing before its fix:

1. A JSON number with more digits than Python converts (4,300), a UTF-16 body or one with a byte-order mark,
   and a body without a JSON ``Content-Type`` are 400s (the number was a 500 with a traceback; the others were
   served, so a page of another origin could post a body without a CORS preflight).
2. The Talk preset (``AsyncEngine.reconfigure``) starts a new telemetry: ``/metrics`` goes on counting finished
   requests, its counters never go back, and the KV event publisher follows the new pool.
3. A turn that ended (stopped or refused) and was not yet written into the chat when the next message is sent
   is written with its status line and never sent to the model again.
4. (a new user's trial) A misspelt field, ignored as vLLM ignores it, is named in the log.
5. A remote stream that ends without ``[DONE]`` or a finish reason is a failed turn, not a finished reply.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.options import TALK_PRESET
from engine.request import SamplingParams
from server.metrics import EngineMetrics
from server.protocol import APIError, ChatCompletionRequest
from server.request_body import BodyLimits, parse_body
from tests.test_ui_handlers import StubEngine, handlers
from ui.reply import FAILED_ID, STOPPED_ID, is_status

torch.set_num_threads(1)


@pytest.mark.parametrize("field", ["max_tokens", "unknown_field"])
def test_a_number_of_5000_digits_is_a_400_not_a_500(field):
    raw = b'{"messages": [{"role": "user", "content": "x"}], "' + field.encode() + b'": ' + b"9" * 5000 + b"}"
    with pytest.raises(APIError) as e:
        parse_body(raw, ChatCompletionRequest, BodyLimits())
    assert e.value.status == 400


def _sample(metrics: EngineMetrics, name: str, **labels) -> float:
    metrics.render()
    return metrics.registry.get_sample_value(name, {"model_name": "m", **labels}) or 0.0


def test_metrics_keep_counting_after_the_talk_preset(tiny_model, tokenizer):
    eng = AsyncEngine(EngineCore(EngineConfig(num_blocks=64, block_size=16, max_num_seqs=8), model=tiny_model,
                                 tokenizer=tokenizer))
    try:
        metrics = EngineMetrics(eng, "m")
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        asyncio.run(eng.generate_text([5, 7, 9], params))
        before = _sample(metrics, "cbp:prompt_tokens_total")
        assert _sample(metrics, "cbp:request_success_total", finished_reason="length") == 1
        eng.reconfigure(**TALK_PRESET)
        asyncio.run(eng.generate_text([5, 7, 9], params))
        assert _sample(metrics, "cbp:request_success_total", finished_reason="length") == 2
        assert _sample(metrics, "cbp:e2e_request_latency_seconds_count") == 2
        assert _sample(metrics, "cbp:prompt_tokens_total") >= before  # a counter never goes back
    finally:
        eng.shutdown()


def _req(session: str = "s1"):
    return SimpleNamespace(session_hash=session, headers={})


@pytest.mark.parametrize("how", ["stopped", "refused"])
def test_an_ended_turn_not_yet_committed_is_not_sent_with_the_next_message(how):
    async def run():
        gate = asyncio.Event()
        eng = StubEngine(gate=gate) if how == "stopped" else StubEngine(reject="the prompt is too long")
        chat = handlers(eng, poll_s=0.01)
        shown, _, _ = await chat.start("first", [], _req(), temperature=0.7)  # what the chatbot shows now
        await asyncio.sleep(0.05)
        if how == "stopped":
            await chat.stop(_req())
            await asyncio.sleep(0.05)
        eng.reject, eng.gate = None, None
        gate.set()
        chatbot, _, _ = await chat.start("second", shown, _req(), temperature=0.7)  # before the commit ran
        for _ in range(100):
            if eng.calls and eng.calls[-1][1][-1]["content"] == "second":
                break
            await asyncio.sleep(0.01)
        return eng.calls[-1][1], chatbot

    prompt, chatbot = asyncio.run(run())
    assert prompt == [{"role": "user", "content": "second"}], prompt
    marks = [(m.get("metadata") or {}).get("id") for m in chatbot if is_status(m)]
    assert marks == [STOPPED_ID if how == "stopped" else FAILED_ID], chatbot  # the ended turn, marked, is shown
    assert [m["content"] for m in chatbot if m["role"] == "user"] == ["first", "second"]


@pytest.mark.parametrize("raw", ['{"messages": []}'.encode("utf-16"), b"\xef\xbb\xbf" + b'{"messages": []}'],
                         ids=["utf-16", "bom"])
def test_a_body_that_is_not_plain_utf8_is_a_400(raw):
    with pytest.raises(APIError) as e:
        parse_body(raw, ChatCompletionRequest, BodyLimits())
    assert e.value.status == 400 and e.value.code == "invalid_json"


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_without_a_json_content_type_is_a_400(content_type):
    """No JSON ``Content-Type``, no generation: a browser posts such a body cross-origin without a preflight."""
    from server.request_body import BodyReader

    class Req:
        headers = {} if content_type is None else {"content-type": content_type}

        async def body(self):
            return b'{"messages": [{"role": "user", "content": "x"}]}'

    with pytest.raises(APIError) as e:
        asyncio.run(BodyReader(BodyLimits()).read(Req(), ChatCompletionRequest))  # type: ignore[arg-type]
    assert e.value.status == 400


def test_the_kv_event_publisher_follows_the_engine_into_a_new_pool(tiny_model, tokenizer):
    from engine.kv_wire import decode_batch
    from server.kv_publisher import KVEventPublisher, parse_kv_events_config

    eng = AsyncEngine(EngineCore(EngineConfig(num_blocks=64, block_size=16, max_num_seqs=8), model=tiny_model,
                                 tokenizer=tokenizer))
    sent: list[bytes] = []
    try:
        cfg = parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "zmq", '
                                     '"endpoint": "tcp://127.0.0.1:5999", "replay_endpoint": null}')
        pub = KVEventPublisher(lambda: eng.telemetry, 16, cfg)
        pub._send = sent.append  # type: ignore[method-assign]
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        pub.poll_once()  # the empty pool
        asyncio.run(eng.generate_text(list(range(5, 45)), params))
        pub.poll_once()
        before = len(sent)
        eng.reconfigure(**TALK_PRESET)
        asyncio.run(eng.generate_text(list(range(5, 45)), params))
        pub.poll_once()
    finally:
        eng.shutdown()
    kinds = [e.type for p in sent[before:] for e in decode_batch(p).events]
    first = [e.type for p in sent[:before] for e in decode_batch(p).events]
    assert "BlockStored" in first and "AllBlocksCleared" in kinds and "BlockStored" in kinds[kinds.index("AllBlocksCleared"):]


def test_an_unknown_field_is_ignored_and_named_in_the_log(caplog):
    """A misspelt field (``max_token``) is ignored as vLLM ignores it, and named in a WARNING."""
    from server.request_body import log_ignored_fields

    body = parse_body(b'{"messages": [{"role": "user", "content": "x"}], "max_token": 5}', ChatCompletionRequest,
                      BodyLimits())
    with caplog.at_level("WARNING", logger="server.request_body"):
        log_ignored_fields(body)
    assert body.max_tokens is None and "'max_token'" in caplog.text


def test_a_stream_closed_before_its_end_is_an_error_not_a_reply():
    """An event stream that ends cleanly but without ``[DONE]`` or a finish reason (a server or proxy that cut
    it) ends the chat with a RemoteError: the cut text is not a finished reply. A finish reason without
    ``[DONE]`` is a reply."""
    import asyncio

    from ui.remote.client import RemoteClient, RemoteError

    def answer(body: bytes):
        def handler(request: httpx.Request) -> httpx.Response:
            if request.url.path.endswith("/models"):
                return httpx.Response(200, json={"data": [{"id": "m"}]})
            return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})
        return httpx.MockTransport(handler)

    async def run(body: bytes) -> str:
        out = ""
        async for t in RemoteClient("http://x", transport=answer(body)).stream_chat([{"role": "user", "content": "hi"}]):
            out += t
        return out

    chunk = b'data: {"choices": [{"delta": {"content": "Hello"}}]}\n\n'
    with pytest.raises(RemoteError, match="before it was finished"):
        asyncio.run(run(chunk))
    done = b'data: {"choices": [{"delta": {"content": ""}, "finish_reason": "stop"}]}\n\n'
    assert asyncio.run(run(chunk + done)) == "Hello"
    assert asyncio.run(run(chunk + b"data: [DONE]\n\n")) == "Hello"
