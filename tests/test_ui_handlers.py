"""Chat handlers (on the local engine's backend), load generator and command line, against a small stand-in for
the engine's API."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from engine.request import CompletionOutput, RequestOutput
from engine.telemetry import Telemetry
from ui.chat import ChatHandlers
from ui.engine_backend import EngineBackend, sampling_params
from ui.loadgen import LoadGenerator, synthetic_chat
from ui.reply import ChatSettings, ReplyStream, message_text, to_messages

SKIP = {"__type__": "update"}


class StubEngine:
    """``generate`` streams the words of ``reply`` one by one (awaiting ``gate`` before each if given);
    records prompts, params and aborts. Has the rest of what the UI reads of an ``AsyncEngine``: an empty
    telemetry and the pacing state of an engine running at full speed."""

    def __init__(self, reply="Hello there friend", gate: asyncio.Event | None = None, reject=None):
        self.reply, self.gate, self.reject = reply.split(), gate, reject
        self.calls, self.aborted, self.closed = [], [], []
        self.telemetry = Telemetry(capacity=16)
        self.step_count, self.paused, self.min_step_time = 0, False, 0.0
        self.seeking, self.until_condition, self.until_met = False, None, None

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


def handlers(engine, **kw) -> ChatHandlers:
    """The local page's chat handlers on ``engine``."""
    return ChatHandlers(EngineBackend(engine), **kw)


def respond(chat, message, history, temperature=0.7, top_p=0.9, max_new_tokens=16, seed=-1, session="s1"):
    """The /chat API's stream (``(chatbot, textbox)`` items) of one message, the settings by name."""
    return chat.respond_api(message, history, req(session), temperature=temperature, top_p=top_p,
                            max_new_tokens=max_new_tokens, seed=seed)


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


def test_sampling_settings_from_controls():
    p = sampling_params(ChatSettings.from_controls(temperature=0.7, top_p=0.9, max_new_tokens=128.0, seed=-1))
    assert (p.temperature, p.top_p, p.max_tokens, p.seed) == (0.7, 0.9, 128, None)
    assert ChatSettings.from_controls(seed=42).seed == 42 and ChatSettings.from_controls(seed=None).seed is None
    with pytest.raises(ValueError):
        sampling_params(ChatSettings(top_p=0.0))


def reply_of(history):
    """The reply text and the status line's title of the last turn of a Chatbot value."""
    status = next(m for m in reversed(history) if m.get("metadata"))
    last = history[-1]
    return ("" if last is status else last["content"]), status["metadata"]["title"]


def test_respond_streams_then_leaves_textbox_alone():
    eng = StubEngine()
    chat = handlers(eng, poll_s=0.01)
    history = [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "reply"}]
    outs = asyncio.run(collect(respond(chat, "  new question ", history, 0.0, 1.0, 16, 7)))
    first_hist, first_box = outs[0]
    assert first_box == "" and first_hist[-2] == {"role": "user", "content": "new question"}
    assert first_hist[-1]["metadata"]["title"].startswith("⏳") and first_hist[-1]["metadata"]["status"] == "pending"
    assert all(box == SKIP for _, box in outs[1:])
    replies = [reply_of(h)[0] for h, _ in outs[1:]]
    assert [r for i, r in enumerate(replies) if r and r not in replies[:i]] == ["Hello", "Hello there",
                                                                             "Hello there friend"]
    text, title = reply_of(outs[-1][0])
    assert text == "Hello there friend" and title.startswith("✓") and outs[-1][0][-2]["metadata"]["status"] == "done"
    rid, prompt, params = eng.calls[0]
    assert rid == chat.latest_request("s1") and rid.startswith("chat-") and rid in title
    assert prompt[-1] == {"role": "user", "content": "new question"}
    assert len(prompt) == 3 and params.seed == 7 and params.max_tokens == 16
    assert chat.replies == {} and eng.aborted == []


def test_status_lines_are_shown_but_never_sent_to_the_model():
    history = [{"role": "user", "content": "q"},
               {"role": "assistant", "content": "", "metadata": {"title": "✓ Finished: 3 tokens (stop)"}},
               {"role": "assistant", "content": "a b c"}]
    assert to_messages(history) == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a b c"}]


