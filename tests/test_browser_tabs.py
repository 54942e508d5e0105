"""Many tabs of ONE browser (one Playwright context, as one person's Chromium): each tab streams a reply at
the same time while the load generator runs, and every tab's panels keep following the engine.

A browser opens at most 6 HTTP/1.1 connections to one host for all its tabs; separate contexts (separate
browsers) hide that limit, so this test keeps all pages in one context. Tiny random-weight model, 16 batch
slots, every wait bounded. Skipped when chromium or playwright is missing.
"""

from __future__ import annotations

import os
import time

import pytest

from tests._browser import CHROMIUM, CHROMIUM_FLAGS, serve, wait

if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium (or set CBP_CHROMIUM)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")

TABS = 8


def test_eight_tabs_of_one_browser_stream_at_once_with_live_panels(tiny_model, tokenizer):
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from ui.layout import build_app

    engine = AsyncEngine(EngineCore(EngineConfig(num_blocks=512, block_size=16, max_num_seqs=16),
                                    model=tiny_model, tokenizer=tokenizer))
    engine.set_min_step_time(0.02)  # the tiny model steps in a millisecond: keep replies long enough to overlap
    demo = build_app(engine, refresh_s=0.2)
    url = serve(demo)
    try:
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
            ctx = browser.new_context(viewport={"width": 1366, "height": 768})  # one profile, many tabs
            pages = []
            for _ in range(TABS):
                page = ctx.new_page()
                page.set_default_timeout(60_000)
                page.goto(url)
                pages.append(page)
            for page in pages:
                page.wait_for_function("() => window.cbpLive && window.cbpLive.lastDrawn")
            pages[0].click("#start-load")  # 16 synthetic chats at 4 per second beside the tabs' own
            for i, page in enumerate(pages):
                page.fill("#msg textarea", f"Tab {i}: tell me a long story.")
                page.click("#send")
            # every tab's reply streams (its text grows) and all of them at the same time
            grew: dict[int, list[float]] = {i: [] for i in range(TABS)}
            last = [0] * TABS
            end = time.monotonic() + 90
            while time.monotonic() < end and not all(len(g) >= 3 for g in grew.values()):
                for i, page in enumerate(pages):
                    n = page.evaluate("() => document.querySelector('#live-reply-text').textContent.length")
                    if n > last[i]:
                        last[i] = n
                        grew[i].append(time.monotonic())
                time.sleep(0.05)
            assert all(len(g) >= 3 for g in grew.values()), {i: len(g) for i, g in grew.items()}
            assert max(g[0] for g in grew.values()) < min(g[-1] for g in grew.values()), "the replies did not overlap"
            chats = {r for r in engine.telemetry.latest().block_tables if r.startswith("chat-")}
            assert len(chats) >= TABS - 1, chats  # (a reply may just have finished)
            # every tab's panels keep following the engine
            before = [page.evaluate("() => window.cbpLive.lastStep") for page in pages]
            time.sleep(1.5)
            after = [page.evaluate("() => window.cbpLive.lastStep") for page in pages]
            assert all(b > a for a, b in zip(before, after)), (before, after)
            assert all(page.locator("#occupancy .js-plotly-plot").count() == 1 for page in pages)
            # closing the tabs aborts their replies: their blocks return to the pool
            running = {r for r in engine.telemetry.latest().block_tables if r.startswith("chat-")}
            for page in pages:
                page.close()
            assert wait(lambda: not running & set(engine.telemetry.latest().block_tables), timeout=30), \
                running & set(engine.telemetry.latest().block_tables)
            browser.close()
    finally:
        demo.cbp_loadgen.stop()
        demo.close()
        engine.shutdown()
