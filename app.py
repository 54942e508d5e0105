"""Continuous Batching Playground: one engine for the whole process, many browser chats on it.

Run ``python app.py`` (no argument needed: the embedded SmolLM2-135M-Instruct, 16 batch slots). Every
option can also be set by an environment variable (``CBP_`` + the option name in capitals with
underscores, e.g. ``CBP_MAX_NUM_SEQS=32``); a command-line option wins over its variable. On Hugging Face
Spaces the file runs as is: Gradio reads ``GRADIO_SERVER_NAME`` / ``GRADIO_SERVER_PORT`` there.

The options are declared once: the engine's in :mod:`engine.options` (with the playground's defaults,
:data:`engine.options.PLAYGROUND_DEFAULTS`), the server's in :mod:`server.options`, the page's below.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
from collections.abc import Mapping, Sequence

from engine import options
from engine.options import PLAYGROUND_DEFAULTS, Option
from server.options import add_server_options, server_kwargs

UI_OPTIONS: tuple[Option, ...] = (
    Option("refresh", float, 0.5, "seconds between panel refreshes in each tab", low=0, low_open=True),
    Option("host_key", str, "", "talk mode in a shared demo: when set, only a page opened with ?host=<key> may "
           "pause, step or slow the engine (on a Space, set CBP_HOST_KEY as a secret); empty: every page may"),
)

# num_blocks is the playground's default only when no KV size is given at all (--num-blocks and
# --kv-cache-memory are exclusive): it is applied after parsing, not as the flag's default.
_PARSER_DEFAULTS = {**PLAYGROUND_DEFAULTS, "num_blocks": None}


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The app's parser: the engine's options (playground defaults), the server's, the page's; each
    defaulting to its ``CBP_*`` variable in ``env`` when given.

    Raises:
        ValueError: a ``CBP_*`` variable holds an invalid value.
    """
    p = argparse.ArgumentParser(
        description="Continuous Batching Playground: many browser chats on one LLM engine.",
        epilog=f"--num-blocks defaults to {PLAYGROUND_DEFAULTS['num_blocks']} when --kv-cache-memory is not "
               "given. Every option also reads CBP_<OPTION> from the environment, e.g. CBP_PORT=7860.",
    )
    options.add_engine_options(p, env=env, defaults=_PARSER_DEFAULTS)
    add_server_options(p, env=env)
    options.add_options(p, UI_OPTIONS, env=env)
    return p


def parse_args(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> argparse.Namespace:
    """Options from ``argv`` (default: ``sys.argv[1:]``), each defaulting to its ``CBP_*`` variable in ``env``
    (default: ``os.environ``), then to the built-in default. Exits (``SystemExit``, as argparse does) on a
    bad option or variable, or when both ``--num-blocks`` and ``--kv-cache-memory`` are given."""
    env = os.environ if env is None else env
    try:
        p = build_parser(env)
    except ValueError as e:  # a CBP_* variable that does not parse
        argparse.ArgumentParser(prog=os.path.basename(__file__)).error(str(e))
    args = p.parse_args(argv)
    if args.num_blocks is not None and args.kv_cache_memory is not None:
        p.error("give --num-blocks or --kv-cache-memory, not both")
    if args.num_blocks is None and args.kv_cache_memory is None:
        args.num_blocks = PLAYGROUND_DEFAULTS["num_blocks"]
    return args


def engine_kwargs(args: argparse.Namespace) -> dict:
    """Keyword arguments of ``AsyncEngine.from_args`` from the parsed options (unset ones left out,
    so the engine's own defaults apply)."""
    return {k: v for k, v in options.engine_kwargs(args).items() if v is not None or k == "model"}


def main(argv: Sequence[str] | None = None) -> None:
    """Parse options, start one engine, serve the Gradio app and the OpenAI-compatible API on one port
    until interrupted."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from engine.async_engine import AsyncEngine
    from server import build_server, serve
    from ui.layout import build_app, launch, mount_kwargs

    engine = AsyncEngine.from_args(**engine_kwargs(args))
    atexit.register(engine.shutdown)
    demo = build_app(engine, model_name=args.model, refresh_s=args.refresh, host_key=args.host_key or None)
    if args.share:  # a gradio.live link needs demo.launch(); the OpenAI API is not served then
        engine.max_pending = args.max_pending
        launch(demo, server_name=args.host, server_port=args.port, share=True)
        return
    # one port for both: the OpenAI-compatible API routes first, the Gradio app mounted at /
    app = build_server(engine, demo, **server_kwargs(args), mount_kwargs=mount_kwargs())
    serve(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
