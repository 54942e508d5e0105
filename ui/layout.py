"""The page: chat column (chat, sampling, load generator) beside the live panels (talk-mode controls,
slot occupancy, block map, timeline, counters, rates) and a "how it works" note. One :func:`build_app` per
engine."""

from __future__ import annotations

import asyncio
import hmac
import time
from typing import Any

import gradio as gr

from ui import talk
from ui.chat import ChatHandlers, session_of
from ui.compare import build_compare_tab
from ui.i18n import EMBEDDED_MODEL, I18N, PACE_TEXTS, SUMMARY_TEXTS, language, state_text, t
from ui.loadgen import LoadGenerator
from ui.panels import COUNTER_KEYS, Panels

CSS = """
#counters .gr-box, #counters textarea, #counters input { font-variant-numeric: tabular-nums; }
.cbp-note { font-size: 0.9em; }
"""


def engine_summary(engine: Any, model_name: str | None = None, lang: str = "en") -> str:
    """One Markdown line describing the engine's configuration (model, slots, blocks, policy, free-block
    order, context) in ``lang`` (``"en"`` or ``"ko"``; English when unknown)."""
    cfg = getattr(engine, "config", None)
    get = lambda name, default="?": getattr(cfg, name, default)  # noqa: E731
    model = model_name or get("model", None) or EMBEDDED_MODEL.get(lang, EMBEDDED_MODEL["en"])
    return SUMMARY_TEXTS.get(lang, SUMMARY_TEXTS["en"]).format(
        model=model, slots=get("max_num_seqs"), blocks=get("num_blocks"), block_size=get("block_size"),
        policy=get("policy"), order=get("free_block_order", "lru"), context=get("max_model_len"))


def pacing_line(engine: Any, snaps_key: tuple | None, lang: str) -> str:
    """One Markdown line: the engine's pace (running / paused at step n / slow motion) and which steps
    the panels show (live, or pinned on the timeline when ``snaps_key``, a :meth:`Panels.refresh` key,
    has an end step)."""
    L = PACE_TEXTS.get(lang, PACE_TEXTS["en"])
    step = getattr(engine, "step_count", None)
    if getattr(engine, "paused", False):
        line = L["paused"].format(step=step)
    else:
        line = L["running"].format(step=step)
    line += talk.seek_text(engine, lang)
    slow = float(getattr(engine, "min_step_time", 0.0) or 0.0)
    if slow > 0:
        line += L["slow"].format(s=slow)
    if snaps_key and snaps_key[3] is not None:
        line += L["pinned"].format(end=snaps_key[0], newest=step)
    return line


def is_host_page(host_key: str | None, given: str | None) -> bool:
    """Whether a page may pace the engine: always when no host key is set, else only when the page was
    opened with ``?host=<key>`` (compared in constant time)."""
    if not host_key:
        return True
    return hmac.compare_digest(str(given or "").encode(), host_key.encode())


