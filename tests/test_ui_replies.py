"""The local page's chat as the page runs it (Send, the tab's polls, commit) on the engine: turns that failed
(refused at admission, a fault in the engine) or were stopped are marked, shown, and never part of a later
prompt; Clear clears (nothing of the turn is written back). The engine's prompts are recorded at its door.
"""

from __future__ import annotations

import asyncio
import time

from engine import CompletionOutput, RequestOutput
from tests.test_ui_handlers import SKIP, StubEngine, handlers, req, respond
from ui.reply import ChatSettings, ReplyStream, to_messages

MARKERS = ("⚠️", "[stopped]", "too long", "engine fault", "tell me more")


class Recording:
    """An engine whose ``generate`` records each prompt before passing it on."""

    def __init__(self, engine) -> None:
        self.engine, self.prompts = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompt, params, request_id=None):
        self.prompts.append(prompt)
        return self.engine.generate(prompt, params, request_id=request_id)


async def _until(cond, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        await asyncio.sleep(0.01)
    return value


async def turn(chat, history, message, session="tab", stop=False, **settings):
    """Send, poll until the reply ended (Stop once text came, when asked), commit: the chatbot and last poll."""
    shown, box, _rid = await chat.start(message, history, req(session), **{"temperature": 0.0, **settings})
    assert box == "" and shown[-1] == {"role": "user", "content": message.strip()}
    if stop:
        await _until(lambda: chat.live_reply(session)["text"], "the first text")
        await chat.stop(req(session))
    live = await _until(lambda: (r := chat.live_reply(session)) and r["final"] and r, "the reply's end")
    chatbot, _send = chat.commit(req(session))
    assert chatbot[:len(history)] == history and chat.live_reply(session) is None
    return chatbot, live


def test_refused_and_stopped_turns_never_reach_the_engine_again_and_clear_clears(tiny_model, tokenizer):
    from engine import AsyncEngine, EngineConfig, EngineCore

    core = EngineCore(EngineConfig(num_blocks=64, block_size=16, max_num_seqs=4, max_model_len=256),
                      model=tiny_model, tokenizer=tokenizer)
    core.input_processor.eos_token_ids = frozenset()  # the random model's replies run to their token limit
    inner = AsyncEngine(core)
    engine = Recording(inner)
    chat = handlers(engine, poll_s=0.01)

    async def run():
        history, live = await turn(chat, [], "hello", max_new_tokens=4)
        assert live["state"] == "finished" and history[-1]["content"]
        good = history
        history, live = await turn(chat, history, "tell me more " * 200, max_new_tokens=4)  # over the context
        assert live["state"] == "failed" and live["text"].startswith("⚠️") and "256" in live["text"]
        inner.set_min_step_time(0.05)  # a reply slow enough to stop in the middle
        history, live = await turn(chat, history, "count slowly", stop=True, max_new_tokens=200)
        assert live["state"] == "stopped" and history[-2]["metadata"]["id"] == "cbp-stopped"
        stopped_id = chat.latest_request("tab")
        await _until(lambda: stopped_id not in inner.telemetry.latest().block_tables, "its blocks freed")
        # Clear while a reply streams: its stream is closed and nothing of the turn comes back
        await chat.start("a reply to clear", history, req("tab"), temperature=0.0, max_new_tokens=200)
        await _until(lambda: chat.live_reply("tab")["text"], "the first text")
        assert (await chat.clear(req("tab")))[:2] == ([], "")
        await asyncio.sleep(0.1)
        assert chat.live_reply("tab") is None and chat.commit(req("tab"))[0] == SKIP
        inner.set_min_step_time(0.0)
        final, live = await turn(chat, history, "last question", max_new_tokens=4)
        assert live["state"] == "finished"
        after_clear, _ = await turn(chat, [], "fresh start", max_new_tokens=4)
        return good, final, after_clear

    try:
        good, final, after_clear = asyncio.run(run())
    finally:
        inner.shutdown()
    assert engine.prompts[-2] == [*to_messages(good), {"role": "user", "content": "last question"}]
    assert to_messages(good) == [{"role": "user", "content": "hello"},
                                 {"role": "assistant", "content": good[-1]["content"]}]
    assert engine.prompts[-1] == [{"role": "user", "content": "fresh start"}]
    for prompt in engine.prompts:
        earlier = prompt[:-1]
        assert not [m for m in earlier if any(k in m["content"] for k in MARKERS)], earlier
        assert "count slowly" not in [m["content"] for m in earlier]  # the stopped turn's question neither
    assert [m["role"] for m in final].count("user") == 4 and len(after_clear) == 3


def test_a_fault_in_the_middle_of_a_reply_is_marked_and_left_out():
    class Faulty(StubEngine):
        async def generate(self, prompt, params, request_id=None):
            self.calls.append((request_id, prompt, params))
            if "FAIL" in prompt[-1]["content"]:
                yield RequestOutput(request_id, prompt, [], [CompletionOutput(0, "half", [1], "half", None)], False)
                yield RequestOutput(request_id, prompt, [], [CompletionOutput(0, "half", [1], "", "error")], True,
                                    error="engine fault: non-finite logits")
                return
            async for out in super().generate(prompt, params, request_id):
                yield out

    eng = Faulty("fine thanks")
    chat = handlers(eng, poll_s=0.01)

    async def run():
        history, _ = await turn(chat, [], "hi")
        history, live = await turn(chat, history, "FAIL now")
        assert live["state"] == "failed" and live["text"] == "half\n\n⚠️ engine fault: non-finite logits"
        assert history[-2]["metadata"]["id"] == "cbp-failed"
        await turn(chat, history, "and then?")

    asyncio.run(run())
    assert eng.calls[-1][1] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "fine thanks"},
                                {"role": "user", "content": "and then?"}]


