"""The page: chat column (chat, sampling, load generator) beside the live panels (counters, slot
occupancy, block map, rates) and a "how it works" note. One :func:`build_app` per engine."""

from __future__ import annotations

from typing import Any

import gradio as gr

from ui.chat import ChatHandlers
from ui.compare import build_compare_tab
from ui.i18n import I18N, language, t
from ui.loadgen import LoadGenerator
from ui.panels import COUNTER_KEYS, Panels

CSS = """
#counters .gr-box, #counters textarea, #counters input { font-variant-numeric: tabular-nums; }
.cbp-note { font-size: 0.9em; }
"""


def engine_summary(engine: Any, model_name: str | None = None) -> str:
    """One Markdown line describing the engine's configuration (model, slots, blocks, policy)."""
    cfg = getattr(engine, "config", None)
    get = lambda name, default="?": getattr(cfg, name, default)  # noqa: E731
    model = model_name or get("model", None) or "SmolLM2-135M-Instruct (embedded)"
    return (f"`{model}` · **{get('max_num_seqs')}** slots · **{get('num_blocks')}** KV blocks × "
            f"**{get('block_size')}** tokens · policy `{get('policy')}` · context {get('max_model_len')} tokens")


def build_app(
    engine: Any,
    *,
    model_name: str | None = None,
    refresh_s: float = 0.5,
    window: int = 96,
    max_builds_per_s: float = 2.0,
) -> gr.Blocks:
    """The Gradio Blocks app for ``engine`` (an ``AsyncEngine``).

    Args:
        engine: the process's engine; the UI uses ``generate``, ``abort``, ``config`` and ``telemetry``.
        model_name: shown in the header (default: ``engine.config.model`` or the embedded model).
        refresh_s: panel refresh period of each tab's ``gr.Timer`` (seconds).
        window: default number of engine steps shown in the occupancy and rates panels.
        max_builds_per_s: most figure rebuilds per second for the whole process (``asyncio-throttle``).

    API endpoints: ``/chat`` (message, history, temperature, top_p, max_new_tokens, seed -> history,
    textbox; streams), ``/stop``, ``/clear``, ``/start_load`` (n, rate), ``/stop_load``.
    """
    chat = ChatHandlers(engine)
    panels = Panels(engine.telemetry, max_builds_per_s=max_builds_per_s)
    loadgen = LoadGenerator(engine)

    async def refresh(window_steps: float, seen: tuple | None, request: gr.Request):
        lang = language(request.headers.get("accept-language") if request is not None else None)
        return (*await panels.refresh(window_steps, seen, lang), loadgen.status())

    async def start_load(n: float, rate: float) -> str:
        loadgen.start(int(n), float(rate))
        return loadgen.status()

    async def stop_load() -> str:
        loadgen.stop()
        return loadgen.status()

    def clear(request: gr.Request):
        chat.stop(request)
        return [], ""

    with gr.Blocks(title="Continuous Batching Playground", fill_width=True) as demo:
        gr.Markdown(t("title"))
        gr.Markdown(t("subtitle"))
        gr.Markdown(engine_summary(engine, model_name), elem_id="engine-summary")
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
                    counters = {}
                    with gr.Row(elem_id="counters"):
                        for key in COUNTER_KEYS[:4]:
                            counters[key] = gr.Textbox(label=t(key), interactive=False, min_width=100,
                                                       elem_id=f"counter-{key}")
                    with gr.Row():
                        for key in COUNTER_KEYS[4:]:
                            counters[key] = gr.Textbox(label=t(key), interactive=False, min_width=120,
                                                       elem_id=f"counter-{key}")
                    occupancy = gr.Plot(label=t("occupancy"), elem_id="occupancy")
                    blocks = gr.Plot(label=t("blocks"), elem_id="blockmap")
                    with gr.Accordion(t("rates"), open=False):
                        rates = gr.Plot(label=t("rates"), show_label=False, elem_id="rates")
                    with gr.Row():
                        window_steps = gr.Slider(16, 512, value=window, step=16, label=t("window"), scale=3)
                        live = gr.Checkbox(value=True, label=t("live"), scale=1)
                    with gr.Accordion(t("how_title"), open=True):
                        gr.Markdown(t("how"), elem_classes="cbp-note")
        with gr.Tab(t("tab_compare"), id="compare"):
            build_compare_tab(engine)

        seen = gr.State(None)
        timer = gr.Timer(refresh_s)

        panel_outputs = [occupancy, blocks, rates, *(counters[k] for k in COUNTER_KEYS), seen, load_status]
        timer.tick(refresh, [window_steps, seen], panel_outputs, concurrency_limit=None,
                   api_visibility="private")
        demo.load(refresh, [window_steps, seen], panel_outputs, concurrency_limit=None, api_visibility="private")
        live.change(lambda on: gr.Timer(active=bool(on)), live, timer, api_visibility="private")

        chat_event = gr.on(
            [msg.submit, send.click], chat.respond, [msg, chatbot, temperature, top_p, max_new, seed],
            [chatbot, msg], api_name="chat", concurrency_limit=None, show_progress="minimal",
        )
        stop.click(chat.stop, None, None, cancels=[chat_event], api_name="stop", concurrency_limit=None)
        clear_btn.click(clear, None, [chatbot, msg], cancels=[chat_event], api_name="clear",
                        concurrency_limit=None)
        start_btn.click(start_load, [n_chats, rate], load_status, api_name="start_load", concurrency_limit=None)
        stop_btn.click(stop_load, None, load_status, api_name="stop_load", concurrency_limit=None)
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
