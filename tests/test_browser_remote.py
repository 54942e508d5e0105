"""Remote mode's page in a real browser (Debian's chromium, Playwright) at 1366x768, in front of the stub OpenAI
server of ``tests/test_remote_replies.py``: a reply streams through the tab's polls and is committed into the
chat, a refused one shows its sentence and never reaches the next request, Clear empties the chat while a reply
streams, the counters table fits its column, and the KV map's "off" note is wrapped with no HTML entities.
Skipped when chromium or playwright is missing; every wait is bounded.
"""

from __future__ import annotations

import os

import pytest

from tests._browser import CHROMIUM, CHROMIUM_FLAGS, free_port, wait
from tests.test_remote_replies import Stub

if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium (or set CHROMIUM_PATH)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")

CHAT_TEXT = "() => document.querySelector('#chatbot').innerText"


def test_the_remote_page_in_a_browser(tmp_path):
    from ui.remote.client import RemoteClient
    from ui.remote.metrics import MetricsScraper
    from ui.remote.page import build_remote_app, launch_remote

    stub = Stub(tmp_path)
    stub.start()
    demo = build_remote_app(RemoteClient(stub.url), MetricsScraper([stub.url], timeout=5), refresh_s=1.0)
    port = free_port()
    launch_remote(demo, server_name="127.0.0.1", server_port=port, quiet=True)
    try:
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
            page = browser.new_context(viewport={"width": 1366, "height": 768}).new_page()
            page.set_default_timeout(30_000)
            page.goto(f"http://127.0.0.1:{port}/")
            page.wait_for_selector("#msg textarea")
            page.wait_for_function("() => document.querySelector('[data-cbp-session]')")

            def send(text: str) -> None:
                page.fill("#msg textarea", text)
                page.locator("#msg textarea").press("Enter")

            send("hello")
            page.wait_for_function(f"() => ({CHAT_TEXT})().includes('Hello from the stub')")
            send("REFUSE this")
            page.wait_for_function(f"() => ({CHAT_TEXT})().includes('The server refused the request (HTTP 400)')")
            send("and now?")
            assert wait(lambda: len(stub.bodies()) == 3, timeout=30)
            assert [m["content"] for m in stub.bodies()[-1]["messages"]] == ["hello", "Hello from the stub", "and now?"]
            page.wait_for_function(f"() => ({CHAT_TEXT})().split('Hello from the stub').length > 2")

            send("SLOW, then Clear")  # Clear while it streams: the chat empties and stays empty
            page.wait_for_function("() => document.querySelector('#live-reply-text').textContent.length > 0")
            page.wait_for_function(f"() => ({CHAT_TEXT})().includes('SLOW, then Clear')")  # as the person sees it
            page.click("#clear")
            page.wait_for_timeout(1500)
            assert "Hello from the stub" not in page.evaluate(CHAT_TEXT)
            assert page.evaluate("() => document.querySelector('#live-reply').hidden")

            page.wait_for_function("() => (document.querySelector('#remote-counters') || {}).textContent"
                                   "?.includes('(vllm)')")
            box = page.evaluate("""() => {
              const area = document.querySelector('#remote-counters-area');
              const t = document.querySelector('#remote-counters').getBoundingClientRect();
              return {table: t.right, column: area.getBoundingClientRect().right}; }""")
            assert box["table"] <= box["column"] + 1, box  # the KV-blocks row is not hidden past the column
            page.wait_for_selector("#remote-kv .annotation-text")
            note = page.evaluate("() => [...document.querySelectorAll('#remote-kv .annotation-text')]"
                                 ".map(a => [a.textContent, a.querySelectorAll('tspan.line').length])")
            assert note and "KV map off" in note[0][0] and "&quot;" not in note[0][0] and note[0][1] >= 2, note
            browser.close()
    finally:
        demo.close()
        stub.kill()
