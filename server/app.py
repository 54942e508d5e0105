"""One server, one port: the OpenAI-compatible API (``/v1/...``, ``/health``, ``/metrics``) and, when
given, a Gradio app (``/``), run by uvicorn.

``build_server`` adds the API routes first, then mounts the Gradio app at ``/`` (a catch-all mount, so
it must come last); ``serve`` runs the result; ``ServerThread`` runs it in a background thread (tests,
notebooks). Both run uvicorn through :func:`uvicorn_config`: its httptools protocol with the HTTP limits of
:mod:`server.http_edge` (``app.state.http_limits``, set by ``build_server``). The module knows nothing of the
playground's page: its Gradio look (css, translations, footer) comes in as ``mount_kwargs``
(``ui.layout.mount_kwargs(demo)`` in ``app.py``).
"""

from __future__ import annotations

import atexit
import gc
import logging
import socket
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from engine import AsyncEngine
from server.address import DEFAULT_HOST, bind
from server.http_edge import HTTPLimits, protocol_class
from server.http_guards import DEFAULT_MAX_BODY_BYTES
from server.kv_publisher import KVEventPublisher, KVEventsConfig, binds, parse_kv_events_config
from server.openai_api import create_api
from server.options import CORSSettings

log = logging.getLogger(__name__)


def build_server(engine: AsyncEngine, demo=None, model_name: str | None = None, *, max_pending: int | None = None,
                 rate_limit: int | None = None, rate_period: float = 1.0, retry_after: int = 1,
                 queue_size: int | None = None, mount_kwargs: dict[str, Any] | None = None,
                 max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 kv_events_config: str | KVEventsConfig | None = None, http_limits: HTTPLimits | None = None,
                 cors: CORSSettings | None = None, special_tokens_in_messages: bool = False) -> FastAPI:
    """The FastAPI app serving the API and, at ``/``, the Gradio ``demo``.

    Args:
        engine: the started engine shared by the API and the UI.
        demo: a ``gr.Blocks`` (None: API only).
        model_name: the model name of the API (``/v1/models``, the ``model`` field); None = default.
        max_pending: if given, sets ``engine.max_pending``: most requests in flight in the engine (API
            and UI together); one more gets HTTP 429 on the API, ``EngineOverloadedError`` in the UI.
        rate_limit, rate_period: at most ``rate_limit`` API generation requests per ``rate_period``
            seconds per client host (None = unlimited); past it HTTP 429 with ``Retry-After``.
        retry_after: ``Retry-After`` seconds of an overload 429.
        queue_size: Gradio's queue bound (``demo.queue(max_size=...)``; None = unbounded).
        mount_kwargs: keyword arguments of ``gr.mount_gradio_app`` (css, i18n, theme, footer_links...);
            the playground's are ``ui.layout.mount_kwargs(demo)``. None = Gradio's defaults.
        max_request_body_bytes: the largest API request body (bytes); larger ones get HTTP 413.
        kv_events_config: vLLM's ``--kv-events-config`` JSON (or its parsed form): when enabled, the engine's KV
            cache events are published over ZMQ in vLLM's format (:mod:`server.kv_publisher`); the
            publisher is ``app.state.kv_publisher`` (None when off).
        http_limits: the HTTP limits :func:`serve` enforces (``app.state.http_limits``; None: the defaults).
        cors: which other origins may read the API (None: none); see :func:`server.openai_api.create_api`.
        special_tokens_in_messages: the default of the chat requests' ``special_tokens_in_messages`` (see
            :func:`server.openai_api.create_api`).

    Raises:
        ValueError: ``kv_events_config`` does not parse (:func:`server.kv_publisher.parse_kv_events_config`).
        zmq.ZMQError: a KV event endpoint cannot be bound.
    """
    if max_pending is not None:
        engine.max_pending = max_pending
    app = create_api(engine, model_name, rate_limit=rate_limit, rate_period=rate_period, retry_after=retry_after,
                     max_body_bytes=max_request_body_bytes, cors=cors,
                     special_tokens_in_messages=special_tokens_in_messages)
    app.state.http_limits = http_limits or HTTPLimits()
    app.state.kv_publisher = start_kv_publisher(engine, kv_events_config)
    if demo is not None:
        import gradio as gr

        demo.queue(max_size=queue_size)
        router = getattr(demo, "cbp_router", None)  # the page's own routes (its live channel), ahead of it
        if router is not None:
            app.include_router(router)
        gr.mount_gradio_app(app, demo, path="/", **dict(mount_kwargs or {}))
    return app


