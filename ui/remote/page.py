"""Remote mode's page: a chat and the load generator sent to a remote OpenAI-compatible server, beside panels of
what a client can see of it: the counters of each server's ``/metrics``, this page's requests over time, and the
KV blocks its KV events tell of. No model runs in this process.

The chat is the local page's (:class:`ui.chat.ChatHandlers`) on a :class:`ui.remote.backend.RemoteBackend`: Send
starts the reply's task and returns, the tab polls ``GET /cbp/live`` (``ui/live.js``) for the status line and
text, and the ended turn is committed into the chatbot; failed and stopped turns never reach the server again.
Stop cancels the reply's task, which closes its HTTP stream (the server aborts the request). The panels, the
header and the notice refresh on a ``gr.Timer`` (about once a second) from the backend's state and one scrape of
``/metrics`` per refresh period for all tabs together.
"""

from __future__ import annotations

import asyncio
import html
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import gradio as gr
import plotly.graph_objects as go
from fastapi import APIRouter
from fastapi.responses import FileResponse, Response

from ui.chat import ChatHandlers, session_of
from ui.chat_column import chat_column, chat_hidden, wire_chat
from ui.remote.backend import BackendState, RemoteBackend
from ui.remote.client import RemoteClient, RemoteLoad
from ui.remote.figures import TIMELINE_NOTE, counters_html, kv_map_figure, kv_summary, publisher_lines, timeline_figure
from ui.remote.kv import NOT_EXPOSED, KVMap, KVSubscriber
from ui.remote.metrics import MetricsScraper

LIVE_JS = Path(__file__).resolve().parent.parent / "live.js"
REMOTE_CSS = """
.cbp-note { font-size: 0.9em; }
.cbp-counters-box { overflow-x: auto; max-width: 100%; }
#remote-counters { border-collapse: collapse; font-size: 0.85em; font-variant-numeric: tabular-nums; }
#remote-counters th, #remote-counters td { border: 1px solid var(--border-color-primary); padding: 2px 6px; }
#remote-counters th { text-align: left; font-weight: 600; overflow-wrap: anywhere; }
#remote-counters tbody th { font-weight: 500; white-space: nowrap; }
.cbp-error { color: var(--error-text-color, #b00); font-size: 0.85em; }
.cbp-stale { opacity: 0.55; }
#live-reply { border: 1px solid var(--border-color-primary); border-radius: 8px; padding: 6px 10px; }
#live-reply-title { font-size: 0.85em; opacity: 0.8; }
#live-reply-text { white-space: pre-wrap; }
#load-status { font-variant-numeric: tabular-nums; min-height: 1.4em; }
"""
KV_OFF_NO_URL = ("KV map off: no --kv-events-url given. Start the server with KV cache events on (vLLM: "
                 "--kv-events-config '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": "
                 "\"tcp://*:5557\"}', with prefix caching) and pass --kv-events-url tcp://host:5557.")


CHAT_TEXTS = {"chat": "chat (remote)", "placeholder": "Type a message", "send": "Send", "stop": "Stop", "clear": "Clear",
              "sampling": "Sampling", "temperature": "temperature", "top_p": "top_p",
              "max_new_tokens": "max new tokens"}  # the chat column's labels (ui.chat_column.chat_column)


def kv_servers(endpoints: Sequence[str], urls: Sequence[str]) -> list[str | None]:
    """The backend URL whose server publishes each KV endpoint: by position when there are as many of both,
    else the one URL on the endpoint's host (None: unknown)."""
    if len(endpoints) == len(urls):
        return list(urls)
    out: list[str | None] = []
    for ep in endpoints:
        same = [u for u in urls if urlsplit(u).hostname == urlsplit(ep).hostname]
        out.append(same[0] if len(same) == 1 else None)
    return out


def header_markdown(client: RemoteClient, metrics_urls: Sequence[str], kv_urls: Sequence[str]) -> str:
    """The page's header: where chats go and with which model (as the server lists it now, or the one given),
    which servers are scraped, where KV events come from."""
    kv = ", ".join(f"`{u}`" for u in kv_urls) or "none"
    model = f"model `{client.model}`" if client.model else "model not known yet: the server has not listed it"
    return ("# Continuous Batching Playground: remote mode\n\n"
            f"Chats and the load generator go to `{client.base_url}` ({model}), streamed; Stop closes the stream "
            f"(the server aborts the request). Metrics from: {', '.join(f'`{u}`' for u in metrics_urls)}. "
            f"KV events from: {kv}.\n\n"
            "No model runs here: the panels show what a client and these public interfaces can see (counters, this "
            "page's requests, KV events), not the engine's own batch slots or block table.")


