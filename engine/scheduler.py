"""Iteration-level (continuous) batching scheduler, with a ``static`` policy for comparison.

One step (Orca, Yu et al., OSDI 2022; vLLM v1's scheduler):

1. running requests first, in admission order: each gets its next tokens (one for decode, the next
   chunk of its prompt for prefill) within the token budget. A request that needs a block and finds
   none preempts the most recently admitted running request (recompute: its blocks are freed,
   ``num_computed_tokens`` goes back to 0, it returns to the front of ``waiting``).
2. then waiting requests, first come first served, while a batch slot, budget and blocks remain.
   Prompts longer than the budget are split into chunks (chunked prefill).

Latency policy (chunked prefill that never freezes a stream): every running request that decodes
gets its token first (the budget is reserved for them before any prompt chunk is sized), and while
at least one request decodes, a prompt part way through its prefill computes at most
``prefill_chunk_tokens`` tokens per step (vLLM's ``long_prefill_token_threshold`` plays the same role), and
the step's prompt tokens are at most ``prefill_chunk_tokens`` times the prompts that can progress
(running ones still prefilling, waiting ones the free batch slots can take), within
``max_num_batched_tokens``. Prompts admitted in the step take what is left in arrival order, each as
much as it still needs: one long prompt is still chunked, a short prompt arriving behind it is computed
at once, and a burst of prompts arriving together reaches its first tokens in arrival order instead of
all of them advancing side by side and finishing together (the step sizes stay the same). With
``prefill_step_target`` set, the prompt tokens of such a step (all prompts together) are sized instead
so that the step takes about that many times what its decode rows alone take, from a cost model
learned from the steps run (:mod:`engine.step_cost`). A long prompt is then prefilled over several
steps, each of them also computing every decode token; with nothing decoding, prompts use the whole
``max_num_batched_tokens`` budget.

``static`` admits a batch only when nothing is running, reserves ``prompt + max_tokens`` blocks per
request up front (as pre-paging servers did), and keeps a finished request's slot empty until the whole
batch is done.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.config import EngineConfig
from engine.errors import PROMPT, ContextLengthError, RequestError
from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus
from engine.step_cost import StepCostModel, attention_pairs
from engine.stopping import Stop, check_token

log = logging.getLogger(__name__)


class SlotState(NamedTuple):
    """Who holds one batch slot when a step is scheduled (:attr:`SchedulerOutput.batch_slots`; plain data).

    Attributes:
        request_id: the request holding the slot.
        num_computed_tokens: its tokens in the KV cache before the step (tokens).
        num_prompt_tokens: its prompt length (tokens).
        num_cached_tokens: tokens it found in the prefix cache at its latest admission (tokens).
    """

    request_id: str
    num_computed_tokens: int
    num_prompt_tokens: int
    num_cached_tokens: int


@dataclass
class SchedulerOutput:
    """What one step computes.

    Attributes:
        scheduled: ``(request, num_new_tokens)`` pairs, in the order their tokens are packed.
        num_scheduled_tokens: total tokens of the step (tokens).
        admitted: requests that took a slot this step.
        preempted: requests preempted this step (already back in ``waiting``).
        blocks_to_copy: copy-on-write ``(src, dst)`` block copies to make before the forward.
        attention_pairs: (query, key) pairs the step's causal attention computes (the step cost model's
            second term, :func:`engine.step_cost.attention_pairs`).
        batch_slots: per batch slot, who holds it once the step is scheduled (a
            :class:`SlotState`, with its tokens computed before the step) or None.
    """

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    attention_pairs: float = 0.0
    batch_slots: tuple[SlotState | None, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Decides, each step, which requests compute how many tokens, and applies the sampled tokens.

    Args:
        config: engine settings (``max_num_seqs``, ``max_num_batched_tokens``, ``policy``).
        kv_cache_manager: the block tables and pool.
        max_model_len: context length (tokens): prompt + generated tokens never exceed it.
    """

    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self.static = config.policy == "static"
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.batch_slots: list[Request | None] = [None] * config.max_num_seqs
        self.num_preemptions = 0
        self.step_cost = StepCostModel()  # fed by the engine after each step (prefill_step_target)
        self._finished: list[Request] = []  # ended since the last take_finished()

    # ------------------------------------------------------------------ admission
    def check_request(self, request: Request) -> None:
        """Reject a request that could never run.

        Raises:
            engine.errors.RequestError: an empty prompt (``param`` prompt); ``n`` over the batch slots
                (``param`` n).
            engine.errors.ContextLengthError: a prompt that leaves no room for one new token within the
                context length, or one needing more blocks than the pool has.
        """
        n = request.num_prompt_tokens
        if n == 0:
            raise RequestError("the prompt is empty", PROMPT)
        if n + 1 > self.max_model_len:
            raise ContextLengthError(
                f"the prompt has {n} tokens, but the context length is {self.max_model_len} tokens "
                f"(prompt + at least one new token must fit)"
            )
        if 1 + len(request.pending_forks) > len(self.batch_slots):
            raise RequestError(f"n={1 + len(request.pending_forks)} parallel samples need more than the "
                               f"{len(self.batch_slots)} batch slots", "n")
        need = n + (request.max_tokens if self.static else 1)
        if self.kv.blocks_needed(need) > self.kv.num_blocks:
            raise ContextLengthError(
                f"the request needs {self.kv.blocks_needed(need)} KV blocks but the pool has {self.kv.num_blocks}"
            )

    def add_request(self, request: Request) -> None:
        """Queue a checked request (raises :class:`engine.errors.RequestError` via :meth:`check_request`, or for
        an id already in use)."""
        self.check_request(request)
        if request.request_id in self.requests:
            raise RequestError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        for sib in request.pending_forks:
            self.requests[sib.request_id] = sib
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def take_finished(self) -> list[Request]:
        """Requests that ended (stopped, length, aborted, failed) since the last call, in order."""
        out, self._finished = self._finished, []
        return out

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests and tokens, allocating blocks (and preempting) as needed."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        # decode tokens are reserved first, so that no prompt chunk can take them (latency policy)
        decodes_left = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        chunk_cap = budget  # tokens a running prompt may compute this step
        admit_cap = budget  # tokens a prompt admitted this step may compute
        sized = False  # whether prefill_step_target sized this step's prompt tokens
        target = self.config.prefill_step_target
        if target is not None and decodes_left:  # size the prompt tokens by a target step time instead
            decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
            prompt = next((r for r in self.running if r.num_tokens - r.num_computed_tokens > 1), None)
            chunk = self.step_cost.chunk_tokens(
                decodes_left, target, budget, decode_pairs=sum(r.num_computed_tokens + 1 for r in decoding),
                prompt_start=prompt.num_computed_tokens if prompt is not None else 0)
            if chunk is not None:
                chunk_cap = admit_cap = chunk
                budget = min(budget, decodes_left + chunk)  # all prompts together, not each
                sized = True
        if decodes_left and not sized:  # the fixed chunk policy
            # a prompt part way through its prefill gets its own chunk; the step holds one chunk per prompt
            # that can progress, and newly admitted prompts take what is left in arrival order
            chunk_cap = self.config.prefill_chunk_tokens
            budget = min(budget, decodes_left + chunk_cap * self._num_prefill_candidates())

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            remaining = req.num_tokens - req.num_computed_tokens
            if remaining <= 0:  # finished row held by the static policy
                i += 1
                continue
            if remaining == 1:
                decodes_left -= 1
                num_new = 1
            else:
                num_new = min(remaining, budget - max(0, decodes_left), chunk_cap)
                if num_new <= 0:
                    i += 1
                    continue
            while self.kv.allocate_slots(req, num_new) is None:
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req in preempted:
                break
            scheduled.append((req, num_new))
            budget -= num_new
            i += 1

        if not preempted and (not self.static or not self.running):
            self._admit(scheduled, out, budget, admit_cap)

        # decode rows first: the attention path handles a contiguous run of single-token rows at once
        scheduled.sort(key=lambda rn: rn[1] > 1)
        out.scheduled = scheduled
        out.num_scheduled_tokens = sum(n for _, n in scheduled)
        out.attention_pairs = sum(attention_pairs(r.num_computed_tokens, n) for r, n in scheduled)
        out.preempted = preempted
        out.blocks_to_copy = self.kv.take_copies()
        bs = self.kv.block_size
        out.batch_slots = tuple(None if r is None else SlotState(r.request_id, r.num_computed_tokens, r.num_prompt_tokens,
                                                                 r.num_hit_blocks * bs) for r in self.batch_slots)
        return out

    def _num_prefill_candidates(self) -> int:
        """Prompts that can compute tokens this step (at least 1): running ones still prefilling, plus the
        waiting ones at the head of the queue that the free batch slots can take (a request with parallel
        samples needs a slot for each; the static policy admits nobody while anything runs)."""
        n = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens > 1)
        if not self.static or not self.running:
            free = sum(1 for r in self.batch_slots if r is None)
            for req in self.waiting:
                need = self._slots_needed(req)
                if need > free:
                    break
                free -= need
                n += 1
        return max(1, n)

    @staticmethod
    def _slots_needed(req: Request) -> int:
        """Batch slots ``req`` takes when admitted: one, plus one per parallel sample not aborted."""
        req.pending_forks = [s for s in req.pending_forks if not s.is_finished]
        return 1 + len(req.pending_forks)

    def _admit(self, scheduled: list, out: SchedulerOutput, budget: int, chunk_cap: int) -> None:
        now = time.monotonic()
        while self.waiting and budget > 0:
            req = self.waiting[0]
            free_slots = [i for i, r in enumerate(self.batch_slots) if r is None]
            if len(free_slots) < self._slots_needed(req):  # parallel samples need a slot each
                break
            slot = free_slots[0]
            hits, num_hit = self.kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else ([], 0)
            remaining = req.num_tokens - req.num_computed_tokens - num_hit
            num_new = min(remaining, budget, chunk_cap)
            lookahead = 0
            if self.static:
                lookahead = req.num_prompt_tokens + req.max_tokens - (req.num_computed_tokens + num_hit + num_new)
            if self.kv.allocate_slots(req, num_new, hits, num_lookahead_tokens=max(0, lookahead)) is None:
                break
            self.waiting.popleft()
            if req.num_computed_tokens == 0 and req.num_preemptions == 0:  # once per request: a recompute
                self.kv.record_prefix_lookup(req, num_hit)  # finds its own blocks again, which is no cache hit
            req.num_computed_tokens += num_hit
            req.num_hit_blocks = len(hits)
            req.status = RequestStatus.RUNNING
            req.batch_slot = slot
            self.batch_slots[slot] = req
            for sib, sib_slot in zip(req.pending_forks, free_slots[1:]):
                sib.batch_slot = sib_slot
                self.batch_slots[sib_slot] = sib
            if req.scheduled_time is None:
                req.scheduled_time = now
            self.running.append(req)
            scheduled.append((req, num_new))
            out.admitted.append(req)
            budget -= num_new

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: free every block, forget computed tokens, go to the front of waiting."""
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_hit_blocks = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._release_slot(req)
        for sib in req.pending_forks:
            self._release_slot(sib)
        self.waiting.appendleft(req)

    def _release_slot(self, req: Request) -> None:
        if req.batch_slot is not None and self.batch_slots[req.batch_slot] is req:
            self.batch_slots[req.batch_slot] = None
        req.batch_slot = None

    # ------------------------------------------------------------------ results
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> tuple[list[Request], dict[str, Stop]]:
        """Apply a step's results: advance ``num_computed_tokens``, record full blocks in the prefix
        cache, fork parallel samples and append the sampled tokens. Nothing is finished here: each token's
        token-level stop (:func:`engine.stopping.check_token`: EOS, a stop token id, ``max_tokens``, the
        context length) is returned as data; the engine core resolves it with the text step (stop strings,
        :meth:`engine.output_processor.OutputProcessor.process_tokens`) and ends the requests that stop with
        :meth:`apply_stops`.

        Args:
            out: the step's :class:`SchedulerOutput`.
            sampled: request id -> sampled token id, for requests whose computed tokens reached
                their end this step (a partial prefill chunk samples nothing).

        Returns:
            ``(changed, token_stops)``: the requests that got a new token this step, in scheduled order, and
            request id -> token-level :class:`engine.stopping.Stop` of those whose new token ends them. A fault
            while applying one request's step (or forking its siblings) fails it alone, at once (finished with
            an error, blocks freed, left out of both).
        """
        changed: list[Request] = []
        stops: dict[str, Stop] = {}
        now = time.monotonic()
        for req, n in out.scheduled:
            if req.is_finished:  # aborted or failed during the step
                continue
            siblings = [s for s in req.pending_forks if not s.is_finished]
            try:
                self._apply_step(req, n, siblings, sampled, changed, stops, now)
            except Exception as e:  # a fault in this request's stop check or fork: it fails alone
                log.exception("applying the step to request %s failed", req.request_id)
                for r in [req] + siblings:
                    if r in changed:
                        changed.remove(r)
                    stops.pop(r.request_id, None)
                    self.finish(r, RequestStatus.FINISHED_ERROR, error=f"stop handling failed: {e!r}")
        return changed, stops

    def _apply_step(self, req: Request, n: int, siblings: list[Request], sampled: dict[str, int],
                    changed: list[Request], stops: dict[str, Stop], now: float) -> None:
        """:meth:`update_from_output` for one scheduled request and the siblings that fork off it."""
        req.num_computed_tokens += n
        self.kv.cache_blocks(req)
        tok = sampled.get(req.request_id)
        if tok is None:
            return
        req.pending_forks = []
        for sib in siblings:  # parallel sampling: the siblings fork off the computed prompt
            self.kv.fork(req, sib)
            sib.num_computed_tokens = req.num_computed_tokens
            sib.status = RequestStatus.RUNNING
            sib.scheduled_time = req.scheduled_time
            self.running.append(sib)
        for r, t in [(req, tok)] + [(s, sampled[s.request_id]) for s in siblings]:
            r.output_token_ids.append(t)
            if r.first_token_time is None:
                r.first_token_time = now
            changed.append(r)
            stop = check_token(r, self.max_model_len)
            if stop is not None:
                stops[r.request_id] = stop

    def apply_stops(self, changed: list[Request], stops: dict[str, Stop]) -> None:
        """End each request of ``changed`` that has a stop in ``stops`` (request id -> its
        :class:`engine.stopping.Stop`), in order: the one place a generated token ends a request (its stop
        reason set, :meth:`finish`: blocks freed at once)."""
        for r in changed:
            stop = stops.get(r.request_id)
            if stop is not None:
                r.stop_reason = stop.reason
                self.finish(r, stop.status, error=stop.error)

    def finish(self, req: Request, status: RequestStatus, error: str | None = None) -> None:
        """End a request (stopped, length, aborted or failed): free its blocks at once. Under the
        static policy its slot stays held (empty row) until the whole batch is done."""
        if req.is_finished:
            return
        req.status = status
        req.error = error
        req.finish_time = time.monotonic()
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.kv.free(req)
        self.kv.forget(req)
        self.requests.pop(req.request_id, None)
        self._finished.append(req)
        for sib in req.pending_forks:  # ended before its prompt was computed: the siblings end too
            self.finish(sib, status, error)
        req.pending_forks = []
        if not self.static:
            self._release_slot(req)
        elif not self.running:
            self.batch_slots = [None] * len(self.batch_slots)  # the static batch is over: every slot opens

    def abort(self, request_id: str) -> Request | None:
        """Abort a waiting or running request; its blocks go back at once. Unknown ids are ignored."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req
