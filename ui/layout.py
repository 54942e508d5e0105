"""The page: chat column (chat, sampling, load generator) beside the live panels (talk-mode controls,
slot occupancy, block map, timeline, counters, rates) and a "how it works" note. One :func:`build_app` per
engine, built from named parts: the header, the chat column, the load generator, the talk controls, the
panels column, the Compare tab and the events. What the controls do is :class:`ui.page_actions.PageActions`
(the chat's :class:`ui.chat.ChatHandlers`); the markup and style are :mod:`ui.page_markup`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gradio as gr

from engine import AsyncEngine
from ui.chat import ChatHandlers
from ui.chat_column import chat_column, chat_hidden, wire_chat
from ui.compare import build_compare_tab
from ui.engine_backend import EngineBackend
from ui.i18n import I18N, t
from ui.live import LiveChannel, head_html
from ui.loadgen import LoadGenerator
from ui.page_actions import PageActions, engine_summary, is_host_page, lang_of  # noqa: F401  (re-exported)
from ui.page_markup import CSS, counters_html, folded_html, live_html, session_html
from ui.panel_table import PANELS
from ui.panels import Panels
from ui.queue_polling import quiet_queue

CHAT_TEXTS = ("chat", "placeholder", "send", "stop", "clear", "sampling", "temperature", "top_p", "max_new_tokens",
              "seed")  # the chat column's labels (ui.i18n keys)


@dataclass
class LoadControls:
    """The load generator's controls."""

    n_chats: gr.Slider
    rate: gr.Slider
    start: gr.Button
    stop: gr.Button


@dataclass
class TalkControls:
    """The pacing row above the panels (host-only when a host key is set), in the page's order."""

    pause: gr.Button
    resume: gr.Button
    step: gr.Button
    handover: gr.Button
    reuse: gr.Button
    talk: gr.Button


@dataclass
class PanelControls:
    """The live area's session mark and the sliders under the panels."""

    session_area: gr.HTML
    slow: gr.Slider
    window_steps: gr.Slider
    look_back: gr.Slider
    live_box: gr.Checkbox


def build_app(
    engine: AsyncEngine,
    *,
    model_name: str | None = None,
    refresh_s: float = 0.2,
    window: int = 48,
    max_builds_per_s: float = 4.0,
    host_key: str | None = None,
    notice: str | None = None,
) -> gr.Blocks:
    """The Gradio Blocks app for ``engine`` (an ``AsyncEngine``).

    Args:
        engine: the process's engine; the UI uses ``generate``, ``abort``, ``config``, ``telemetry`` and the
            pacing methods (``pause``, ``resume``, ``step_once``, ``set_min_step_time``).
        model_name: shown in the header (default: ``engine.config.model`` or the embedded model).
        refresh_s: seconds between two polls of the live channel by a visible tab (:mod:`ui.live`).
        window: default number of engine steps shown in the occupancy and rates panels (48: cells of about 14 px
            at 1366x768, see ``ui.figures.DEFAULT_WINDOW``).
        max_builds_per_s: most figure rebuilds per second for the whole process (``asyncio-throttle``).
        host_key: when set, only a page opened with ``?host=<host_key>`` may pause, step or slow the engine
            (a shared demo, e.g. a Space); None or "" lets every page do it.
        notice: a line shown under the header (e.g. that a ZeroGPU Space runs the engine on the CPU).

    The page holds no ``gr.State`` and no unload event (either would keep a heartbeat connection open per
    tab); panels, counters and streaming replies come through :class:`ui.live.LiveChannel`, whose routes
    (``demo.cbp_router``) the server includes next to the page (:func:`server.build_server`, :func:`launch`).

    API endpoints: ``/chat`` (message, history, temperature, top_p, max_new_tokens, seed -> history,
    textbox; streams), ``/stop``, ``/clear``, ``/start_load`` (n, rate), ``/stop_load``, ``/pause``,
    ``/resume``, ``/step``, ``/slow_motion`` (seconds per step), ``/next_handover`` and ``/next_block_reuse``
    (run until a slot or a KV block changes hands, then pause); the pacing ones only when no host key is set.
    """
    cfg = engine.config
    panels = Panels(engine.telemetry, max_builds_per_s=max_builds_per_s, num_slots=cfg.max_num_seqs,
                    num_blocks=cfg.num_blocks)
    # every status line names the colour and letter, queued ones too: a chat's request gets them when sent
    chat = ChatHandlers(EngineBackend(engine), describe=lambda rid, lang: panels.label(rid, lang))
    loadgen = LoadGenerator(engine)
    live = LiveChannel(engine, panels, chat, loadgen, window=window, refresh_s=refresh_s)
    actions = PageActions(engine, panels, live, loadgen, host_key=host_key, model_name=model_name)
    with gr.Blocks(title="Continuous Batching Playground", fill_width=True) as demo:
        summary_md = header(engine, model_name, notice)
        with gr.Tab(t("tab_playground"), id="playground"):
            with gr.Row(equal_height=False):
                with gr.Column(scale=2, min_width=360):
                    col = chat_column({k: t(k) for k in CHAT_TEXTS})
                    load = load_generator()
                with gr.Column(scale=3, min_width=480):
                    pacing = talk_controls()
                    view = panels_column(window, actions.capacity)
        with gr.Tab(t("tab_compare"), id="compare"):
            build_compare_tab(engine)
        given_key = gr.Textbox(visible=False)
        hidden = chat_hidden()
        wire_page(demo, actions, given_key, summary_md, pacing, view, load)
        wire_chat(chat, col, hidden)
        pacing_api = "private" if host_key else "public"  # host-only actions: no public API with a host key
        wire_load(actions, load, pacing_api)
        wire_talk(actions, pacing, view, summary_md, pacing_api)
    demo.cbp_panels = panels  # for tests and benchmarks: build counts, cached figures
    demo.cbp_loadgen = loadgen
    demo.cbp_chat = chat
    demo.cbp_live = live
    demo.cbp_router = live.router(lang_of)
    demo.cbp_head = head_html(refresh_s)
    return demo