def notice_markdown(state: BackendState, fixed: str | None = None) -> str:
    """The notice under the header: ``fixed`` (a line given at start, if any) and, while the server does not
    answer or its model list fails, why (empty when all is well)."""
    lines = [f"⚠️ {fixed}"] if fixed else []
    if state.error:
        lines.append(f"⚠️ {state.error}" + ("" if state.reachable else
                                            " Chats fail until it answers; this page asks it again every few seconds."))
    return "\n\n".join(lines)


class RemoteHandlers:
    """The page's handlers, callable without a browser (tests pass a stand-in request, or None: one anonymous
    tab).

    Args:
        client: where chats and load go.
        scraper: reads every server's ``/metrics``.
        kv_map: the KV events' block map (None: KV map off, for ``kv_off_reason``).
        subscribers: the KV event subscribers feeding ``kv_map`` (their liveness and errors are shown).
        kv_off_reason: why the KV map is off (shown instead of it).
        refresh_s: seconds between two scrapes at most (the panels' refresh period).
        window_s: seconds of the request timeline.
        backend: the chat backend (default: one on ``client``); its state drives the header and the notice.
        notice: a fixed line for the notice, if any.
        lease_s: a tab that has not polled for this long (seconds) is taken as closed: its reply is stopped.

    Attributes:
        chat: the chat handlers (:class:`ui.chat.ChatHandlers`), shared with the local page.
    """

    def __init__(self, client: RemoteClient, scraper: MetricsScraper, kv_map: KVMap | None = None,
                 subscribers: Sequence[KVSubscriber] = (), kv_off_reason: str | None = None, refresh_s: float = 1.0,
                 window_s: float = 120.0, backend: RemoteBackend | None = None, notice: str | None = None,
                 lease_s: float = 90.0) -> None:
        self.client = client
        self.scraper = scraper
        self.kv_map = kv_map
        self.subscribers = list(subscribers)
        self.kv_off_reason = kv_off_reason if kv_map is None else None
        if kv_map is None and self.kv_off_reason is None:
            self.kv_off_reason = KV_OFF_NO_URL
        self.refresh_s = refresh_s
        self.window_s = window_s
        self.backend = backend or RemoteBackend(client)
        self.chat = ChatHandlers(self.backend)
        self.notice = notice
        self.lease_s = lease_s
        self.load = RemoteLoad(client)
        self.tabs: dict[str, float] = {}  # session -> monotonic time of its latest poll
        self._scrape_lock = asyncio.Lock()
        self._probe_lock = asyncio.Lock()

    # ------------------------------------------------------------------ the chat's live channel
    def poll(self, session: str, now: float | None = None) -> str:
        """One poll of the tab ``session`` (``GET /cbp/live``): ``{"chat": ..., "refresh": ...}`` as JSON text,
        ``chat`` as :meth:`ui.chat.ChatHandlers.live_reply`; tabs silent past the lease are closed."""
        import json

        now = time.monotonic() if now is None else now
        self.tabs[session] = now
        for gone in [s for s, seen in self.tabs.items() if now - seen > self.lease_s]:
            self.bye(gone)
        return json.dumps({"chat": self.chat.live_reply(session), "refresh": 0.25}, ensure_ascii=False)

    def bye(self, session: str) -> None:
        """The tab closed: stop its reply (the stream closes: the server aborts it) and forget it."""
        self.chat.forget(session)
        self.tabs.pop(session, None)

    def router(self) -> APIRouter:
        """The chat's live-channel routes (``/cbp/live``, ``/cbp/bye``, ``/cbp/live.js``), to include in the
        FastAPI app that serves the page."""
        router = APIRouter()

        @router.get("/cbp/live", include_in_schema=False)
        async def live(session: str = "") -> Response:
            if not session:
                return Response(status_code=400, content="session missing")
            return Response(self.poll(session), media_type="application/json", headers={"Cache-Control": "no-store"})

        @router.post("/cbp/bye", include_in_schema=False)
        async def bye(session: str = "") -> Response:
            if session:
                self.bye(session)
            return Response(status_code=204)

        @router.get("/cbp/live.js", include_in_schema=False)
        async def script() -> Response:
            return FileResponse(LIVE_JS, media_type="text/javascript", headers={"Cache-Control": "no-cache"})

        return router

    # ------------------------------------------------------------------ load generator
    async def start_load(self, n: float, rate: float) -> str:
        """Start ``n`` synthetic chats at ``rate`` per second; returns the load status line."""
        self.load.start(int(n), float(rate))
        return self.load.status()

    async def stop_load(self) -> str:
        """Stop every synthetic chat (their connections close); returns the load status line."""
        self.load.stop()
        return self.load.status()

    async def on_load(self, request: gr.Request):
        """A tab opened: its live area (with its session) and everything the timer draws (:meth:`refresh`)."""
        session = session_of(request)
        self.tabs[session] = time.monotonic()
        return (f'<div id="cbp-live" data-cbp-session="{html.escape(session)}"></div>', *await self.refresh())

    # ------------------------------------------------------------------ panels, header, notice
    async def scrape(self) -> None:
        """Scrape every ``/metrics`` unless another tab did within the refresh period (in a worker thread), and
        probe the chat server when due (:meth:`ui.remote.backend.RemoteBackend.probe_due`)."""
        if not self._probe_lock.locked() and self.backend.probe_due():
            async with self._probe_lock:
                await self.backend.probe()
        if self._scrape_lock.locked():  # another tab's scrape is under way: show the latest, do not queue
            return
        async with self._scrape_lock:
            if time.time() - self.scraper.latest_at >= 0.8 * self.refresh_s:
                await asyncio.to_thread(self.scraper.scrape)

    def kv_panel(self, now: float | None = None) -> tuple[go.Figure, str]:
        """The KV map figure and its caption (markdown), with each publisher's liveness."""
        now = time.time() if now is None else now
        if self.kv_map is None:
            return kv_map_figure([], off_reason=self.kv_off_reason), f"_{self.kv_off_reason}_"
        scraped = {r.url: r.error for r in self.scraper.latest if r.error and not r.engines}
        servers = kv_servers([s.endpoint for s in self.subscribers], self.scraper.urls)
        errors = {s.label: scraped.get(url) if url else None for s, url in zip(self.subscribers, servers)}
        lines, stale = publisher_lines(self.subscribers, errors, now)
        caption = kv_summary(self.kv_map.summary(), lines, self.kv_map.block_size, NOT_EXPOSED,
                             as_last_seen=bool(self.subscribers) and len(stale) == len(self.subscribers))
        return kv_map_figure(self.kv_map.records(), now=now, stale=stale), caption

    def header(self) -> str:
        """The header as the backend stands now."""
        return header_markdown(self.client, self.scraper.urls, [s.endpoint for s in self.subscribers])

    async def refresh(self) -> tuple[str, Any, str, go.Figure, go.Figure, str, str]:
        """Everything the timer redraws: header, notice (hidden when empty), counters (HTML), request timeline,
        KV map, its caption, the load status line."""
        await self.scrape()
        now = time.time()
        kv_fig, kv_md = self.kv_panel(now)
        timeline = timeline_figure(self.client.log.records(since=now - self.window_s), now, self.window_s)
        notice = notice_markdown(self.backend.state, self.notice)
        return (self.header(), gr.update(value=notice, visible=bool(notice)), counters_html(self.scraper.latest),
                timeline, kv_fig, kv_md, html.escape(self.load.status()))


