"""The API alone (no page) on the engine's tiny random-weight Llama (:func:`engine.tiny_random_llama`) with the
default tokenizer, on ``127.0.0.1:PORT``, until killed; it starts in seconds. The schema fuzzing
(``tests/test_api_fuzz.py``), the hostile-client benchmark (:mod:`bench.hostile`) and the memory benchmark
(:mod:`bench.memory_burst`) run against it in a process of its own.

``python -m bench.tiny_server PORT [--protocol edge|httptools|h11] [--max-model-len N] [--num-blocks N]
[--max-num-batched-tokens N] [--max-body-bytes N] [--name NAME]``

By default the context is 64 tokens and the batch 8 slots, so that any request ends within a few dozen steps of
milliseconds. ``--protocol edge`` serves as ``app.py`` does (:mod:`server.http_edge`'s limits); ``httptools`` and
``h11`` are uvicorn's plain parsers, for comparison.
"""

from __future__ import annotations

import argparse
import logging


def serve_tiny(port: int, *, protocol: str = "edge", max_model_len: int = 64, num_blocks: int = 64,
               max_num_batched_tokens: int | None = None, max_body_bytes: int | None = None,
               name: str = "tiny") -> None:
    """Serve the tiny model's API on ``127.0.0.1:port`` until interrupted (see the module's docstring). Threads:
    torch's default (callers set ``OMP_NUM_THREADS``); ``max_num_batched_tokens`` None: the larger of 256 and
    ``max_model_len``."""
    import server.serving as serving
    from engine import AsyncEngine, EngineConfig, EngineCore, tiny_random_llama
    from engine.model_loader import load_tokenizer
    from server import build_server, serve

    tokenizer = load_tokenizer(None)
    config = EngineConfig(num_blocks=num_blocks, block_size=16, max_num_seqs=8, max_model_len=max_model_len,
                          max_num_batched_tokens=max_num_batched_tokens or max(256, max_model_len))
    engine = AsyncEngine(EngineCore(config, model=tiny_random_llama(len(tokenizer)), tokenizer=tokenizer))
    extra = {} if max_body_bytes is None else {"max_request_body_bytes": max_body_bytes}
    app = build_server(engine, None, name, max_pending=64, **extra)
    if protocol != "edge":  # uvicorn's own parser instead of the edge protocol (bench.hostile --parsers)
        import uvicorn

        def plain(app, host, port, log_level, limits=None, timeout_graceful_shutdown=5):
            extra = {"h11_max_incomplete_event_size": 64 * 1024} if protocol == "h11" else {}
            return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol, **extra)

        serving.uvicorn_config = plain  # type: ignore[assignment]
    serve(app, host="127.0.0.1", port=port, log_level="warning", banner="(OpenAI API at /v1, metrics at /metrics)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.tiny_server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("port", type=int)
    p.add_argument("--protocol", choices=("edge", "httptools", "h11"), default="edge")
    p.add_argument("--max-model-len", type=int, default=64)
    p.add_argument("--num-blocks", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-body-bytes", type=int, default=None)
    p.add_argument("--name", default="tiny")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the kernel build's lines (minutes at first)
    serve_tiny(a.port, protocol=a.protocol, max_model_len=a.max_model_len, num_blocks=a.num_blocks,
               max_num_batched_tokens=a.max_num_batched_tokens, max_body_bytes=a.max_body_bytes, name=a.name)


if __name__ == "__main__":
    main()
