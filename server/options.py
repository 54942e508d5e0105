"""The server's command-line options, declared once as :class:`engine.options.Option` (flag, type,
default, help and ``CBP_*`` variable): where it listens and how much it admits.

``app.py`` adds them next to :data:`engine.options.ENGINE_OPTIONS`; :func:`server_kwargs` turns the
parsed values into :func:`server.app.build_server` arguments.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from engine.options import Option, add_options

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


def server_kwargs(args: argparse.Namespace) -> dict:
    """:func:`server.app.build_server` keyword arguments from a namespace parsed with
    :func:`add_server_options` (``rate_limit`` 0 means no limit: None)."""
    return {"model_name": args.served_model_name, "max_pending": args.max_pending,
            "rate_limit": args.rate_limit or None, "rate_period": args.rate_period, "queue_size": args.queue_size,
            "max_request_body_bytes": args.max_request_body_bytes,
            "kv_events_config": getattr(args, "kv_events_config", None)}
