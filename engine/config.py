"""Engine settings (``EngineConfig``) and parsing of memory sizes."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

POLICIES = ("continuous", "static")
FORWARDS = ("auto", "transformers")  # the engine's own forward where it owns the architecture, or transformers' modules
STATIC_DECODE = ("auto", "on", "off")  # padded static decode buffers (CUDA graphs on CUDA): auto = on CUDA only
FREE_BLOCK_ORDERS = ("lru", "mru")  # which free KV block is taken first: least / most recently freed
DEFAULT_KV_CACHE_MEMORY = 512 * 1024**2  # bytes

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3}


def parse_memory(value: int | float | str | None) -> int | float | None:
    """``"512MiB"``, ``"1.5GB"``, ``"268435456"`` -> bytes (int); a float in (0, 1] -> that fraction of
    free device memory (returned as float); None -> None.

    Raises:
        ValueError: for an unreadable size.
    """
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, float):
        if 0 < value <= 1:
            return value
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read memory size {value!r}; use e.g. 512MiB, 2GiB, 0.5 (fraction)")
    num, unit = float(m.group(1)), m.group(2).lower()
    if unit == "" and 0 < num <= 1 and "." in m.group(1):
        return num
    return int(num * _UNITS[unit])


@dataclass
class EngineConfig:
    """Settings of one engine.

    Attributes:
        model: None (embedded SmolLM2-135M-Instruct), a folder, a ``.gguf`` path or a hub id.
        dtype: ``"bfloat16"``, ``"float32"``, ``"float16"`` or None (auto).
        device: ``"cpu"``, ``"cuda"`` or None (auto).
        block_size: tokens per KV block.
        num_blocks: physical KV blocks; None sizes the pool from ``kv_cache_memory``.
        kv_cache_memory: KV budget in bytes (int or ``"512MiB"``) or a fraction of free device memory.
        max_num_seqs: batch slots: requests running at once.
        max_num_batched_tokens: token budget of one step (tokens).
        prefill_chunk_tokens: while any request decodes, a prompt part way through its prefill computes at
            most this many tokens per step (tokens), so a long prompt never freezes running streams, and a
            step holds at most this many prompt tokens per prompt that can progress, prompts admitted in
            the step taking what is left in arrival order (a burst reaches first tokens in arrival order);
            with nothing decoding, prompts use the whole ``max_num_batched_tokens``.
        prefill_step_target: None (the fixed ``prefill_chunk_tokens``), or a ratio > 1: while any request
            decodes, a step's prompt tokens (all prompts together) are sized so that the step takes about
            this many times its decode rows alone, from a cost model of the steps run
            (:mod:`engine.step_cost`; ``prefill_chunk_tokens`` until the model has seen enough steps).
        max_model_len: context length (tokens); None = the model's, capped by the KV pool's capacity.
        policy: ``"continuous"`` or ``"static"`` (comparison only).
        enable_prefix_caching: reuse cached full blocks of identical prefixes.
        free_block_order: ``"lru"`` (vLLM's: freed blocks join the back of the free queue and the least
            recently freed is taken first, so cached prefixes live longest) or ``"mru"`` (the most recently
            freed block is taken first: a waiting request takes exactly the blocks a finished one just
            freed, which talk mode can point at; it evicts the freshest cached prefixes first, so prefix
            caching finds fewer hits).
        forward: ``"auto"``: the engine's own forward (``engine.models``) for the Llama family, transformers'
            modules with our attention for other architectures; ``"transformers"``: transformers' modules
            always (for comparison).
        batch_invariant: a request's logits (so its greedy and seeded tokens) do not depend on what else
            shares its steps, on how its prompt was chunked or on prefix-cache hits: every linear runs in
            fixed row tiles (CPU, the engine's own forward and the C++ attention; docs/performance.md
            gives the cost).
        static_decode: pure decode steps of the engine's own forward run on static buffers padded to a
            few batch sizes (:mod:`engine.static_decode`), captured in CUDA graphs on CUDA: ``"auto"`` on
            CUDA only, ``"on"`` on any device (on CPU eagerly, for equivalence tests), ``"off"`` never
            (vLLM's ``enforce_eager``).
        telemetry_capacity: steps kept in the telemetry ring buffer.
        seed: seed of the global sampling generator for unseeded requests.
    """

    model: str | None = None
    dtype: str | None = None
    device: str | None = None
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | float | str | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_chunk_tokens: int = 80
    prefill_step_target: float | None = None
    max_model_len: int | None = None
    policy: str = "continuous"
    enable_prefix_caching: bool = True
    free_block_order: str = "lru"
    forward: str = "auto"
    batch_invariant: bool = False
    static_decode: str = "auto"
    telemetry_capacity: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.free_block_order not in FREE_BLOCK_ORDERS:
            raise ValueError(f"free_block_order must be one of {FREE_BLOCK_ORDERS}, got {self.free_block_order!r}")
        if self.forward not in FORWARDS:
            raise ValueError(f"forward must be one of {FORWARDS}, got {self.forward!r}")
        if self.static_decode not in STATIC_DECODE:
            raise ValueError(f"static_decode must be one of {STATIC_DECODE}, got {self.static_decode!r}")
        if self.batch_invariant and self.forward != "auto":
            raise ValueError("batch_invariant needs the engine's own forward (forward='auto')")
        if min(self.block_size, self.max_num_seqs, self.max_num_batched_tokens, self.prefill_chunk_tokens) < 1:
            raise ValueError("block_size, max_num_seqs, max_num_batched_tokens and prefill_chunk_tokens must be >= 1")
        if self.prefill_step_target is not None and not 1.0 < self.prefill_step_target < float("inf"):
            raise ValueError(f"prefill_step_target must be a finite ratio > 1, got {self.prefill_step_target}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.kv_cache_memory = parse_memory(self.kv_cache_memory)

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """Build from keyword arguments (None values take the defaults), rejecting unknown names with a
        ``TypeError``."""
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in kwargs.items() if v is not None}  # None means "the default"
        unknown = set(kwargs) - names
        if unknown:
            raise TypeError(f"unknown engine argument(s): {sorted(unknown)}")
        return cls(**kwargs)
