"""Runs one forward pass per step over a packed (varlen) batch, against the paged KV cache.

The forward is chosen once per engine (``EngineConfig.forward``) from the model registry
(:mod:`engine.models`):

* ``"auto"``: the engine's own forward for the architectures the registry has (the Llama family): merged
  projections, fused norms, RoPE and SiLU-and-mul, the LM head on sampling rows only; any other
  architecture falls back to transformers' modules;
* ``"transformers"``: transformers' modules with our paged attention registered in them
  (:class:`engine.models.TransformersForward`).

Both take the step's :class:`engine.attention.AttentionMetadata`, packed here (or, for a pure decode step,
kept in static buffers by :mod:`engine.static_decode`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

import kernels
from engine.attention import AttentionMetadata
from engine.config import DEFAULT_KV_CACHE_MEMORY, FORWARDS, EngineConfig
from engine.models import TransformersForward, build_forward
from engine.request import Request
from engine.static_decode import StaticDecode

log = logging.getLogger(__name__)


def kv_cache_shape(config) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of a transformers config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    num_heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
    return text.num_hidden_layers, num_kv_heads, head_dim


def bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
    """KV bytes of one block over all layers (K and V)."""
    layers, kvh, hd = kv_cache_shape(config)
    return 2 * layers * kvh * block_size * hd * torch.empty((), dtype=dtype).element_size()


class ModelRunner:
    """Owns the model and the paged K/V tensors; turns a step's schedule into logits.

    Args:
        model: a transformers causal LM (any architecture whose attention goes through
            ``ALL_ATTENTION_FUNCTIONS``; without an own forward it is switched to our attention).
        num_blocks: physical blocks per layer.
        block_size: tokens per block.
        forward: ``"auto"`` (the engine's own forward where it owns the architecture) or
            ``"transformers"`` (transformers' modules with our attention).
        batch_invariant: the own forward's batch-invariant mode (see :class:`engine.models.LlamaForward`).
        static_decode: ``"auto"`` / ``"on"`` / ``"off"``: pure decode steps of the own forward on static
            padded buffers (:class:`engine.static_decode.StaticDecode`; CUDA graphs on CUDA); ``"auto"``
            on CUDA only. Ignored (eager) with transformers' modules.
        max_num_seqs, max_model_len: the largest padded batch (requests) and the block-table width
            (tokens) of the static buffers.

    Attributes:
        own_forward: the engine's own forward (:data:`engine.models.MODEL_REGISTRY`), or None.
        forward: the forward that runs: ``own_forward``, or the transformers fallback.
        static: the :class:`engine.static_decode.StaticDecode` runner, or None (eager steps only).

    Raises:
        ValueError: for another ``forward`` name, or ``batch_invariant`` without the own forward.
    """

    def __init__(self, model, num_blocks: int, block_size: int, forward: str = "auto",
                 batch_invariant: bool = False, static_decode: str = "auto", max_num_seqs: int = 64,
                 max_model_len: int | None = None) -> None:
        if forward not in FORWARDS:
            raise ValueError(f"forward must be one of {FORWARDS}, got {forward!r}")
        if batch_invariant and forward != "auto":
            raise ValueError("batch-invariant mode needs the engine's own forward (forward='auto')")
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.own_forward = build_forward(model, batch_invariant) if forward == "auto" else None
        if batch_invariant and kernels.backend_for(torch.empty(0, device=self.device)) == "torch":
            log.warning("batch-invariant mode: the attention runs on the torch path here (forced, or the C++ "
                        "kernels did not build), which is not batch invariant: outputs may still change with the batch")
        self.forward = self.own_forward if self.own_forward is not None else TransformersForward(model)
        self.num_prepacked_linears = 0
        self.num_float32_linears = 0  # bfloat16 linears that multiply many-row calls in float32
        self.num_own_gemm_linears = 0  # linears on the engine's own GEMM (bfloat16, or float32 on AVX2-only CPUs)
        if self.device.type == "cpu":
            if self.own_forward is not None:
                self.num_prepacked_linears = self.own_forward.num_packed_linears
                self.num_own_gemm_linears = self.own_forward.num_own_gemm_linears
                self.num_float32_linears = self.own_forward.num_float32_linears
            else:
                # transformers' linear modules on oneDNN-prepacked weights where kernels.cpu_linear.packs
                # says so (bfloat16 on CPUs with native bfloat16)
                from kernels.cpu_linear import prepack_linears

                self.num_prepacked_linears = prepack_linears(model)
            kernels.cpp_available()  # build or load the C++ kernels now, not at the first request
        self.block_size = block_size
        self.num_blocks = num_blocks
        layers, kvh, hd = kv_cache_shape(model.config)
        shape = (num_blocks, kvh, block_size, hd)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device), torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(layers)
        ]
        self.static: StaticDecode | None = None
        if self.own_forward is not None and (static_decode == "on" or (static_decode == "auto" and self.device.type == "cuda")):
            self.static = StaticDecode(self.own_forward, self.kv_caches, block_size, max_num_seqs,
                                       max_model_len or num_blocks * block_size, use_graphs=True)

    def prepare(self, scheduled: list[tuple[Request, int]]):
        """Pack the step: returns ``(input_ids [1, T], positions [1, T], metadata, logits_rows,
        sampling_requests)`` where ``logits_rows`` ``[S]`` are the rows whose next token is sampled
        (a request's last new token, when it reaches the end of its known tokens)."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        qsl = [0]
        rows: list[int] = []
        sampling: list[Request] = []
        tables: list[list[int]] = []
        for req, n in scheduled:
            start = req.num_computed_tokens
            end = start + n
            num_prompt = len(req.prompt_token_ids)
            if start >= num_prompt:  # decode (or recompute of generated tokens)
                toks = req.output_token_ids[start - num_prompt : end - num_prompt]
            elif end <= num_prompt:
                toks = req.prompt_token_ids[start:end]
            else:
                toks = req.prompt_token_ids[start:] + req.output_token_ids[: end - num_prompt]
            ids.extend(toks)
            pos.extend(range(start, end))
            bt = req.block_ids
            if n == 1:
                slots.append(bt[start // bs] * bs + start % bs)
            else:
                slots.extend(bt[p // bs] * bs + p % bs for p in range(start, end))
            seq_lens.append(end)
            qsl.append(qsl[-1] + n)
            tables.append(bt)
            if end == req.num_tokens:
                rows.append(qsl[-1] - 1)
                sampling.append(req)
        max_blocks = max(len(t) for t in tables)
        bt_tensor = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
        dev = self.device
        meta = AttentionMetadata(
            kv_caches=self.kv_caches,
            slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=True),
            block_tables=bt_tensor.to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32).to(dev, non_blocking=True),
            seq_lens_list=seq_lens,
            query_start_loc_list=qsl,
        )
        input_ids = torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True)[None]
        positions = torch.tensor(pos, dtype=torch.int64).to(dev, non_blocking=True)[None]
        logits_rows = torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)
        return input_ids, positions, meta, logits_rows, sampling

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: copy the K/V of block ``src`` into block ``dst`` in every layer."""
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for key_cache, value_cache in self.kv_caches:
            key_cache.index_copy_(0, dst, key_cache.index_select(0, src))
            value_cache.index_copy_(0, dst, value_cache.index_select(0, src))

    @torch.inference_mode()
    def execute_model(self, scheduled: list[tuple[Request, int]], blocks_to_copy: Sequence[tuple[int, int]] = ()
                ) -> tuple[torch.Tensor | None, list[Request]]:
        """Make the step's copy-on-write block copies, then one forward pass over every scheduled token.

        Returns:
            ``(logits [S, vocab_size] float, requests)``: one row per request that samples this step
            (None and [] when none does).
        """
        self.copy_blocks(list(blocks_to_copy))
        if self.static is not None and self.static.supports(scheduled):
            return self.static.execute(scheduled), [req for req, _ in scheduled]
        input_ids, positions, meta, rows, sampling = self.prepare(scheduled)
        logits = self.forward.forward(input_ids[0], positions[0], meta, rows)
        # a step of partial prefill chunks only fills the cache: ``rows`` is empty, no logits
        return (logits if sampling else None), sampling


def num_blocks_for(config: EngineConfig, model, device: torch.device, dtype: torch.dtype) -> int:
    """KV blocks of the pool: ``config.num_blocks``, else ``config.kv_cache_memory`` (bytes, or a fraction of
    free device memory; default 512 MiB) divided by the bytes of one block of every layer's K and V."""
    if config.num_blocks is not None:
        return config.num_blocks
    per_block = bytes_per_block(model.config, config.block_size, dtype)
    budget = config.kv_cache_memory if config.kv_cache_memory is not None else DEFAULT_KV_CACHE_MEMORY
    if isinstance(budget, float):  # a fraction of free device memory
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
        else:
            import psutil

            free = psutil.virtual_memory().available
            free = max(0, free - float32_copy_bytes(config, model, device, dtype)
                       - packed_copy_bytes(config, model, device, dtype))
        budget = int(free * budget)
    return max(1, int(budget) // per_block)


def float32_copy_bytes(config: EngineConfig, model, device: torch.device, dtype: torch.dtype) -> int:
    """Bytes that the engine's own forward will add on CPU for float32 copies of bfloat16 linear weights
    (:func:`kernels.cpu_linear.makes_float32_copy`: 4 bytes per parameter of each decoder-layer linear and
    the LM head that gets one), so that a KV budget given as a fraction of free memory leaves room for
    them; 0 when no float32 copy will be made (another device or dtype, transformers' modules,
    batch-invariant row tiles, or the own GEMM taking the weights: its packed copies are
    :func:`packed_copy_bytes`)."""
    from kernels.cpu_linear import BATCH_INVARIANT_ROWS, makes_float32_copy

    if device.type != "cpu" or config.forward != "auto" or dtype != torch.bfloat16:
        return 0
    row_tile = BATCH_INVARIANT_ROWS if config.batch_invariant else None
    one = torch.empty((), dtype=dtype)  # expanded to each weight's shape: the rule reads dtype and shape only
    return sum(4 * w.numel() for w in linear_weights(model) if makes_float32_copy(one.expand(w.shape), row_tile))


def packed_copy_bytes(config: EngineConfig, model, device: torch.device, dtype: torch.dtype) -> int:
    """Bytes that the engine's own forward will add on CPU for the packed copies of the weights its own GEMMs
    take (:func:`kernels.cpu_linear.uses_own_gemm`: 2 bytes per parameter in bfloat16, 4 in float32), so that
    a KV budget given as a fraction of free memory leaves room for them; 0 on another device, with
    transformers' modules, or where no weight goes to an own GEMM."""
    from kernels.cpu_linear import uses_own_gemm

    if device.type != "cpu" or config.forward != "auto" or dtype not in (torch.bfloat16, torch.float32):
        return 0
    one = torch.empty((), dtype=dtype)  # expanded to each weight's shape: the rule reads dtype and shape only
    size = one.element_size()
    return sum(size * w.numel() for w in linear_weights(model) if uses_own_gemm(one.expand(w.shape)))


def linear_weights(model) -> list[torch.Tensor]:
    """The linear weights the engine's forward multiplies: the decoder layers' 2-D weights and the LM
    head (not the embedding)."""
    return [m.weight for n, m in model.named_modules()
            if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2
            and (".layers." in f".{n}." or n == "lm_head")]


def linear_parameters(model) -> int:
    """Parameters of :func:`linear_weights` (the bench's floor counts the step's FLOPs from them)."""
    return sum(w.numel() for w in linear_weights(model))