@pytest.mark.parametrize("state,tokens,paused,expect", [
    (None, 0, False, "Sent"),
    ({"state": "queued", "position": 2, "waiting": 5}, 0, False, "Queued: 2 of 5"),
    ({"state": "queued", "position": 1, "waiting": 1}, 7, False, "Preempted"),
    ({"state": "prefilling", "computed": 40, "prompt": 120}, 0, True, "40 of 120 prompt tokens · engine paused"),
    ({"state": "decoding"}, 12, False, "Decoding: 12 tokens"),
    ({"state": "finished", "reason": "length"}, 16, True, "Finished: 16 tokens (length)"),
    ({"state": "stopped"}, 3, False, "Stopped after 3 tokens"),
])
def test_status_text_names_each_state(state, tokens, paused, expect):
    stream = ReplyStream("chat-1", "hi", state=(state or {}).get("state", "sent"), tokens=tokens,
                         where={k: v for k, v in (state or {}).items() if k != "state"},
                         finish_reason=(state or {}).get("reason"))
    assert expect in stream.status("en", paused)
    assert stream.ended == ((state or {}).get("state") in ("finished", "stopped", "failed"))
    assert stream.status("ko", paused) != stream.status("en", paused)  # translated


def test_a_second_message_while_a_reply_streams_starts_nothing():
    async def run():
        gate = asyncio.Event()
        eng = StubEngine(gate=gate)
        chat = handlers(eng, poll_s=0.01)
        first = respond(chat, "a", [])
        await first.__anext__()
        second = await collect(respond(chat, "b", []))  # e.g. a double click
        gate.set()
        rest = [x async for x in first]
        return eng, second, rest

    eng, second, rest = asyncio.run(run())
    assert second == [(SKIP, SKIP)] and len(eng.calls) == 1
    assert reply_of(rest[-1][0])[0] == "Hello there friend"


def test_empty_message_does_nothing():
    eng = StubEngine()
    outs = asyncio.run(collect(respond(handlers(eng), "   ", [])))
    assert outs == [(SKIP, SKIP)] and eng.calls == []


def test_rejected_request_is_shown_in_the_chat():
    chat = handlers(StubEngine(reject="prompt is longer than the context (9000 > 8192 tokens)"), poll_s=0.01)
    outs = asyncio.run(collect(respond(chat, "x", [])))
    text, title = reply_of(outs[-1][0])
    assert "longer than the context" in text and title.startswith("⚠️") and chat.replies == {}


def test_stop_aborts_only_the_callers_requests_and_says_stopped():
    async def run():
        gate = asyncio.Event()
        eng = StubEngine(gate=gate)
        chat = handlers(eng, poll_s=0.01)
        a = respond(chat, "a", [], session="s1")
        b = respond(chat, "b", [], session="s2")
        await a.__anext__(), await b.__anext__()
        ta, tb = asyncio.ensure_future(collect(a)), asyncio.ensure_future(b.__anext__())
        await asyncio.sleep(0.05)
        assert chat.busy("s1") and chat.busy("s2")
        await chat.stop(req("s1"))
        outs_a = await asyncio.wait_for(ta, 5)  # the reply ends on its own, with a "stopped" status line
        assert reply_of(outs_a[-1][0])[1].startswith("⏹")
        assert outs_a[-1][0][-1]["metadata"]["id"] == "cbp-stopped"  # marked: never sent to the model again
        assert eng.aborted == [] and eng.closed == [chat_ids(eng, "a")]  # its engine stream was closed (aborts)
        gate.set()
        await tb
        await b.aclose()  # a tab that goes away: Gradio closes the generator
        await asyncio.sleep(0.05)
        return eng, chat

    def chat_ids(eng, text):
        return next(rid for rid, p, _ in eng.calls if p[-1]["content"] == text)

    eng, chat = asyncio.run(run())
    assert sorted(eng.closed) == sorted(rid for rid, _, _ in eng.calls)  # both engine streams were closed
    assert chat.replies == {}




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
        await _until(lambda: gen2.stats.started == 3)  # all three chats began (a loaded machine may lag)
        cancelled = gen2.stop()
        await asyncio.sleep(0.01)
        return eng, done, gen2, cancelled, eng2

    eng, done, gen2, cancelled, eng2 = asyncio.run(run())
    assert len(eng.calls) == 5 and all(rid.startswith("load-1-") for rid, _, _ in eng.calls)
    assert done == "run 1: 5 requested · 0 running · 0 waiting · 5 finished · 0 stopped · 0 failed"  # no telemetry
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


