"""Continuous Batching Playground: one engine for the whole process, many browser chats on it.

Run ``python app.py`` (no argument needed: the embedded SmolLM2-135M-Instruct, 16 batch slots). Every
option can also be set by an environment variable (``CBP_`` + the option name in capitals with
underscores, e.g. ``CBP_MAX_NUM_SEQS=32``); a command-line option wins over its variable. On Hugging Face
Spaces the file runs as is: Gradio reads ``GRADIO_SERVER_NAME`` / ``GRADIO_SERVER_PORT`` there.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
from collections.abc import Mapping, Sequence

ENV_PREFIX = "CBP_"
DEFAULT_MAX_NUM_SEQS = 16
DEFAULT_NUM_BLOCKS = 384  # when no KV size is given: small enough that the block map shows recycling
POLICIES = ("continuous", "static")
_TRUE = {"1", "true", "yes", "on"}


def _env(env: Mapping[str, str], name: str, cast=str):
    value = env.get(ENV_PREFIX + name.upper().replace("-", "_"))
    if value is None or value.strip() == "":
        return None
    if cast is bool:
        return value.strip().lower() in _TRUE
    return cast(value.strip())


def parse_args(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> argparse.Namespace:
    """Options from ``argv`` (default: ``sys.argv[1:]``), each defaulting to its ``CBP_*`` variable in ``env``
    (default: ``os.environ``), then to the built-in default."""
    env = os.environ if env is None else env
    p = argparse.ArgumentParser(
        description="Continuous Batching Playground: many browser chats on one LLM engine.",
        epilog="Every option also reads CBP_<OPTION> from the environment, e.g. CBP_PORT=7860.",
    )
    p.add_argument("--model", default=_env(env, "model"),
                   help="model folder, .gguf file or hub id (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=_env(env, "dtype"), help="bfloat16, float16 or float32 (default: auto)")
    p.add_argument("--device", default=_env(env, "device"), help="cpu or cuda (default: auto)")
    p.add_argument("--host", default=_env(env, "host"),
                   help="address to bind (default: GRADIO_SERVER_NAME or 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=_env(env, "port", int),
                   help="port (default: GRADIO_SERVER_PORT or the first free one from 7860)")
    share = _env(env, "share", bool)
    p.add_argument("--share", action=argparse.BooleanOptionalAction, default=bool(share),
                   help="create a public gradio.live link")
    p.add_argument("--max-num-seqs", type=int, default=_env(env, "max-num-seqs", int) or DEFAULT_MAX_NUM_SEQS,
                   help=f"batch slots: requests computed together (default: {DEFAULT_MAX_NUM_SEQS})")
    p.add_argument("--block-size", type=int, default=_env(env, "block-size", int),
                   help="tokens per KV block (default: the engine's, 16)")
    p.add_argument("--num-blocks", type=int, default=_env(env, "num-blocks", int),
                   help=f"physical KV blocks (default: {DEFAULT_NUM_BLOCKS}, or sized from --kv-cache-memory)")
    p.add_argument("--kv-cache-memory", default=_env(env, "kv-cache-memory"),
                   help='KV cache budget instead of --num-blocks: bytes, "256MiB", "2GiB", or a fraction of '
                        'free device memory such as 0.5')
    p.add_argument("--max-num-batched-tokens", type=int, default=_env(env, "max-num-batched-tokens", int),
                   help="token budget of one engine step (default: the engine's)")
    p.add_argument("--policy", choices=POLICIES, default=_env(env, "policy") or "continuous",
                   help="continuous batching, or static batches for comparison (default: continuous)")
    p.add_argument("--refresh", type=float, default=_env(env, "refresh", float) or 0.5,
                   help="seconds between panel refreshes in each tab (default: 0.5)")
    p.add_argument("--max-pending", type=int, default=_env(env, "max-pending", int) or 256,
                   help="requests in flight at once (chats + API); more get 'busy, retry' / HTTP 429 (default: 256)")
    p.add_argument("--rate-limit", type=int, default=_env(env, "rate-limit", int) or 0,
                   help="API requests per --rate-period per client host; 0 = no limit (default)")
    p.add_argument("--rate-period", type=float, default=_env(env, "rate-period", float) or 60.0,
                   help="seconds of the rate-limit window (default: 60)")
    p.add_argument("--queue-size", type=int, default=_env(env, "queue-size", int) or 256,
                   help="Gradio's event queue bound (default: 256)")
    p.add_argument("--served-model-name", default=_env(env, "served-model-name"),
                   help="model name of the OpenAI API (default: --model, or SmolLM2-135M-Instruct)")
    args = p.parse_args(argv)
    if args.policy not in POLICIES:
        p.error(f"--policy must be one of {POLICIES}, got {args.policy!r}")
    if args.num_blocks is not None and args.kv_cache_memory is not None:
        p.error("give --num-blocks or --kv-cache-memory, not both")
    if args.num_blocks is None and args.kv_cache_memory is None:
        args.num_blocks = DEFAULT_NUM_BLOCKS
    return args


def engine_kwargs(args: argparse.Namespace) -> dict:
    """Keyword arguments of ``AsyncEngine.from_args`` from the parsed options (unset ones left out,
    so the engine's own defaults apply)."""
    kw = {
        "model": args.model, "dtype": args.dtype, "device": args.device, "max_num_seqs": args.max_num_seqs,
        "block_size": args.block_size, "num_blocks": args.num_blocks, "kv_cache_memory": args.kv_cache_memory,
        "max_num_batched_tokens": args.max_num_batched_tokens, "policy": args.policy,
    }
    return {k: v for k, v in kw.items() if v is not None or k == "model"}


def main(argv: Sequence[str] | None = None) -> None:
    """Parse options, start one engine, serve the Gradio app and the OpenAI-compatible API on one port
    until interrupted."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from engine.async_engine import AsyncEngine
    from ui.layout import build_app, launch
    from ui.server import build_server, serve

    engine = AsyncEngine.from_args(**engine_kwargs(args))
    atexit.register(engine.shutdown)
    demo = build_app(engine, model_name=args.model, refresh_s=args.refresh)
    if args.share:  # a gradio.live link needs demo.launch(); the OpenAI API is not served then
        engine.max_pending = args.max_pending
        launch(demo, server_name=args.host, server_port=args.port, share=True)
        return
    # one port for both: the OpenAI-compatible API routes first, the Gradio app mounted at /
    app = build_server(engine, demo, model_name=args.served_model_name, max_pending=args.max_pending,
                       rate_limit=args.rate_limit or None, rate_period=args.rate_period, queue_size=args.queue_size)
    serve(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