def header(engine: AsyncEngine, model_name: str | None, notice: str | None) -> gr.Markdown:
    """Title, subtitle, the engine's one-line summary (returned: the page's load and the talk preset rewrite
    it in the tab's language) and the notice, if any."""
    gr.Markdown(t("title"))
    gr.Markdown(t("subtitle"))
    summary_md = gr.Markdown(engine_summary(engine, model_name), elem_id="engine-summary")
    if notice:
        gr.Markdown(f"⚠️ {notice}", elem_id="engine-notice")
    return summary_md


def load_generator() -> LoadControls:
    """The load generator's accordion: how many chats at what rate, start and stop, and its status line."""
    with gr.Accordion(t("loadgen"), open=True):
        gr.Markdown(t("loadgen_help"), elem_classes="cbp-note")
        with gr.Row():
            n_chats = gr.Slider(1, 64, value=16, step=1, label=t("num_chats"), elem_id="num-chats")
            rate = gr.Slider(0.5, 20, value=4, step=0.5, label=t("rate"), elem_id="load-rate")
        with gr.Row():
            start_btn = gr.Button(t("start_load"), variant="primary", elem_id="start-load")
            stop_btn = gr.Button(t("stop_load"), variant="stop", elem_id="stop-load")
        # a plain label line above the status (a component's label badge covered its first line)
        gr.Markdown(t("load_status"), elem_id="load-status-label")
        gr.HTML('<div id="load-status"></div>', padding=False, elem_id="load-status-area")
    return LoadControls(n_chats, rate, start_btn, stop_btn)


def talk_controls() -> TalkControls:
    """The pacing row above the panels: pause, resume, one step, next hand-over, next block reuse, talk preset."""
    with gr.Row(elem_id="pacing", equal_height=False):  # one line of buttons that never wrap
        return TalkControls(
            pause=gr.Button(t("pause"), size="sm", scale=0, elem_id="pause"),
            resume=gr.Button(t("resume"), size="sm", scale=0, elem_id="resume"),
            step=gr.Button(t("step"), size="sm", scale=0, elem_id="step"),
            handover=gr.Button(t("next_handover"), size="sm", scale=0, elem_id="next-handover"),
            reuse=gr.Button(t("next_reuse"), size="sm", scale=0, elem_id="next-reuse"),
            talk=gr.Button(t("talk_preset"), size="sm", scale=0, elem_id="talk-preset"),
        )


def panels_column(window: int, capacity: int) -> PanelControls:
    """The live area (both panels, filled by ``ui/live.js``), the sliders under it, the counters, the rates
    panel and the "how it works" note."""
    gr.HTML(live_html(), padding=False, elem_id="cbp-live-area")
    session_area = gr.HTML(session_html(), padding=False, elem_id="cbp-session-area")
    with gr.Row():
        slow = gr.Slider(0.0, 1.0, value=0.0, step=0.05, label=t("slow_motion"), scale=2, elem_id="slow-motion")
        window_steps = gr.Slider(16, 512, value=window, step=16, label=t("window"), scale=2, elem_id="window-steps")
        look_back = gr.Slider(0, capacity, value=0, step=1, label=t("look_back"), scale=2, elem_id="look-back")
        live_box = gr.Checkbox(value=True, label=t("live"), scale=1)
    gr.HTML(counters_html(), padding=False, elem_id="counters")  # below the panels
    for panel in PANELS:
        if panel.folded is not None:
            with gr.Accordion(t(panel.folded), open=False):
                gr.HTML(folded_html(panel.name), padding=False)
    with gr.Accordion(t("how_title"), open=True):
        gr.Markdown(t("how"), elem_classes="cbp-note")
    return PanelControls(session_area, slow, window_steps, look_back, live_box)


