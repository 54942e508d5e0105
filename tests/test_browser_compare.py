"""The Compare tab in a headless browser (Debian's chromium) at 1366x768, in English and in Korean: after
one run, both grids sit side by side and fully inside the screen without scrolling, each grid's plot area
fills at least 70% of its panel's height with the legend outside the grid, and under ko-KR the button,
headline, explanation and figure titles are Korean.

The whole app (``ui.layout.build_app``) runs on the tiny random model, so the module takes a few seconds.
Skipped when chromium or playwright is missing.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

from tests._browser import CHROMIUM, CHROMIUM_FLAGS, serve

if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium (or set CHROMIUM_PATH)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")

from engine.async_engine import AsyncEngine  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core import EngineCore  # noqa: E402
from ui import compare, i18n  # noqa: E402

WIDTH, HEIGHT = 1366, 768  # a projector / small laptop screen



@pytest.fixture(scope="module")
def app(tiny_model, tokenizer):
    """The playground on the tiny model at a loopback port: ``url``, ``runs`` (the classic preset's runs,
    for the expected headline)."""
    from ui.layout import build_app

    engine = AsyncEngine(EngineCore(EngineConfig(num_blocks=64, block_size=16, max_num_seqs=4), model=tiny_model,
                                    tokenizer=tokenizer))
    demo = build_app(engine, refresh_s=2.0)
    yield SimpleNamespace(url=serve(demo), runs=compare.run_compare(tiny_model, tokenizer, "classic"))
    demo.close()
    engine.shutdown()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        yield b
        b.close()


def _run_compare(browser, url: str, locale: str):
    """Open the page at 1366x768 in ``locale``, open the Compare tab, press Run and wait for both grids;
    returns the page."""
    ctx = browser.new_context(viewport={"width": WIDTH, "height": HEIGHT}, locale=locale)
    page = ctx.new_page()
    page.set_default_timeout(30_000)
    page.goto(url)
    page.click("button[role=tab][data-tab-id=compare]")
    page.click("#compare-run")
    for plot in ("#compare-static", "#compare-continuous"):
        page.wait_for_selector(f"{plot} .js-plotly-plot .heatmaplayer image", state="attached")
    page.wait_for_function("() => /\\d/.test(document.querySelector('#compare-summary').innerText)")
    page.wait_for_timeout(300)  # let Plotly finish its layout
    return page


def _assert_one_slide(page) -> None:
    """Both grids fully inside the 1366x768 viewport, without scrolling, side by side with equal sizes (read
    again for up to 30 s: on a loaded machine Plotly may take longer than the 300 ms to finish its layout)."""
    end = time.monotonic() + 30
    while True:
        try:
            return _check_one_slide(page)
        except AssertionError:
            if time.monotonic() > end:
                raise
            page.wait_for_timeout(200)


def _check_one_slide(page) -> None:
    assert page.evaluate("window.scrollY") == 0, "the page had to scroll"
    s = page.locator("#compare-static").bounding_box()
    c = page.locator("#compare-continuous").bounding_box()
    for box in (s, c):
        assert box["x"] >= 0 and box["y"] >= 0, box
        assert box["x"] + box["width"] <= WIDTH and box["y"] + box["height"] <= HEIGHT, (box, "below the screen")
        assert box["height"] >= 240, box  # a readable grid, not a collapsed box
    assert abs(s["y"] - c["y"]) < 2 and s["x"] + s["width"] <= c["x"], (s, c)  # side by side, static left
    assert abs(s["width"] - c["width"]) < 2 and abs(s["height"] - c["height"]) < 2, (s, c)
    headline = page.locator("#compare-summary").bounding_box()
    assert headline["y"] + headline["height"] <= s["y"], "the headline is not above the grids"
    for plot, box in (("#compare-static", s), ("#compare-continuous", c)):
        area = page.locator(f"{plot} .nsewdrag").first.bounding_box()  # the plot area (Plotly's drag layer)
        assert area["height"] >= 0.70 * box["height"], (plot, area, box)  # no band above a squashed grid
        legend = page.locator(f"{plot} .legend").first.bounding_box()
        assert legend["x"] >= area["x"] + area["width"], (plot, legend, area)  # the legend beside the grid
        assert legend["y"] >= box["y"] and legend["y"] + legend["height"] <= box["y"] + box["height"]


def test_english_compare_is_one_slide(app, browser):
    page = _run_compare(browser, app.url, "en-US")
    try:
        _assert_one_slide(page)
        assert page.inner_text("#compare-run").strip() == i18n.EN["cmp_run"]
        headline = page.inner_text("#compare-summary").strip()
        assert headline == compare.headline_markdown(app.runs, "en").removeprefix("### ")
        assert "tokens/s" not in page.inner_text("#compare-static")
        assert "static: 9 steps" in page.text_content("#compare-static .gtitle")
    finally:
        page.context.close()


def test_korean_compare_is_one_slide_in_korean(app, browser):
    page = _run_compare(browser, app.url, "ko-KR")
    try:
        _assert_one_slide(page)
        assert page.inner_text("#compare-run").strip() == i18n.KO["cmp_run"]
        headline = page.inner_text("#compare-summary").strip()
        assert headline == compare.headline_markdown(app.runs, "ko").removeprefix("### ")
        assert "스텝" in headline and "steps" not in headline
        assert page.inner_text("#compare-note").strip().startswith("새 엔진 두 개가")
        assert page.input_value("#compare-preset input") == i18n.KO["cmp_preset_classic"]
        assert page.text_content("#compare-static .gtitle").startswith("정적 배칭: ")
        assert page.text_content("#compare-continuous .xtitle") == "엔진 스텝"
        assert page.inner_text("button[role=tab][data-tab-id=compare]").strip() == i18n.KO["tab_compare"]
    finally:
        page.context.close()
