"""One server, one port: the OpenAI-compatible API (``/v1/...``, ``/health``, ``/metrics``) and, when
given, a Gradio app (``/``), run by uvicorn.

``build_server`` adds the API routes first, then mounts the Gradio app at ``/`` (a catch-all mount, so
it must come last); :func:`server.serving.serve` runs the result, or :class:`server.serving.ServerThread` in a
background thread (tests, notebooks), both with the HTTP limits of :mod:`server.http_edge` (``app.state.http_limits``,
set by ``build_server``). The module knows nothing of the
playground's page: its Gradio look (css, translations, footer) comes in as ``mount_kwargs``
(``ui.layout.mount_kwargs(demo)`` in ``app.py``).
"""

from __future__ import annotations

import atexit
import logging
from typing import Any

from fastapi import FastAPI

from engine import AsyncEngine
from server.http_edge import HTTPLimits
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
        http_limits: the HTTP limits :func:`server.serving.serve` enforces (``app.state.http_limits``; None: the defaults).
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
    publisher = KVEventPublisher(lambda: engine.telemetry, engine.config.block_size, cfg).start()
    atexit.register(publisher.stop)
    shown = ", replay " + str(publisher.replay_endpoint) if publisher.replay_endpoint else ""
    how = "bound on" if binds(publisher.endpoint or "") else "connecting to (no * in the endpoint: vLLM's rule)"
    log.info("KV cache events (vLLM format, %s encoding) %s %s%s, topic %r", cfg.encoding, how, publisher.endpoint,
             shown, cfg.topic)
    return publisher
