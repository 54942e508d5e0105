"""EngineCore: one engine step = schedule -> forward -> sample -> update -> output -> telemetry.

``add_request`` and ``abort_request`` may be called from any thread: they only validate and put a
message in an inbox, which :meth:`EngineCore.step` drains on the stepping thread. Everything else
(scheduler, KV manager, model runner) is touched by the stepping thread alone.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
import uuid

import torch

from engine.config import EngineConfig
from engine.detokenizer import max_token_chars
from engine.isolation import error_output, execute_isolated, reject_non_finite, sample_isolated
from engine.kv_cache import KVCacheManager
from engine.model_loader import eos_token_ids, load_model
from engine.model_runner import ModelRunner, num_blocks_for
from engine.output_processor import OutputProcessor
from engine.request import ChatPrompt, Request, RequestOutput, RequestStatus, SamplingParams, TextPrompt
from engine.sampler import Sampler
from engine.scheduler import Scheduler, SchedulerOutput
from engine.telemetry import BatchSlotSnapshot, FinishedRequestStats, StepSnapshot, Telemetry

log = logging.getLogger(__name__)


def _check_text(text: str, what: str) -> None:
    """Raise ``ValueError`` when ``text`` cannot be encoded as UTF-8 (e.g. a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode text: {e.reason} at position {e.start}") from None


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
        self.runner = ModelRunner(model, num_blocks, cfg.block_size, cfg.forward, cfg.batch_invariant)
        self.sampler = Sampler()
        self.output_processor = OutputProcessor(tokenizer)
        self.telemetry = Telemetry(capacity=cfg.telemetry_capacity)
        self.eos_token_ids = eos_token_ids(tokenizer, model)
        self.step_count = 0
        self.peak_used_blocks = 0
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._groups: dict[str, list[Request]] = {}  # request id -> its sequences, for n > 1
        self._live: set[str] = set()  # ids of requests added and not finished
        self._rejected: list[Request] = []  # refused while draining the inbox (e.g. a duplicate id)

    # ------------------------------------------------------------------ requests in
    def tokenize(self, prompt, check_length: bool = True) -> list[int]:
        """Prompt -> token ids. A string (or a :class:`TextPrompt`) is tokenized as is; a list of
        ``{"role", "content"}`` dicts is rendered with the chat template (generation prompt added), a
        :class:`ChatPrompt` with its own flags; a list of ints is taken as ids.

        With ``check_length``, text longer than the context length can hold (``max_model_len`` x the
        longest vocabulary entry, in characters) is refused before it is tokenized, so a huge prompt costs
        no tokenizer time or memory.

        Raises:
            ValueError: empty or malformed prompt, or text that cannot fit in the context length.
        """
        add_special_tokens = True
        if isinstance(prompt, TextPrompt):
            prompt, add_special_tokens = prompt.text, bool(prompt.add_special_tokens)
            if not isinstance(prompt, str):
                raise ValueError("a TextPrompt's text must be a string")
        if isinstance(prompt, ChatPrompt):
            return self._render_chat(prompt, check_length)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            _check_text(prompt, "the prompt")
            if check_length:
                self._check_chars(len(prompt))
            return self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt):
            vocab = self.model.config.get_text_config().vocab_size
            if any(t < 0 or t >= vocab for t in prompt):
                raise ValueError(f"prompt token ids must be in [0, {vocab})")
            return list(prompt)
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            return self._render_chat(ChatPrompt(list(prompt)), check_length)
        if isinstance(prompt, (list, tuple)) and not prompt:
            raise ValueError("the prompt is empty")
        raise ValueError("a prompt must be a string, a list of chat messages or a list of token ids")

    def _check_chars(self, num_chars: int) -> None:
        """Raise ``ValueError`` when text of ``num_chars`` characters needs more tokens than the context length."""
        limit = self.max_model_len * max_token_chars(self.tokenizer)
        if num_chars > limit:
            raise ValueError(f"the prompt has {num_chars} characters, more than the context length of "
                             f"{self.max_model_len} tokens can hold (at most {limit} characters)")

    def _render_chat(self, chat: ChatPrompt, check_length: bool = True) -> list[int]:
        """A chat rendered with the chat template and its flags, then tokenized. Raises ``ValueError``."""
        messages = chat.messages
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("the prompt is empty")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError("each chat message needs a string 'role' and a string 'content'")
            _check_text(m["role"], "a chat message role")
            _check_text(m["content"], "a chat message")
        if check_length:  # the template only adds text: the contents alone must fit
            self._check_chars(sum(len(m["content"]) for m in messages))
        if chat.continue_final_message and chat.add_generation_prompt:
            raise ValueError("continue_final_message cannot be used together with add_generation_prompt")
        kwargs = dict(chat.chat_template_kwargs or {})
        reserved = sorted(set(kwargs) & {"conversation", "messages", "tokenize", "add_generation_prompt",
                                         "continue_final_message", "chat_template", "tools", "documents"})
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        try:
            text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, **kwargs,
                                                      add_generation_prompt=bool(chat.add_generation_prompt),
                                                      continue_final_message=bool(chat.continue_final_message))
        except Exception as e:  # a template error (jinja, a bad variable): this request's fault
            raise ValueError(f"the chat template failed on these messages: {e}") from None
        return self.tokenizer(text, add_special_tokens=bool(chat.add_special_tokens))["input_ids"]

    def make_request(self, request_id: str | None, prompt, params: SamplingParams | None = None,
                     cache_salt: str | None = None) -> Request:
        """Validate and build a :class:`Request` (any thread; touches no engine state).

        Raises:
            ValueError: bad sampling values, empty prompt, prompt over the context length, or a
                request that can never fit in the KV pool.
        """
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        params.validate()
        if cache_salt is not None:
            if not isinstance(cache_salt, str) or not cache_salt:
                raise ValueError("cache_salt must be a non-empty string")
            _check_text(cache_salt, "cache_salt")
        if request_id is not None and (not isinstance(request_id, str) or "#" in request_id):
            raise ValueError("a request id must be a string without '#'")
        if request_id is not None:
            _check_text(request_id, "the request id")
        ids = self.tokenize(prompt, check_length=params.truncate_prompt_tokens is None)
        if params.truncate_prompt_tokens is not None:  # vLLM's: keep the last k prompt tokens
            keep = self.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            ids = ids[-keep:]
        vocab = self.model.config.get_text_config().vocab_size
        if params.logit_bias and any(t >= vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias has a token id outside the vocabulary [0, {vocab})")
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids has a token id outside the vocabulary [0, {vocab})")
        if params.allowed_token_ids is not None and any(t >= vocab for t in params.allowed_token_ids):
            raise ValueError(f"allowed_token_ids has a token id outside the vocabulary [0, {vocab})")
        if params.allowed_token_ids is not None and params.min_tokens > 0:
            # before min_tokens, EOS (unless ignore_eos) and stop token ids are masked: something must remain
            masked = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
            if set(params.allowed_token_ids) <= masked:
                raise ValueError("allowed_token_ids leaves nothing to sample before min_tokens: every allowed id "
                                 "is an end-of-sequence or stop token id")
        rid = request_id or uuid.uuid4().hex
        seqs = []
        for i in range(params.n):
            sp = params if params.n == 1 else dataclasses.replace(
                params, n=1, seed=None if params.seed is None else params.seed + i)
            req = Request(rid if params.n == 1 else f"{rid}#{i}", ids, sp, self.eos_token_ids, self.max_model_len,
                          prompt=prompt)
            req.group_id, req.index, req.cache_salt = rid, i, cache_salt
            req.detokenizer = self.output_processor.new_detokenizer(ids, sp)
            seqs.append(req)
        seqs[0].pending_forks = seqs[1:]
        self.scheduler.check_request(seqs[0])
        return seqs[0]

    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None,
                    cache_salt: str | None = None) -> Request:
        """Validate a request and queue it for the next step (thread-safe). Raises ``ValueError``."""
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
                    if item.group_id in self._live:
                        raise ValueError(f"request id {item.group_id!r} is already in use")
                    self.scheduler.add_request(item)
                    self._live.add(item.group_id)
                    if item.pending_forks:
                        self._groups[item.group_id] = [item] + item.pending_forks
                except ValueError as e:  # e.g. a duplicate id: fail that request alone
                    for seq in [item] + item.pending_forks:
                        seq.status = RequestStatus.FINISHED_ERROR
                        seq.error = str(e)
                    self._rejected.append(item)
            else:
                for seq in self._groups.get(item, [None]):
                    self.scheduler.abort(item if seq is None else seq.request_id)

    def _rejected_outputs(self) -> list[RequestOutput]:
        """Final outputs of the requests refused while draining the inbox (then forgotten)."""
        outs = [self.output_processor.make_output(r, [r] + r.pending_forks) for r in self._rejected]
        self._rejected = []
        return outs

    def process_inbox(self) -> list[RequestOutput]:
        """Apply the queued adds and aborts without running a step (a paused engine): new requests join
        the waiting queue, aborted ones give their blocks back now. Returns the final outputs of the
        requests that ended (aborted, refused)."""
        if not self._drain_inbox():
            return []
        self._amend_telemetry()
        finished = self.scheduler.take_finished()
        outputs = self._outputs(finished)
        self._record_finished(finished + self.scheduler.take_finished(), time.monotonic())
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
        self.kv.pool.step = self.step_count + 1  # stamps the blocks taken and freed in this step
        self._drain_inbox()
        sched = self.scheduler.schedule()
        batch_slots = self.scheduler.batch_slot_snapshot(sched)
        changed: list[Request] = []
        forward_time = 0.0
        if not sched.is_empty:
            tf = time.monotonic()
            logits, sampling, failed = execute_isolated(self.runner, sched.scheduled, sched.blocks_to_copy)
            logits, sampling = self._add_fork_rows(logits, sampling)
            logits, sampling, bad_rows = reject_non_finite(logits, sampling)
            sampled, bad_samples = sample_isolated(self.sampler, logits, sampling)
            forward_time = time.monotonic() - tf
            for req, error in failed + bad_rows + bad_samples:  # these fail alone; the others go on
                self.scheduler.finish(req, RequestStatus.FINISHED_ERROR, error=error)
            changed = self.scheduler.update_from_output(sched, sampled)
            for req in changed:
                self._detokenize(req)
        finished = self.scheduler.take_finished()
        outputs = self._outputs(changed + finished)
        finished += self.scheduler.take_finished()  # failed while their output was built (already in outputs)
        outputs += self._rejected_outputs()
        if not sched.is_empty or finished:
            self.step_count += 1
            try:  # telemetry only observes: its failure must not lose this step's outputs
                self._record(t0, forward_time, sched, batch_slots, changed, finished)
            except Exception:
                log.exception("recording telemetry failed at step %d; the step's outputs are delivered", self.step_count)
        self.kv.pool.step = self.step_count  # blocks freed between steps (aborts while paused): this step
        return outputs

    def _detokenize(self, req: Request) -> None:
        """The output step of one request (text, stop strings); a failure there fails it alone."""
        try:
            for stopped in self.output_processor.process_tokens([req]):
                self.scheduler.finish(stopped, RequestStatus.FINISHED_STOPPED)
        except Exception as e:
            log.exception("detokenizing failed for request %s", req.request_id)
            self._fail(req, f"detokenizing failed: {e!r}")

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
            self._amend_telemetry()
            self._record_finished(finished, time.monotonic())
        except Exception:
            log.exception("recording telemetry after failing every request failed")
        return outputs

    @staticmethod
    def _add_fork_rows(logits, sampling: list[Request]):
        """Parallel sampling: a first sequence whose prompt is now computed lends its logits row to
        each sibling about to fork from it, so each draws its own first token."""
        extra = [(i, sib) for i, r in enumerate(sampling) for sib in r.pending_forks if not sib.is_finished]
        if not extra:
            return logits, sampling
        rows = torch.tensor([i for i, _ in extra], device=logits.device)
        return torch.cat([logits, logits.index_select(0, rows)]), sampling + [sib for _, sib in extra]

    def _outputs(self, touched: list[Request]) -> list[RequestOutput]:
        """One :class:`RequestOutput` per user request touched this step (all n sequences of it)."""
        outs = []
        seen = set()
        for req in touched:
            gid = req.group_id
            if gid in seen:
                continue
            seen.add(gid)
            seqs = self._groups.get(gid, [req])
            try:
                out = self.output_processor.make_output(req, seqs)
            except Exception as e:  # building this request's output failed: it fails alone
                log.exception("building the output of request %s failed", gid)
                for seq in seqs:
                    self._fail(seq, f"building the output failed: {e!r}")
                out = error_output(req, seqs)
            if out.finished:
                self._groups.pop(gid, None)
                self._live.discard(gid)
            outs.append(out)
        return outs

    def _record(self, t0: float, forward_time: float, sched: SchedulerOutput,
                batch_slots: tuple[BatchSlotSnapshot, ...], changed: list[Request], finished: list[Request]) -> None:
        kv = self.kv.snapshot(self.scheduler.running)
        self.peak_used_blocks = max(self.peak_used_blocks, kv.num_used_blocks)
        now = time.monotonic()
        self.telemetry.record(
            StepSnapshot(
                step=self.step_count,
                time=now,
                duration=now - t0,
                forward_time=forward_time,
                batch_slots=batch_slots,
                block_tables=kv.block_tables,
                block_refcount=kv.block_refcount,
                block_tokens=kv.block_tokens,
                block_reuses=kv.block_reuses,
                cached_blocks=kv.cached_blocks,
                num_running=len(self.scheduler.running),
                num_waiting=len(self.scheduler.waiting),
                num_scheduled_tokens=sched.num_scheduled_tokens,
                num_generated_tokens=len(changed),
                num_preemptions=self.scheduler.num_preemptions,
                finished=tuple(r.request_id for r in finished),
                admitted=tuple(r.request_id for r in sched.admitted),
                prefix_cache_queries=kv.prefix_cache_queries,
                prefix_cache_hits=kv.prefix_cache_hits,
                cache_hit_blocks=kv.cache_hit_blocks,
                waiting=tuple(r.request_id for r in self.scheduler.waiting),
                block_takes=self.kv.pool.take_events(),
                block_origins=kv.block_origins,
            )
        )
        self._record_finished(finished, now)

    def _amend_telemetry(self) -> None:
        """Between steps (a paused engine took requests or aborts): the newest snapshot's pool, block tables
        and queue become what they are now, so the panels show freed blocks and queued requests at once."""
        waiting = tuple(r.request_id for r in self.scheduler.waiting)
        last = self.telemetry.latest()
        if last is None:  # before the first step: only the queue (amend_latest sets it otherwise)
            self.telemetry.set_queue(waiting)
            return
        kv = self.kv.snapshot(self.scheduler.running)
        self.telemetry.amend_latest(dataclasses.replace(
            last, block_tables=kv.block_tables, block_refcount=kv.block_refcount, block_tokens=kv.block_tokens,
            block_reuses=kv.block_reuses, cached_blocks=kv.cached_blocks, cache_hit_blocks=kv.cache_hit_blocks,
            block_origins=kv.block_origins, num_running=len(self.scheduler.running), num_waiting=len(waiting), waiting=waiting,
        ))

    def _record_finished(self, finished: list[Request], now: float) -> None:
        """Latency records of finished requests; time the engine was held by a pause is left out of TTFT,
        TPOT and e2e (it measures the presenter, not the engine)."""
        held = self.telemetry.held_time
        for r in finished:
            end = r.finish_time or now
            ttft, tpot = r.ttft, r.tpot
            if ttft is not None:
                ttft = max(0.0, ttft - held(r.arrival_time, r.first_token_time, now))
            if tpot is not None:
                n = len(r.output_token_ids) - 1
                tpot = max(0.0, tpot - held(r.first_token_time, r.finish_time, now) / n)
            self.telemetry.record_finished(
                FinishedRequestStats(r.request_id, ttft, tpot, max(0.0, end - r.arrival_time - held(r.arrival_time, end, now)),
                                     r.num_prompt_tokens, len(r.output_token_ids), r.status.finish_reason)
            )
