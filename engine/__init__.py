"""Continuous Batching Playground's inference engine: continuous batching over a paged KV cache.

The public API, as in vLLM::

    from engine import LLM, SamplingParams

    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=32))[0]

:class:`AsyncEngine` streams outputs to asyncio callers (servers); :class:`EngineConfig` holds the
engine settings; :meth:`EngineCore.run_to_end` steps a core of one's own on the calling thread (the
offline demos). How the pieces fit: ``docs/architecture.md``.

Everything the front ends (``ui/``, ``server/``) use of the engine is exported here, and they import
nothing else of it (``tests/test_layout.py`` holds them to that). By group:

- running requests: ``LLM``, ``AsyncEngine``, ``EngineCore``, ``EngineConfig``, ``EngineStats``,
  ``EngineOverloadedError``;
- requests and their outputs: ``SamplingParams``, ``RequestOutput``, ``CompletionOutput``, ``RequestState``,
  ``ChatPrompt``, ``TextPrompt``, the limits ``MAX_LOGPROBS``, ``MAX_N``, ``MAX_STOP_STRINGS``,
  ``SEED_MIN``, ``SEED_MAX``; typed errors ``RequestError`` and the name of the prompt parameter ``PROMPT``;
- what the engine shows of itself: ``Telemetry``, ``StepSnapshot``, ``FinishedRequestStats``, the batch-slot
  phases ``PHASE_IDLE``, ``PHASE_PREFILL``, ``PHASE_DECODE``; the run-until conditions ``NextHandover``, ``NextBlockReuse``;
- KV cache events on the wire (vLLM's format): ``KVFeed``, ``to_vllm_events``, ``WireBatch``,
  ``encode_batch``, ``decode_batch``, ``ENCODINGS``;
- the option declarations ``Option``, ``add_options``, the talk preset ``TALK_PRESET``, and the prompt bank's ``synthetic_chat``.

Names are imported on first use, so the light ones (options, prompts, the KV wire format) load without
torch: remote mode runs no model and needs none.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names as type checkers see them; at run time each is imported on first use
    from engine.async_engine import AsyncEngine, EngineOverloadedError
    from engine.config import EngineConfig
    from engine.core import EngineCore, EngineStats
    from engine.errors import PROMPT, RequestError
    from engine.handover import NextBlockReuse, NextHandover
    from engine.kv_events import KVFeed, to_vllm_events
    from engine.kv_wire import ENCODINGS, WireBatch, decode_batch, encode_batch
    from engine.llm import LLM
    from engine.model_loader import tiny_random_llama
    from engine.options import TALK_PRESET, Option, add_options
    from engine.prompts import synthetic_chat
    from engine.request import (
        MAX_LOGPROBS,
        MAX_N,
        MAX_STOP_STRINGS,
        SEED_MAX,
        SEED_MIN,
        ChatPrompt,
        CompletionOutput,
        RequestOutput,
        RequestState,
        SamplingParams,
        TextPrompt,
    )
    from engine.telemetry import PHASE_DECODE, PHASE_IDLE, PHASE_PREFILL, FinishedRequestStats, StepSnapshot, Telemetry

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
    "RequestState": "engine.request",
    "ChatPrompt": "engine.request",
    "TextPrompt": "engine.request",
    "MAX_LOGPROBS": "engine.request",
    "MAX_N": "engine.request",
    "MAX_STOP_STRINGS": "engine.request",
    "SEED_MIN": "engine.request",
    "SEED_MAX": "engine.request",
    "RequestError": "engine.errors",
    "PROMPT": "engine.errors",
    "Telemetry": "engine.telemetry",
    "StepSnapshot": "engine.telemetry",
    "FinishedRequestStats": "engine.telemetry",
    "PHASE_IDLE": "engine.telemetry",
    "PHASE_PREFILL": "engine.telemetry",
    "PHASE_DECODE": "engine.telemetry",
    "NextHandover": "engine.handover",
    "NextBlockReuse": "engine.handover",
    "KVFeed": "engine.kv_events",
    "to_vllm_events": "engine.kv_events",
    "WireBatch": "engine.kv_wire",
    "encode_batch": "engine.kv_wire",
    "decode_batch": "engine.kv_wire",
    "ENCODINGS": "engine.kv_wire",
    "Option": "engine.options",
    "add_options": "engine.options",
    "TALK_PRESET": "engine.options",
    "synthetic_chat": "engine.prompts",
    "tiny_random_llama": "engine.model_loader",
}
__all__ = ["LLM", "AsyncEngine", "EngineOverloadedError", "EngineConfig", "EngineCore", "EngineStats",
           "SamplingParams", "RequestOutput", "CompletionOutput", "RequestState", "ChatPrompt", "TextPrompt",
           "MAX_LOGPROBS", "MAX_N", "MAX_STOP_STRINGS", "SEED_MIN", "SEED_MAX", "RequestError", "PROMPT",
           "Telemetry", "StepSnapshot", "FinishedRequestStats", "PHASE_IDLE", "PHASE_PREFILL", "PHASE_DECODE",
           "NextHandover", "NextBlockReuse", "KVFeed", "to_vllm_events", "WireBatch", "encode_batch",
           "decode_batch", "ENCODINGS", "Option", "add_options", "TALK_PRESET", "synthetic_chat",
           "tiny_random_llama"]
assert sorted(__all__) == sorted(_EXPORTS)  # one list of names, checked against the lazy-import table


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