async def _until(cond, timeout=10.0):

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_load_generator_status_counts_the_runs_ids_in_the_engine_snapshot():
    from engine.telemetry import BatchSlotSnapshot, StepSnapshot

    def snapshot(step, slots, running, waiting=(), finished=()):
        return StepSnapshot(step=step, time=0.0, duration=0.0, forward_time=0.0,
                            batch_slots=tuple(BatchSlotSnapshot(i, rid, "decode" if rid else "idle")
                                              for i, rid in enumerate(slots)),
                            block_tables={rid: (0,) for rid in running}, block_refcount=(1,), block_tokens=(1,),
                            block_reuses=(0,), cached_blocks=frozenset(), num_running=len(running),
                            num_waiting=len(waiting), num_scheduled_tokens=0, num_generated_tokens=0,
                            num_preemptions=0, finished=tuple(finished), waiting=tuple(waiting))

    async def run():
        eng = StubEngine(gate=asyncio.Event())
        eng.telemetry = SimpleNamespace(snap=None)
        eng.telemetry.latest = lambda: eng.telemetry.snap
        gen = LoadGenerator(eng, seed=2)
        assert gen.status() == "no run yet"
        gen.start(4, rate=1000.0)
        await _until(lambda: len(eng.calls) == 4)
        assert gen.status() == "run 1: 4 requested · 0 running · 0 waiting · 4 queued · 0 finished · 0 stopped · 0 failed"
        a, b, c, _ = (rid for rid, _, _ in eng.calls)
        # a runs; b held a slot in the step but ended in it; c waits behind another run's and a browser's
        # requests; the fourth is not in the snapshot yet (queued)
        eng.telemetry.snap = snapshot(7, [a, b, "load-11-x", None], running=[a, "load-11-x"],
                                      waiting=["chat-y", "load-11-z", c], finished=[b])
        line = gen.status()
        assert line == "run 1: 4 requested · 1 running · 1 waiting · 1 queued · 0 finished · 0 stopped · 0 failed"
        assert gen.status() == line  # counted once per snapshot, same answer
        eng.telemetry.snap = snapshot(8, [a, b, c, None], running=[a, b, c])
        assert gen.status().startswith("run 1: 4 requested · 3 running · 0 waiting · 1 queued")  # a new snapshot
        gen.stop()
        await _until(lambda: gen.active == 0)

    asyncio.run(run())


def test_load_generator_runs_follow_the_engine_and_restart_from_zero(tiny_model, tokenizer):
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.core import EngineCore

    eng = AsyncEngine(EngineCore(EngineConfig(num_blocks=256, block_size=16, max_num_seqs=4), model=tiny_model,
                                 tokenizer=tokenizer))

    def engine_part(snap):  # the run's requests are the only ones in the engine: its counts are the run's
        stats = eng.telemetry.stats()
        assert (stats["running"], stats["waiting"]) == (snap.num_running, snap.num_waiting)
        return f"{snap.num_running} running · {snap.num_waiting} waiting · 0 finished"

    async def run():
        eng.pause()  # paused: nothing runs but single steps, so the counts hold still
        gen = LoadGenerator(eng, seed=5)
        gen.start(6, rate=1000.0)
        await _until(lambda: gen.stats.started == 6 and eng.core.stats().num_waiting == 6)
        assert eng.telemetry.latest() is None  # no step yet: all six are queued, nothing raises
        assert gen.status() == "run 1: 6 requested · 0 running · 0 waiting · 6 queued · 0 finished · 0 stopped · 0 failed"
        eng.step_once()
        await _until(lambda: eng.step_count == 1)
        snap = eng.telemetry.latest()
        assert snap.num_running > 0 and snap.num_running + snap.num_waiting == 6
        assert gen.status() == f"run 1: 6 requested · {engine_part(snap)} · 0 stopped · 0 failed"
        gen.start(2, rate=1000.0)  # while run 1 still has chats: a new run, run 1's chats go on apart
        await _until(lambda: gen.stats.started == 2)
        assert gen.run == 2 and gen.stats.requested == 2
        # paused: the engine takes them into its waiting queue and amends its newest snapshot, so they count
        # as waiting at once
        await _until(lambda: len(eng.telemetry.queue) == snap.num_waiting + 2)
        assert gen.status() == ("run 2: 2 requested · 0 running · 2 waiting · 0 finished · 0 stopped · 0 failed"
                                " · + 6 of earlier runs")
        assert gen.status("ko").endswith("이전 실행 6개 진행 중")
        gen.stop()  # every run's chats
        await _until(lambda: gen.active == 0)
        assert gen.stats.cancelled == 2 and gen.run == 2
        assert gen.status().endswith("0 finished · 2 stopped · 0 failed")  # run 1's are gone: no "+ earlier"

        gen.start(3, rate=1000.0)  # a new run: its counts start from zero; earlier runs' ids in the snapshot don't count
        assert gen.run == 3 and gen.stats.cancelled == 0
        assert gen.status() == "run 3: 3 requested · 0 running · 0 waiting · 0 finished · 0 stopped · 0 failed"
        await _until(lambda: gen.stats.started == 3 and len(eng.telemetry.queue) == 3)
        assert gen.status() == "run 3: 3 requested · 0 running · 3 waiting · 0 finished · 0 stopped · 0 failed"
        assert gen.status("ko").startswith("실행 3: 요청 3 · 실행 중 0 · 대기 중 3")
        eng.step_once()
        await _until(lambda: eng.step_count == 2)
        snap = eng.telemetry.latest()
        assert snap.num_running > 0 and snap.num_running + snap.num_waiting == 3
        assert all(s.request_id is None or s.request_id.startswith("load-3-") for s in snap.batch_slots)
        assert gen.status() == f"run 3: 3 requested · {engine_part(snap)} · 0 stopped · 0 failed"
        gen.stop()
        await _until(lambda: gen.active == 0)

    try:
        asyncio.run(run())
    finally:
        eng.resume()
        eng.shutdown()


