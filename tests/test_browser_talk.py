"""Talk mode in a real browser (Debian's chromium, Playwright): pause, single step, slow motion and the
timeline from the page; every chat's status line in its own bubble; one request per Send however often it is
clicked; pacing restricted to the host when a host key is set.

The app runs on a tiny random-weight model (fast to load, fast steps) with two batch slots; every wait is
bounded. Skipped when chromium or playwright is missing.
"""

from __future__ import annotations

import os
import re
import time
from types import SimpleNamespace

import pytest

from tests._browser import CHROMIUM, CHROMIUM_FLAGS, serve, wait

if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium (or set CHROMIUM_PATH)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")


@pytest.fixture(scope="module")
def talk(tiny_model, tokenizer):
    """One engine (2 slots) served twice: an open page (``url``) and one with a host key (``hosted``)."""
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from ui.layout import build_app

    engine = AsyncEngine(EngineCore(EngineConfig(num_blocks=96, block_size=4, max_num_seqs=2), model=tiny_model,
                                    tokenizer=tokenizer))
    demos, urls = [], []
    for key in (None, "s3cret"):
        demo = build_app(engine, refresh_s=0.25, host_key=key)
        urls.append(serve(demo))
        demos.append(demo)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        yield SimpleNamespace(engine=engine, demo=demos[0], url=urls[0], hosted=urls[1], browser=browser)
        browser.close()
    for demo in demos:
        demo.close()
    engine.resume()
    engine.shutdown()


def _page(talk, url=None, locale="en-US"):
    ctx = talk.browser.new_context(viewport={"width": 1366, "height": 768}, locale=locale)
    page = ctx.new_page()
    page.set_default_timeout(30_000)
    page.goto(url or talk.url)
    page.wait_for_selector("#msg textarea")
    page.wait_for_selector("#occupancy .js-plotly-plot")
    return page


# the conversation as shown: the chatbot's finished turns and the reply streaming below it (ui/live.py)
CHAT_TEXT = ("(document.querySelector('#chatbot').innerText + '\\n' + "
             "(document.querySelector('#live-reply:not([hidden])') || {innerText: ''}).innerText)")


def _chat_text(page) -> str:
    return page.evaluate(f"() => {CHAT_TEXT}")


def _wait_chat(page, pattern: str, timeout: float = 30_000) -> None:
    """Wait until the conversation shown matches the JS regular expression ``pattern``."""
    page.wait_for_function(f"() => /{pattern}/.test({CHAT_TEXT})", timeout=timeout)


def _send(page, text: str) -> None:
    page.fill("#msg textarea", text)
    page.click("#send")


def test_pause_step_and_the_status_line_follow_one_request(talk):
    engine, chat = talk.engine, talk.demo.cbp_chat
    page = _page(talk)
    try:
        page.click("#pause")
        assert wait(lambda: engine.paused), "Pause did not pause the engine"
        page.wait_for_selector("#pace-status:has-text('Engine paused')")
        _send(page, "Hello, who are you?")
        # queued while paused: the reply's own bubble says so, Send is disabled meanwhile
        _wait_chat(page, "Queued: 1 of 1")
        assert "engine paused" in _chat_text(page)
        assert page.locator("#send").is_disabled()
        rid = wait(lambda: [s.request_id for s in chat.replies.values() if not s.ended])[0]
        before = engine.step_count
        for k in (1, 2, 3):  # one press, one engine step
            page.click("#step")
            assert wait(lambda k=k: engine.step_count == before + k), (engine.step_count, before + k)
            # the pace line answers the press itself: the new step shows without waiting for a refresh
            page.wait_for_selector(f"#pace-status:has-text('after step {before + k}:')", timeout=10_000)
            time.sleep(0.3)
            assert engine.step_count == before + k, "a Step press ran more than one step"
        _wait_chat(page, "Decoding: \\d+ tokens")
        # the tab names its own request by colour and letter (its id on hover); the panels outline it
        page.wait_for_selector(f"#mine .cbp-req[title='{rid}']")
        mine = page.inner_text("#mine")
        label = talk.demo.cbp_panels.label(rid)
        assert re.fullmatch(r"[a-z ]+ [A-Z]", label) and f"Your request: {label}" in mine and rid not in mine, mine
        assert f"your request · {label}" in _chat_text(page)
        page.wait_for_function(
            "() => [...document.querySelectorAll('#occupancy .legendtext')].some(e => e.textContent.includes('your'))")
        # the timeline: look 2 steps back pins the panels
        box = page.locator("#look-back input[type=number]")
        box.fill("2")
        box.press("Enter")
        page.wait_for_selector("#pace-status:has-text('pinned at step')")
        pinned = int(re.search(r"pinned at step (\d+)", page.inner_text("#pace-status")).group(1))
        assert pinned == engine.step_count - 2
        box.fill("0")
        box.press("Enter")
        page.wait_for_function("() => !document.querySelector('#pace-status').innerText.includes('pinned')")
        page.click("#resume")
        assert wait(lambda: not engine.paused)
        _wait_chat(page, "Finished", timeout=60_000)
        assert wait(lambda: not page.locator("#send").is_disabled()), "Send stayed disabled after the reply"
    finally:
        engine.resume()
        page.context.close()


