"""The app end to end on the real embedded model: concurrent gradio_client chats, Stop and a client that
goes away, and a headless browser (Debian's chromium) with two contexts chatting at once.

One engine and one server for the module (loading the model takes 15-60 s on CPU); every wait is bounded.
Set ``CBP_TEST_MODEL`` to run them on another model than the embedded one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from tests._browser import CHROMIUM, CHROMIUM_FLAGS, serve, wait

PROMPTS = ["Write a long story about a dragon who learns to bake bread.",
           "Write a long poem about the ocean at night.",
           "Explain in detail how a steam engine works.",
           "Describe a busy market in Seoul in great detail."]



@pytest.fixture(scope="module")
def live_app():
    """The playground on a loopback port: ``url``, ``engine``, ``demo``."""
    async_engine = pytest.importorskip("engine.async_engine", reason="the engine is not there yet")
    gradio_client = pytest.importorskip("gradio_client")
    from ui.layout import build_app

    engine = async_engine.AsyncEngine.from_args(model=os.environ.get("CBP_TEST_MODEL") or None,
                                                max_num_seqs=8, num_blocks=256, block_size=16)
    demo = build_app(engine, refresh_s=0.5)
    url = serve(demo)
    yield SimpleNamespace(url=url, engine=engine, demo=demo, Client=gradio_client.Client)
    demo.close()
    engine.shutdown()


def _chat_ids_running(snap) -> set[str]:
    return {s.request_id for s in snap.batch_slots if s.request_id and s.request_id.startswith("chat-")
            and s.phase in ("prefill", "decode")}



def test_four_clients_stream_concurrently(live_app):
    clients = [live_app.Client(live_app.url, verbose=False) for _ in range(4)]
    start_step = (live_app.engine.telemetry.latest().step if live_app.engine.telemetry.latest() else 0)
    stamps: dict[int, list[tuple[float, int]]] = {i: [] for i in range(4)}
    barrier = threading.Barrier(4)

    def run(i: int) -> None:
        barrier.wait(timeout=30)
        job = clients[i].submit(PROMPTS[i], [], 0.0, 1.0, 32, 0, api_name="/chat")
        for history, _box in job:
            reply = history[-1]["content"] if history else ""
            text = reply if isinstance(reply, str) else "".join(c.get("text", "") for c in reply)
            stamps[i].append((time.monotonic(), len(text)))

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not any(t.is_alive() for t in threads), "a chat did not finish within 240 s"
    growth = {i: [(ts, n) for ts, n in s if n > 0] for i, s in stamps.items()}
    assert all(len(g) >= 5 for g in growth.values()), {i: len(g) for i, g in growth.items()}
    first = max(g[0][0] for g in growth.values())
    last = min(g[-1][0] for g in growth.values())
    assert first < last, "the four replies did not stream at the same time"
    snaps = [s for s in live_app.engine.telemetry.snapshots() if s.step > start_step]
    assert max(len(_chat_ids_running(s)) for s in snaps) == 4, "telemetry never showed four chats in one step"
    for c in clients:
        c.close()


def _start_long_chat(live_app, client):
    """Submit a long reply and wait until it is running; returns (job, request id)."""
    chat = live_app.demo.cbp_chat
    job = client.submit("Write a very long essay about the history of Rome.", [], 0.0, 1.0, 400, 0,
                        api_name="/chat")
    assert wait(lambda: chat.busy(client.session_hash), timeout=120), "the chat never started"
    rid = chat.latest_request(client.session_hash)
    tel = live_app.engine.telemetry
    assert wait(lambda: tel.latest() and len(tel.latest().block_tables.get(rid, ())) > 0, timeout=120)
    return job, rid


def _assert_freed_within_a_few_steps(live_app, rid, step_at_stop):
    tel = live_app.engine.telemetry

    def freed():
        snap = tel.latest()
        return snap if rid not in snap.block_tables and all(s.request_id != rid for s in snap.batch_slots) else None

    snap = wait(freed, timeout=30)
    assert snap is not None, f"{rid} still holds blocks 30 s after it was stopped"
    print(f"{rid}: blocks freed {snap.step - step_at_stop} step(s) after the stop")
    assert snap.step - step_at_stop <= 3, f"blocks freed only {snap.step - step_at_stop} steps after the stop"
    assert rid in {r for s in tel.snapshots() for r in s.finished}
    owners = {r for o in snap.block_owners() for r in o}
    assert rid not in owners


def test_stop_frees_the_requests_blocks(live_app):
    client = live_app.Client(live_app.url, verbose=False)
    job, rid = _start_long_chat(live_app, client)
    client.predict(api_name="/stop")  # returns once the handler has called engine.abort
    _assert_freed_within_a_few_steps(live_app, rid, live_app.engine.telemetry.latest().step)
    wait(job.done, timeout=30)
    client.close()


def test_cancelled_job_frees_the_requests_blocks(live_app):
    client = live_app.Client(live_app.url, verbose=False)
    job, rid = _start_long_chat(live_app, client)
    job.cancel()  # gradio_client cancels through the event that cancels /chat (Stop): the stream is closed
    _assert_freed_within_a_few_steps(live_app, rid, live_app.engine.telemetry.latest().step)
    client.close()


CLIENT_SCRIPT = """
import sys
from gradio_client import Client
client = Client(sys.argv[1], verbose=False)
job = client.submit("Write a very long essay about the history of Rome.", [], 0.0, 1.0, 400, 0, api_name="/chat")
for n, _ in enumerate(job):
    if n == 3:
        print("streaming", flush=True)
