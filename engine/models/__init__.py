"""Model forwards: a registry table from architecture to the engine's own forward, with transformers'
modules as the fallback (as vLLM's and mini-sglang's model registries).

transformers stays the loader (config, tokenizer, weights, GGUF) and the test oracle; the served forward is
ours where the table has the architecture (the transformers class name, e.g. ``LlamaForCausalLM``) and the
forward accepts the model's settings (its ``unsupported_reason``); any other model runs transformers'
modules with our paged attention (:class:`engine.models.transformers_modules.TransformersForward`).

A forward here is a class built from the loaded transformers model and ``batch_invariant``, with
``forward(input_ids [T], positions [T], meta, logits_rows) -> logits`` over the packed batch (see
:class:`engine.models.llama.LlamaForward`). A new architecture: one module, one row in the table.
"""

from __future__ import annotations

from engine.models.llama import LlamaForward
from engine.models.transformers_modules import TransformersForward

# architecture (the transformers model's class name) -> the engine's own forward for it
MODEL_REGISTRY: dict[str, type[LlamaForward]] = {
    "LlamaForCausalLM": LlamaForward,
    "MistralForCausalLM": LlamaForward,
    "Qwen2ForCausalLM": LlamaForward,
}


def unsupported_reason(model) -> str | None:
    """Why the engine has no own forward for ``model`` (a transformers causal LM), or None when it has."""
    name = type(model).__name__
    forward = MODEL_REGISTRY.get(name)
    if forward is None:
        return f"architecture {name} is not one the engine owns ({', '.join(MODEL_REGISTRY)})"
    return forward.unsupported_reason(model)


def build_forward(model, batch_invariant: bool = False) -> LlamaForward | None:
    """The engine's own forward for ``model`` (a transformers causal LM), or None when the registry has none
    for its architecture or the forward does not take its settings (the runner then falls back to
    :class:`TransformersForward`).

    Raises:
        ValueError: ``batch_invariant`` asked for a model without an own forward (only ours has the mode).
    """
    reason = unsupported_reason(model)
    if reason and batch_invariant:
        raise ValueError(f"batch-invariant mode needs the engine's own forward: {reason}")
    return None if reason else MODEL_REGISTRY[type(model).__name__](model, batch_invariant=batch_invariant)


__all__ = ["MODEL_REGISTRY", "LlamaForward", "TransformersForward", "build_forward", "unsupported_reason"]
