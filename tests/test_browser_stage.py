"""The page as a presenter and a room meet it, in a real browser (Debian's chromium, Playwright) at 1366x768:
the talk preset from the page (4 slots, 96 blocks, MRU, cells of at least 14 px), lines that name requests by
colour and letter (ids on hover only), distinct colours for the requests holding slots, a fixed layout (the
panels and their legends do not move whatever the pace line says), and hover text that neither comes from
the ▷ marker nor covers the cells.

The app runs on a tiny random-weight model with the load generator; every wait is bounded. Skipped when
chromium or playwright is missing.
"""

from __future__ import annotations

import os
import re
from types import SimpleNamespace

import pytest

from tests._browser import CHROMIUM, CHROMIUM_FLAGS, serve, wait

if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium (or set CHROMIUM_PATH)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")

from engine.options import TALK_PRESET  # noqa: E402
from ui import figures as F  # noqa: E402
from ui.talk import TALK_WINDOW  # noqa: E402

# the figure's plot area and cells as drawn: Plotly's own layout numbers of the occupancy panel
CELLS_JS = """() => { const gd = document.querySelector('#occupancy .js-plotly-plot'); const L = gd._fullLayout;
  const [x0, x1] = L.xaxis.range, [y0, y1] = L.yaxis.range;
  return {w: L._size.w / (x1 - x0), h: L._size.h / Math.abs(y1 - y0), rows: gd.data[0].y.length}; }"""
# per step (column) of the occupancy heatmap: the requests holding slots and their colour codes
COLUMNS_JS = """() => { const h = document.querySelector('#occupancy .js-plotly-plot').data[0];
  return h.x.map((step, i) => h.z.map((row, s) => row[i] === null ? null :
    [h.customdata[s][i][0], row[i] % %K%]).filter(Boolean)); }"""


@pytest.fixture(scope="module")
def stage(tiny_model, tokenizer):
    """The playground on the tiny model, 8 slots and 192 blocks (not the talk preset) at a loopback port."""
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from ui.layout import build_app

    engine = AsyncEngine(EngineCore(EngineConfig(num_blocks=192, block_size=16, max_num_seqs=8), model=tiny_model,
                                    tokenizer=tokenizer))
    demo = build_app(engine, refresh_s=0.2)
    url = serve(demo)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        yield SimpleNamespace(engine=engine, demo=demo, url=url, browser=browser)
        browser.close()
    demo.cbp_loadgen.stop()
    demo.close()
    engine.resume()
    engine.shutdown()


def _page(stage, locale="en-US"):
    ctx = stage.browser.new_context(viewport={"width": 1366, "height": 768}, locale=locale)
    page = ctx.new_page()
    page.set_default_timeout(30_000)
    page.goto(stage.url)
    page.wait_for_selector("#occupancy .js-plotly-plot")
    page.wait_for_function("() => document.querySelector('[data-cbp-session]').dataset.cbpSession")
    return page


def _talk(stage, page) -> None:
    """Press the page's Talk preset (once it is applied, pressing again keeps it) and load the engine."""
    page.click("#talk-preset")
    assert wait(lambda: stage.engine.config.max_num_seqs == TALK_PRESET["max_num_seqs"]), stage.engine.config
    page.wait_for_function(f"() => document.querySelector('#occupancy .js-plotly-plot').data[0].y.length === "
                           f"{TALK_PRESET['max_num_seqs']}")
    stage.engine.set_min_step_time(0.05)
    if not stage.demo.cbp_loadgen.stats.run or not stage.engine.telemetry.queue:
        page.click("#start-load")
    assert wait(lambda: (stage.engine.telemetry.latest() or SimpleNamespace(num_running=0)).num_running >= 4)


def test_the_talk_preset_from_the_page_gives_a_picture_a_room_can_read(stage):
    page = _page(stage)
    try:
        page.wait_for_selector("#engine-summary:has-text('8')")
        _talk(stage, page)
        cfg = stage.engine.config
        assert {k: getattr(cfg, k) for k in TALK_PRESET} == TALK_PRESET
        page.wait_for_selector(f"#engine-summary:has-text('{TALK_PRESET['num_blocks']}')")
        assert page.input_value("#window-steps input[type=number]") == str(TALK_WINDOW)
        page.wait_for_function(f"() => {{ const h = document.querySelector('#occupancy .js-plotly-plot').data[0];"
                               f" return h.x.length >= {TALK_WINDOW}; }}", timeout=60_000)
        cells = page.evaluate(CELLS_JS)
        assert cells["rows"] == 4 and cells["w"] >= 14 and cells["h"] >= 14, cells
        # the block map: 96 blocks in cells large enough for each owner's letter
        letters = page.evaluate("() => document.querySelectorAll('#blockmap .textpoint').length")
        assert letters > 0
    finally:
        page.context.close()


def test_pace_lines_name_requests_by_colour_and_letter_with_ids_on_hover(stage):
    page = _page(stage)
    try:
        _talk(stage, page)
        page.click("#next-handover")
        page.wait_for_selector("#pace-status:has-text('hand-over · slot')", timeout=60_000)
        line = page.inner_text("#pace-status")
        names = "|".join(re.escape(n) for n in F.PALETTE_NAMES["en"])
        m = re.search(rf"slot (\d+): ({names}) ([A-Z]) → ({names}) ([A-Z])", line)
        assert m, line
        assert "load-" not in line and "chat-" not in line  # no request id in what the room reads
        spans = page.evaluate("() => [...document.querySelectorAll('#pace-status .cbp-req')].map("
                              "s => [s.textContent, s.title])")
        assert [s[0] for s in spans] == [f"{m.group(2)} {m.group(3)}", f"{m.group(4)} {m.group(5)}"]
        assert all(re.match(r"(load|chat)-", title) for _, title in spans)  # the ids, on hover
        # the occupancy panel draws the new holder's letter and colour in that slot at that step
        slot, new_id = int(m.group(1)), spans[1][1]
        find = """([slot, rid]) => { const h = document.querySelector('#occupancy .js-plotly-plot').data[0];
            const c = h.customdata[slot].find(c => c && c[0] === rid); return c ? c[5] : null; }"""
        page.wait_for_function(find, arg=[slot, new_id])  # the panels reach that step (every step is played)
        assert page.evaluate(find, [slot, new_id]) == spans[1][0]
    finally:
        stage.engine.resume()
        page.context.close()