"""


def test_client_that_goes_away_frees_the_requests_blocks(live_app):
    """A client process killed mid-reply: Gradio sees the stream close and the request is aborted."""
    tel = live_app.engine.telemetry
    before = set(tel.latest().block_tables) if tel.latest() else set()
    proc = subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT, live_app.url], stdout=subprocess.PIPE, text=True)
    try:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout=180)
        assert lines and lines[0].strip() == "streaming", "the client's chat did not stream within 180 s"
        new = wait(lambda: {r for r in tel.latest().block_tables if r.startswith("chat-")} - before, timeout=30)
        assert len(new) == 1, new
        rid = new.pop()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    killed_at = time.monotonic()
    gone = wait(lambda: rid not in tel.latest().block_tables, timeout=60, every=0.05)
    assert gone, f"{rid} still holds blocks 60 s after its client went away"
    print(f"{rid}: blocks freed {time.monotonic() - killed_at:.2f} s after its client was killed")
    assert rid in {r for s in tel.snapshots() for r in s.finished}


def _bot_text_len(page) -> int:
    """Characters of the reply the page streams now (``#live-reply-text``, filled by the page's polls)."""
    return page.evaluate("() => (document.querySelector('#live-reply-text') || {textContent: ''}).textContent.length")


def test_browser_two_contexts_chat_at_once_and_panels_render(request):
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium (or set CHROMIUM_PATH)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    live_app = request.getfixturevalue("live_app")  # only now: no model load for a skipped test
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        try:
            pages = []
            for _ in range(2):
                ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
                page = ctx.new_page()
                page.set_default_timeout(60_000)
                page.goto(live_app.url)
                page.wait_for_selector("#msg textarea")
                pages.append(page)
            for page, prompt in zip(pages, PROMPTS):
                page.fill("#msg textarea", prompt)
            tel = live_app.engine.telemetry
            sent_at = tel.latest().step if tel.latest() else 0  # earlier tests' chats are in the steps before
            for page in pages:  # send both at once
                page.locator("#msg textarea").press("Enter")
            seen: list[list[tuple[float, int]]] = [[], []]
            both = 0  # the most chat requests seen holding blocks at once while the replies stream

            def chats_holding_blocks(snap) -> int:
                if snap is None or snap.step <= sent_at:
                    return 0
                return len({r for r in snap.block_tables if r.startswith("chat-")})

            end = time.monotonic() + 180
            while time.monotonic() < end:
                both = max(both, chats_holding_blocks(tel.latest()))
                for i, page in enumerate(pages):
                    n = _bot_text_len(page)
                    if n and (not seen[i] or seen[i][-1][1] != n):
                        seen[i].append((time.monotonic(), n))
                if all(len(s) >= 4 for s in seen):
                    break
                time.sleep(0.1)
            assert all(len(s) >= 4 for s in seen), f"replies did not stream: {seen}"  # grew at least 4 times
            assert max(s[0][0] for s in seen) < min(s[-1][0] for s in seen), "the two replies did not overlap"
            # both replies held blocks at once (sampled while they streamed, and the engine's recent steps: on a
            # busy machine one reply may have ended by now, at EOS or its token limit)
            both = max([both, *(chats_holding_blocks(s) for s in tel.snapshots())])
            assert both == 2, f"{both} chat request(s) held blocks at once, not 2"
            for page in pages:
                for panel in ("#occupancy", "#blockmap"):
                    page.wait_for_selector(f"{panel} .js-plotly-plot .heatmaplayer image", state="attached")
            # closing the tabs aborts their replies (256 new tokens by default: still running here, unless a
            # slow machine took long to draw the panels)
            running = {r for r in tel.latest().block_tables if r.startswith("chat-")}
            for page in pages:
                page.context.close()
            gone = wait(lambda: not running & set(tel.latest().block_tables), timeout=60, every=0.2)
            assert gone, f"closed tabs still hold blocks: {running & set(tel.latest().block_tables)}"
        finally:
            browser.close()