def build_app(
    engine: Any,
    *,
    model_name: str | None = None,
    refresh_s: float = 0.5,
    window: int = 48,
    max_builds_per_s: float = 2.0,
    host_key: str | None = None,
) -> gr.Blocks:
    """The Gradio Blocks app for ``engine`` (an ``AsyncEngine``).

    Args:
        engine: the process's engine; the UI uses ``generate``, ``abort``, ``config``, ``telemetry`` and the
            pacing methods (``pause``, ``resume``, ``step_once``, ``set_min_step_time``).
        model_name: shown in the header (default: ``engine.config.model`` or the embedded model).
        refresh_s: panel refresh period of each tab's ``gr.Timer`` (seconds).
        window: default number of engine steps shown in the occupancy and rates panels (48: cells of about 14 px
            at 1366x768, see ``ui.figures.DEFAULT_WINDOW``).
        max_builds_per_s: most figure rebuilds per second for the whole process (``asyncio-throttle``).
        host_key: when set, only a page opened with ``?host=<host_key>`` may pause, step or slow the engine
            (a shared demo, e.g. a Space); None or "" lets every page do it.

    API endpoints: ``/chat`` (message, history, temperature, top_p, max_new_tokens, seed -> history,
    textbox; streams), ``/stop``, ``/clear``, ``/start_load`` (n, rate), ``/stop_load``, ``/pause``,
    ``/resume``, ``/step``, ``/slow_motion`` (seconds per step), ``/next_handover`` and ``/next_block_reuse``
    (run until a slot or a KV block changes hands, then pause); the pacing ones only when no host key is set.
    """
    cfg = getattr(engine, "config", None)
    panels = Panels(engine.telemetry, max_builds_per_s=max_builds_per_s,
                    num_slots=getattr(cfg, "max_num_seqs", None), num_blocks=getattr(cfg, "num_blocks", None))
    # every status line names the colour, queued ones too: a chat's request gets its colour when sent
    chat = ChatHandlers(engine, describe=lambda rid, lang: panels.color_name(rid, lang, reserve=True))
    loadgen = LoadGenerator(engine)
    capacity = int(getattr(engine.telemetry, "capacity", 512))

    def lang_of(request: gr.Request | None) -> str:
        return language(request.headers.get("accept-language") if request is not None else None)

    async def refresh(window_steps: float, seen: tuple | None, mine: str | None, pin: int | None,
                      request: gr.Request):
        lang = lang_of(request)
        outs = await panels.refresh(window_steps, seen, lang, mine=mine, end=pin)
        color = panels.color_name(mine, lang) if mine else None
        mine_line = state_text(lang, "mine_panel", rid=mine, color=color) if mine and color else ""
        return (*outs, loadgen.status(lang), pacing_line(engine, outs[-1], lang), mine_line)

    async def start_load(n: float, rate: float, is_host: bool, request: gr.Request) -> str:
        if allowed(is_host, request):
            loadgen.start(int(n), float(rate))
        return loadgen.status(lang_of(request))

    async def stop_load(is_host: bool, request: gr.Request) -> str:
        if allowed(is_host, request):
            loadgen.stop()
        return loadgen.status(lang_of(request))

    def clear(request: gr.Request):
        chat.clear(request)
        return [], "", gr.update(interactive=True), None

    def lock_send():
        return gr.update(interactive=False)

    def unlock_send(request: gr.Request):
        return gr.update(interactive=not chat.active.of(session_of(request)))

    def allowed(is_host: bool, request: gr.Request | None) -> bool:
        if not is_host:
            gr.Warning(state_text(lang_of(request), "host_only"))
        return bool(is_host)

    def pace_now(request: gr.Request | None) -> str:
        return pacing_line(engine, None, lang_of(request))

    def pause(is_host: bool, request: gr.Request):
        if not allowed(is_host, request):
            return gr.skip()
        engine.pause()
        return pace_now(request)

    def resume(is_host: bool, request: gr.Request):
        if not allowed(is_host, request):
            return gr.skip()
        engine.resume()
        return pace_now(request)

    async def step_once(is_host: bool, request: gr.Request):
        """One engine step; answers once the step has run (at most 2 s), so the line shows the new step."""
        if not allowed(is_host, request):
            return gr.skip()
        before = engine.step_count
        engine.step_once()
        deadline = time.monotonic() + 2.0
        while engine.paused and engine.step_count == before and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return pace_now(request)

    def slow_motion(seconds: float, is_host: bool, request: gr.Request):
        if not allowed(is_host, request):
            return gr.skip()
        engine.set_min_step_time(float(seconds))
        return pace_now(request)

    async def next_handover(is_host: bool, request: gr.Request):
        """Run to the next hand-over of a batch slot; answers once paused there (at most 10 s)."""
        if not allowed(is_host, request):
            return gr.skip()
        await talk.run_to(engine, "handover")
        return pace_now(request)

    async def next_reuse(is_host: bool, request: gr.Request):
        """Run to the next reuse of a freed KV block by another request; answers once paused there."""
        if not allowed(is_host, request):
            return gr.skip()
        await talk.run_to(engine, "reuse")
        return pace_now(request)

    def summary(request: gr.Request) -> str:
        return engine_summary(engine, model_name, lang_of(request))

    def on_load(given_key: str):
        host = is_host_page(host_key, given_key)
        return (host, *(gr.update(interactive=host) for _ in range(8)))

    def pin_timeline(back: float):
        latest = engine.telemetry.latest()
        if not back or latest is None:
            return None
        oldest = engine.telemetry.snapshots(capacity)[0].step
        return max(oldest, latest.step - int(back))

    with gr.Blocks(title="Continuous Batching Playground", fill_width=True) as demo:
        gr.Markdown(t("title"))
        gr.Markdown(t("subtitle"))
        summary_md = gr.Markdown(engine_summary(engine, model_name), elem_id="engine-summary")
        with gr.Tab(t("tab_playground"), id="playground"):
            with gr.Row(equal_height=False):
                with gr.Column(scale=2, min_width=360):
                    chatbot = gr.Chatbot(label=t("chat"), height=430, elem_id="chatbot", buttons=["copy"],
                                         feedback_options=None)
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
                            n_chats = gr.Slider(1, 64, value=16, step=1, label=t("num_chats"))
                            rate = gr.Slider(0.5, 20, value=4, step=0.5, label=t("rate"))
                        with gr.Row():
                            start_btn = gr.Button(t("start_load"), variant="primary", elem_id="start-load")
                            stop_btn = gr.Button(t("stop_load"), variant="stop", elem_id="stop-load")
                        load_status = gr.Textbox(label=t("load_status"), interactive=False, elem_id="load-status")
                with gr.Column(scale=3, min_width=480):
                    with gr.Row(elem_id="pacing", equal_height=False):
                        pause_btn = gr.Button(t("pause"), size="sm", min_width=80, elem_id="pause")
                        resume_btn = gr.Button(t("resume"), size="sm", min_width=80, elem_id="resume")
                        step_btn = gr.Button(t("step"), size="sm", min_width=80, elem_id="step")
                        handover_btn = gr.Button(t("next_handover"), size="sm", min_width=80, elem_id="next-handover")
                        reuse_btn = gr.Button(t("next_reuse"), size="sm", min_width=80, elem_id="next-reuse")
                        slow = gr.Slider(0.0, 1.0, value=0.0, step=0.05, label=t("slow_motion"), scale=3,
                                         elem_id="slow-motion")
                    pace_md = gr.Markdown(elem_id="pace-status")
                    mine_md = gr.Markdown(elem_id="mine")
                    occupancy = gr.Plot(label=t("occupancy"), elem_id="occupancy")
                    blocks = gr.Plot(label=t("blocks"), elem_id="blockmap")
                    with gr.Row():
                        window_steps = gr.Slider(16, 512, value=window, step=16, label=t("window"), scale=2)
                        look_back = gr.Slider(0, capacity, value=0, step=1, label=t("look_back"), scale=2,
                                              elem_id="look-back")
                        live = gr.Checkbox(value=True, label=t("live"), scale=1)
                    counters = {}  # below the plots: pacing and both panels fit one 1366x768 screen
                    with gr.Row(elem_id="counters"):
                        for key in COUNTER_KEYS[:4]:
                            counters[key] = gr.Textbox(label=t(key), interactive=False, min_width=100,
                                                       elem_id=f"counter-{key}")
                    with gr.Row():
                        for key in COUNTER_KEYS[4:]:
                            counters[key] = gr.Textbox(label=t(key), interactive=False, min_width=120,
                                                       elem_id=f"counter-{key}")
                    with gr.Accordion(t("rates"), open=False):
                        rates = gr.Plot(label=t("rates"), show_label=False, elem_id="rates")
                    with gr.Accordion(t("how_title"), open=True):
                        gr.Markdown(t("how"), elem_classes="cbp-note")
        with gr.Tab(t("tab_compare"), id="compare"):
            build_compare_tab(engine)

        seen = gr.State(None)
        mine = gr.State(None)  # this tab's latest chat request id (outlined in the panels)
        pin = gr.State(None)  # timeline: the step the panels end at (None: live)
        is_host = gr.State(not host_key)
        given_key = gr.Textbox(visible=False)
        timer = gr.Timer(refresh_s)

        panel_outputs = [occupancy, blocks, rates, *(counters[k] for k in COUNTER_KEYS), seen, load_status,
                         pace_md, mine_md]
        refresh_inputs = [window_steps, seen, mine, pin]
        timer.tick(refresh, refresh_inputs, panel_outputs, concurrency_limit=None, api_visibility="private")
        demo.load(refresh, refresh_inputs, panel_outputs, concurrency_limit=None, api_visibility="private")
        demo.load(on_load, given_key, [is_host, pause_btn, resume_btn, step_btn, slow, start_btn, stop_btn,
                                       handover_btn, reuse_btn],
                  api_visibility="private",
                  js="() => new URLSearchParams(window.location.search).get('host') || ''")
        demo.load(summary, None, summary_md, api_visibility="private", queue=False)  # in the page's language
        live.change(lambda on: gr.Timer(active=bool(on)), live, timer, api_visibility="private")
        look_back.change(pin_timeline, look_back, pin, api_visibility="private", queue=False)

        # trigger_mode="multiple": a second Send or Enter reaches respond(), which refuses it with a warning
        pacing_api = "private" if host_key else "public"  # host-only actions: no public API with a host key
        locked = gr.on([msg.submit, send.click], lock_send, None, send, api_visibility="private", queue=False,
                       trigger_mode="multiple")
        chat_event = locked.then(
            chat.respond, [msg, chatbot, temperature, top_p, max_new, seed], [chatbot, msg, mine],
            api_name="chat", concurrency_limit=None, show_progress="minimal", trigger_mode="multiple",
        )
        chat_event.then(unlock_send, None, send, api_visibility="private", queue=False)
        stop.click(chat.stop, None, None, api_name="stop", concurrency_limit=None)
        clear_btn.click(clear, None, [chatbot, msg, send, mine], cancels=[chat_event], api_name="clear",
                        concurrency_limit=None)
        start_btn.click(start_load, [n_chats, rate, is_host], load_status, api_name="start_load",
                        concurrency_limit=None, api_visibility=pacing_api)
        stop_btn.click(stop_load, is_host, load_status, api_name="stop_load", concurrency_limit=None,
                       api_visibility=pacing_api)
        pause_btn.click(pause, is_host, pace_md, api_name="pause", api_visibility=pacing_api)
        resume_btn.click(resume, is_host, pace_md, api_name="resume", api_visibility=pacing_api)
        step_btn.click(step_once, is_host, pace_md, api_name="step", api_visibility=pacing_api,
                       trigger_mode="multiple", concurrency_limit=None)
        handover_btn.click(next_handover, is_host, pace_md, api_name="next_handover", api_visibility=pacing_api,
                           concurrency_limit=None)
        reuse_btn.click(next_reuse, is_host, pace_md, api_name="next_block_reuse", api_visibility=pacing_api,
                        concurrency_limit=None)
        slow.change(slow_motion, [slow, is_host], pace_md, api_name="slow_motion", api_visibility=pacing_api)
        demo.unload(chat.unload)
    demo.cbp_panels = panels  # for tests and benchmarks: build counts, cached figures
    demo.cbp_loadgen = loadgen
    demo.cbp_chat = chat
    return demo


def mount_kwargs() -> dict[str, Any]:
    """The page's look for ``gr.mount_gradio_app`` (``server.build_server(..., mount_kwargs=...)``):
    translations, style, footer links, no run history; what :func:`launch` gives ``demo.launch``."""
    return {"i18n": I18N, "css": CSS, "footer_links": ["api", "gradio", "settings"], "run_history": False}


def launch(demo: gr.Blocks, **kwargs: Any):
    """``demo.queue().launch(...)`` with the app's translations and style; ``kwargs`` go to launch."""
    return demo.queue().launch(**{**mount_kwargs(), **kwargs})