def start_kv_publisher(engine: AsyncEngine, config: str | KVEventsConfig | None) -> KVEventPublisher | None:
    """Start publishing ``engine``'s KV cache events when ``config`` enables it (else None); the publisher
    stops with the process (atexit). Without prefix caching it warns: no block is ever stored then.

    Raises:
        ValueError: ``config`` does not parse. zmq.ZMQError: an endpoint cannot be bound.
    """
    cfg = parse_kv_events_config(config) if isinstance(config, str) or config is None else config
    if cfg is None or not cfg.enabled:
        return None
    if not engine.config.enable_prefix_caching:
        log.warning("KV events are on but prefix caching is off: no block will ever be published as stored")
    publisher = KVEventPublisher(engine.telemetry, engine.config.block_size, cfg).start()
    atexit.register(publisher.stop)
    shown = ", replay " + str(publisher.replay_endpoint) if publisher.replay_endpoint else ""
    how = "bound on" if binds(publisher.endpoint or "") else "connecting to (no * in the endpoint: vLLM's rule)"
    log.info("KV cache events (vLLM format, %s encoding) %s %s%s, topic %r", cfg.encoding, how, publisher.endpoint,
             shown, cfg.topic)
    return publisher


class _Server(uvicorn.Server):
    """uvicorn's server, with the playground's exit. At the first Ctrl-C / SIGTERM ``on_exit`` runs (the engine
    ends every request with an error, so each API stream sends its error event and ``[DONE]``, each page chat
    its final status), and uvicorn's own shutdown starts :data:`EXIT_GRACE_S` later, so those last events go
    out on the open connections before uvicorn stops accepting and closes them; a second Ctrl-C exits at once.
    The signal is not raised again afterwards (uvicorn does that to mimic the default handler, which turns a
    Ctrl-C into a ``KeyboardInterrupt`` traceback)."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.on_exit = on_exit
        self._exiting = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._exiting or self.on_exit is None:
            super().handle_exit(sig, frame)
            self._captured_signals.clear()
            return
        self._exiting = True
        self.on_exit()
        timer = threading.Timer(EXIT_GRACE_S, self._begin_shutdown, args=(sig,))
        timer.daemon = True
        timer.start()

    def _begin_shutdown(self, sig: int) -> None:
        if not self.should_exit:
            super().handle_exit(sig, None)
            self._captured_signals.clear()


EXIT_GRACE_S = 0.5  # seconds between the engine ending its streams and uvicorn closing the connections


def uvicorn_config(app, host: str, port: int, log_level: str, limits: HTTPLimits | None = None,
                   timeout_graceful_shutdown: int = 2) -> uvicorn.Config:
    """uvicorn's configuration for ``app``: its httptools protocol bound to ``limits`` (None: ``app.state.http_limits``,
    else the defaults; :mod:`server.http_edge`) and their keep-alive timeout."""
    if limits is None:
        state = getattr(app, "state", None)
        limits = getattr(state, "http_limits", None) or HTTPLimits()
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol_class(limits),
                          timeout_keep_alive=limits.timeout_keep_alive,
                          timeout_graceful_shutdown=timeout_graceful_shutdown)


def serve(app: FastAPI, host: str | None = None, port: int | None = None, log_level: str = "info",
          sock: socket.socket | None = None, on_exit: Callable[[], None] | None = None,
          banner: str = "(UI at /, OpenAI API at /v1, metrics at /metrics)", limits: HTTPLimits | None = None) -> None:
    """Run ``app`` with uvicorn until interrupted (Ctrl-C or SIGTERM), then return, with the HTTP limits of
    :func:`uvicorn_config` (``limits``, else ``app.state.http_limits``). Address: ``sock`` (bound by
    :func:`server.address.bind` before the engine loaded) or :func:`server.address.resolve_address`.
    ``on_exit`` runs (in the signal handler) at the first Ctrl-C / SIGTERM, before the connections close: the
    app ends its streams there. ``banner`` follows the address on the "Running on" line. The objects alive at
    the call are frozen out of the cyclic garbage collector (``gc.freeze``)."""
    if sock is None:
        sock = bind(host, port)
    host, port = sock.getsockname()[:2]
    # What is alive now (model, engine, page: about 500,000 objects for the playground) lives as long as
    # the process: collect the start's garbage, then freeze the rest out of the cyclic collector's sight,
    # so a full collection (server.memory.MemoryRelease after large bodies, or Python's own) takes
    # milliseconds instead of about 150 ms that would stall the event loop and the engine.
    gc.collect()
    gc.freeze()
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    print(f"* Running on http://{shown}:{port}  {banner}", flush=True)
    _Server(uvicorn_config(app, host, port, log_level, limits), on_exit).run(sockets=[sock])


class ServerThread:
    """``app`` served by uvicorn in a daemon thread (tests, notebooks); ``port=0`` picks a free port; the HTTP
    limits are ``limits``, else those of :func:`uvicorn_config`.

    Attributes:
        url: ``http://host:port`` once :meth:`start` returned.
    """

    def __init__(self, app: FastAPI, host: str = DEFAULT_HOST, port: int = 0, log_level: str = "warning",
                 limits: HTTPLimits | None = None) -> None:
        self.server = uvicorn.Server(uvicorn_config(app, host, port, log_level, limits, timeout_graceful_shutdown=2))
        self.host = host
        self.port = port
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    @property
    def url(self) -> str:
        """``http://host:port`` (the real port once started)."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        """Start and wait until the server accepts connections (raises ``RuntimeError`` after ``timeout``)."""
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the server to exit and wait for its thread."""
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