def test_a_reply_is_plain_state_and_ignores_updates_after_it_ended():
    from ui.reply import ReplyUpdate

    s = ReplyStream("chat-1", "hi")
    s.apply(ReplyUpdate(state="queued", where={"position": 2, "waiting": 3}))
    assert (s.state, s.status("en")) == ("queued", "⏳ Queued: 2 of 3 waiting")
    s.apply(ReplyUpdate(text="a b", tokens=2, state="decoding"))
    s.end("stopped", "abort")
    s.apply(ReplyUpdate(text="a b c", tokens=3, finish_reason="stop"))  # a token that came after Stop
    assert (s.state, s.text, s.tokens, s.finish_reason) == ("stopped", "a b", 2, "abort")
    before = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    assert to_messages([*before, *s.messages("⏹ Stopped")]) == before  # the stopped turn, question and all, left out
    assert ChatSettings.from_controls(temperature=0, top_p=1, max_new_tokens=8.0, seed="") == ChatSettings(0.0, 1.0, 8)


def test_the_status_line_follows_the_state_its_outputs_carry(tiny_model, tokenizer):
    """One channel: a chat learns where its request stands from the outputs of its own stream (no telemetry
    polling): two chats sent to a paused engine with one batch slot say "Queued: 1 of 2" and "Queued: 2 of
    2"; after Resume both finish."""
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.core import EngineCore

    eng = AsyncEngine(EngineCore(EngineConfig(num_blocks=64, block_size=16, max_num_seqs=1), model=tiny_model,
                                 tokenizer=tokenizer))
    chat = handlers(eng, poll_s=0.02)

    def polled(request_id):
        raise AssertionError("the chat polled the telemetry")

    eng.core.telemetry.request_state = polled  # type: ignore[method-assign]
    eng.pause()

    async def main():
        titles: dict[str, list[str]] = {"a": [], "b": []}

        async def one(session):
            async for hist, _box in respond(chat, f"hello from {session}", [], 0.0, 1.0, 4, None, session=session):
                if isinstance(hist, list):
                    titles[session].append(hist[-1 if hist[-1].get("metadata") else -2]["metadata"]["title"])

        tasks = [asyncio.create_task(one("a"))]
        await asyncio.sleep(0.3)
        tasks.append(asyncio.create_task(one("b")))
        deadline = time.monotonic() + 30
        while not any("Queued: 2 of 2" in t for t in titles["b"]) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        eng.resume()
        await asyncio.gather(*tasks)
        return titles

    try:
        titles = asyncio.run(main())
    finally:
        eng.shutdown()
    assert any(t.startswith("⏳ Queued: 1 of ") and "engine paused" in t for t in titles["a"]), titles["a"]
    assert any(t.startswith("⏳ Queued: 2 of 2") for t in titles["b"]), titles["b"]
    assert titles["a"][-1].startswith("✓") and titles["b"][-1].startswith("✓")
