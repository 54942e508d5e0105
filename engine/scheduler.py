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
at least one request decodes, each prompt's chunk is at most ``prefill_chunk_tokens`` tokens per step
(vLLM's ``long_prefill_token_threshold`` plays the same role). A long prompt is then prefilled over
several steps, each of them also computing every decode token; with nothing decoding, prompts use the
whole ``max_num_batched_tokens`` budget.

``static`` admits a batch only when nothing is running, reserves ``prompt + max_tokens`` blocks per
request up front (as pre-paging servers did), and keeps a finished request's slot empty until the whole
batch is done.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus
from engine.telemetry import PHASE_DECODE, PHASE_IDLE, PHASE_PREFILL, BatchSlotSnapshot

log = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    """What one step computes.

    Attributes:
        scheduled: ``(request, num_new_tokens)`` pairs, in the order their tokens are packed.
        num_scheduled_tokens: total tokens of the step (tokens).
        admitted: requests that took a slot this step.
        preempted: requests preempted this step (already back in ``waiting``).
        blocks_to_copy: copy-on-write ``(src, dst)`` block copies to make before the forward.
    """

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

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
        self._finished: list[Request] = []  # ended since the last take_finished()

    # ------------------------------------------------------------------ admission
    def check_request(self, request: Request) -> None:
        """Reject a request that could never run.

        Raises:
            ValueError: empty prompt, a prompt that leaves no room for one new token within the
                context length, or one needing more blocks than the pool has.
        """
        n = request.num_prompt_tokens
        if n == 0:
            raise ValueError("the prompt is empty")
        if n + 1 > self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens, but the context length is {self.max_model_len} tokens "
                f"(prompt + at least one new token must fit)"
            )
        if 1 + len(request.pending_forks) > len(self.batch_slots):
            raise ValueError(f"n={1 + len(request.pending_forks)} parallel samples need more than the "
                             f"{len(self.batch_slots)} batch slots")
        need = n + (request.max_tokens if self.static else 1)
        if self.kv.blocks_needed(need) > self.kv.num_blocks:
            raise ValueError(
                f"the request needs {self.kv.blocks_needed(need)} KV blocks but the pool has {self.kv.num_blocks}"
            )

    def add_request(self, request: Request) -> None:
        """Queue a checked request (raises ``ValueError`` via :meth:`check_request`)."""
        self.check_request(request)
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
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
        chunk_cap = self.config.prefill_chunk_tokens if decodes_left else budget  # per prompt, per step

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
            self._admit(scheduled, out, budget, chunk_cap)

        # decode rows first: the attention path handles a contiguous run of single-token rows at once
        scheduled.sort(key=lambda rn: rn[1] > 1)
        out.scheduled = scheduled
        out.num_scheduled_tokens = sum(n for _, n in scheduled)
        out.preempted = preempted
        out.blocks_to_copy = self.kv.take_copies()
        return out

    def _admit(self, scheduled: list, out: SchedulerOutput, budget: int, chunk_cap: int) -> None:
        now = time.monotonic()
        while self.waiting and budget > 0:
            req = self.waiting[0]
            req.pending_forks = [s for s in req.pending_forks if not s.is_finished]  # aborted siblings
            free_slots = [i for i, r in enumerate(self.batch_slots) if r is None]
            if len(free_slots) < 1 + len(req.pending_forks):  # parallel samples need a slot each
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
            if req.num_computed_tokens == 0:
                self.kv.record_prefix_lookup(req, num_hit)
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
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Apply a step's results: advance ``num_computed_tokens``, record full blocks in the prefix
        cache, fork parallel samples, append the sampled tokens and finish requests that reached a
        token-level stop (EOS, a stop token id, ``max_tokens`` or the context length). Stop *strings*
        are the output processor's (they need text): it calls :meth:`finish` for them.

        Args:
            out: the step's :class:`SchedulerOutput`.
            sampled: request id -> sampled token id, for requests whose computed tokens reached
                their end this step (a partial prefill chunk samples nothing).

        Returns:
            Requests that got a new token this step, in scheduled order; those that finished have their
            blocks freed already and are also returned by :meth:`take_finished`.
        """
        changed: list[Request] = []
        now = time.monotonic()
        for req, n in out.scheduled:
            if req.is_finished:  # aborted or failed during the step
                continue
            siblings = [s for s in req.pending_forks if not s.is_finished]
            try:
                self._apply_step(req, n, siblings, sampled, changed, now)
            except Exception as e:  # a fault in this request's stop handling or fork: it fails alone
                log.exception("applying the step to request %s failed", req.request_id)
                for r in [req] + siblings:
                    if r in changed:
                        changed.remove(r)
                    self.finish(r, RequestStatus.FINISHED_ERROR, error=f"stop handling failed: {e!r}")
        return changed

    def _apply_step(self, req: Request, n: int, siblings: list[Request], sampled: dict[str, int],
                    changed: list[Request], now: float) -> None:
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
            status = self._check_stop(r, t)
            if status is not None:
                self.finish(r, status)
            changed.append(r)

    def _check_stop(self, req: Request, tok: int) -> RequestStatus | None:
        sp = req.sampling_params
        # before min_tokens tokens exist, EOS and stop token ids do not stop (the sampler masks them too)
        if len(req.output_token_ids) >= sp.min_tokens:
            if not sp.ignore_eos and tok in req.eos_token_ids:
                req.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if tok in sp.stop_token_ids:
                req.stop_reason = tok
                return RequestStatus.FINISHED_STOPPED
        if len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

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

    # ------------------------------------------------------------------ telemetry
    def batch_slot_snapshot(self, out: SchedulerOutput) -> tuple[BatchSlotSnapshot, ...]:
        """Plain-data view of the batch slots for a step just scheduled (call before
        :meth:`update_from_output`, which releases finished requests' slots)."""
        n_sched = {r.request_id: n for r, n in out.scheduled}
        snaps = []
        for i, r in enumerate(self.batch_slots):
            if r is None:
                snaps.append(BatchSlotSnapshot(i, None, PHASE_IDLE))
                continue
            n = n_sched.get(r.request_id, 0)
            if n == 0:
                phase = PHASE_IDLE
            elif n > 1 or r.num_computed_tokens < r.num_prompt_tokens:
                phase = PHASE_PREFILL
            else:
                phase = PHASE_DECODE
            snaps.append(BatchSlotSnapshot(i, r.request_id, phase, n, r.num_computed_tokens + n, r.num_prompt_tokens,
                                           num_cached_tokens=r.num_hit_blocks * self.kv.block_size))
        return tuple(snaps)
