"""The engine's own forward for the Llama family (Llama, SmolLM2, Mistral, Qwen2) over a packed batch.

Built from a loaded transformers model (its weights are read, never changed: the same model object
stays usable as transformers' ``generate`` oracle). Per decoder layer:

    x, residual = fused_add_rms_norm(h, residual)        (the first layer: residual = h, x = rms_norm(h))
    q | k | v   = x @ W_qkv                              one merged projection
    rotary_embedding(q, k) in place                      cos / sin rows from a table built once
    reshape_and_cache(k, v); o = paged_attention(q)      the paged KV cache (kernels/)
    x, residual = fused_add_rms_norm(o @ W_o, residual)
    h           = silu_and_mul(x @ W_gate_up) @ W_down   one merged gate / up projection

then the final norm and the LM head on the rows that sample only. The elementwise operations are one
pass each (``kernels``: C++ on CPU, torch elsewhere) and round to the storage dtype where transformers'
modules round, so a bfloat16 step reproduces theirs up to summation order. Linears are
:class:`kernels.cpu_linear.Linear` (oneDNN-prepacked bfloat16 on CPUs with native bfloat16).

Where every linear runs on one of the engine's own GEMMs and the C++ kernels serve the step (CPUs with
AVX-512, or float32 on AVX2), all layers run in one C++ call (:func:`kernels.cpu_ops.decoder_layers`): the
same kernels in the same order, bit-identical, without Python between them. ``CBP_CPU_FUSED_LAYERS=0``
keeps the Python loop.

The structure follows the Llama papers (Touvron et al., 2023) and transformers' ``LlamaModel``; merged
projections and fused residual norms are what vLLM and nano-vllm do.
"""

from __future__ import annotations

import torch

import kernels
from kernels import cpu_ops, envs
from kernels.cpu_linear import BATCH_INVARIANT_ROWS, Linear

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # tables that do not depend on the sequence length


def _text_config(model):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _cat_bias(*mods) -> torch.Tensor | None:
    biases = [m.bias for m in mods]
    if all(b is None for b in biases):
        return None
    return torch.cat([b.detach() if b is not None else torch.zeros(m.out_features, dtype=m.weight.dtype,
                                                                   device=m.weight.device)
                      for b, m in zip(biases, mods)])


