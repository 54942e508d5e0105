"""Where the Compare tab and the batch-invariance demo take the loaded model and tokenizer from: the app's
engine, whose state they never touch (they run engines of their own over the same weights)."""

from __future__ import annotations

from typing import Any, TypeAlias

from engine import LLM, AsyncEngine, EngineCore

# the app's engine, or what the demos' own engines can be built from (see :func:`model_of`)
ModelSource: TypeAlias = AsyncEngine | EngineCore | LLM | tuple[Any, Any]


def model_of(source: ModelSource) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of an ``AsyncEngine``, an ``EngineCore``, an ``LLM`` or a
    ``(model, tokenizer)`` pair (returned as it is)."""
    if isinstance(source, tuple):
        return source
    if isinstance(source, AsyncEngine):
        core = source.core
    elif isinstance(source, LLM):
        core = source.engine
    else:
        core = source
    return core.model, core.tokenizer
