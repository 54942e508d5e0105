"""Continuous Batching Playground's inference engine: continuous batching over a paged KV cache.

The public API, as in vLLM::

    from engine import LLM, SamplingParams

    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=32))[0]

:class:`AsyncEngine` streams outputs to asyncio callers (servers); :class:`EngineConfig` holds the
engine settings. How the pieces fit: ``docs/architecture.md``.
"""

import importlib

# name -> module; imported on first use, so that light modules (``engine.options``) load without torch
_EXPORTS = {
    "LLM": "engine.llm",
    "AsyncEngine": "engine.async_engine",
    "EngineOverloadedError": "engine.async_engine",
    "EngineConfig": "engine.config",
    "EngineCore": "engine.core",
    "EngineStats": "engine.core",
    "SamplingParams": "engine.request",
    "RequestOutput": "engine.request",
    "CompletionOutput": "engine.request",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