class LlamaLayer:
    """One decoder layer's weights and its forward (see the module docstring).

    Args:
        layer: a transformers ``LlamaDecoderLayer`` (or Mistral / Qwen2's).
        index: its layer index (selects its K/V cache).
        cfg: the text config.
        row_tile: the fixed row tile of every linear (batch-invariant mode: the attention then also runs
            in one launch configuration for every batch) or None.
    """

    def __init__(self, layer, index: int, cfg, row_tile: int | None = None) -> None:
        att, mlp = layer.self_attn, layer.mlp
        self.index = index
        self.batch_invariant = row_tile is not None
        self.head_dim = att.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.scaling = float(att.scaling)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        with torch.no_grad():
            self.qkv = Linear(torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]),
                              _cat_bias(att.q_proj, att.k_proj, att.v_proj), row_tile)
            self.o = Linear(att.o_proj.weight, att.o_proj.bias, row_tile)
            self.gate_up = Linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                                  _cat_bias(mlp.gate_proj, mlp.up_proj), row_tile)
            self.down = Linear(mlp.down_proj.weight, mlp.down_proj.bias, row_tile)
        self.input_norm = layer.input_layernorm.weight.detach()
        self.post_norm = layer.post_attention_layernorm.weight.detach()
        self.eps = float(layer.input_layernorm.variance_epsilon)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, rope, meta
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``h`` ``[T, hidden]`` (the previous layer's output) and ``residual`` ``[T, hidden]`` (None at
        the first layer) -> this layer's ``(h, residual)``; writes this step's K/V into the cache."""
        if residual is None:
            residual = h
            x = kernels.rms_norm(h, self.input_norm, self.eps)
        else:
            kernels.fused_add_rms_norm(h, residual, self.input_norm, self.eps)
            x = h
        n = x.shape[0]
        qkv = self.qkv(x)
        q = qkv[:, : self.q_size]
        k = qkv[:, self.q_size : self.q_size + self.kv_size]
        v = qkv[:, self.q_size + self.kv_size :]
        kernels.rotary_embedding(positions, q, k, rope[0], rope[1], self.head_dim)
        key_cache, value_cache = meta.kv_caches[self.index]
        k3, v3 = k.unflatten(1, (self.num_kv_heads, self.head_dim)), v.unflatten(1, (self.num_kv_heads, self.head_dim))
        kernels.reshape_and_cache(k3, v3, key_cache, value_cache, meta.slot_mapping)
        attn = kernels.paged_attention(
            q.unflatten(1, (self.num_heads, self.head_dim)), key_cache, value_cache, meta.block_tables,
            meta.seq_lens, meta.query_start_loc, self.scaling,
            seq_lens_list=meta.seq_lens_list, query_start_loc_list=meta.query_start_loc_list,
            batch_invariant=self.batch_invariant,
        )
        x = self.o(attn.reshape(n, self.q_size))
        kernels.fused_add_rms_norm(x, residual, self.post_norm, self.eps)
        return self.down(kernels.silu_and_mul(self.gate_up(x))), residual


class LlamaForward:
    """The forward of a Llama-family causal LM over one step's packed batch.

    Args:
        model: a loaded transformers model whose :func:`unsupported_reason` is None.
        batch_invariant: compute every linear in fixed tiles of
            :data:`kernels.cpu_linear.BATCH_INVARIANT_ROWS` rows, so that a row's logits do not depend on
            the other rows of the step (see :class:`kernels.cpu_linear.Linear`; the other operations are
            per row already, the C++ paged attention reads each sequence's keys in one fixed order, and
            the Triton one then runs in one launch configuration for every batch, without split-KV).

    Raises:
        ValueError: when the architecture is not supported (the reason in the message).
    """

    @staticmethod
    def unsupported_reason(model) -> str | None:
        """Why this forward cannot run ``model`` (a registered architecture; a short phrase), or None when it can."""
        cfg = _text_config(model)
        if getattr(cfg, "hidden_act", "silu") != "silu":
            return f"activation {cfg.hidden_act!r}"
        rope = (getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}).get("rope_type", "default")
        if rope not in STATIC_ROPE_TYPES:
            return f"RoPE type {rope!r} depends on the sequence length"
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "rotary_emb") or not hasattr(inner, "layers"):
            return "unexpected module layout"
        return None

    def __init__(self, model, batch_invariant: bool = False) -> None:
        reason = self.unsupported_reason(model)
        if reason:
            raise ValueError(f"LlamaForward: {reason}")
        cfg = _text_config(model)
        inner = model.model
        self.embed = inner.embed_tokens.weight.detach()
        tile = BATCH_INVARIANT_ROWS if batch_invariant else None
        self.layers = [LlamaLayer(layer, i, cfg, tile) for i, layer in enumerate(inner.layers)]
        self.norm = inner.norm.weight.detach()
        self.eps = float(inner.norm.variance_epsilon)
        head = model.get_output_embeddings()
        self.lm_head = Linear(head.weight, getattr(head, "bias", None), tile)
        self.rope = self._rope_table(inner.rotary_emb, cfg, self.layers[0].head_dim)
        self._plan: tuple | bool | None = None  # the one-call layers' fixed arguments; False: not possible here
        self.timings: torch.Tensor | None = None  # float64 [3]: the one-call path adds seconds to it (profile)

    def one_call_plan(self) -> tuple | None:
        """``(weights, eps, dot_products)`` for :func:`kernels.cpu_ops.decoder_layers`, or None when the layers
        cannot run in one C++ call here: ``CBP_CPU_FUSED_LAYERS=0``, not a CPU model in bfloat16 or float32,
        the C++ kernels not serving CPU tensors, a linear not on an own GEMM of the model's dtype, or layers of
        different head shapes. Decided once (the first call); each step also checks that the C++ attention
        takes its head size and caches (:func:`kernels.cpu_ops.attention_takes`)."""
        if self._plan is None:
            self._plan = self._make_plan() or False
        return self._plan if isinstance(self._plan, tuple) else None

    def _make_plan(self) -> tuple | None:
        dt = self.embed.dtype
        if not envs.CBP_CPU_FUSED_LAYERS or self.embed.device.type != "cpu" or \
                dt not in (torch.bfloat16, torch.float32):
            return None
        if kernels.backend_for(self.embed) != "cpp" or not cpu_ops.decoder_layers_available():
            return None
        lins = [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if any(lin.gemm is None or lin.gemm.dtype != dt for lin in lins) or len({lin.gemm_dp for lin in lins}) != 1:
            return None
        first = self.layers[0]
        shape = (first.num_heads, first.num_kv_heads, first.head_dim, first.scaling)
        if any((la.num_heads, la.num_kv_heads, la.head_dim, la.scaling) != shape for la in self.layers):
            return None
        norms = [w for la in self.layers for w in (la.input_norm, la.post_norm)]
        if any(w.dtype != dt or not w.is_contiguous() for w in norms):
            return None
        empty = torch.empty(0, dtype=torch.float32)

        def packed(lin: Linear) -> list[torch.Tensor]:
            assert lin.gemm is not None  # every linear is on an own GEMM (checked above)
            return [lin.gemm, empty if lin.bias32 is None else lin.bias32]

        weights = [w for la in self.layers for w in (la.input_norm, *packed(la.qkv), *packed(la.o), la.post_norm,
                                                     *packed(la.gate_up), *packed(la.down))]
        eps = [la.eps for la in self.layers]
        return weights, eps, lins[0].gemm_dp

    def _layers_in_one_call(self, h: torch.Tensor, positions: torch.Tensor, meta):
        """``(h, residual)`` from :func:`kernels.cpu_ops.decoder_layers`, or None when this step takes the
        Python loop (see :meth:`one_call_plan`; also when the attention backend is forced to another one, or
        the caches or positions are not as the C++ kernels take them)."""
        plan = self.one_call_plan()
        if plan is None or kernels.backend_for(h) != "cpp":
            return None
        first = self.layers[0]
        if not cpu_ops.attention_takes(h.dtype, first.head_dim, meta.kv_caches[0][0]) or \
                positions.dtype != torch.int64 or not positions.is_contiguous():
            return None
        weights, eps, dp = plan
        caches = [c for pair in meta.kv_caches for c in pair]
        return cpu_ops.decoder_layers(h, positions, weights, caches, meta.block_tables, meta.seq_lens,
                                      meta.query_start_loc, meta.slot_mapping, self.rope[0], self.rope[1],
                                      first.num_heads, first.num_kv_heads, first.head_dim, first.scaling, eps, dp,
                                      self.timings)

    def _rope_table(self, rotary_emb, cfg, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[max_position_embeddings, head_dim // 2]`` in the model's dtype, computed by
        transformers' own rotary module (so every static RoPE variant's frequencies are theirs)."""
        n = int(getattr(cfg, "max_position_embeddings", 8192))
        probe = self.embed[:1]
        with torch.no_grad():
            cos, sin = rotary_emb(probe, torch.arange(n, device=probe.device)[None])
        half = head_dim // 2
        return cos[0, :, :half].contiguous(), sin[0, :, :half].contiguous()

    def _linears(self) -> list[Linear]:
        """Every linear of the forward: four per layer, then the LM head."""
        return [*(lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)),
                self.lm_head]

    @property
    def num_packed_linears(self) -> int:
        """Linears on oneDNN-prepacked weights (four per layer and the LM head where packing applies)."""
        return sum(lin.packed is not None for lin in self._linears())

    @property
    def num_own_gemm_linears(self) -> int:
        """Linears on one of the engine's own GEMMs, bfloat16 or float32 (:func:`kernels.cpu_linear.uses_own_gemm`)."""
        return sum(lin.gemm is not None for lin in self._linears())

    @property
    def num_float32_linears(self) -> int:
        """Linears that multiply calls of many rows in float32 on a float32 copy of their bfloat16 weight
        (:func:`kernels.cpu_linear.makes_float32_copy`)."""
        return sum(lin.weight32 is not None for lin in self._linears())

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, logits_rows: torch.Tensor
                 ) -> torch.Tensor:
        """One step.

        Args:
            input_ids: ``[T]`` int64 token ids of the packed batch.
            positions: ``[T]`` int64 positions.
            meta: the step's :class:`engine.attention.AttentionMetadata`.
            logits_rows: ``[S]`` int64 rows whose next token is sampled.

        Returns:
            ``[S, vocab_size]`` logits in the model's dtype (``[0, vocab_size]`` when ``S`` is 0).
        """
        h = self.embed.index_select(0, input_ids)
        out = self._layers_in_one_call(h, positions, meta)
        if out is not None:
            h, residual = out
        else:
            residual = None
            for layer in self.layers:
                h, residual = layer.forward(h, residual, positions, self.rope, meta)
        assert residual is not None  # set by the first layer (a model has at least one)
        h = h.index_select(0, logits_rows)
        residual = residual.index_select(0, logits_rows)
        kernels.fused_add_rms_norm(h, residual, self.norm, self.eps)
        return self.lm_head(h)

    __call__ = forward
