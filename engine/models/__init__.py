"""Model forwards the engine owns (one module per architecture family), as vLLM and nano-vllm do.

transformers stays the loader (config, tokenizer, weights, GGUF) and the test oracle; the served forward
is ours: :func:`build_forward` takes a loaded transformers model and returns a forward over the packed
batch, or None when the architecture is not one we own (the engine then runs transformers' modules with
our paged attention registered in them, see :mod:`engine.model_runner`).
"""

from __future__ import annotations

from engine.models.llama import LlamaForward, unsupported_reason


def build_forward(model, batch_invariant: bool = False) -> LlamaForward | None:
    """Our forward for ``model`` (a transformers causal LM), or None when we do not own its architecture.

    Raises:
        ValueError: ``batch_invariant`` asked for an architecture we do not own (only our forward has it).
    """
    reason = unsupported_reason(model)
    if reason and batch_invariant:
        raise ValueError(f"batch-invariant mode needs the engine's own forward: {reason}")
    return None if reason else LlamaForward(model, batch_invariant=batch_invariant)


__all__ = ["LlamaForward", "build_forward", "unsupported_reason"]
