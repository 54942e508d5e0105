"""The page: chat column (chat, sampling, load generator) beside the live panels (talk-mode controls,
slot occupancy, block map, timeline, counters, rates) and a "how it works" note. One :func:`build_app` per
engine."""

from __future__ import annotations

import asyncio
import hmac
import html
import time
from typing import Any

import gradio as gr
from fastapi import Request

from engine import TALK_PRESET, AsyncEngine
from ui import talk
from ui.chat import ChatHandlers, session_of, settings_inputs
from ui.compare import COMPARE_CSS, build_compare_tab
from ui.engine_backend import EngineBackend
from ui.i18n import EMBEDDED_MODEL, I18N, SUMMARY_TEXTS, language, state_text, t
from ui.invariance import INVARIANCE_CSS
from ui.live import LiveChannel, head_html
from ui.loadgen import LoadGenerator
from ui.panels import COUNTER_KEYS, PLOT_HEIGHT, Panels
from ui.queue_polling import quiet_queue

# Fixed layout: the lines above the panels have fixed heights (a longer text is cut, never wraps the panels
# down), the panels a fixed height, and Plotly's own hover label is hidden (ui/live.js writes the hovered
# cell's text into #cbp-hover instead, so no tooltip covers the cells it describes). Fonts: the theme's, then
# Korean ones (a projector laptop without a Korean system font otherwise shows boxes; Debian: fonts-nanum).
CSS = f"""
.gradio-container {{ font-family: var(--font), "Noto Sans KR", "NanumGothic", "Malgun Gothic",
  "Apple SD Gothic Neo", sans-serif; }}
.cbp-note {{ font-size: 0.9em; }}
.cbp-panel {{ height: {PLOT_HEIGHT}px; min-height: {PLOT_HEIGHT}px; overflow: hidden; }}
.cbp-panel .cbp-plot {{ width: 100%; height: {PLOT_HEIGHT}px; }}
#occupancy .hoverlayer, #blockmap .hoverlayer {{ display: none; }}
#pace-status {{ height: 2.8em; line-height: 1.4em; overflow: hidden; display: -webkit-box;
  -webkit-line-clamp: 2; -webkit-box-orient: vertical; }}
#mine, #cbp-hover {{ height: 1.4em; line-height: 1.4em; overflow: hidden; white-space: nowrap;
  text-overflow: ellipsis; }}
#cbp-hover {{ font-size: 0.9em; opacity: 0.85; }}
.cbp-req {{ white-space: nowrap; }}
.cbp-req i {{ display: inline-block; width: 0.8em; height: 0.8em; margin-right: 0.25em; border-radius: 2px;
  vertical-align: -0.05em; }}
#pacing {{ flex-wrap: wrap; gap: 6px; }}
#pacing button {{ white-space: nowrap; flex: 0 0 auto; width: auto; min-width: 0; }}
#cbp-counters {{ display: grid; grid-template-columns: repeat(4, minmax(100px, 1fr)); gap: 6px; }}
#cbp-counters .cbp-counter {{ border: 1px solid var(--border-color-primary); border-radius: 6px; padding: 4px 8px; }}
#cbp-counters .cbp-counter.cbp-wide {{ grid-column: span 2; }}
#cbp-counters .cbp-label {{ font-size: 0.8em; opacity: 0.75; }}
#cbp-counters .cbp-value {{ font-variant-numeric: tabular-nums; }}
#live-reply {{ border: 1px solid var(--border-color-primary); border-radius: 8px; padding: 6px 10px; }}
#live-reply-title {{ font-size: 0.85em; opacity: 0.8; }}
#live-reply-text {{ white-space: pre-wrap; }}
#load-status {{ font-variant-numeric: tabular-nums; min-height: 1.4em; }}
#load-status-label {{ font-size: 0.85em; opacity: 0.75; margin-bottom: 0; }}
""" + INVARIANCE_CSS + COMPARE_CSS


def live_html() -> str:
    """The live area the page's poller fills (``ui/live.js``): pace line, the tab's own request, the hovered
    cell's line and both panels. It is never replaced (the panels drawn before the page's load event stay)."""
    return ('<div id="cbp-live"><div id="pace-status"></div><div id="mine"></div><div id="cbp-hover"></div>'
            '<div id="occupancy" class="cbp-panel"></div><div id="blockmap" class="cbp-panel"></div></div>')