def test_double_click_on_send_starts_one_request(talk):
    engine, chat = talk.engine, talk.demo.cbp_chat
    page = _page(talk)
    try:
        engine.pause()
        page.fill("#msg textarea", "Tell me a story.")
        page.dblclick("#send")
        _wait_chat(page, "Queued")
        page.fill("#msg textarea", "And another one.")
        page.locator("#msg textarea").press("Enter")  # Enter while the reply waits: refused, visibly
        page.wait_for_selector("text=A reply is still streaming")
        assert page.input_value("#msg textarea") == "And another one."  # the text stays in the box
        time.sleep(1.0)
        ids = [s.request_id for s in chat.replies.values() if not s.ended]
        assert len(ids) == 1, f"hidden requests: {ids}"
        assert wait(lambda: [r for r in engine.telemetry.queue if r.startswith("chat-")] == ids)
        page.click("#stop")  # stopped while paused: the status says so and the queue is empty again
        _wait_chat(page, "Stopped")
        assert wait(lambda: not [r for r in engine.telemetry.queue if r.startswith("chat-")])
        assert wait(lambda: not page.locator("#send").is_disabled())
    finally:
        engine.resume()
        page.context.close()


def test_slow_motion_from_the_page(talk):
    engine = talk.engine
    page = _page(talk)
    try:
        box = page.locator("#slow-motion input[type=number]")
        box.fill("0.4")
        box.press("Enter")
        assert wait(lambda: abs(engine.min_step_time - 0.4) < 1e-9), engine.min_step_time
        page.wait_for_selector("#pace-status:has-text('slow motion: 0.40 s per step')")
        box.fill("0")
        box.press("Enter")
        assert wait(lambda: engine.min_step_time == 0.0)
    finally:
        engine.set_min_step_time(0.0)
        page.context.close()


def test_pacing_is_for_the_host_when_a_host_key_is_set(talk):
    engine = talk.engine
    guest = _page(talk, talk.hosted)
    host = _page(talk, talk.hosted + "?host=s3cret")
    try:
        assert wait(lambda: guest.locator("#pause").is_disabled()), "a guest page can pause"
        assert guest.locator("#start-load").is_disabled() and guest.locator("#step").is_disabled()
        assert not engine.paused
        assert wait(lambda: not host.locator("#pause").is_disabled())
        host.click("#pause")
        assert wait(lambda: engine.paused)
        guest.wait_for_selector("#pace-status:has-text('Engine paused')")  # everyone sees it
        host.click("#resume")
        assert wait(lambda: not engine.paused)
    finally:
        engine.resume()
        guest.context.close()
        host.context.close()
