"""Remote mode's page against a stub OpenAI server in its own process (``tests/_stub_openai.py``) that records
every request body and refuses or breaks some: an HTTP 400, a stream dropped in the middle, Stop, the process
killed mid-reply and a chat sent while it is down. No error text, stop marker or failed prompt ever reaches a
later request; Clear clears (nothing of the turn comes back); the header and the notice follow the server (down
at start, up, killed, up again), in a new tab too. The page's handlers are driven as Gradio and the page's
polls call them; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from ui.remote.backend import RemoteBackend
from ui.remote.client import RemoteClient
from ui.remote.metrics import MetricsScraper
from ui.remote.page import build_remote_app

ROOT = Path(__file__).resolve().parent.parent
STUB = ROOT / "tests" / "_stub_openai.py"
MARKERS = ("⚠️", "[stopped]", "HTTP 400", "RemoteProtocolError", "does not answer", "closed the connection",
           "maximum context length", "REFUSE", "DROP", "SLOW", "w1 w2")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stub:
    """The stub server's process on a fixed port: start, kill, start again; its recorded request bodies."""

    def __init__(self, tmp: Path) -> None:
        self.port, self.record, self.proc = _free_port(), tmp / "bodies.jsonl", None
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(STUB), str(self.port), str(self.record)])
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(self.url + "/v1/models", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the stub server did not start"
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def bodies(self) -> list[dict]:
        return [json.loads(line) for line in self.record.read_text().splitlines()] if self.record.exists() else []


@pytest.fixture
def stub(tmp_path):
    s = Stub(tmp_path)
    yield s
    s.kill()


def tab(session: str = "tab") -> SimpleNamespace:
    return SimpleNamespace(session_hash=session, headers={})


async def _until(cond, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        await asyncio.sleep(0.02)
    return value


async def turn(h, history: list, message: str, session: str = "tab", stop_after_text: bool = False,
               kill=None) -> tuple[list, dict]:
    """One turn as the page runs it: Send (start), polls until the reply ended (Stop or ``kill()`` once text
    came, when asked), commit. Returns the chatbot after the commit and the last poll's reply."""
    shown, box, _rid = await h.chat.start(message, history, tab(session), temperature=0.0, top_p=1.0,
                                          max_new_tokens=64)
    assert box == "" and shown[-1] == {"role": "user", "content": message}
    if stop_after_text or kill is not None:
        await _until(lambda: json.loads(h.poll(session))["chat"]["text"], "the first text")
        if kill is not None:
            kill()
        else:
            await h.chat.stop(tab(session))
    live = await _until(lambda: (c := json.loads(h.poll(session))["chat"]) and c["final"] and c, "the reply's end")
    chatbot, _send = h.chat.commit(tab(session))
    assert isinstance(chatbot, list) and chatbot[:len(history)] == history
    return chatbot, live


async def refresh_until(h, cond, what: str, timeout: float = 30.0) -> tuple:
    deadline = time.monotonic() + timeout
    while True:
        out = await h.refresh()
        if cond(out):
            return out
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}: {out[:2]}"
        await asyncio.sleep(0.2)


def test_failed_and_stopped_turns_never_reach_a_later_request_and_the_notice_follows_the_server(stub):
    async def run():
        client = RemoteClient(stub.url)
        backend = RemoteBackend(client, up_probe_s=1.0, down_probe_s=0.2)
        await backend.probe(timeout=2)  # as app.py does at start: the server is not up yet
        demo = build_remote_app(client, MetricsScraper([stub.url], timeout=5), refresh_s=0.2, backend=backend)
        h = demo.cbp_remote
        header, notice, *_ = await h.refresh()
        assert "model not known yet" in header and notice["visible"]
        assert notice["value"].startswith("⚠️ The server does not answer at http://127.0.0.1:")

        stub.start()  # comes up after the page: header and notice follow, without a restart
        # the notice follows the backend's probe, the counters the next scrape of /metrics (one refresh later at most)
        header, notice, counters, *_ = await refresh_until(h, lambda o: not o[1]["visible"] and "(vllm)" in o[2],
                                                           "notice gone and the counters read")
        assert "model `stub-model`" in header
        assert "model `stub-model`" in h.header()  # what a new tab's load shows

        good, live = await turn(h, [], "hello")
        assert live["state"] == "finished" and good[-1]["content"] == "Hello from the stub"
        history, live = await turn(h, good, "REFUSE: a very long question")
        assert live["state"] == "failed" and live["text"].startswith("⚠️ The server refused the request (HTTP 400)")
        assert "maximum context length is 8 tokens" in live["text"]  # the technical text, after the sentence
        history, live = await turn(h, history, "DROP it")
        assert live["state"] == "failed" and "Hello from" in live["text"]  # the text before the drop stays shown
        assert "The server closed the connection in the middle of the reply" in live["text"]
        assert "RemoteProtocolError" in live["text"]
        history, live = await turn(h, history, "SLOW please", stop_after_text=True)
        assert live["state"] == "stopped" and history[-2]["metadata"]["id"] == "cbp-stopped"
        history, live = await turn(h, history, "SLOW again", kill=stub.kill)  # the server dies mid-reply
        assert live["state"] == "failed" and "crashed or restarted" in live["text"]
        header, notice, *_ = await refresh_until(h, lambda o: o[1]["visible"], "the notice says it is down")
        assert "does not answer" in notice["value"]
        history, live = await turn(h, history, "anyone there?")
        assert live["state"] == "failed" and live["text"].startswith("⚠️ The server does not answer")

        stub.start()  # back on the same port
        await refresh_until(h, lambda o: not o[1]["visible"], "notice gone after the restart")
        # Clear while a reply streams (another tab): nothing of that turn is written back
        await h.chat.start("SLOW, then cleared", [], tab("other"), temperature=0.0)
        await _until(lambda: json.loads(h.poll("other"))["chat"]["text"], "the first text")
        cleared = await h.chat.clear(tab("other"))
        await asyncio.sleep(0.3)
        assert cleared[:2] == ([], "") and json.loads(h.poll("other"))["chat"] is None
        assert h.chat.commit(tab("other"))[0] == {"__type__": "update"}
        other, _ = await turn(h, [], "fresh start", session="other")

        final, live = await turn(h, history, "the last question")
        assert live["state"] == "finished"
        return final, other

    final, other = asyncio.run(run())
    bodies = stub.bodies()
    assert [b["messages"][-1]["content"] for b in bodies] == [
        "hello", "REFUSE: a very long question", "DROP it", "SLOW please", "SLOW again", "SLOW, then cleared",
        "fresh start", "the last question"]  # (none while the server was down: it never arrived)
    by_last = {b["messages"][-1]["content"]: b["messages"] for b in bodies}
    assert by_last["the last question"] == [{"role": "user", "content": "hello"},
                                            {"role": "assistant", "content": "Hello from the stub"},
                                            {"role": "user", "content": "the last question"}]
    assert by_last["fresh start"] == [{"role": "user", "content": "fresh start"}]  # Clear left nothing behind
    for body in bodies:  # no error text, stop marker or earlier failed prompt in any request
        earlier = body["messages"][:-1]
        assert not [m for m in earlier if any(k in m["content"] for k in MARKERS)], earlier
    assert [m["role"] for m in final].count("user") == 7 and [m["role"] for m in other].count("user") == 1


def test_the_page_serves_its_live_channel(stub):
    """The page's routes as the browser uses them: the poll answers the tab's reply, the script is served."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    stub.start()
    client = RemoteClient(stub.url)
    demo = build_remote_app(client, MetricsScraper([stub.url], timeout=5), refresh_s=1.0)
    app = FastAPI()
    app.include_router(demo.cbp_router)
    with TestClient(app) as http:
        assert http.get("/cbp/live").status_code == 400
        assert http.get("/cbp/live", params={"session": "s"}).json() == {"chat": None, "refresh": 0.25}
        assert "cbp/live" in http.get("/cbp/live.js").text
        assert http.post("/cbp/bye", params={"session": "s"}).status_code == 204
    assert os.path.exists(STUB)