def build_remote_app(client: RemoteClient, scraper: MetricsScraper, kv_map: KVMap | None = None,
                     subscribers: Sequence[KVSubscriber] = (), *, kv_off_reason: str | None = None,
                     refresh_s: float = 1.0, notice: str | None = None,
                     backend: RemoteBackend | None = None) -> gr.Blocks:
    """The remote-mode page.

    Args:
        client: the chat client (first backend URL).
        scraper: the ``/metrics`` scraper (every backend URL).
        kv_map: the KV events' map (None: the KV map says it is off, and ``kv_off_reason`` why).
        subscribers: the KV subscribers feeding ``kv_map``.
        kv_off_reason: why the KV map is off (default: no KV events URL was given).
        refresh_s: seconds between two refreshes of the panels, header and notice (``gr.Timer``).
        notice: a fixed warning line under the header, if any (the server's own state is added to it).
        backend: the chat backend (default: one on ``client``).

    Returns:
        the ``gr.Blocks``; ``demo.cbp_remote`` is its :class:`RemoteHandlers`, ``demo.cbp_router`` the live
        channel's routes (include them in the app that serves the page), ``demo.cbp_head`` its ``<head>`` lines.
    """
    h = RemoteHandlers(client, scraper, kv_map, subscribers, kv_off_reason, refresh_s, backend=backend,
                       notice=notice)
    with gr.Blocks(title="Continuous Batching Playground (remote)", fill_width=True) as demo:
        header_md, notice_md = remote_header(h, notice)
        with gr.Row(equal_height=False):
            with gr.Column(scale=2, min_width=360):
                col = chat_column(CHAT_TEXTS, max_new_tokens=2048, seed=False)
                n_chats, rate, start_btn, stop_btn, load_md = remote_load_generator()
            with gr.Column(scale=3, min_width=480):
                counters, timeline, kv_plot, kv_md = remote_panels()
        live_area = gr.HTML('<div id="cbp-live"></div>', padding=False, elem_id="cbp-live-area")
        hidden = chat_hidden()
        timer = gr.Timer(refresh_s)
        outputs = [header_md, notice_md, counters, timeline, kv_plot, kv_md, load_md]
        timer.tick(h.refresh, None, outputs, show_progress="hidden", api_visibility="private", concurrency_limit=None)
        demo.load(h.on_load, None, [live_area, *outputs], show_progress="hidden", api_visibility="private")
        wire_chat(h.chat, col, hidden)
        start_btn.click(h.start_load, [n_chats, rate], load_md, api_name="start_load", concurrency_limit=None)
        stop_btn.click(h.stop_load, None, load_md, api_name="stop_load", concurrency_limit=None)
    demo.cbp_remote = h
    demo.cbp_router = h.router()
    demo.cbp_head = '<script src="cbp/live.js" data-refresh="0.25" defer></script>'
    return demo