def test_an_engine_that_is_down_fails_the_reply_instead_of_waiting_forever():
    class Down(StubEngine):
        async def generate(self, prompt, params, request_id=None):
            raise RuntimeError("the engine is not running")
            yield  # an async generator

    chat = handlers(Down(), poll_s=0.01)
    outs = asyncio.run(asyncio.wait_for(collect(respond(chat, "x", [])), 5))
    text, title = reply_of(outs[-1][0])
    assert "not running" in text and title.startswith("⚠️") and chat.replies == {}


def test_a_failed_turn_is_never_sent_to_the_model_again():
    chat = handlers(StubEngine(reject="the prompt has 5030 tokens, but the context length is 1536"), poll_s=0.01)
    outs = asyncio.run(collect(respond(chat, "a very long message", [{"role": "user", "content": "hi"},
                                                                    {"role": "assistant", "content": "hello"}])))
    history = outs[-1][0]
    assert history[-2]["metadata"]["id"] == "cbp-failed" and "5030" in history[-1]["content"]
    eng = StubEngine()
    asyncio.run(collect(respond(handlers(eng, poll_s=0.01), "next", history)))
    assert eng.calls[0][1] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                               {"role": "user", "content": "next"}]


def test_clear_ends_the_reply_without_another_update():
    async def run():
        gate = asyncio.Event()
        eng = StubEngine(gate=gate)
        chat = handlers(eng, poll_s=0.01)
        _, box, rid = await chat.start("a", [{"role": "user", "content": "old"}], req("s1"), temperature=0.7)
        await asyncio.sleep(0.05)
        cleared = await chat.clear(req("s1"))
        await asyncio.sleep(0.05)
        return eng, chat, cleared, rid, chat.commit(req("s1")), chat.live_reply("s1")

    eng, chat, cleared, rid, commit, live = asyncio.run(run())
    assert cleared[:2] == ([], "") and commit[0] == SKIP and live is None  # nothing writes the turn back
    assert eng.closed == [rid] and chat.replies == {} and chat.latest_request("s1") is None


def test_queued_again_after_holding_a_slot_is_preempted_even_before_the_first_token():
    stream = ReplyStream("chat-1", "hi", state="queued", where={"position": 1, "waiting": 3}, started=True)
    assert stream.status("en").startswith("⏸ Preempted")


def test_host_key_and_pace_line():
    from ui.layout import is_host_page
    from ui.live import pacing_line

    assert is_host_page(None, None) and is_host_page("", "anything")
    assert is_host_page("k3y", "k3y") and not is_host_page("k3y", "") and not is_host_page("k3y", "k3")
    eng = SimpleNamespace(step_count=42, paused=True, min_step_time=0.5, until_condition=None)
    line = pacing_line(eng, 40, "en")
    assert "Engine paused" in line and "step 42" in line and "0.50 s per step" in line and "pinned at step 40" in line
    assert "일시 정지" in pacing_line(eng, None, "ko")
    assert pacing_line(SimpleNamespace(step_count=3, paused=False, min_step_time=0.0, until_condition=None), None, "en") == \
        "▶ Engine running · step 3"


def test_a_cancelled_reply_ends_at_once_even_as_an_output_arrives():
    """Cancelling the task that streams a reply (gradio_client's ``job.cancel()``, Gradio's ``cancels=``) ends
    it with CancelledError and closes the engine stream, whatever the loop was doing: here outputs arrive on
    every loop turn, so some cancels land while an output is being handed over (``asyncio.wait_for`` on
    Python 3.11 returned that output and dropped the cancel; the reply then streamed to its end)."""

    async def run(turns: int) -> tuple[bool, bool]:
        eng = StubEngine(reply=" ".join(["w"] * 2000))
        replies = respond(handlers(eng, poll_s=0.25), "hi", [], 0.0, 1.0, 16, -1)

        async def consume():
            async for _ in replies:
                await asyncio.sleep(0)

        task = asyncio.get_running_loop().create_task(consume())
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.wait([task], timeout=5)  # Gradio's /cancel awaits the cancelled task, then closes the handler
        cancelled = task.cancelled()
        await replies.aclose()
        return cancelled, len(eng.closed) == len(eng.calls)  # a stream that began was closed

    results = [asyncio.run(run(turns)) for turns in range(3, 63)]
    assert all(cancelled for cancelled, _ in results), f"{sum(not c for c, _ in results)} of 60 cancels were dropped"
    assert all(closed for _, closed in results)
