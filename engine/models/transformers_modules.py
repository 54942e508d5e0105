"""The fallback forward: a transformers model's own modules, with the engine's paged attention in them.

For an architecture the registry (:data:`engine.models.MODEL_REGISTRY`) has no forward of the engine's own
for, or with ``--forward transformers``: :func:`paged_attention_forward` is registered in transformers'
``AttentionInterface`` under :data:`ATTN_NAME`, and each step's metadata
(:class:`engine.attention.AttentionMetadata`) reaches it as an extra keyword argument of ``model(...)``.
With ``attention_mask=None``, ``use_cache=False`` and no mask function registered for our name,
transformers builds no ``T x T`` mask.
"""

from __future__ import annotations

import torch

import kernels
from engine.attention import AttentionMetadata

ATTN_NAME = "cbp_paged"


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: write this step's K/V into the paged cache, then attend.

    Args:
        module: the attention module (``module.layer_idx`` selects the cache).
        query: ``[1, num_heads, num_tokens, head_dim]``; key, value: ``[1, num_kv_heads, num_tokens,
            head_dim]`` (after RoPE).
        attention_mask: ignored (causality comes from the metadata).
        scaling: softmax scale.
        kwargs: must hold ``cbp_attn_metadata`` (:class:`engine.attention.AttentionMetadata`).

    Returns:
        ``([1, num_tokens, num_heads, head_dim], None)``.
    """
    meta: AttentionMetadata = kwargs["cbp_attn_metadata"]
    key_cache, value_cache = meta.kv_caches[module.layer_idx]
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    kernels.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    out = kernels.paged_attention(
        q,
        key_cache,
        value_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        scaling,
        seq_lens_list=meta.seq_lens_list,
        query_start_loc_list=meta.query_start_loc_list,
    )
    return out.unsqueeze(0), None


def register_attention() -> str:
    """Register :func:`paged_attention_forward` in transformers' ``AttentionInterface`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention_forward)
    return ATTN_NAME


class TransformersForward:
    """A transformers causal LM (any architecture whose attention goes through ``ALL_ATTENTION_FUNCTIONS``)
    run over the packed batch with the engine's paged attention; the model is switched to it.

    Args:
        model: the loaded transformers model (still usable by transformers' ``generate``: the attention is
            switched back to ours before each step).
    """

    def __init__(self, model) -> None:
        self.model = model
        register_attention()
        model.set_attn_implementation(ATTN_NAME)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                logits_rows: torch.Tensor) -> torch.Tensor:
        """``input_ids`` / ``positions`` ``[T]`` int64 of the packed step -> logits ``[len(logits_rows), vocab]``
        of the rows that sample (writes this step's K/V into the paged cache)."""
        if self.model.config._attn_implementation != ATTN_NAME:
            # the same model object may also serve transformers' own generate (tests, baselines)
            self.model.set_attn_implementation(ATTN_NAME)
        out = self.model(input_ids=input_ids[None], position_ids=positions[None], attention_mask=None,
                         use_cache=False, logits_to_keep=logits_rows, cbp_attn_metadata=meta)
        return out.logits[0]