def remote_header(h: RemoteHandlers, notice: str | None) -> tuple[gr.Markdown, gr.Markdown]:
    """The header (where chats go, what is scraped) and the notice under it (hidden while empty)."""
    header_md = gr.Markdown(h.header(), elem_id="remote-header")
    first_notice = notice_markdown(h.backend.state, notice)
    notice_md = gr.Markdown(first_notice, visible=bool(first_notice), elem_id="remote-notice")
    return header_md, notice_md


def remote_load_generator() -> tuple[gr.Slider, gr.Slider, gr.Button, gr.Button, gr.HTML]:
    """The load generator's accordion: ``(chats, rate, start, stop, status line)``."""
    with gr.Accordion("Load generator", open=True):
        gr.Markdown("Synthetic chats (built-in prompts of varied length, 16-256 new tokens) sent to "
                    "the remote server at a rate, streamed; shared by every tab of this page.",
                    elem_classes="cbp-note")
        with gr.Row():
            n_chats = gr.Slider(1, 256, value=16, step=1, label="chats", elem_id="num-chats")
            rate = gr.Slider(0.5, 50, value=4, step=0.5, label="per second", elem_id="load-rate")
        with gr.Row():
            start_btn = gr.Button("Start load", variant="primary", elem_id="start-load")
            stop_btn = gr.Button("Stop load", variant="stop", elem_id="stop-load")
        load_md = gr.HTML('<div id="load-status"></div>', elem_id="load-status-area")
    return n_chats, rate, start_btn, stop_btn, load_md


def remote_panels() -> tuple[gr.HTML, gr.Plot, gr.Plot, gr.Markdown]:
    """The panels column: ``(counters per engine, this page's request timeline, KV map, its caption)``."""
    gr.Markdown("### Counters per engine (from /metrics)")
    counters = gr.HTML(counters_html([]), elem_id="remote-counters-area")
    gr.Markdown(f"### This page's requests\n\n{TIMELINE_NOTE}", elem_classes="cbp-note")
    timeline = gr.Plot(label="requests (client view)", elem_id="remote-timeline")
    gr.Markdown("### KV map (from KV cache events)")
    kv_plot = gr.Plot(label="KV blocks by hash", elem_id="remote-kv")
    kv_md = gr.Markdown(elem_classes="cbp-note", elem_id="remote-kv-caption")
    return counters, timeline, kv_plot, kv_md


def remote_mount_kwargs(demo: gr.Blocks | None = None) -> dict[str, Any]:
    """The page's look for ``gr.mount_gradio_app``: its style, footer links, no run history, and the live
    channel's script in ``<head>`` (``demo.cbp_head``)."""
    kw: dict[str, Any] = {"css": REMOTE_CSS, "footer_links": ["api", "gradio", "settings"], "run_history": False}
    head = getattr(demo, "cbp_head", None)
    if head:
        kw["head"] = head
    return kw


def launch_remote(demo: gr.Blocks, **kwargs: Any) -> Any:
    """``demo.launch(...)`` with the page's look and its live-channel routes (ahead of Gradio's own), not
    blocking; ``kwargs`` go to launch. Close it with ``demo.close()``."""
    result = demo.launch(**{**remote_mount_kwargs(demo), **kwargs}, prevent_thread_lock=True)
    router = getattr(demo, "cbp_router", None)
    if router is not None:
        routes = demo.app.router.routes
        before = len(routes)
        demo.app.include_router(router)
        routes[:] = routes[before:] + routes[:before]
    return result