def session_html(session: str = "") -> str:
    """A hidden mark that tells the poller which tab it is (Gradio's session hash, set at page load)."""
    return f'<span id="cbp-session" data-cbp-session="{html.escape(session)}" hidden></span>'



def counters_html() -> str:
    """The counters' cells (label and value filled by the poller), ids ``counter-<key>``."""
    cells = "".join(f'<div id="counter-{k}" class="cbp-counter{" cbp-wide" if k in ("totals", "prefix_cache") else ""}">'
                    '<div class="cbp-label"></div><div class="cbp-value">-</div></div>' for k in COUNTER_KEYS)
    return f'<div id="cbp-counters">{cells}</div>'


LIVE_REPLY_HTML = ('<div id="live-reply" hidden><div id="live-reply-title"></div>'
                   '<div id="live-reply-text"></div></div>')


def engine_summary(engine: AsyncEngine, model_name: str | None = None, lang: str = "en") -> str:
    """One Markdown line describing the engine's configuration (model, slots, KV blocks and tokens per block,
    policy, free-block order, context in tokens) in ``lang`` (``"en"`` or ``"ko"``; English when unknown)."""
    cfg = engine.config
    model = model_name or cfg.model or EMBEDDED_MODEL.get(lang, EMBEDDED_MODEL["en"])
    return SUMMARY_TEXTS.get(lang, SUMMARY_TEXTS["en"]).format(
        model=model, slots=cfg.max_num_seqs, blocks=cfg.num_blocks, block_size=cfg.block_size,
        policy=cfg.policy, order=cfg.free_block_order, context=cfg.max_model_len)


