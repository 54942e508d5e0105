"""Remote mode's page: a chat and the load generator sent to a remote OpenAI-compatible server, beside panels of
what a client can see of it: the counters of each server's ``/metrics``, this page's requests over time, and the
KV blocks its KV events tell of. No model runs in this process.

The chat streams as one Gradio event per reply (a generator); Stop cancels the reply's stream task, which closes
its HTTP connection (the server aborts the request). The panels refresh on a ``gr.Timer`` (about once a second);
each refresh scrapes ``/metrics`` at most once per refresh period for all tabs together.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import gradio as gr
import plotly.graph_objects as go

from ui.chat import session_of, to_messages
from ui.remote_client import RemoteClient, RemoteError, RemoteLoad
from ui.remote_figures import TIMELINE_NOTE, counters_html, kv_map_figure, kv_summary, timeline_figure
from ui.remote_kv import NOT_EXPOSED, KVMap, KVSubscriber
from ui.remote_metrics import MetricsScraper

REMOTE_CSS = """
.cbp-note { font-size: 0.9em; }
#remote-counters { border-collapse: collapse; font-size: 0.85em; font-variant-numeric: tabular-nums; width: 100%; }
#remote-counters th, #remote-counters td { border: 1px solid var(--border-color-primary); padding: 2px 6px; }
#remote-counters th { text-align: left; font-weight: 600; }
#remote-counters .cbp-error td { color: var(--error-text-color, #b00); }
#load-status { font-variant-numeric: tabular-nums; min-height: 1.4em; }
"""
KV_OFF_NO_URL = ("KV map off: no --kv-events-url given (start the server with KV cache events on, e.g. vLLM's "
                 "--kv-events-config '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": "
                 "\"tcp://*:5557\"}' with prefix caching, and pass --kv-events-url tcp://host:5557)")
_DONE, _STOPPED = object(), object()


class RemoteHandlers:
    """The page's event handlers, callable without a browser (tests pass ``request=None``: one anonymous tab).

    Args:
        client: where chats and load go.
        scraper: reads every server's ``/metrics``.
        kv_map: the KV events' block map (None: KV map off, for ``kv_off_reason``).
        subscribers: the KV event subscribers feeding ``kv_map`` (their errors are shown).
        kv_off_reason: why the KV map is off (shown instead of it).
        refresh_s: seconds between two scrapes at most (the panels' refresh period).
        window_s: seconds of the request timeline.
    """

    def __init__(self, client: RemoteClient, scraper: MetricsScraper, kv_map: KVMap | None = None,
                 subscribers: Sequence[KVSubscriber] = (), kv_off_reason: str | None = None, refresh_s: float = 1.0,
                 window_s: float = 120.0) -> None:
        self.client = client
        self.scraper = scraper
        self.kv_map = kv_map
        self.subscribers = list(subscribers)
        self.kv_off_reason = kv_off_reason if kv_map is None else None
        if kv_map is None and self.kv_off_reason is None:
            self.kv_off_reason = KV_OFF_NO_URL
        self.refresh_s = refresh_s
        self.window_s = window_s
        self.load = RemoteLoad(client)
        self._streams: dict[str, asyncio.Task] = {}
        self._scrape_lock = asyncio.Lock()

    async def respond(self, message: str, history: list[dict] | None, temperature: float = 0.7, top_p: float = 0.9,
                      max_tokens: float = 256, request: gr.Request | None = None,
                      ) -> AsyncIterator[tuple[list[dict], str]]:
        """Send ``message`` (after ``history``) and stream the reply: yields ``(chatbot value, textbox value)``
        as text arrives; the last one carries the whole reply, ``" [stopped]"`` after Stop, or the error."""
        history = list(history or [])
        if not (message or "").strip():
            yield history, message or ""
            return
        session = session_of(request)
        old = self._streams.pop(session, None)
        if old is not None:  # one reply per tab: a new message stops the previous one
            old.cancel()
        messages = [*to_messages(history), {"role": "user", "content": message}]
        shown = [*history, {"role": "user", "content": message}]
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for text in self.client.stream_chat(messages, max_tokens=int(max_tokens),
                                                          temperature=float(temperature), top_p=float(top_p)):
                    queue.put_nowait(text)
                queue.put_nowait(_DONE)
            except RemoteError as exc:
                queue.put_nowait(exc)
            except asyncio.CancelledError:
                queue.put_nowait(_STOPPED)
                raise
            except Exception as exc:  # noqa: BLE001 -- the reply must end, whatever failed
                queue.put_nowait(RemoteError(f"{type(exc).__name__}: {exc}"))

        task = asyncio.get_running_loop().create_task(pump())
        self._streams[session] = task
        reply = ""
        try:
            yield [*shown, {"role": "assistant", "content": ""}], ""
            item = await queue.get()
            while True:
                if isinstance(item, str):
                    reply += item
                    item = None
                    while not queue.empty():  # what arrived meanwhile goes out in one update
                        item = queue.get_nowait()
                        if not isinstance(item, str):
                            break
                        reply += item
                        item = None
                    yield [*shown, {"role": "assistant", "content": reply}], ""
                    if item is None:
                        item = await queue.get()
                    continue
                if item is _STOPPED:
                    reply += " [stopped]"
                elif isinstance(item, RemoteError):
                    reply = (reply + "\n\n" if reply else "") + f"⚠️ {item}"
                break
            yield [*shown, {"role": "assistant", "content": reply}], ""
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if self._streams.get(session) is task:
                del self._streams[session]

    def stop(self, request: gr.Request | None = None) -> None:
        """Stop this tab's reply: its stream is closed, so the server aborts the request."""
        task = self._streams.get(session_of(request))
        if task is not None:
            task.cancel()

    def clear(self, request: gr.Request | None = None) -> tuple[list[dict], str]:
        """Stop this tab's reply and empty its chat: ``(chatbot value, textbox value)``."""
        self.stop(request)
        return [], ""

    async def start_load(self, n: float, rate: float) -> str:
        """Start ``n`` synthetic chats at ``rate`` per second; returns the load status line."""
        self.load.start(int(n), float(rate))
        return self.load.status()

    async def stop_load(self) -> str:
        """Stop every synthetic chat (their connections close); returns the load status line."""
        self.load.stop()
        return self.load.status()

    async def scrape(self) -> None:
        """Scrape every ``/metrics`` unless another tab did within the refresh period (in a worker thread)."""
        if self._scrape_lock.locked():  # another tab's scrape is under way: show the latest, do not queue
            return
        async with self._scrape_lock:
            if time.time() - self.scraper.latest_at >= 0.8 * self.refresh_s:
                await asyncio.to_thread(self.scraper.scrape)

    def kv_panel(self) -> tuple[go.Figure, str]:
        """The KV map figure and its caption (markdown)."""
        if self.kv_map is None:
            return kv_map_figure([], off_reason=self.kv_off_reason), f"_{self.kv_off_reason}._"
        errors = [f"{s.endpoint}: {s.error}" for s in self.subscribers if s.error]
        caption = kv_summary(self.kv_map.summary(), list(self.kv_map.sources), errors, self.kv_map.block_size,
                             NOT_EXPOSED)
        return kv_map_figure(self.kv_map.records()), caption

    async def refresh(self) -> tuple[str, go.Figure, go.Figure, str, str]:
        """Every panel now: counters (HTML), request timeline, KV map, its caption, the load status line."""
        await self.scrape()
        now = time.time()
        kv_fig, kv_md = self.kv_panel()
        timeline = timeline_figure(self.client.log.records(since=now - self.window_s), now, self.window_s)
        return (counters_html(self.scraper.latest), timeline, kv_fig, kv_md,
                html.escape(self.load.status()))


def header_markdown(client: RemoteClient, metrics_urls: Sequence[str], kv_urls: Sequence[str]) -> str:
    """The page's header: where chats go, which servers are scraped, where KV events come from."""
    kv = ", ".join(f"`{u}`" for u in kv_urls) or "none"
    return ("# Continuous Batching Playground: remote mode\n\n"
            f"Chats and the load generator go to `{client.base_url}` (model `{client.model or 'its first'}`), "
            f"streamed; Stop closes the stream (the server aborts the request). Metrics from: "
            f"{', '.join(f'`{u}`' for u in metrics_urls)}. KV events from: {kv}.\n\n"
            "No model runs here: the panels show what a client and these public interfaces can see (counters, this "
            "page's requests, KV events), not the engine's own batch slots or block table.")


def build_remote_app(client: RemoteClient, scraper: MetricsScraper, kv_map: KVMap | None = None,
                     subscribers: Sequence[KVSubscriber] = (), *, kv_off_reason: str | None = None,
                     refresh_s: float = 1.0, notice: str | None = None) -> gr.Blocks:
    """The remote-mode page.

    Args:
        client: the chat client (first backend URL).
        scraper: the ``/metrics`` scraper (every backend URL).
        kv_map: the KV events' map (None: the KV map says it is off, and ``kv_off_reason`` why).
        subscribers: the KV subscribers feeding ``kv_map``.
        kv_off_reason: why the KV map is off (default: no KV events URL was given).
        refresh_s: seconds between two refreshes of the panels (``gr.Timer``).
        notice: a warning line under the header, if any.

    Returns:
        the ``gr.Blocks``; ``demo.cbp_remote`` is its :class:`RemoteHandlers`.
    """
    h = RemoteHandlers(client, scraper, kv_map, subscribers, kv_off_reason, refresh_s)
    kv_urls = [s.endpoint for s in subscribers]
    with gr.Blocks(title="Continuous Batching Playground (remote)", fill_width=True) as demo:
        gr.Markdown(header_markdown(client, scraper.urls, kv_urls))
        if notice:
            gr.Markdown(f"⚠️ {notice}")
        with gr.Row(equal_height=False):
            with gr.Column(scale=2, min_width=360):
                chatbot = gr.Chatbot(label="chat (remote)", height=430, elem_id="chatbot", buttons=["copy"],
                                     feedback_options=None)
                with gr.Row():
                    msg = gr.Textbox(show_label=False, placeholder="Type a message", scale=5, lines=1, max_lines=4,
                                     elem_id="msg")
                    send = gr.Button("Send", variant="primary", scale=1, min_width=70, elem_id="send")
                    stop = gr.Button("Stop", variant="stop", scale=1, min_width=70, elem_id="stop")
                    clear = gr.Button("Clear", scale=1, min_width=70, elem_id="clear")
                with gr.Accordion("Sampling", open=False):
                    temperature = gr.Slider(0.0, 2.0, value=0.7, step=0.05, label="temperature")
                    top_p = gr.Slider(0.05, 1.0, value=0.9, step=0.05, label="top_p")
                    max_new = gr.Slider(1, 2048, value=256, step=1, label="max new tokens")
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
            with gr.Column(scale=3, min_width=480):
                gr.Markdown("### Counters per engine (from /metrics)")
                counters = gr.HTML(counters_html([]), elem_id="remote-counters-area")
                gr.Markdown(f"### This page's requests\n\n{TIMELINE_NOTE}", elem_classes="cbp-note")
                timeline = gr.Plot(label="requests (client view)", elem_id="remote-timeline")
                gr.Markdown("### KV map (from KV cache events)")
                kv_plot = gr.Plot(label="KV blocks by hash", elem_id="remote-kv")
                kv_md = gr.Markdown(elem_classes="cbp-note", elem_id="remote-kv-caption")
        timer = gr.Timer(refresh_s)
        outputs = [counters, timeline, kv_plot, kv_md, load_md]
        timer.tick(h.refresh, None, outputs, show_progress="hidden", api_visibility="private",
                   concurrency_limit=None)
        demo.load(h.refresh, None, outputs, show_progress="hidden", api_visibility="private")
        gr.on([msg.submit, send.click], h.respond, [msg, chatbot, temperature, top_p, max_new], [chatbot, msg],
              api_name="chat", concurrency_limit=None, show_progress="hidden")
        stop.click(h.stop, None, None, api_name="stop", queue=False)
        clear.click(h.clear, None, [chatbot, msg], api_name="clear", queue=False)
        start_btn.click(h.start_load, [n_chats, rate], load_md, api_name="start_load", concurrency_limit=None)
        stop_btn.click(h.stop_load, None, load_md, api_name="stop_load", concurrency_limit=None)
    demo.cbp_remote = h
    return demo


def remote_mount_kwargs() -> dict[str, Any]:
    """The page's look for ``gr.mount_gradio_app``: its style, footer links, no run history."""
    return {"css": REMOTE_CSS, "footer_links": ["api", "gradio", "settings"], "run_history": False}
