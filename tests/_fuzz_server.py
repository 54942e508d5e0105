"""A real server process for schema-driven fuzzing (``tests/test_api_fuzz.py``): the OpenAI-compatible API of a
tiny random-weight model with the default tokenizer, through :func:`server.build_server` and
:func:`server.serve` (the playground's HTTP limits and uvicorn protocol), on ``127.0.0.1:PORT``.

``python -m tests._fuzz_server PORT``. The context is 64 tokens and the batch 8 slots, so that any generated
request ends within a few dozen engine steps of milliseconds.
"""

from __future__ import annotations

import sys

import torch


def main(port: int) -> None:
    """Serve until killed."""
    torch.set_num_threads(1)
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from server import build_server, serve
    from tests._tokenizer import load_tokenizer
    from tests.conftest import make_tiny_model

    tokenizer = load_tokenizer()
    engine = AsyncEngine(EngineCore(EngineConfig(num_blocks=64, block_size=16, max_num_seqs=8, max_model_len=64,
                                                 max_num_batched_tokens=256),
                                    model=make_tiny_model(len(tokenizer)), tokenizer=tokenizer))
    serve(build_server(engine, None, "tiny-fuzz", max_pending=64), host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main(int(sys.argv[1]))