def is_host_page(host_key: str | None, given: str | None) -> bool:
    """Whether a page may pace the engine: always when no host key is set, else only when the page was
    opened with ``?host=<key>`` (compared in constant time)."""
    if not host_key:
        return True
    return hmac.compare_digest(str(given or "").encode(), host_key.encode())


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
    capacity = int(engine.telemetry.capacity)

    def lang_of(request: gr.Request | Request | None) -> str:
        """The language of a Gradio event's or a live-channel poll's request (its Accept-Language)."""
        headers = getattr(request, "headers", None) or {}
        return language(headers.get("accept-language"))

    def allowed(request: gr.Request | None) -> bool:
        host = not host_key or live.is_host(session_of(request))
        if not host:
            gr.Warning(state_text(lang_of(request), "host_only"))
        return host

    async def start_load(n: float, rate: float, request: gr.Request) -> None:
        if allowed(request):
            loadgen.start(int(n), float(rate))

    async def stop_load(request: gr.Request) -> None:
        if allowed(request):
            loadgen.stop()

    def lock_send():
        return gr.update(interactive=False)

    def pause(request: gr.Request) -> None:
        if allowed(request):
            engine.pause()

    def resume(request: gr.Request) -> None:
        if allowed(request):
            engine.resume()

    async def step_once(request: gr.Request) -> None:
        """One engine step; answers once the step has run (at most 2 s)."""
        if not allowed(request):
            return
        before = engine.step_count
        engine.step_once()
        deadline = time.monotonic() + 2.0
        while engine.paused and engine.step_count == before and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def slow_motion(seconds: float, request: gr.Request) -> None:
        if allowed(request):
            engine.set_min_step_time(float(seconds))

    async def next_handover(request: gr.Request) -> None:
        """Run to the next hand-over of a batch slot; answers once paused there (at most 10 s)."""
        if allowed(request):
            await talk.run_to(engine, "handover")

    async def next_reuse(request: gr.Request) -> None:
        """Run to the next reuse of a freed KV block by another request; answers once paused there."""
        if allowed(request):
            await talk.run_to(engine, "reuse")

    async def talk_preset(request: gr.Request):
        """The talk preset from the page: the engine restarted with its settings (unless it has them; replies
        in flight end) and every tab's window set to :data:`ui.talk.TALK_WINDOW` steps."""
        if not allowed(request):
            return gr.update(), gr.update()
        restarted = await asyncio.to_thread(talk.apply_preset, engine)
        if restarted:
            panels.rebind(engine.telemetry, engine.config.max_num_seqs, engine.config.num_blocks)
        live.window = talk.TALK_WINDOW
        for view in live.tabs.values():
            view.window, view.pin = talk.TALK_WINDOW, None
        lang = lang_of(request)
        gr.Info(state_text(lang, "talk_on" if restarted else "talk_kept", slots=TALK_PRESET["max_num_seqs"],
                           blocks=TALK_PRESET["num_blocks"], window=talk.TALK_WINDOW))
        return engine_summary(engine, model_name, lang), gr.update(value=talk.TALK_WINDOW)

    def on_load(given_key: str, request: gr.Request):
        session = session_of(request)
        host = is_host_page(host_key, given_key)
        live.open(session, host)
        return (engine_summary(engine, model_name, lang_of(request)), session_html(session),
                *(gr.update(interactive=host) for _ in range(9)), gr.update(value=live.view(session).window))

    def set_window(steps: float, request: gr.Request) -> None:
        live.view(session_of(request)).window = int(steps)

    def set_live(on: bool, request: gr.Request) -> None:
        live.view(session_of(request)).live = bool(on)

    def pin_timeline(back: float, request: gr.Request) -> None:
        view = live.view(session_of(request))
        latest = engine.telemetry.latest()
        if not back or latest is None:
            view.pin = None
            return
        oldest = engine.telemetry.snapshots(capacity)[0].step
        view.pin = max(oldest, latest.step - int(back))

    with gr.Blocks(title="Continuous Batching Playground", fill_width=True) as demo:
        gr.Markdown(t("title"))
        gr.Markdown(t("subtitle"))
        summary_md = gr.Markdown(engine_summary(engine, model_name), elem_id="engine-summary")
        if notice:
            gr.Markdown(f"⚠️ {notice}", elem_id="engine-notice")
        with gr.Tab(t("tab_playground"), id="playground"):
            with gr.Row(equal_height=False):
                with gr.Column(scale=2, min_width=360):
                    chatbot = gr.Chatbot(label=t("chat"), height=430, elem_id="chatbot", buttons=["copy"],
                                         feedback_options=None)
                    gr.HTML(LIVE_REPLY_HTML, padding=False, elem_id="live-reply-area")
                    with gr.Row():
                        msg = gr.Textbox(show_label=False, placeholder=t("placeholder"), scale=5, lines=1,
                                         max_lines=4, elem_id="msg", submit_btn=False)
                        send = gr.Button(t("send"), variant="primary", scale=1, min_width=70, elem_id="send")
                        stop = gr.Button(t("stop"), variant="stop", scale=1, min_width=70, elem_id="stop")
                        clear_btn = gr.Button(t("clear"), scale=1, min_width=70, elem_id="clear")
                    with gr.Accordion(t("sampling"), open=False):
                        temperature = gr.Slider(0.0, 2.0, value=0.7, step=0.05, label=t("temperature"))
                        top_p = gr.Slider(0.05, 1.0, value=0.9, step=0.05, label=t("top_p"))
                        max_new = gr.Slider(1, 1024, value=256, step=1, label=t("max_new_tokens"))
                        seed = gr.Number(value=-1, precision=0, label=t("seed"))
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
                with gr.Column(scale=3, min_width=480):
                    with gr.Row(elem_id="pacing", equal_height=False):  # one line of buttons that never wrap
                        pause_btn = gr.Button(t("pause"), size="sm", scale=0, elem_id="pause")
                        resume_btn = gr.Button(t("resume"), size="sm", scale=0, elem_id="resume")
                        step_btn = gr.Button(t("step"), size="sm", scale=0, elem_id="step")
                        handover_btn = gr.Button(t("next_handover"), size="sm", scale=0, elem_id="next-handover")
                        reuse_btn = gr.Button(t("next_reuse"), size="sm", scale=0, elem_id="next-reuse")
                        talk_btn = gr.Button(t("talk_preset"), size="sm", scale=0, elem_id="talk-preset")
                    gr.HTML(live_html(), padding=False, elem_id="cbp-live-area")
                    session_area = gr.HTML(session_html(), padding=False, elem_id="cbp-session-area")
                    with gr.Row():
                        slow = gr.Slider(0.0, 1.0, value=0.0, step=0.05, label=t("slow_motion"), scale=2,
                                         elem_id="slow-motion")
                        window_steps = gr.Slider(16, 512, value=window, step=16, label=t("window"), scale=2,
                                                 elem_id="window-steps")
                        look_back = gr.Slider(0, capacity, value=0, step=1, label=t("look_back"), scale=2,
                                              elem_id="look-back")
                        live_box = gr.Checkbox(value=True, label=t("live"), scale=1)
                    gr.HTML(counters_html(), padding=False, elem_id="counters")  # below the panels
                    with gr.Accordion(t("rates"), open=False):
                        gr.HTML('<div id="rates" class="cbp-panel"></div>', padding=False)
                    with gr.Accordion(t("how_title"), open=True):
                        gr.Markdown(t("how"), elem_classes="cbp-note")
        with gr.Tab(t("tab_compare"), id="compare"):
            build_compare_tab(engine)

        given_key = gr.Textbox(visible=False)
        mine_box = gr.Textbox(visible=False)  # the reply's request id (start's third output)
        commit_btn = gr.Button("commit", visible="hidden", elem_id="cbp-commit")  # clicked by ui/live.js
        api_chat = gr.Button("chat", visible=False)  # carries the streaming /chat API for gradio_client

        demo.load(on_load, given_key, [summary_md, session_area, pause_btn, resume_btn, step_btn, slow, start_btn,
                                       stop_btn, handover_btn, reuse_btn, talk_btn, window_steps],
                  api_visibility="private",
                  js="() => new URLSearchParams(window.location.search).get('host') || ''")
        window_steps.change(set_window, window_steps, None, api_visibility="private", queue=False)
        live_box.change(set_live, live_box, None, api_visibility="private", queue=False)
        look_back.change(pin_timeline, look_back, None, api_visibility="private", queue=False)

        # trigger_mode="multiple": a second Send or Enter reaches start(), which refuses it with a warning
        pacing_api = "private" if host_key else "public"  # host-only actions: no public API with a host key
        # the sampling controls go by name (one ChatSettings in the handlers), after the message and history
        settings = settings_inputs(temperature, top_p, max_new, seed)
        locked = gr.on([msg.submit, send.click], lock_send, None, send, api_visibility="private", queue=False,
                       trigger_mode="multiple")
        started = locked.then(chat.start, [msg, chatbot], [chatbot, msg, mine_box], inputs_kwargs=settings,
                              api_visibility="private", concurrency_limit=None, show_progress="hidden",
                              trigger_mode="multiple")
        started.then(chat.unlock_send, None, send, api_visibility="private", queue=False)
        commit_btn.click(chat.commit, None, [chatbot, send], api_visibility="private", queue=False,
                         trigger_mode="multiple")
        api_chat.click(chat.respond_api, [msg, chatbot], [chatbot, msg], inputs_kwargs=settings, api_name="chat",
                       concurrency_limit=None)
        stop.click(chat.stop, None, None, api_name="stop", concurrency_limit=None)
        clear_btn.click(chat.clear, None, [chatbot, msg, send], api_name="clear", concurrency_limit=None)
        start_btn.click(start_load, [n_chats, rate], None, api_name="start_load", concurrency_limit=None,
                        api_visibility=pacing_api)
        stop_btn.click(stop_load, None, None, api_name="stop_load", concurrency_limit=None,
                       api_visibility=pacing_api)
        # once a pacing event has run, the tab polls at once: the panels show its effect without waiting
        poll_now = "() => { if (window.cbpPoll) window.cbpPoll(); }"
        for event in (
            pause_btn.click(pause, None, None, api_name="pause", api_visibility=pacing_api, queue=False),
            resume_btn.click(resume, None, None, api_name="resume", api_visibility=pacing_api, queue=False),
            step_btn.click(step_once, None, None, api_name="step", api_visibility=pacing_api, queue=False,
                           trigger_mode="multiple"),
            handover_btn.click(next_handover, None, None, api_name="next_handover", api_visibility=pacing_api,
                               concurrency_limit=None),
            reuse_btn.click(next_reuse, None, None, api_name="next_block_reuse", api_visibility=pacing_api,
                            concurrency_limit=None),
            slow.change(slow_motion, slow, None, api_name="slow_motion", api_visibility=pacing_api, queue=False),
            talk_btn.click(talk_preset, None, [summary_md, window_steps], api_name="talk_preset",
                           api_visibility=pacing_api, concurrency_limit=1, show_progress="hidden"),
        ):
            event.then(None, None, None, js=poll_now, api_visibility="private", queue=False)
    demo.cbp_panels = panels  # for tests and benchmarks: build counts, cached figures
    demo.cbp_loadgen = loadgen
    demo.cbp_chat = chat
    demo.cbp_live = live
    demo.cbp_router = live.router(lang_of)
    demo.cbp_head = head_html(refresh_s)
    return demo


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
