"""EngineCore: one engine step = schedule -> forward -> sample -> update -> text -> output -> telemetry.

Data flows one way through a step: the scheduler appends the sampled tokens and returns their token-level
stops; the output processor turns the tokens into text and returns the stops it resolves (stop strings);
the core ends those requests through the scheduler; the telemetry gets one :class:`engine.telemetry.StepView`
of the step to observe. No stage calls back into an earlier one.

``add_request`` and ``abort_request`` may be called from any thread: they only validate and put a
message in an inbox, which :meth:`EngineCore.step` drains on the stepping thread. Everything else
(scheduler, KV manager, model runner) is touched by the stepping thread alone.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import time

from engine.config import EngineConfig
from engine.errors import RequestError
from engine.input_processor import InputProcessor
from engine.isolation import error_output, execute_isolated, reject_non_finite, sample_isolated
from engine.kv_cache import KVCacheManager
from engine.model_loader import eos_token_ids, load_model
from engine.model_runner import ModelRunner, num_blocks_for
from engine.output_processor import OutputProcessor
from engine.pacing import Pacing
from engine.parallel_sampling import add_fork_rows, child_ids
from engine.request import Request, RequestOutput, RequestState, RequestStatus, SamplingParams
from engine.sampler import Sampler
from engine.scheduler import Scheduler, SchedulerOutput
from engine.telemetry import StepView, Telemetry

log = logging.getLogger(__name__)

QUEUE_REPORT_DEPTH = 32  # waiting requests whose place in the queue is reported at every step (the head)
QUEUE_REFRESH_STEPS = 32  # every this many steps, the place of every waiting request is reported


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """Counters of an engine (plain data, for command lines, benches and tests).

    Attributes:
        step_count: engine steps run.
        num_running / num_waiting: requests now running / waiting.
        num_preemptions: preemptions so far.
        prefix_cache_queries / prefix_cache_hits: prompt tokens looked up / found in the prefix cache.
        num_used_blocks / peak_used_blocks / num_blocks: KV blocks held now / at most / in the pool.
        block_size: tokens per block.
        idle_batch_slot_steps: batch-slot steps held without work (the static policy's waste).
        dtype: the model's dtype, e.g. ``"torch.float32"``.
    """

    step_count: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_used_blocks: int
    peak_used_blocks: int
    num_blocks: int
    block_size: int
    idle_batch_slot_steps: int
    dtype: str


class EngineCore:
    """The engine: a scheduler, a KV cache manager, a model runner, a sampler and telemetry.

    Args:
        config: engine settings; keyword arguments build one when it is None.
        model, tokenizer: an already loaded transformers model and tokenizer (tests); when None they
            are loaded from ``config.model``.

    Attributes:
        max_model_len: context length (tokens): the model's, capped by ``config.max_model_len`` and by
            the KV pool's capacity, so that a lone request always fits.
    """

    def __init__(self, config: EngineConfig | None = None, model=None, tokenizer=None, **kwargs) -> None:
        self.config = config if config is not None else EngineConfig.from_kwargs(**kwargs)
        cfg = self.config
        if model is None:
            model, tokenizer = load_model(cfg.model, cfg.dtype, cfg.device)
        elif tokenizer is None:
            raise ValueError("a preloaded model needs its tokenizer")
        self.model = model
        self.tokenizer = tokenizer
        device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        num_blocks = num_blocks_for(cfg, model, device, dtype)
        cfg.num_blocks = num_blocks
        text_cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        limits = [num_blocks * cfg.block_size, getattr(text_cfg, "max_position_embeddings", None), cfg.max_model_len]
        self.max_model_len = min(x for x in limits if x)
        cfg.max_model_len = self.max_model_len
        self.kv = KVCacheManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching, cfg.free_block_order)
        self.scheduler = Scheduler(cfg, self.kv, self.max_model_len)
        self.runner = ModelRunner(model, num_blocks, cfg.block_size, cfg.forward, cfg.batch_invariant,
                                  static_decode=cfg.static_decode, max_num_seqs=cfg.max_num_seqs,
                                  max_model_len=self.max_model_len)
        self.sampler = Sampler()
        self.output_processor = OutputProcessor(tokenizer)
        self.telemetry = Telemetry(capacity=cfg.telemetry_capacity)
        self.pacing = Pacing()  # talk mode (AsyncEngine); its held intervals leave paused time out of latencies
        self.eos_token_ids = eos_token_ids(tokenizer, model)
        self.input_processor = InputProcessor(tokenizer, text_cfg.vocab_size, self.max_model_len, self.eos_token_ids,
                                              self.output_processor, self.scheduler.check_request)
        self.step_count = 0
        self.peak_used_blocks = 0
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: set[str] = set()  # ids of sequences added and not finished
        self._reported: dict[str, RequestState] = {}  # sequence id -> the state its last output carried
        # report every waiting request's place now and then (streaming callers); LLM.generate turns it off
        self.report_whole_queue = True
        self._rejected: list[Request] = []  # refused while draining the inbox (e.g. a duplicate id)

    # ------------------------------------------------------------------ requests in
    def make_request(self, request_id: str | None, prompt, params: SamplingParams | None = None,
                     cache_salt: str | None = None) -> Request:
        """Validate and build a :class:`Request` (any thread; touches no engine state): the input
        processor's :meth:`engine.input_processor.InputProcessor.process`.

        Raises:
            engine.errors.RequestError: see :meth:`engine.input_processor.InputProcessor.process`.
        """
        return self.input_processor.process(request_id, prompt, params, cache_salt)

    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None,
                    cache_salt: str | None = None) -> Request:
        """Validate a request and queue it for the next step (thread-safe). Raises
        :class:`engine.errors.RequestError`; tokenizes on the calling thread (:meth:`make_request`)."""
        req = self.make_request(request_id, prompt, params, cache_salt)
        self.enqueue(req)
        return req

    def enqueue(self, request: Request) -> None:
        """Queue a request built by :meth:`make_request` for the next step (thread-safe)."""
        self._inbox.put(("add", request))

    def abort_request(self, request_id: str) -> None:
        """Abort a request at the next step (thread-safe); its blocks go back to the pool."""
        self._inbox.put(("abort", request_id))

    def _drain_inbox(self) -> int:
        """Apply the queued adds and aborts; returns how many there were."""
        n = 0
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return n
            n += 1
            if kind == "add":
                try:
                    in_use = [rid for rid in child_ids(item) if rid in self._live]
                    if in_use:
                        raise RequestError(f"request id {in_use[0]!r} is already in use")
                    self.scheduler.add_request(item)
                    self._live.update(child_ids(item))
                except ValueError as e:  # e.g. a duplicate id: fail that request alone
                    for seq in [item] + item.pending_forks:
                        seq.status = RequestStatus.FINISHED_ERROR
                        seq.error = str(e)
                    self._rejected.append(item)
            else:
                self.scheduler.abort(item)

    def _rejected_outputs(self) -> list[RequestOutput]:
        """Final outputs of the requests refused while draining the inbox (then forgotten)."""
        outs = [self.output_processor.make_output(seq) for r in self._rejected for seq in [r] + r.pending_forks]
        self._rejected = []
        return outs

    def process_inbox(self) -> list[RequestOutput]:
        """Apply the queued adds and aborts without running a step (a paused engine): new requests join
        the waiting queue, aborted ones give their blocks back now. Returns the final outputs of the
        requests that ended (aborted, refused)."""
        if not self._drain_inbox():
            return []
        finished = self.scheduler.take_finished()
        outputs = self._outputs(finished)
        self.telemetry.observe(self._view(finished + self.scheduler.take_finished()))
        outputs += self._rejected_outputs()
        return outputs

    def has_unfinished_requests(self) -> bool:
        """True while a request is waiting, running, or queued for the next step."""
        return self.scheduler.has_unfinished_requests() or not self._inbox.empty()

    def stats(self) -> EngineStats:
        """The engine's counters now (call from the stepping thread, or when it is idle)."""
        kv = self.kv
        return EngineStats(
            step_count=self.step_count,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits,
            num_used_blocks=kv.num_used_blocks,
            peak_used_blocks=self.peak_used_blocks,
            num_blocks=kv.num_blocks,
            block_size=kv.block_size,
            idle_batch_slot_steps=self.telemetry.total_idle_slot_steps,
            dtype=str(self.runner.dtype),
        )

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput]:
        """Run one engine iteration. Returns an output for every request that got a token or ended.

        A fault in one request's forward, logits, sampling, stop handling, detokenizing or output fails
        that request alone (finish reason ``error``, blocks freed); see ``engine/isolation.py``.

        Raises:
            Exception: a fault outside the per-request stages (the scheduler, the KV cache manager): the
                engine's state cannot be trusted; callers fail everything in flight (:meth:`fail_all`).
        """
        t0 = time.monotonic()
        self._drain_inbox()
        sched = self.scheduler.schedule()  # schedule
        sampled, forward_time = self._execute(sched)  # execute: forward and sample
        changed, token_stops = self.scheduler.update_from_output(sched, sampled)  # update: tokens, token-level stops
        stops = self.output_processor.process_tokens(changed, token_stops)  # text: detokenize, stop strings
        self.scheduler.apply_stops(changed, stops)  # the requests that stop end (blocks freed)
        finished = self.scheduler.take_finished()
        outputs = self._outputs(changed + finished)  # outputs
        finished += self.scheduler.take_finished()  # failed while their output was built (already in outputs)
        outputs += self._rejected_outputs()
        if not sched.is_empty or finished:
            self.step_count += 1
            self.peak_used_blocks = max(self.peak_used_blocks, self.kv.num_used_blocks)
            try:  # telemetry only observes: its failure must not lose the outputs
                self.telemetry.observe(self._view(finished, sched, t0, forward_time, len(changed)))
            except Exception:
                log.exception("recording telemetry failed at step %d; the step's outputs are delivered", self.step_count)
            if self.config.prefill_step_target is not None:  # only then is the cost model read
                self.scheduler.step_cost.observe(sched.num_scheduled_tokens, time.monotonic() - t0,
                                                 sched.attention_pairs)
        return outputs

    def run_to_end(self, max_steps: int | None = None) -> dict[str, RequestOutput]:
        """Step on the calling thread until no request is waiting, running or queued (or ``max_steps`` steps
        have run): the synchronous loop of the offline demos (Compare, the batch-invariance demo).

        Args:
            max_steps: most steps to run (None: until every request has finished).

        Returns:
            the final output of every request that ended in these steps, by request id (in the order they
            ended); what a step ran is in :attr:`telemetry`, one snapshot per step.

        Raises:
            Exception: what :meth:`step` raises (nothing is aborted: the caller owns this core).
        """
        final: dict[str, RequestOutput] = {}
        steps = 0
        while self.has_unfinished_requests() and (max_steps is None or steps < max_steps):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
            steps += 1
        return final

    def _execute(self, sched: SchedulerOutput) -> tuple[dict[str, int], float]:
        """The forward and the sampling of a scheduled step: ``(request id -> sampled token id, seconds)``.
        A request whose forward rows, logits or draw fail is finished with an error here, alone."""
        if sched.is_empty:
            return {}, 0.0
        tf = time.monotonic()
        logits, sampling, failed = execute_isolated(self.runner, sched.scheduled, sched.blocks_to_copy)
        if logits is not None:  # None: no request samples this step, so none forks
            logits, sampling = add_fork_rows(logits, sampling)
        logits, sampling, bad_rows = reject_non_finite(logits, sampling)
        sampled, bad_samples = sample_isolated(self.sampler, logits, sampling)
        for req, error in failed + bad_rows + bad_samples:  # these fail alone; the others go on
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR, error=error)
        return sampled, time.monotonic() - tf

    def _view(self, finished: list[Request], sched: SchedulerOutput | None = None, start: float = 0.0,
              forward_time: float = 0.0, num_generated_tokens: int = 0) -> StepView:
        """The :class:`engine.telemetry.StepView` of the step just run (``sched``), or of the state now
        between steps (``sched`` None: the newest snapshot is amended); ``finished``: the sequences that ended."""
        kv, sch = self.kv, self.scheduler
        return StepView(step=self.step_count, scheduled=sched, start=start, forward_time=forward_time,
                        num_generated_tokens=num_generated_tokens, running=tuple(sch.running),
                        waiting=tuple(r.request_id for r in sch.waiting), finished=tuple(finished),
                        num_preemptions=sch.num_preemptions, kv_events=kv.pool.pop_events(), num_blocks=kv.num_blocks,
                        block_size=kv.block_size, num_used_blocks=kv.num_used_blocks,
                        prefix_cache_queries=kv.prefix_queries, prefix_cache_hits=kv.prefix_hits,
                        held_time=self.pacing.held_time)

    def _fail(self, req: Request, error: str) -> None:
        """Fail one sequence: finished now (blocks freed), or, if a token-level stop finished it this
        step already, its finish reason becomes ``error`` too."""
        if req.is_finished:
            req.status, req.error = RequestStatus.FINISHED_ERROR, error
        else:
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR, error=error)

    def fail_all(self, error: str) -> list[RequestOutput]:
        """Finish every waiting and running request with ``error`` (their blocks go back to the pool)
        and return their final outputs. Only for an engine that cannot go on: a step that raised outside
        the per-request guards (the scheduler or the KV cache manager themselves; see the failure model
        in docs/architecture.md)."""
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR, error=error)
        finished = self.scheduler.take_finished()
        outputs = self._outputs(finished)
        try:  # the panels, /health and /metrics show the emptied engine and count the failures
            self.telemetry.observe(self._view(finished))
        except Exception:
            log.exception("recording telemetry after failing every request failed")
        return outputs

    def _outputs(self, touched: list[Request]) -> list[RequestOutput]:
        """One :class:`RequestOutput` per sequence touched this step (the children of an n > 1 request
        each under their own id; the front merges them, :mod:`engine.parallel_sampling`), and one for each
        waiting or running sequence whose :class:`RequestState` changed without a token (its place in the
        queue, a prompt chunk, a preemption). Every output carries its request's state."""
        waiting = self.scheduler.waiting
        # the head of the queue every step, the whole queue every QUEUE_REFRESH_STEPS steps: a deep queue
        # whose positions all shift at each admission must not cost an output per waiting request per step
        deep = self.report_whole_queue and self.step_count % QUEUE_REFRESH_STEPS == 0
        head = list(waiting) if deep else list(itertools.islice(waiting, QUEUE_REPORT_DEPTH))
        queue = {r.request_id: i for i, r in enumerate(head)}
        seen = {r.request_id for r in touched}
        moved = [r for r in head + self.scheduler.running
                 if r.request_id not in seen and self._reported.get(r.request_id) != self._state_of(r, queue)]
        outs = []
        seen = set()
        for req in touched + moved:
            if req.request_id in seen:
                continue
            seen.add(req.request_id)
            try:
                out = self.output_processor.make_output(req)
            except Exception as e:  # building this request's output failed: it fails alone
                log.exception("building the output of request %s failed", req.request_id)
                self._fail(req, f"building the output failed: {e!r}")
                out = error_output(req)
            out.state = self._state_of(req, queue)
            if req.first_token_time is not None:  # the part of the wait the engine was held (Pause)
                out.metrics["paused_time"] = self.pacing.held_time(req.arrival_time, req.first_token_time)
            if out.finished:
                self._live.discard(req.request_id)
                self._reported.pop(req.request_id, None)
            else:
                self._reported[req.request_id] = out.state
            outs.append(out)
        return outs

    def _state_of(self, req: Request, queue: dict[str, int]) -> RequestState:
        """Where ``req`` stands now; ``queue``: request id -> index in the waiting queue."""
        if req.is_finished:
            return RequestState("finished", preempted=req.num_preemptions > 0)
        if req.request_id in queue:
            return RequestState("queued", position=queue[req.request_id] + 1, waiting=len(queue),
                                preempted=req.num_preemptions > 0)
        if req.num_computed_tokens < req.num_prompt_tokens:
            return RequestState("prefilling", computed=req.num_computed_tokens, prompt=req.num_prompt_tokens,
                                preempted=req.num_preemptions > 0)
        return RequestState("decoding", preempted=req.num_preemptions > 0)