def test_requests_holding_slots_in_the_window_have_distinct_colours(stage):
    page = _page(stage)
    try:
        _talk(stage, page)
        for _ in range(5):  # a few windows as the engine runs
            page.wait_for_timeout(600)
            columns = page.evaluate(COLUMNS_JS.replace("%K%", str(F.K)))
            colour_of: dict[str, int] = {}
            for column in columns:
                codes = [c for _, c in column]
                assert len(codes) == len(set(codes)), column  # two running requests never share a colour
                for rid, code in column:
                    colour_of.setdefault(rid, code)
            assert len(colour_of) <= F.K and len(set(colour_of.values())) == len(colour_of), colour_of
    finally:
        page.context.close()


def test_the_panels_keep_their_place_whatever_the_lines_say_and_hover_never_covers_cells(stage):
    engine = stage.engine
    page = _page(stage)
    try:
        _talk(stage, page)
        page.evaluate("document.querySelector('#pacing').scrollIntoView({block: 'start'})")

        def boxes():
            """Top and height of the panels, their plot areas and legends, from the pacing row's top (the page
            may scroll when a control below the panels takes the focus)."""
            top = page.locator("#pacing").bounding_box()["y"]
            out = {}
            for sel in ("#pace-status", "#occupancy", "#blockmap", "#occupancy .nsewdrag", "#blockmap .nsewdrag",
                        "#occupancy .legend", "#blockmap .legend"):
                b = page.locator(sel).first.bounding_box()
                out[sel] = (round(b["y"] - top), round(b["height"]))
            return out

        page.wait_for_timeout(500)
        first = boxes()
        seen = [page.inner_text("#pace-status")]
        page.click("#pause")  # the pace lines differ in length: paused, a run-to's find, pinned, slow motion
        page.wait_for_selector("#pace-status:has-text('Engine paused')")
        assert boxes() == first
        page.click("#next-reuse")
        page.wait_for_selector("#pace-status:has-text('reuse · block')", timeout=60_000)
        seen.append(page.inner_text("#pace-status"))
        assert boxes() == first, seen
        box = page.locator("#look-back input[type=number]")
        box.fill("3")
        box.press("Enter")
        page.wait_for_selector("#pace-status:has-text('pinned at step')")
        seen.append(page.inner_text("#pace-status"))
        assert boxes() == first, seen
        box.fill("0")
        box.press("Enter")
        page.click("#resume")
        for _ in range(6):  # running: the block map's legend keeps its lines from step to step
            page.wait_for_timeout(300)
            assert boxes() == first
        # hover on a cell whose ▷ marks an admission: the cell's own text, in the line above the panels
        page.click("#next-handover")  # pauses on the step a request takes a slot
        page.wait_for_selector("#pace-status:has-text('hand-over · slot')", timeout=60_000)
        page.wait_for_function("(step) => { const h = document.querySelector('#occupancy .js-plotly-plot').data[0];"
                               " return h.x[h.x.length - 1] >= step; }", arg=engine.step_count)  # that step drawn
        page.wait_for_timeout(300)
        at = page.evaluate("""() => { const gd = document.querySelector('#occupancy .js-plotly-plot');
            const m = gd.data[1]; if (!m.x.length) return null; const L = gd._fullLayout;
            const b = gd.querySelector('.nsewdrag').getBoundingClientRect();
            return [b.left + L.xaxis.l2p(m.x[0]), b.top + L.yaxis.l2p(m.y[0])]; }""")
        assert at is not None, "no admission in the window"
        page.mouse.move(at[0], at[1])
        page.wait_for_function("() => document.querySelector('#cbp-hover').innerText.length > 0")
        hover = page.inner_text("#cbp-hover")
        assert "took its slot" in hover and "admitted:" not in hover, hover
        assert page.evaluate("() => getComputedStyle(document.querySelector('#occupancy .hoverlayer')).display") == "none"
        cbp = page.locator("#cbp-hover").bounding_box()
        assert cbp["y"] + cbp["height"] <= page.locator("#occupancy").bounding_box()["y"] + 1  # above the panels
    finally:
        engine.resume()
        page.context.close()


def test_a_folded_panel_is_drawn_once_its_accordion_opens(stage):
    """The rates panel (a folded row of ui.panel_table.PANELS) is asked for and drawn only once its accordion
    is open, then follows the engine like the others."""
    page = _page(stage)
    try:
        stage.engine.set_min_step_time(0.05)
        if not stage.demo.cbp_loadgen.stats.run:
            page.click("#start-load")
        assert page.evaluate("() => !document.querySelector('#rates .js-plotly-plot')")
        from ui.i18n import EN

        page.get_by_text(EN["rates"]).first.click()
        page.wait_for_selector("#rates .js-plotly-plot")
        first = page.evaluate("() => window.cbpLive.drawn.rates")
        page.wait_for_function(f"() => window.cbpLive.drawn.rates > {first}")
    finally:
        page.context.close()
