"""Decode steps on static, padded input buffers; on CUDA, replayed from CUDA graphs.

A pure decode step (every scheduled request computes one token and samples it) has a shape that only
depends on the number of requests. This runner pads that number up to the next of a few *capture
sizes* (1, 2, 4, 8, then multiples of 8 up to ``max_num_seqs``, as vLLM does) and runs the engine's own
forward on buffers allocated once: token ids, positions, slot mapping, block tables, context lengths
and query start offsets live at fixed addresses, so on CUDA the whole forward of each size is captured
once at start-up into a ``torch.cuda.CUDAGraph`` and every later step is one host-to-device copy of the
step's inputs (from pinned host memory) and one graph replay: no Python per layer, no kernel launches
from the host. On CPU the same padded buffers run eagerly (there are no graphs); that path exists so
that CI checks the padding is harmless (greedy float32 tokens equal to the eager engine's).

Padding rows compute a dummy token at position 0 of a one-token context in block 0, write nothing to the
cache (slot -1) and are dropped before sampling. Block tables are kept per row on the host and written
from the step's changes only: a row keeps its request while it stays at that index, so a decode step
writes at most one new block id per row (a new block every ``block_size`` tokens); a row whose request
changed, was preempted since, or whose last block was replaced (copy-on-write) is written again whole.

The idea of capturing decode at a set of padded batch sizes is vLLM's (``cudagraph_capture_sizes``) and
SGLang's; the code is ours.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Sequence

import torch

from engine.attention import AttentionMetadata
from engine.request import Request

log = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes for ``max_num_seqs`` slots: 1, 2, 4, 8, 16, 24, ... up to and including
    ``max_num_seqs`` (requests). Raises ValueError for ``max_num_seqs < 1``."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


class StaticDecode:
    """Pure decode steps of the engine's own forward on static padded buffers (CUDA graphs on CUDA).

    Args:
        forward: the engine's own forward (:class:`engine.models.LlamaForward`).
        kv_caches: per layer ``(key_cache, value_cache)`` ``[num_blocks, num_kv_heads, block_size, head_dim]``.
        block_size: tokens per block.
        max_num_seqs: batch slots (the largest capture size).
        max_model_len: context limit (tokens): block-table rows hold ``ceil(max_model_len / block_size)``
            entries.
        use_graphs: capture CUDA graphs (CUDA only; on CPU the padded buffers run eagerly).

    Attributes:
        sizes: the capture sizes (requests).
        capture_seconds: wall time of the capture at start-up (0 on CPU).
        graph_memory_bytes: device memory the graphs' pool took (0 on CPU).
    """

    def __init__(self, forward, kv_caches, block_size: int, max_num_seqs: int, max_model_len: int,
                 use_graphs: bool) -> None:
        self.forward = forward
        self.block_size = block_size
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks = -(-max_model_len // block_size)
        dev = kv_caches[0][0].device
        self.device = dev
        self.use_graphs = bool(use_graphs and dev.type == "cuda")
        n, mb = self.sizes[-1], self.max_blocks
        pin = dev.type == "cuda"

        def host(shape, dtype):
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        # host staging (pinned on CUDA) and the device buffers the forward (or the graph) reads
        self._h_ids, self._h_pos = host(n, torch.int64), host(n, torch.int64)
        self._h_slots, self._h_lens = host(n, torch.int64), host(n, torch.int32)
        self._h_tables = host((n, mb), torch.int32)
        self._ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self._pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self._slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self._lens = torch.ones(n, dtype=torch.int32, device=dev)
        self._tables = torch.zeros((n, mb), dtype=torch.int32, device=dev)
        self._qsl = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self._rows = torch.arange(n, dtype=torch.int64, device=dev)
        # per row: (request id, its preemptions, block ids written, the last of them), to write only changes
        self._row_owner: list[tuple[str, int, int, int] | None] = [None] * n
        self._meta = {
            s: AttentionMetadata(
                kv_caches=kv_caches, slot_mapping=self._slots[:s], block_tables=self._tables[:s],
                seq_lens=self._lens[:s], query_start_loc=self._qsl[: s + 1],
                # host lists only steer launch planning: every row has one query; the context bound
                # comes from the block-table width (the tensors carry the real lengths)
                seq_lens_list=None, query_start_loc_list=list(range(s + 1)),  # type: ignore[arg-type]
            )
            for s in self.sizes
        }
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.graph_memory_bytes = 0
        if self.use_graphs:
            self._capture()

    def supports(self, scheduled: Sequence[tuple[Request, int]]) -> bool:
        """Whether this step is a pure decode step the buffers hold: every request computes one token and
        samples it, at most ``max(sizes)`` requests, block tables within ``max_blocks``."""
        if not scheduled or len(scheduled) > self.sizes[-1]:
            return False
        for req, n in scheduled:
            if n != 1 or req.num_computed_tokens + 1 != req.num_tokens or len(req.block_ids) > self.max_blocks:
                return False
        return True

    def padded_size(self, num_seqs: int) -> int:
        """The capture size a step of ``num_seqs`` requests runs at."""
        return next(s for s in self.sizes if s >= num_seqs)

    def _stage(self, scheduled: Sequence[tuple[Request, int]], size: int) -> None:
        """Write the step's inputs into the host staging buffers, then copy the first ``size`` rows over."""
        bs = self.block_size
        ids, pos, slots, lens, tables = self._h_ids, self._h_pos, self._h_slots, self._h_lens, self._h_tables
        for i, (req, _) in enumerate(scheduled):
            p = req.num_computed_tokens
            num_prompt = len(req.prompt_token_ids)
            ids[i] = req.output_token_ids[p - num_prompt] if p >= num_prompt else req.prompt_token_ids[p]
            pos[i] = p
            bt = req.block_ids
            slots[i] = bt[p // bs] * bs + p % bs
            lens[i] = p + 1
            owner = self._row_owner[i]
            done = 0
            if owner is not None:
                rid, preemptions, written, last = owner
                if (rid == req.request_id and preemptions == req.num_preemptions and written <= len(bt)
                        and bt[written - 1] == last):
                    done = written  # the row already holds this request's first ``written`` block ids
            if done < len(bt):
                tables[i, done : len(bt)] = torch.tensor(bt[done:], dtype=torch.int32)
                self._row_owner[i] = (req.request_id, req.num_preemptions, len(bt), bt[-1])
        b = len(scheduled)
        for i in range(b, size):  # padding rows: a dummy one-token context in block 0, nothing written
            ids[i], pos[i], slots[i], lens[i] = 0, 0, -1, 1
            if self._row_owner[i] is not None:
                tables[i].zero_()
                self._row_owner[i] = None
        nb = self.use_graphs
        self._ids[:size].copy_(ids[:size], non_blocking=nb)
        self._pos[:size].copy_(pos[:size], non_blocking=nb)
        self._slots[:size].copy_(slots[:size], non_blocking=nb)
        self._lens[:size].copy_(lens[:size], non_blocking=nb)
        self._tables[:size].copy_(tables[:size], non_blocking=nb)

    def _run(self, size: int) -> torch.Tensor:
        return self.forward.forward(self._ids[:size], self._pos[:size], self._meta[size], self._rows[:size])

    @torch.inference_mode()
    def execute(self, scheduled: Sequence[tuple[Request, int]]) -> torch.Tensor:
        """One pure decode step (:meth:`supports` must hold).

        Returns:
            ``[len(scheduled), vocab_size]`` logits in the model's dtype, one row per request in order
            (a view into the graph's output buffer on CUDA: read it before the next step).
        """
        size = self.padded_size(len(scheduled))
        self._stage(scheduled, size)
        if size in self._graphs:
            self._graphs[size].replay()
            return self._outputs[size][: len(scheduled)]
        return self._run(size)[: len(scheduled)]

    @torch.inference_mode()
    def _capture(self) -> None:
        """Capture the forward of every size, the largest first, into graphs sharing one memory pool.

        Python's garbage collector is run first and kept off while capturing: an engine dropped earlier
        (a fresh engine per demo run, a test) may hold CUDA graphs in reference cycles, and destroying
        them in the middle of this capture invalidates it ("operation failed due to a previous error
        during capture"; seen on an H200 when engines were built one after another). vLLM freezes the
        collector around its captures for the same reason."""
        gc.collect()
        enabled = gc.isenabled()
        gc.disable()
        try:
            self._capture_all()
        finally:
            if enabled:
                gc.enable()

    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        before = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                for _ in range(2):  # compile the Triton kernels and settle the allocator before capturing
                    self._run(size)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        for size in reversed(self.sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[size] = self._run(size)
            self._graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        self.graph_memory_bytes = torch.cuda.memory_reserved(self.device) - before
        log.info("captured decode CUDA graphs for %d batch sizes (1..%d) in %.1f s, %.0f MiB",
                 len(self.sizes), self.sizes[-1], self.capture_seconds, self.graph_memory_bytes / 2**20)
