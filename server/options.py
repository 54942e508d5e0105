"""The server's command-line options, declared once as :class:`engine.options.Option` (flag, type,
default, help and ``CBP_*`` variable): where it listens, how much it admits, the HTTP limits at its edge,
which other origins may read it (CORS) and how chat messages are tokenized.

``app.py`` adds them next to :data:`engine.options.ENGINE_OPTIONS`; :func:`server_kwargs` turns the
parsed values into :func:`server.app.build_server` arguments (:func:`http_limits` and :func:`cors_settings`
the HTTP limits and the CORS policy alone, for the remote mode's page).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import dataclass

from engine import Option, add_options
from server.http_limits import (
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_HEADER_FIELDS,
    DEFAULT_MAX_URL_BYTES,
    DEFAULT_TIMEOUT_KEEP_ALIVE,
    DEFAULT_TIMEOUT_REQUEST_BODY,
    DEFAULT_TIMEOUT_REQUEST_HEAD,
    HTTPLimits,
)

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # 4 MiB: see the option's help

SERVER_OPTIONS: tuple[Option, ...] = (
    Option("host", str, None, "address to bind (default: GRADIO_SERVER_NAME or 127.0.0.1; 0.0.0.0 for all)"),
    Option("port", int, None, "port (default: GRADIO_SERVER_PORT or the first free one from 7860)", low=0,
           high=65535),
    Option("share", bool, False, "create a public gradio.live link (the OpenAI API is not served then)"),
    Option("max_pending", int, 256,
           "requests in flight at once (chats + API); more get 'busy, retry' / HTTP 429", low=1),
    Option("rate_limit", int, 0, "API requests per --rate-period per client host; 0 = no limit", low=0),
    Option("rate_period", float, 60.0, "seconds of the rate-limit window", low=0, low_open=True),
    Option("queue_size", int, 256, "Gradio's event queue bound", low=1),
    Option("max_request_body_bytes", int, DEFAULT_MAX_BODY_BYTES,
           "largest API request body in bytes; larger ones get HTTP 413 unread (the default, 4 MiB, holds a "
           "full context as escaped JSON with room for logit_bias over the whole vocabulary)", low=1),
    Option("max_header_bytes", int, DEFAULT_MAX_HEADER_BYTES,
           "largest request head (request line and header fields) in bytes; larger ones get HTTP 431 and the "
           "connection is closed", low=1),
    Option("max_header_fields", int, DEFAULT_MAX_HEADER_FIELDS,
           "most header fields of a request; more get HTTP 431 (vLLM's limit)", low=1),
    Option("max_url_bytes", int, DEFAULT_MAX_URL_BYTES,
           "longest request target (path and query) in bytes; longer ones get HTTP 414", low=1),
    Option("timeout_request_head", float, DEFAULT_TIMEOUT_REQUEST_HEAD,
           "seconds a client has to send a whole request head (from the connection's opening, or from the "
           "request's first byte on a kept-alive connection); then HTTP 408 and closed: a client trickling its "
           "head (slowloris) is dropped", low=0, low_open=True),
    Option("timeout_request_body", float, DEFAULT_TIMEOUT_REQUEST_BODY,
           "seconds a client has to send a whole request body once its head arrived; then HTTP 408 (or closed "
           "if answered) (the 4 MiB body limit at 70 KB/s)", low=0, low_open=True),
    Option("timeout_keep_alive", int, DEFAULT_TIMEOUT_KEEP_ALIVE, "seconds an idle kept-alive connection stays open (uvicorn's)", low=1),
    Option("allowed_origins", str, "",
           "origins whose pages may read the API from a browser (CORS), as vLLM's: a JSON list or comma-separated, "
           "'*' for any; default none (same origin only; the Gradio page keeps its own rule)"),
    Option("allowed_methods", str, "*", "HTTP methods allowed to those origins (CORS; JSON list or commas)"),
    Option("allowed_headers", str, "*", "request headers allowed to those origins (CORS; JSON list or commas)"),
    Option("allow_credentials", bool, False, "let those origins send credentials (cookies) along (CORS; not with '*')"),
    Option("special_tokens_in_messages", bool, False,
           "read special-token strings typed in chat messages (<|im_end|>, <|im_start|>...) as control tokens, "
           "as a plain render of the chat template would: any client can then forge turns (a system message) "
           "in its own request; off (default): message text is always text, only the template's own markup is "
           "special; a request may set its own 'special_tokens_in_messages'"),
    Option("served_model_name", str, None,
           "model name of the OpenAI API (default: --model, or SmolLM2-135M-Instruct)"),
    Option("kv_events_config", str, None,
           "publish KV cache events as vLLM does, with vLLM's JSON: '{\"enable_kv_cache_events\": true, "
           "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\", "
           "\"topic\": \"kv-events\"}' (ZMQ + msgpack; needs prefix caching); default off"),
    Option("log_level", str, "info", "how much the app logs; debug adds tracebacks, kernel and library detail",
           choices=("debug", "info", "warning", "error")),
)


def add_server_options(parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None,
                       defaults: Mapping[str, object] | None = None, title: str | None = None) -> None:
    """Add :data:`SERVER_OPTIONS` to ``parser`` (see :func:`engine.options.add_options`), in an argument
    group when ``title`` is given.

    Raises:
        ValueError: a ``CBP_*`` variable in ``env`` holds an invalid value.
    """
    add_options(parser, SERVER_OPTIONS, env=env, defaults=defaults, title=title)


@dataclass(frozen=True)
class CORSSettings:
    """Which other origins may read the API from a browser (Starlette's ``CORSMiddleware`` arguments).

    Attributes:
        origins: allowed origins (``"*"`` = any); empty: no cross-origin reads.
        methods, headers: allowed methods and request headers (``"*"`` = any).
        credentials: whether cookies / authorization may be sent along (never with origin ``"*"``).
    """

    origins: tuple[str, ...] = ()
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False


def parse_list(text: str | None) -> tuple[str, ...]:
    """A list option's value: a JSON list of strings (vLLM's form, ``'["http://a.b"]'``) or comma-separated.

    Raises:
        ValueError: JSON that is not a list of strings.
    """
    text = (text or "").strip()
    if text.startswith("["):
        items = json.loads(text)
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise ValueError(f"expected a JSON list of strings, got {text!r}")
        return tuple(x.strip() for x in items if x.strip())
    return tuple(x.strip() for x in text.split(",") if x.strip())


def cors_settings(args: argparse.Namespace) -> CORSSettings:
    """The CORS policy of the parsed options (see :class:`CORSSettings`).

    Raises:
        ValueError: a list that does not parse, or credentials with origin ``*``.
    """
    cors = CORSSettings(parse_list(args.allowed_origins), parse_list(args.allowed_methods) or ("*",),
                        parse_list(args.allowed_headers) or ("*",), bool(args.allow_credentials))
    if cors.credentials and "*" in cors.origins:
        raise ValueError("--allow-credentials needs explicit --allowed-origins, not '*' (browsers refuse both)")
    return cors


def http_limits(args: argparse.Namespace) -> HTTPLimits:
    """The :class:`server.http_limits.HTTPLimits` of the parsed options."""
    return HTTPLimits(max_header_bytes=args.max_header_bytes, max_header_fields=args.max_header_fields,
                      max_url_bytes=args.max_url_bytes, timeout_request_head=args.timeout_request_head,
                      timeout_request_body=args.timeout_request_body, timeout_keep_alive=args.timeout_keep_alive)


def server_kwargs(args: argparse.Namespace) -> dict:
    """:func:`server.app.build_server` keyword arguments from a namespace parsed with
    :func:`add_server_options` (``rate_limit`` 0 means no limit: None).

    Raises:
        ValueError: a CORS list that does not parse (see :func:`cors_settings`).
    """
    return {"model_name": args.served_model_name, "max_pending": args.max_pending,
            "rate_limit": args.rate_limit or None, "rate_period": args.rate_period, "queue_size": args.queue_size,
            "max_request_body_bytes": args.max_request_body_bytes,
            "kv_events_config": getattr(args, "kv_events_config", None),
            "http_limits": http_limits(args), "cors": cors_settings(args),
            "special_tokens_in_messages": bool(args.special_tokens_in_messages)}
