"""Shared set-up of the API tests (``tests/test_api.py``, ``tests/test_api_errors.py``): a tiny-model
engine behind the OpenAI-compatible API on a loopback port, and bounded waits."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import openai

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core import EngineCore
from server import ServerThread, create_api

MODEL = "tiny-test"
CHAT = [{"role": "user", "content": "Tell me a story about a lighthouse."}]


def endpoint(name: str) -> tuple[str, dict]:
    """``(path, minimal body)`` of the ``"chat"`` or ``"completions"`` endpoint."""
    if name == "chat":
        return "/v1/chat/completions", {"messages": CHAT}
    return "/v1/completions", {"prompt": "hi"}


def serve_tiny_api(tiny_model, tokenizer, **api_kwargs) -> Iterator[SimpleNamespace]:
    """Body of a module-scoped ``api`` fixture: the API of a tiny-model engine on 127.0.0.1 (free port),
    yielded as ``url``, ``engine``, ``client`` (openai), ``http`` (httpx) and ``app``; all closed afterwards.
    ``api_kwargs`` go to :func:`server.create_api` (e.g. ``max_body_bytes``)."""
    engine = AsyncEngine(EngineCore(EngineConfig(num_blocks=128, block_size=16, max_num_seqs=8,
                                                 max_num_batched_tokens=512), model=tiny_model, tokenizer=tokenizer))
    app = create_api(engine, MODEL, **api_kwargs)
    server = ServerThread(app).start()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    http = httpx.Client(base_url=server.url, timeout=60)
    yield SimpleNamespace(url=server.url, engine=engine, client=client, http=http, app=app)
    http.close()
    client.close()
    server.stop()
    engine.shutdown()


def wait_idle(engine: AsyncEngine, timeout: float = 30.0) -> bool:
    """True once no request is pending, running or waiting and no block is held (within ``timeout``)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        s = engine.core.scheduler
        if engine.num_pending == 0 and not s.running and not s.waiting and engine.core.kv.pool.num_used_blocks == 0:
            return True
        time.sleep(0.005)
    return False


def finished_record(engine: AsyncEngine, rid: str):
    """The telemetry record of the finished request ``rid``, or None."""
    return next((r for r in reversed(engine.telemetry.finished_requests()) if r.request_id == rid), None)


def normal_request_works(api) -> None:
    """A plain request succeeds and leaves nothing behind."""
    r = api.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
    assert wait_idle(api.engine)