def wire_page(demo: gr.Blocks, actions: PageActions, given_key: gr.Textbox, summary_md: gr.Markdown,
              pacing: TalkControls, view: PanelControls, load: LoadControls) -> None:
    """The page's load (summary in the tab's language, session mark, host-only controls enabled or not,
    window) and each tab's view of the panels (window, live, look back)."""
    host_only = [pacing.pause, pacing.resume, pacing.step, view.slow, load.start, load.stop, pacing.handover,
                 pacing.reuse, pacing.talk]  # enabled on the host's page only (ui.page_actions.is_host_page)
    demo.load(actions.on_load, given_key, [summary_md, view.session_area, *host_only, view.window_steps],
              api_visibility="private", js="() => new URLSearchParams(window.location.search).get('host') || ''")
    view.window_steps.change(actions.set_window, view.window_steps, None, api_visibility="private", queue=False)
    view.live_box.change(actions.set_live, view.live_box, None, api_visibility="private", queue=False)
    view.look_back.change(actions.pin_timeline, view.look_back, None, api_visibility="private", queue=False)


def wire_load(actions: PageActions, load: LoadControls, pacing_api: str) -> None:
    """``/start_load`` (n, rate) and ``/stop_load``."""
    load.start.click(actions.start_load, [load.n_chats, load.rate], None, api_name="start_load",
                     concurrency_limit=None, api_visibility=pacing_api)
    load.stop.click(actions.stop_load, None, None, api_name="stop_load", concurrency_limit=None,
                    api_visibility=pacing_api)


def wire_talk(actions: PageActions, pacing: TalkControls, view: PanelControls, summary_md: gr.Markdown,
              pacing_api: str) -> None:
    """The pacing events (``/pause``, ``/resume``, ``/step``, ``/next_handover``, ``/next_block_reuse``,
    ``/slow_motion``, ``/talk_preset``); once one has run, the tab polls at once, so the panels show its
    effect without waiting."""
    poll_now = "() => { if (window.cbpPoll) window.cbpPoll(); }"
    for event in (
        pacing.pause.click(actions.pause, None, None, api_name="pause", api_visibility=pacing_api, queue=False),
        pacing.resume.click(actions.resume, None, None, api_name="resume", api_visibility=pacing_api, queue=False),
        pacing.step.click(actions.step_once, None, None, api_name="step", api_visibility=pacing_api, queue=False,
                          trigger_mode="multiple"),
        pacing.handover.click(actions.next_handover, None, None, api_name="next_handover",
                              api_visibility=pacing_api, concurrency_limit=None),
        pacing.reuse.click(actions.next_reuse, None, None, api_name="next_block_reuse", api_visibility=pacing_api,
                           concurrency_limit=None),
        view.slow.change(actions.slow_motion, view.slow, None, api_name="slow_motion", api_visibility=pacing_api,
                         queue=False),
        pacing.talk.click(actions.talk_preset, None, [summary_md, view.window_steps], api_name="talk_preset",
                          api_visibility=pacing_api, concurrency_limit=1, show_progress="hidden"),
    ):
        event.then(None, None, None, js=poll_now, api_visibility="private", queue=False)


def mount_kwargs(demo: gr.Blocks | None = None) -> dict[str, Any]:
    """The page's look for ``gr.mount_gradio_app`` (``server.build_server(..., mount_kwargs=...)``):
    translations, style, footer links, no run history, and the live channel's scripts in ``<head>``
    (``demo.cbp_head``); what :func:`launch` gives ``demo.launch``."""
    kw: dict[str, Any] = {"i18n": I18N, "css": CSS, "footer_links": ["api", "gradio", "settings"],
                          "run_history": False}
    head = getattr(demo, "cbp_head", None)
    if head:
        kw["head"] = head
    return kw


def launch(demo: gr.Blocks, **kwargs: Any):
    """``demo.queue().launch(...)`` with the app's translations, style and live-channel routes (included
    before the page blocks the thread), its queue polling quietly (:func:`ui.queue_polling.quiet_queue`);
    ``kwargs`` go to launch."""
    block = not kwargs.pop("prevent_thread_lock", False)
    demo.queue()
    quiet_queue(demo)
    result = demo.launch(**{**mount_kwargs(demo), **kwargs}, prevent_thread_lock=True)
    router = getattr(demo, "cbp_router", None)
    if router is not None:
        routes = demo.app.router.routes
        before = len(routes)
        demo.app.include_router(router)
        routes[:] = routes[before:] + routes[:before]  # ahead of Gradio's own routes
    if block:
        demo.block_thread()
    return result
