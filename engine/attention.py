"""The per-step inputs of the paged attention, shared by every forward and every layer.

The model runner packs them for an eager step (:meth:`engine.model_runner.ModelRunner.prepare`), the static
decode runner keeps them in buffers at fixed addresses (:mod:`engine.static_decode`), and the forwards read
them (:mod:`engine.models`): the one piece those modules share sits here, below all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per-step inputs of the paged attention, shared by all layers.

    Attributes:
        kv_caches: per layer ``(key_cache, value_cache)``, each ``[num_blocks, num_kv_heads,
            block_size, head_dim]``.
        slot_mapping: ``[num_tokens]`` int64, cache slot of each new token.
        block_tables: ``[num_seqs, max_blocks]`` int32, padded with 0.
        seq_lens: ``[num_seqs]`` int32, context length after this step (tokens).
        query_start_loc: ``[num_seqs + 1]`` int32, cumulative new-token counts.
        seq_lens_list / query_start_loc_list: the same as Python lists (host side).
    """

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens_list: list[int]
    query_start_loc_list: list[int]
