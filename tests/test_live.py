"""The page's live channel (ui/live.py): what one poll returns, the streaming reply through polls and its
commit into the chatbot, closed tabs (goodbye and lease), per-tab views, and the page holding no state that
would open Gradio's per-tab heartbeat connection."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from engine.config import EngineConfig
from engine.telemetry import Telemetry
from tests.test_ui_figures import SEQ
from tests.test_ui_handlers import StubEngine, handlers, req
from ui.live import LiveChannel, markdown_line_html, pacing_line
from ui.loadgen import LoadGenerator
from ui.panel_table import PANELS, Panel
from ui.panels import Panels


def _channel(engine=None, lease_s=90.0):
    engine = engine or StubEngine()
    engine.telemetry = Telemetry(capacity=16)
    engine.step_count, engine.paused, engine.min_step_time = 0, False, 0.0
    panels = Panels(engine.telemetry, max_builds_per_s=100, num_slots=3, num_blocks=24)
    chat = handlers(engine, describe=panels.color_name, poll_s=0.01)
    return engine, chat, LiveChannel(engine, panels, chat, LoadGenerator(engine), lease_s=lease_s)


def test_a_poll_sends_figures_only_when_the_picture_changed():
    engine, _chat, live = _channel()
    engine.telemetry.record(SEQ[0])

    async def run():
        first = json.loads(await live.frame("s1", None))
        again = json.loads(await live.frame("s1", first["key"]))
        engine.telemetry.record(SEQ[1])
        newer = json.loads(await live.frame("s1", first["key"], shown={"rates"}))
        return first, again, newer

    first, again, newer = asyncio.run(run())
    assert set(first["figs"]) == {p.name for p in PANELS} >= {"occupancy", "blockmap", "rates"}
    assert first["figs"]["occupancy"]["data"] and first["figs"]["blockmap"]["data"]
    assert first["figs"]["rates"] is None  # the rates accordion is closed unless the tab asks
    assert "figs" not in again and again["key"] == first["key"]  # up to date: a few hundred bytes
    assert newer["key"] != first["key"] and newer["figs"]["rates"]["data"]
    assert [c["key"] for c in first["counters"]][:2] == ["running", "waiting"]
    assert first["pace"].startswith("▶") and first["chat"] is None and first["refresh"] > 0


def test_a_reply_streams_through_polls_and_is_committed_into_the_chatbot():
    gate = asyncio.Event()
    engine, chat, live = _channel(StubEngine("one two three", gate=gate))

    async def run():
        history, box, rid = await chat.start("hi", [], req("tab"), temperature=0.0, top_p=1.0, max_new_tokens=8)
        assert box == "" and rid.startswith("chat-") and history == [{"role": "user", "content": "hi"}]
        waiting = json.loads(await live.frame("tab", None))["chat"]
        assert waiting["rid"] == rid and not waiting["final"] and waiting["text"] == ""
        not_yet = chat.commit(req("tab"))  # the page commits only once the reply ended
        gate.set()
        for _ in range(3000):  # (30 s at most)
            frame = json.loads(await live.frame("tab", None))["chat"]
            if frame["final"]:
                break
            await asyncio.sleep(0.01)
        return rid, not_yet, frame, chat.commit(req("tab")), json.loads(await live.frame("tab", None))

    rid, not_yet, frame, committed, after = asyncio.run(run())
    assert not_yet[0] == {"__type__": "update"}
    assert frame["text"] == "one two three" and "Finished" in frame["title"] and rid in frame["title"]
    history, send = committed
    assert [m["role"] for m in history] == ["user", "assistant", "assistant"]  # message, status line, reply
    assert history[-1]["content"] == "one two three" and send["interactive"] is True
    assert after["chat"] is None and chat.latest_request("tab") == rid


def test_a_second_message_while_a_reply_streams_is_refused():
    gate = asyncio.Event()
    engine, chat, _live = _channel(StubEngine("a b", gate=gate))

    async def run():
        await chat.start("first", [], req("tab"), temperature=0.0, top_p=1.0, max_new_tokens=8)
        second = await chat.start("second", [], req("tab"), temperature=0.0, top_p=1.0, max_new_tokens=8)
        active = [chat.latest_request("tab")] if chat.busy("tab") else []
        gate.set()
        return second, active

    second, active = asyncio.run(run())
    assert second == ({"__type__": "update"},) * 3 and len(active) == 1


def test_goodbye_and_the_lease_abort_a_closed_tabs_reply():
    gate = asyncio.Event()
    engine, chat, live = _channel(StubEngine("x y", gate=gate), lease_s=5.0)

    async def run():
        live.open("a", is_host=True)
        live.open("b", is_host=False)
        _, _, rid_a = await chat.start("hi", [], req("a"), temperature=0.0, top_p=1.0, max_new_tokens=8)
        _, _, rid_b = await chat.start("hi", [], req("b"), temperature=0.0, top_p=1.0, max_new_tokens=8)
        await asyncio.sleep(0.05)  # both requests reach the engine
        live.bye("a")  # the page's beacon on close
        now = live.tabs["b"].last_seen
        assert live.reap(now + 1.0) == []  # polled a second ago: alive
        assert live.reap(now + 6.0) == ["b"]  # silent past the lease: taken as closed
        await asyncio.sleep(0.05)
        closed = list(engine.closed)  # their engine streams were closed before any token came: aborted
        gate.set()
        return rid_a, rid_b, closed

    rid_a, rid_b, closed = asyncio.run(run())
    assert sorted(closed) == sorted([rid_a, rid_b])
    assert live.tabs == {} and chat.latest_request("a") is None


def test_per_tab_views_and_host_rights():
    engine, _chat, live = _channel()
    live.open("host", is_host=True)
    assert live.is_host("host") and not live.is_host("guest")
    live.view("guest").pin = 7
    assert live.view("host").pin is None and live.view("guest").window == live.window
    eng = SimpleNamespace(step_count=9, paused=True, min_step_time=0.0, until_condition=None)
    assert "pinned at step 7" in pacing_line(eng, 7, "en")
    assert markdown_line_html("a **b** <c>") == "a <b>b</b> &lt;c&gt;"


def test_the_page_opens_no_heartbeat_connection():
    """gr.State or an unload event makes Gradio hold a heartbeat connection open per tab (the sixth tab of
    one browser then waits): the page has neither."""
    import gradio as gr

    from ui.layout import build_app

    engine, _chat, _live = _channel()
    engine.config = EngineConfig(max_num_seqs=3, num_blocks=24, block_size=4, policy="continuous", max_model_len=96)
    demo = build_app(engine)
    config = demo.get_config_file()
    assert config["connect_heartbeat"] is False
    assert not [b for b in demo.blocks.values() if isinstance(b, gr.State)]
    assert demo.cbp_router is not None and "cbp/live.js" in demo.cbp_head


def test_in_slow_motion_a_tab_is_sent_every_step_in_turn():
    """Paused or in slow motion, a tab that drew step n gets step n + 1 (and how far it is behind), so no step
    goes undrawn; at full speed it gets the newest step."""
    engine, _chat, live = _channel()
    for s in SEQ:
        engine.telemetry.record(s)

    async def frames(**kw):
        return json.loads(await live.frame("s1", None, **kw))

    engine.min_step_time = 0.5
    one = asyncio.run(frames(after=1))
    assert (one["drawn"], one["behind"], one["every"]) == (2, 1, True) and one["figs"]["occupancy"]["data"]
    assert list(one["figs"]["occupancy"]["data"][0]["x"]) == [1, 2]  # the window ends at step 2
    two = asyncio.run(frames(after=2))
    assert (two["drawn"], two["behind"]) == (3, 0)
    engine.min_step_time, engine.paused = 0.0, True  # paused: Step presses are played one by one too
    assert asyncio.run(frames(after=1))["drawn"] == 2
    engine.paused = False  # full speed: only the newest step counts
    fast = asyncio.run(frames(after=1))
    assert (fast["drawn"], fast["behind"], fast["every"]) == (3, 0, False)


def test_a_poll_may_wait_for_the_next_step_and_the_template_comes_once():
    engine, _chat, live = _channel()
    engine.telemetry.record(SEQ[0])
    engine.telemetry.record(SEQ[1])

    async def run():
        async def later():
            await asyncio.sleep(0.05)
            engine.telemetry.record(SEQ[2])

        task = asyncio.create_task(later())
        t0 = asyncio.get_running_loop().time()
        f = json.loads(await live.frame("s1", None, after=2, wait=5.0, template=True))
        await task
        return f, asyncio.get_running_loop().time() - t0

    f, took = asyncio.run(run())
    assert f["drawn"] == 3 and took < 0.9  # answered when step 3 existed (the wait is at most 1 s anyway)
    assert f["template"]["layout"] and "template" not in f["figs"]["occupancy"]["layout"]
    anonymous = json.loads(asyncio.run(live.frame("", None)))  # before the page's load event named the tab
    assert anonymous["figs"]["occupancy"]["data"] and anonymous["chat"] is None and anonymous["mine"] == ""
    assert "" not in live.tabs


def test_lines_name_requests_by_colour_and_letter_with_the_id_on_hover():
    _engine, _chat, live = _channel()
    html_a = live.panels.request_html("chat-1a2b", "en")
    assert 'title="chat-1a2b"' in html_a and ">blue A</span>" in html_a and "background:#3C87FF" in html_a
    assert live.panels.label("chat-1a2b", "ko") == "파랑 A" and live.panels.label("load-9", "en") == "orange B"
    line = pacing_line(SimpleNamespace(step_count=3, paused=True, min_step_time=0.0, until_condition=None), None, "en")
    assert line.startswith("‖ **Engine paused** after step 3:")
    refs = ['<span title="x">red D</span>']
    assert markdown_line_html("**slot 2**: \x000\x00 <b>", refs) == '<b>slot 2</b>: <span title="x">red D</span> &lt;b&gt;'


def test_the_page_loads_plotlys_cartesian_bundle_of_the_plotly_packages_version():
    """ui/static holds plotly.js's cartesian partial bundle (the panels use heatmap and scatter traces only):
    the same plotly.js version as the full bundle the ``plotly`` package ships, so figures built by plotly.py
    draw the same."""
    import re
    from pathlib import Path

    import plotly

    from ui import live

    def version(path: Path) -> str:
        return re.search(r"v(\d+\.\d+\.\d+)", path.read_text(encoding="utf-8", errors="replace")[:300]).group(1)

    full = Path(plotly.__file__).with_name("package_data") / "plotly.min.js"
    assert live._plotly_js_path() == live.PLOTLY_CARTESIAN
    head = live.PLOTLY_CARTESIAN.read_text(encoding="utf-8")[:300]
    assert "cartesian" in head and version(live.PLOTLY_CARTESIAN) == version(full)
    assert live.PLOTLY_CARTESIAN.stat().st_size < full.stat().st_size / 2


def test_a_row_of_the_panel_table_is_a_panel_of_every_frame(monkeypatch):
    """A new panel is one row of ui.panel_table.PANELS: built from the same window, sent by name (a folded
    one only to a tab that shows it), with an element of that id on the page."""
    import ui.live
    import ui.panels
    from ui.page_markup import folded_html, live_html

    steps = Panel("steps", lambda f: {"data": [{"type": "bar", "y": [s.step for s in f.snaps]}], "layout": {}})
    folded = Panel("folded", lambda f: {"data": [], "layout": {}}, folded="rates")
    monkeypatch.setattr(ui.panels, "PANELS", (*PANELS, steps, folded))
    monkeypatch.setattr(ui.live, "FOLDED", ("rates", "folded"))
    engine, _chat, live = _channel()
    engine.telemetry.record(SEQ[0])
    engine.telemetry.record(SEQ[1])
    closed = json.loads(asyncio.run(live.frame("s1", None)))
    opened = json.loads(asyncio.run(live.frame("s2", None, shown={"folded"})))
    assert closed["figs"]["steps"]["data"][0]["y"] == [s.step for s in SEQ[:2]]
    assert closed["figs"]["folded"] is None and opened["figs"]["folded"] == {"data": [], "layout": {}}
    assert all(f'id="{p.name}"' in live_html() for p in PANELS if p.folded is None)
    assert 'data-folded' in folded_html("folded")
