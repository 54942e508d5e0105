"""What the playground page's controls do (the chat's own are :class:`ui.chat.ChatHandlers`): the load
generator, pacing the engine (pause, resume, one step, slow motion, run to the next hand-over or block
reuse), the talk preset, the page's load, and each tab's view of the panels (window, live, look back).

With a host key, only a page opened with ``?host=<key>`` may pace the engine or run the load generator
(:func:`is_host_page`); another page's press is refused with a warning.
"""

from __future__ import annotations

import asyncio
import hmac
import time

import gradio as gr
from fastapi import Request

from engine import TALK_PRESET, AsyncEngine
from ui import talk
from ui.chat import session_of
from ui.i18n import EMBEDDED_MODEL, SUMMARY_TEXTS, language, state_text
from ui.live import LiveChannel
from ui.loadgen import LoadGenerator
from ui.page_markup import session_html
from ui.panels import Panels


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


def lang_of(request: gr.Request | Request | None) -> str:
    """The language of a Gradio event's or a live-channel poll's request (its Accept-Language)."""
    headers = getattr(request, "headers", None) or {}
    return language(headers.get("accept-language"))


class PageActions:
    """The page's event handlers on one engine (Gradio passes ``request``, the event's ``gr.Request``).

    Args:
        engine: the process's engine (pacing methods, ``config``, ``telemetry``).
        panels: the live panels (rebound to the engine's new telemetry when the talk preset restarts it).
        live: the live channel (each tab's view: window, live, pinned step).
        loadgen: the load generator.
        host_key: see :func:`is_host_page` (None or "": every page is the host).
        model_name: the model named in the header (:func:`engine_summary`).
    """

    def __init__(self, engine: AsyncEngine, panels: Panels, live: LiveChannel, loadgen: LoadGenerator,
                 host_key: str | None = None, model_name: str | None = None) -> None:
        self.engine, self.panels, self.live, self.loadgen = engine, panels, live, loadgen
        self.host_key, self.model_name = host_key, model_name
        self.capacity = int(engine.telemetry.capacity)

    def allowed(self, request: gr.Request | None) -> bool:
        """Whether the event's page may pace the engine (else a warning on that page)."""
        host = not self.host_key or self.live.is_host(session_of(request))
        if not host:
            gr.Warning(state_text(lang_of(request), "host_only"))
        return host

    # ------------------------------------------------------------------ load generator
    async def start_load(self, n: float, rate: float, request: gr.Request) -> None:
        if self.allowed(request):
            self.loadgen.start(int(n), float(rate))

    async def stop_load(self, request: gr.Request) -> None:
        if self.allowed(request):
            self.loadgen.stop()

    # ------------------------------------------------------------------ pacing
    def pause(self, request: gr.Request) -> None:
        if self.allowed(request):
            self.engine.pause()

    def resume(self, request: gr.Request) -> None:
        if self.allowed(request):
            self.engine.resume()

    async def step_once(self, request: gr.Request) -> None:
        """One engine step; answers once the step has run (at most 2 s)."""
        if not self.allowed(request):
            return
        engine = self.engine
        before = engine.step_count
        engine.step_once()
        deadline = time.monotonic() + 2.0
        while engine.paused and engine.step_count == before and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def slow_motion(self, seconds: float, request: gr.Request) -> None:
        if self.allowed(request):
            self.engine.set_min_step_time(float(seconds))

    async def next_handover(self, request: gr.Request) -> None:
        """Run to the next hand-over of a batch slot; answers once paused there (at most 10 s)."""
        if self.allowed(request):
            await talk.run_to(self.engine, "handover")

    async def next_reuse(self, request: gr.Request) -> None:
        """Run to the next reuse of a freed KV block by another request; answers once paused there."""
        if self.allowed(request):
            await talk.run_to(self.engine, "reuse")

    async def talk_preset(self, request: gr.Request):
        """The talk preset from the page: the engine restarted with its settings (unless it has them; replies
        in flight end) and every tab's window set to :data:`ui.talk.TALK_WINDOW` steps."""
        if not self.allowed(request):
            return gr.update(), gr.update()
        engine = self.engine
        restarted = await asyncio.to_thread(talk.apply_preset, engine)
        if restarted:
            self.panels.rebind(engine.telemetry, engine.config.max_num_seqs, engine.config.num_blocks)
        self.live.window = talk.TALK_WINDOW
        for view in self.live.tabs.values():
            view.window, view.pin = talk.TALK_WINDOW, None
        lang = lang_of(request)
        gr.Info(state_text(lang, "talk_on" if restarted else "talk_kept", slots=TALK_PRESET["max_num_seqs"],
                           blocks=TALK_PRESET["num_blocks"], window=talk.TALK_WINDOW))
        return engine_summary(engine, self.model_name, lang), gr.update(value=talk.TALK_WINDOW)

    # ------------------------------------------------------------------ the page and its view
    def on_load(self, given_key: str, request: gr.Request):
        session = session_of(request)
        host = is_host_page(self.host_key, given_key)
        self.live.open(session, host)
        return (engine_summary(self.engine, self.model_name, lang_of(request)), session_html(session),
                *(gr.update(interactive=host) for _ in range(9)), gr.update(value=self.live.view(session).window))

    def set_window(self, steps: float, request: gr.Request) -> None:
        self.live.view(session_of(request)).window = int(steps)

    def set_live(self, on: bool, request: gr.Request) -> None:
        self.live.view(session_of(request)).live = bool(on)

    def pin_timeline(self, back: float, request: gr.Request) -> None:
        view = self.live.view(session_of(request))
        telemetry = self.engine.telemetry
        latest = telemetry.latest()
        if not back or latest is None:
            view.pin = None
            return
        oldest = telemetry.snapshots(self.capacity)[0].step
        view.pin = max(oldest, latest.step - int(back))
