"""Offline API: ``LLM(...).generate(prompts, params)``, as in vLLM."""

from __future__ import annotations

import logging

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.parallel_sampling import ParentRequest, child_ids
from engine.request import RequestOutput, SamplingParams

log = logging.getLogger(__name__)


class LLM:
    """An engine for offline batches.

    Args:
        model: None for the embedded SmolLM2-135M-Instruct, a folder, a ``.gguf`` path, a hub id, or an
            already loaded transformers model (then ``tokenizer`` is required).
        dtype: ``"bfloat16"``, ``"float32"``, ``"float16"`` or None (auto).
        tokenizer: the tokenizer of a preloaded ``model``.
        engine_args: any :class:`engine.config.EngineConfig` field (``max_num_seqs``, ``block_size``,
            ``num_blocks``, ``kv_cache_memory``, ``max_num_batched_tokens``, ``policy``, ...).

    Raises:
        TypeError: unknown engine argument; ValueError: bad value.
    """

    def __init__(self, model=None, dtype=None, tokenizer=None, **engine_args) -> None:
        if model is None or isinstance(model, str):
            cfg = EngineConfig.from_kwargs(model=model, dtype=dtype, **engine_args)
            self.engine = EngineCore(cfg)
        else:
            cfg = EngineConfig.from_kwargs(dtype=dtype, **engine_args)
            self.engine = EngineCore(cfg, model=model, tokenizer=tokenizer)
        self.tokenizer = self.engine.tokenizer
        self.engine.report_whole_queue = False  # offline: nobody reads the places of a deep queue
        self._counter = 0

    @property
    def telemetry(self):
        return self.engine.telemetry

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion.

        Args:
            prompts: one prompt or a list; a prompt is a string, a list of chat messages
                (``{"role", "content"}`` dicts, rendered with the chat template) or a list of token ids.
            params: one :class:`SamplingParams` for all, a list with one per prompt, or None (defaults).

        Returns:
            One finished :class:`RequestOutput` per prompt, in the order of the prompts.

        Raises:
            ValueError: a bad prompt or sampling value (nothing is run then).
            Exception: whatever an engine step raised (a fault that is not one request's alone: see the
                failure model in docs/architecture.md); everything the call admitted is aborted and
                freed first, so the next call works.

        A request that fails alone (non-finite logits, a detokenizer fault, a forward that fails for it
        alone) does not raise: its output has ``finish_reason == "error"`` and ``error`` set.
        """
        single = isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], (dict, int))
        )
        if single:
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        reqs = []
        for p, sp in zip(prompts, params):
            self._counter += 1
            reqs.append(self.engine.input_processor.process(f"offline-{self._counter}", p, sp))  # caller's thread
        parents = [ParentRequest(r) if r.pending_forks else None for r in reqs]  # n > 1: built before the forks
        ids = {rid for r in reqs for rid in child_ids(r)}  # every sequence (n > 1: each child)
        final: dict[str, RequestOutput] = {}
        try:
            for r in reqs:
                self.engine.enqueue(r)
            while len(final) < len(ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in ids:
                        final[out.request_id] = out
        except BaseException:  # a step raised (or Ctrl-C): free everything this call admitted, then re-raise
            self._abort(ids - set(final))
            raise
        return [final[r.request_id] if p is None else p.merge([final[c] for c in p.children])
                for r, p in zip(reqs, parents)]

    def _abort(self, ids: set[str]) -> None:
        """Abort the requests ``ids`` now (their blocks go back to the pool) so the next call starts clean."""
        for rid in ids:
            self.engine.abort_request(rid)
        try:
            self.engine.process_inbox()
        except Exception:  # the engine itself is broken: the original error is the one to report
            log.exception("aborting the requests of a failed generate() call failed")
