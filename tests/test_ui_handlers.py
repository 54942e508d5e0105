"""Chat handlers, load generator and command line, against a small stand-in for the engine's API."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from engine.request import CompletionOutput, RequestOutput
from ui.chat import ActiveRequests, ChatHandlers, message_text, sampling_params, to_messages
from ui.loadgen import LoadGenerator, synthetic_chat

SKIP = {"__type__": "update"}


class StubEngine:
    """``generate`` streams the words of ``reply`` one by one (awaiting ``gate`` before each if given);
    records prompts, params and aborts."""

    def __init__(self, reply="Hello there friend", gate: asyncio.Event | None = None, reject=None):
        self.reply, self.gate, self.reject = reply.split(), gate, reject
        self.calls, self.aborted, self.closed = [], [], []

    async def generate(self, prompt, params, request_id=None):
        if self.reject:
            raise ValueError(self.reject)
        self.calls.append((request_id, prompt, params))
        text = ""
        try:
            for i, w in enumerate(self.reply):
                if self.gate is not None:
                    await self.gate.wait()
                delta = ("" if i == 0 else " ") + w
                text += delta
                done = i == len(self.reply) - 1
                yield RequestOutput(request_id, prompt, [], [CompletionOutput(0, text, [], delta, "stop" if done else None)], done)
                await asyncio.sleep(0)
        finally:
            self.closed.append(request_id)

    def abort(self, request_id):
        self.aborted.append(request_id)


def req(session="s1"):
    return SimpleNamespace(session_hash=session, headers={})


async def collect(agen):
    return [x async for x in agen]


def test_message_text_and_to_messages_normalise_chatbot_values():
    history = [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "file", "file": {}}, {"text": "b"}]},
        {"role": "assistant", "content": ""},  # a reply stopped before its first token
    ]
    assert message_text(None) == "" and message_text({"type": "text", "text": "x"}) == "x"
    assert to_messages(history) == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "a\nb"},
    ]


def test_sampling_params_from_controls():
    p = sampling_params(0.7, 0.9, 128.0, -1)
    assert (p.temperature, p.top_p, p.max_tokens, p.seed) == (0.7, 0.9, 128, None)
    assert sampling_params(0, 1, 5, 42).seed == 42 and sampling_params(0, 1, 5, None).seed is None
    with pytest.raises(ValueError):
        sampling_params(0.7, 0.0, 16, -1)


def test_respond_streams_then_leaves_textbox_alone():
    eng = StubEngine()
    chat = ChatHandlers(eng)
    history = [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "reply"}]
    outs = asyncio.run(collect(chat.respond("  new question ", history, 0.0, 1.0, 16, 7, req())))
    first_hist, first_box = outs[0]
    assert first_box == "" and first_hist[-2:] == [{"role": "user", "content": "new question"},
                                                    {"role": "assistant", "content": ""}]
    assert all(box == SKIP for _, box in outs[1:])
    assert [h[-1]["content"] for h, _ in outs[1:]] == ["Hello", "Hello there", "Hello there friend"]
    rid, prompt, params = eng.calls[0]
    assert rid.startswith("chat-") and prompt[-1] == {"role": "user", "content": "new question"}
    assert len(prompt) == 3 and params.seed == 7 and params.max_tokens == 16
    assert len(chat.active) == 0 and eng.aborted == []


def test_empty_message_does_nothing():
    eng = StubEngine()
    outs = asyncio.run(collect(ChatHandlers(eng).respond("   ", [], 0.7, 0.9, 16, -1, req())))
    assert outs == [(SKIP, SKIP)] and eng.calls == []


def test_rejected_request_is_shown_in_the_chat():
    chat = ChatHandlers(StubEngine(reject="prompt is longer than the context (9000 > 8192 tokens)"))
    outs = asyncio.run(collect(chat.respond("x", [], 0.7, 0.9, 16, -1, req())))
    assert "longer than the context" in outs[-1][0][-1]["content"] and len(chat.active) == 0


def test_stop_aborts_only_the_callers_requests_and_closing_the_stream_closes_the_engine_stream():
    async def run():
        gate = asyncio.Event()
        eng = StubEngine(gate=gate)
        chat = ChatHandlers(eng)
        a = chat.respond("a", [], 0.7, 0.9, 16, -1, req("s1"))
        b = chat.respond("b", [], 0.7, 0.9, 16, -1, req("s2"))
        await a.__anext__(), await b.__anext__()
        ta, tb = asyncio.ensure_future(a.__anext__()), asyncio.ensure_future(b.__anext__())
        await asyncio.sleep(0.01)
        assert len(chat.active) == 2
        chat.stop(req("s1"))
        assert eng.aborted == [chat_ids(eng, "a")]
        ta.cancel()  # what Gradio does to the Stop button's cancelled event
        with pytest.raises(asyncio.CancelledError):
            await ta
        gate.set()
        await tb
        await b.aclose()  # a tab that goes away: Gradio closes the generator
        return eng, chat

    def chat_ids(eng, text):
        return next(rid for rid, p, _ in eng.calls if p[-1]["content"] == text)

    eng, chat = asyncio.run(run())
    assert sorted(eng.closed) == sorted(rid for rid, _, _ in eng.calls)  # both engine streams were closed
    assert len(chat.active) == 0


def test_active_requests_registry():
    reg = ActiveRequests()
    reg.add("s", "r1"), reg.add("s", "r2"), reg.add("t", "r3")
    reg.discard("s", "r1"), reg.discard("x", "nothing")
    assert reg.of("s") == ["r2"] and reg.of("t") == ["r3"] and reg.of("u") == [] and len(reg) == 2


def test_load_generator_runs_n_chats_and_stops():
    async def run():
        eng = StubEngine(reply="one two three")
        gen = LoadGenerator(eng, seed=1)
        gen.start(5, rate=200.0)
        for _ in range(200):
            await asyncio.sleep(0.01)
            if gen.stats.finished == 5:
                break
        done = gen.status()
        gate = asyncio.Event()
        eng2 = StubEngine(gate=gate)
        gen2 = LoadGenerator(eng2)
        gen2.start(3, rate=1000.0)
        await asyncio.sleep(0.05)
        cancelled = gen2.stop()
        await asyncio.sleep(0.01)
        return eng, done, gen2, cancelled, eng2

    eng, done, gen2, cancelled, eng2 = asyncio.run(run())
    assert len(eng.calls) == 5 and all(rid.startswith("load-") for rid, _, _ in eng.calls)
    assert "5 requested · 5 started · 0 running · 5 finished" in done
    assert cancelled >= 3 and gen2.stats.cancelled == 3 and gen2.active == 0
    assert sorted(eng2.closed) == sorted(rid for rid, _, _ in eng2.calls)
    with pytest.raises(ValueError):
        LoadGenerator(eng).start(1, rate=0)


def test_synthetic_chats_vary_in_prompt_and_length():
    import random

    rng = random.Random(0)
    chats = [synthetic_chat(rng) for _ in range(50)]
    lengths = {len(m[0]["content"]) for m, _ in chats}
    max_tokens = [n for _, n in chats]
    assert len(lengths) > 10 and max(lengths) > 500 and min(lengths) < 80
    assert all(16 <= n <= 256 for n in max_tokens) and len(set(max_tokens)) > 20


def test_app_options_from_command_line_and_environment():
    import app

    a = app.parse_args([], env={})
    assert a.max_num_seqs == 16 and a.policy == "continuous" and a.model is None and a.share is False
    kw = app.engine_kwargs(a)
    assert (kw["model"], kw["max_num_seqs"], kw["num_blocks"], kw["policy"]) == (None, 16, 384, "continuous")
    assert "kv_cache_memory" not in kw and "dtype" not in kw  # unset: the engine decides
    env = {"CBP_PORT": "7999", "CBP_MAX_NUM_SEQS": "8", "CBP_KV_CACHE_MEMORY": "256MiB", "CBP_SHARE": "true",
           "CBP_POLICY": "static", "CBP_MODEL": "/models/x", "CBP_BLOCK_SIZE": ""}
    b = app.parse_args([], env=env)
    assert (b.port, b.max_num_seqs, b.kv_cache_memory, b.share, b.policy, b.model) == (
        7999, 8, "256MiB", True, "static", "/models/x")
    assert b.block_size == 16 and b.num_blocks is None  # an empty variable is unset: the engine's default
    c = app.parse_args(["--port", "7001", "--max-num-seqs", "4", "--no-share", "--num-blocks", "64"],
                       env={**env, "CBP_KV_CACHE_MEMORY": ""})
    assert (c.port, c.max_num_seqs, c.share, c.num_blocks) == (7001, 4, False, 64)
    assert app.engine_kwargs(c)["num_blocks"] == 64
    with pytest.raises(SystemExit):
        app.parse_args(["--num-blocks", "64", "--kv-cache-memory", "1GiB"], env={})
    with pytest.raises(SystemExit):
        app.parse_args([], env={"CBP_POLICY": "bogus"})
