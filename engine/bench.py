"""Benchmarks: our engine (continuous and static) against transformers' baselines, in one process.

``python -m engine.bench`` runs a workload through several *systems* with the same model weights, the
same dtype and the same number of threads, and prints one table (``--json`` / ``--html`` save it):

* ``ours-continuous``: :class:`engine.core.EngineCore`, iteration-level batching, paged KV cache;
* ``ours-static``: the same engine with ``policy="static"`` (a batch starts only when the previous one
  is done; each request reserves ``prompt + max_tokens`` of KV up front);
* ``hf-static``: transformers' ``generate`` in static batches (``--hf-batch-size``, 16) with left
  padding, each batch run to its longest ``max_tokens`` (the naive baseline);
* ``hf-cb``: transformers' built-in continuous batching (``init_continuous_batching``) with a bounded
  paged cache (its CPU default would take 60% of RAM). It gets its own model instance: a model switched
  to transformers' paged attention must not serve plain ``generate``.

Workloads (all seeded, nothing downloaded):

* ``offline`` (default): every request at time 0. Default: 64 built-in chat prompts
  (:mod:`engine.prompts`) with right-skewed output lengths between 16 and 256 tokens
  (:func:`skewed_max_tokens`); ``--workload PATH`` reads a W64-style JSON file instead (the reference
  workload ``bench/w64.json``). Greedy, EOS ignored: every system generates exactly the same
  number of tokens.
* ``online``: the same requests arriving as a Poisson process at ``--rate`` requests/s; TTFT, TPOT and
  end-to-end latency percentiles.
* ``multiturn``: ``--conversations`` C chats of ``--turns`` T turns; each turn resends the whole history
  (prompt + previous answers, token for token), once with prefix caching and once without.

``--profile`` prints where one decode step at 64 running requests spends its time instead;
``--mode replay`` replays the workload through our scheduler and KV manager alone (no model) at block
sizes 8, 16 and 32: steps, idle slot-steps and KV shares in seconds.

Units: times in seconds unless a key ends in ``_ms``; rates per second; KV in tokens (one token = K and
V of every layer); shares in percent.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.prompts import chat_prompts
from engine.request import SamplingParams
from engine.telemetry import PHASE_IDLE, StepSnapshot, percentile

log = logging.getLogger(__name__)

SYSTEMS = ("ours-continuous", "ours-static", "hf-static", "hf-cb")


# ==================================================================================================
# workloads
# ==================================================================================================
@dataclass
class BenchRequest:
    """One request of a workload.

    Attributes:
        request_id: unique id.
        prompt_token_ids: the prompt, already tokenized (chat template applied).
        max_tokens: tokens to generate (EOS is ignored, so exactly this many).
        arrival: arrival time after the start of the run (seconds); 0 for offline workloads.
        conversation: conversation index (multi-turn workloads), else None.
        turn: turn index within the conversation (0 = first).
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival: float = 0.0
    conversation: int | None = None
    turn: int = 0


def skewed_max_tokens(n: int, low: int = 16, high: int = 256, seed: int = 20261129) -> list[int]:
    """``n`` output lengths (tokens) in ``[low, high]``, right-skewed like chat answers: many short, a
    long tail (``low + (high - low) * u**2`` with ``u`` uniform: median about ``low + 0.25 (high - low)``,
    mean ``low + (high - low) / 3``). Deterministic for a ``seed``."""
    rng = random.Random(seed)
    return [low + int(round((high - low) * rng.random() ** 2)) for _ in range(n)]


def render_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template (generation prompt added)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def offline_workload(tokenizer, n: int = 64, low: int = 16, high: int = 256, seed: int = 0) -> list[BenchRequest]:
    """``n`` built-in chat requests (varied topics and phrasings) with :func:`skewed_max_tokens` lengths
    (tokens), all arriving at time 0."""
    lengths = skewed_max_tokens(n, low, high)
    return [BenchRequest(f"r{i}", render_chat(tokenizer, msgs), mt)
            for i, (msgs, mt) in enumerate(zip(chat_prompts(n, seed), lengths))]


def load_workload(path: str, n: int | None = None, max_tokens_cap: int | None = None) -> list[BenchRequest]:
    """Requests of a W64-style JSON file (``{"requests": [{"prompt_token_ids", "max_tokens"}, ...]}``).

    Args:
        path: the file.
        n: keep the first ``n`` requests (all when None).
        max_tokens_cap: clamp every ``max_tokens`` to this (quick runs); None keeps them.
    """
    with open(path) as f:
        reqs = json.load(f)["requests"]
    if n is not None:
        reqs = reqs[:n]
    out = []
    for i, r in enumerate(reqs):
        mt = int(r["max_tokens"]) if max_tokens_cap is None else min(int(r["max_tokens"]), max_tokens_cap)
        out.append(BenchRequest(f"w{r.get('id', i)}", list(r["prompt_token_ids"]), mt))
    return out


def poisson_arrivals(requests: Sequence[BenchRequest], rate: float, seed: int = 0) -> list[BenchRequest]:
    """Copies of ``requests`` arriving as a Poisson process of ``rate`` requests/s (exponential gaps,
    first arrival after one gap), in order."""
    rng = random.Random(seed)
    t = 0.0
    out = []
    for r in requests:
        t += rng.expovariate(rate)
        out.append(BenchRequest(r.request_id, list(r.prompt_token_ids), r.max_tokens, t, r.conversation, r.turn))
    return out


FOLLOW_UPS = [
    "Tell me more.", "Can you give an example?", "Why is that?", "Summarise that in one sentence.",
    "What else should I know?", "How does that compare to something familiar?",
]


class MultiTurn:
    """``conversations`` chats of ``turns`` turns; each turn resends its whole history.

    Turn ``t + 1``'s prompt is, token for token, turn ``t``'s prompt + its generated tokens + the
    template's end-of-turn and the next user message (as a server keeping token histories would send
    it), so a prefix cache can reuse everything but the new message.

    Args:
        tokenizer: renders the first turn and the turn separators with its chat template.
        conversations: C, chats running at once.
        turns: T, turns per chat.
        max_tokens: tokens generated per turn.
        seed: picks topics and follow-up questions.
    """

    def __init__(self, tokenizer, conversations: int = 16, turns: int = 4, max_tokens: int = 64, seed: int = 0) -> None:
        self.tokenizer = tokenizer
        self.conversations = conversations
        self.turns = turns
        self.max_tokens = max_tokens
        rng = random.Random(seed)
        self.first = chat_prompts(conversations, seed)
        self.follow = [[rng.choice(FOLLOW_UPS) for _ in range(turns - 1)] for _ in range(conversations)]

    def _separator(self, message: str) -> list[int]:
        """Tokens between an assistant answer and the next generation prompt, for a user ``message``."""
        marker = "\x00ANSWER\x00"
        msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": marker},
                {"role": "user", "content": message}]
        text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text.split(marker, 1)[1], add_special_tokens=False)["input_ids"]

    def first_turns(self) -> list[BenchRequest]:
        """The first turn of every conversation (arrival 0)."""
        return [BenchRequest(f"c{c}t0", render_chat(self.tokenizer, self.first[c]), self.max_tokens, 0.0, c, 0)
                for c in range(self.conversations)]

    def next_turn(self, done: BenchRequest, output_token_ids: list[int]) -> BenchRequest | None:
        """The turn after ``done`` (which generated ``output_token_ids``), or None after the last."""
        c, t = done.conversation, done.turn + 1
        if c is None or t >= self.turns:
            return None
        ids = list(done.prompt_token_ids) + list(output_token_ids) + self._separator(self.follow[c][t - 1])
        return BenchRequest(f"c{c}t{t}", ids, self.max_tokens, 0.0, c, t)


# ==================================================================================================
# measuring
# ==================================================================================================
class ForwardClock:
    """Counts and times a model's ``forward`` calls (seconds), on whatever thread calls them.

    Installed on the model instance (``model.forward`` is wrapped), so it sees our engine's forward,
    ``generate``'s and transformers' continuous batching's alike. On CUDA it synchronizes around each call.
    """

    def __init__(self, model) -> None:
        self.model = model
        self.calls = 0
        self.seconds = 0.0
        self.spans: list[tuple[float, float]] = []  # (start, end) of every call, time.perf_counter()
        self._inner = model.forward
        self._cuda = next(model.parameters()).device.type == "cuda"

        def forward(*args, **kwargs):
            if self._cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            try:
                return self._inner(*args, **kwargs)
            finally:
                if self._cuda:
                    torch.cuda.synchronize()
                e = time.perf_counter()
                self.seconds += e - t
                self.calls += 1
                self.spans.append((t, e))

        model.forward = forward

    def read(self) -> tuple[int, float]:
        """``(calls, seconds)`` so far."""
        return self.calls, self.seconds

    def remove(self) -> None:
        """Restore the model's own ``forward`` and forget this clock."""
        if self.model.__dict__.get("forward") is not None:
            del self.model.forward
        if self.model.__dict__.get("_cbp_forward_clock") is self:
            del self.model._cbp_forward_clock


def forward_clock(model) -> ForwardClock:
    """The model's :class:`ForwardClock`, installed on first use."""
    clock = getattr(model, "_cbp_forward_clock", None)
    if clock is None:
        clock = ForwardClock(model)
        model._cbp_forward_clock = clock
    return clock


@dataclass
class StepRecord:
    """One engine step (or one forward of a baseline).

    Attributes:
        duration: wall time of the step (seconds).
        forward: time inside the model's forward (seconds).
        num_scheduled: requests computed in the step.
        num_waiting: requests waiting after the step.
        num_tokens: tokens computed (tokens).
        idle_slots: batch rows held without useful work (finished or padded rows).
        kv_reserved: KV held for requests (tokens: used blocks x block size, or the padded cache).
        kv_real: of it, positions holding a real token of a live request (tokens).
    """

    duration: float
    forward: float
    num_scheduled: int
    num_waiting: int
    num_tokens: int
    idle_slots: int
    kv_reserved: int | None
    kv_real: int | None


@dataclass
class RequestRecord:
    """One finished request; times in seconds from the start of the run."""

    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    arrival: float
    first_token: float | None
    finish: float
    output_token_ids: list[int] = field(default_factory=list, repr=False)
    preemptions: int = 0


@dataclass
class SystemRun:
    """What a system did on a workload; :func:`summarize` turns it into metrics."""

    system: str
    wall: float
    steps: list[StepRecord]
    requests: list[RequestRecord]
    preemptions: int | None = 0
    max_num_seqs: int | None = None
    prefix_hit_tokens: int | None = None
    prefill_tokens: int | None = None
    notes: list[str] = field(default_factory=list)
    config: dict = field(default_factory=dict)


def kv_from_snapshot(snap: StepSnapshot, block_size: int) -> tuple[int, int]:
    """``(reserved, real)`` KV tokens of a step: blocks held by some block table x ``block_size``, and
    the tokens filled in them (a shared block counts once)."""
    reserved = real = 0
    for ref, tok in zip(snap.block_refcount, snap.block_tokens):
        if ref > 0:
            reserved += block_size
            real += tok
    return reserved, real


def step_series(run: SystemRun) -> dict:
    """Per-step series of a run for plots: ``step_ms`` (ms), ``num_scheduled`` (requests computed),
    ``kv_reserved`` and ``kv_real`` (tokens, None where unknown)."""
    return {
        "step_ms": [round(1000 * s.duration, 3) for s in run.steps],
        "num_scheduled": [s.num_scheduled for s in run.steps],
        "kv_reserved": [s.kv_reserved for s in run.steps],
        "kv_real": [s.kv_real for s in run.steps],
    }


def summarize(run: SystemRun) -> dict:
    """Metrics of one :class:`SystemRun` (a flat dict, JSON-ready).

    Keys: ``generated_tokens`` (tokens), ``requests``, ``wall_s``, ``tokens_per_s``, ``requests_per_s``,
    ``steps`` (forward passes), ``idle_slot_steps`` (rows held without useful work, summed over steps),
    ``kv_reserved_mean`` / ``kv_reserved_peak`` / ``kv_real_mean`` (tokens), ``kv_real_pct_mean`` (real
    over reserved, token-steps, %), ``kv_real_pct_at_peak`` (% at the step of peak reservation),
    ``preemptions``, ``outside_forward_pct`` (share of the summed step time not spent in the model's
    forward, %), ``outside_forward_pct_full`` (the same over steps with at least 90% of ``max_num_seqs``
    requests computed), ``ttft_p50_ms`` ... ``e2e_p99_ms`` (latency percentiles, ms), ``prefill_tokens``
    and ``prefix_hit_tokens`` (tokens) where known.
    """
    gen = sum(r.num_output_tokens for r in run.requests)
    m: dict = {
        "system": run.system,
        "requests": len(run.requests),
        "generated_tokens": gen,
        "wall_s": run.wall,
        "tokens_per_s": gen / run.wall if run.wall > 0 else 0.0,
        "requests_per_s": len(run.requests) / run.wall if run.wall > 0 else 0.0,
        "steps": len(run.steps),
        "idle_slot_steps": sum(s.idle_slots for s in run.steps),
        "preemptions": run.preemptions,
        "prefill_tokens": run.prefill_tokens,
        "prefix_hit_tokens": run.prefix_hit_tokens,
    }
    kv = [(s.kv_reserved, s.kv_real) for s in run.steps if s.kv_reserved is not None]
    if kv:
        res = [a for a, _ in kv]
        real = [b for _, b in kv]
        peak_i = max(range(len(res)), key=res.__getitem__)
        m.update(
            kv_reserved_mean=sum(res) / len(res), kv_reserved_peak=max(res), kv_real_mean=sum(real) / len(real),
            kv_real_pct_mean=100.0 * sum(real) / max(1, sum(res)),
            kv_real_pct_at_peak=100.0 * real[peak_i] / max(1, res[peak_i]),
        )
    else:
        m.update(kv_reserved_mean=None, kv_reserved_peak=None, kv_real_mean=None, kv_real_pct_mean=None,
                 kv_real_pct_at_peak=None)
    dur = sum(s.duration for s in run.steps)
    fwd = sum(s.forward for s in run.steps)
    m["outside_forward_pct"] = 100.0 * (1 - fwd / dur) if dur > 0 else None
    full = [s for s in run.steps if run.max_num_seqs and s.num_scheduled >= 0.9 * run.max_num_seqs]
    dfull = sum(s.duration for s in full)
    m["outside_forward_pct_full"] = 100.0 * (1 - sum(s.forward for s in full) / dfull) if dfull > 0 else None
    m["full_batch_steps"] = len(full)
    ttft = [r.first_token - r.arrival for r in run.requests if r.first_token is not None]
    e2e = [r.finish - r.arrival for r in run.requests]
    tpot = [(r.finish - r.first_token) / (r.num_output_tokens - 1) for r in run.requests
            if r.first_token is not None and r.num_output_tokens > 1]
    for name, vals in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
        for q in (50, 90, 99):
            v = percentile(vals, q)
            m[f"{name}_p{q}_ms"] = None if v is None else 1000.0 * v
    m["notes"] = list(run.notes)
    m["config"] = dict(run.config)
    return m


# ==================================================================================================
# our engine
# ==================================================================================================
def run_ours(
    model,
    tokenizer,
    requests: Sequence[BenchRequest],
    policy: str = "continuous",
    next_turn: Callable[[BenchRequest, list[int]], BenchRequest | None] | None = None,
    **engine_args,
) -> SystemRun:
    """Run ``requests`` through a fresh :class:`EngineCore` on a preloaded ``model``.

    The engine is stepped on this thread; a request is queued once its ``arrival`` (seconds after the
    start) has passed, and its arrival time is that instant, so TTFT includes queueing. Greedy, EOS
    ignored.

    Args:
        model, tokenizer: a loaded transformers causal LM and its tokenizer (shared, not copied).
        requests: the workload.
        policy: ``"continuous"`` or ``"static"``.
        next_turn: for multi-turn workloads: called with a finished request and its output tokens,
            returns the follow-up request (queued at once) or None.
        engine_args: :class:`EngineConfig` fields (``max_num_seqs``, ``num_blocks``, ...).

    Returns:
        A :class:`SystemRun` with one :class:`StepRecord` per engine step.
    """
    engine_args.setdefault("telemetry_capacity", 1 << 20)
    cfg = EngineConfig.from_kwargs(policy=policy, **engine_args)
    core = EngineCore(cfg, model=model, tokenizer=tokenizer)
    clock = forward_clock(model)
    bs = cfg.block_size
    pending = sorted(requests, key=lambda r: r.arrival)
    by_id: dict[str, BenchRequest] = {}
    live: dict = {}
    records: list[RequestRecord] = []
    steps: list[StepRecord] = []
    snaps: list[StepSnapshot] = []
    scheduled_tokens = 0

    def make(br: BenchRequest, arrival_mono: float):
        sp = SamplingParams(temperature=0.0, max_tokens=br.max_tokens, ignore_eos=True)
        req = core.make_request(br.request_id, br.prompt_token_ids, sp)
        req.arrival_time = arrival_mono
        by_id[br.request_id] = br
        live[br.request_id] = req
        return req

    # offline requests are built before the clock starts, as LLM.generate does
    pre = [make(br, 0.0) for br in pending if br.arrival <= 0.0]
    pending = [br for br in pending if br.arrival > 0.0]
    t0 = time.monotonic()
    for req in pre:
        req.arrival_time = t0
        core.enqueue(req)
    while pending or core.has_unfinished_requests():
        now = time.monotonic()
        while pending and t0 + pending[0].arrival <= now:
            br = pending.pop(0)
            core.enqueue(make(br, t0 + br.arrival))
        if not core.has_unfinished_requests():
            time.sleep(max(0.0, t0 + pending[0].arrival - time.monotonic()))
            continue
        c0, f0 = clock.read()
        s0 = time.monotonic()
        outs = core.step()
        dur = time.monotonic() - s0
        _, f1 = clock.read()
        snap = core.telemetry.latest()
        if snap is not None and (not snaps or snap is not snaps[-1]):
            snaps.append(snap)
            scheduled_tokens += snap.num_scheduled_tokens
            n_sched = sum(1 for s in snap.slots if s.request_id is not None and s.phase != PHASE_IDLE)
            idle = sum(1 for s in snap.slots if s.request_id is not None and s.phase == PHASE_IDLE)
            steps.append(StepRecord(dur, f1 - f0, n_sched, snap.num_waiting, snap.num_scheduled_tokens, idle,
                                    None, None))
        for out in outs:
            if not out.finished:
                continue
            req = live.pop(out.request_id)
            if out.error:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            records.append(RequestRecord(
                out.request_id, req.num_prompt_tokens, len(req.output_token_ids), req.arrival_time - t0,
                None if req.first_token_time is None else req.first_token_time - t0, req.finish_time - t0,
                list(req.output_token_ids), req.num_preemptions))
            if next_turn is not None:
                nxt = next_turn(by_id[out.request_id], list(req.output_token_ids))
                if nxt is not None:
                    core.enqueue(make(nxt, time.monotonic()))
    wall = time.monotonic() - t0
    # KV accounting from the snapshots, after the clock stopped
    for st, snap in zip(steps, snaps):
        st.kv_reserved, st.kv_real = kv_from_snapshot(snap, bs)
    decode_tokens = sum(max(0, r.num_output_tokens - 1) for r in records)
    run = SystemRun(
        system=f"ours-{policy}", wall=wall, steps=steps, requests=records,
        preemptions=core.scheduler.num_preemptions, max_num_seqs=cfg.max_num_seqs,
        prefix_hit_tokens=core.kv.prefix_hits if cfg.enable_prefix_caching else 0,
        prefill_tokens=scheduled_tokens - decode_tokens,
        config={"max_num_seqs": cfg.max_num_seqs, "block_size": bs, "num_blocks": cfg.num_blocks,
                "max_num_batched_tokens": cfg.max_num_batched_tokens,
                "enable_prefix_caching": cfg.enable_prefix_caching},
    )
    del core
    gc.collect()
    return run


# ==================================================================================================
# transformers' generate in static batches
# ==================================================================================================
class _StepTimes:
    """A logits processor that only records when each generation step produced its logits."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def run_hf_static(model, tokenizer, requests: Sequence[BenchRequest], batch_size: int = 16) -> SystemRun:
    """transformers' ``generate`` over static batches of ``batch_size`` requests, left-padded, greedy,
    EOS ignored, each batch generating its longest ``max_tokens`` (shorter rows are cut afterwards: the
    tokens they compute past their own limit are the idle slot-steps).

    Online arrivals: when idle, the server takes up to ``batch_size`` requests that have arrived
    (waiting for the first one if none has). KV per step is computed from the cache's shape
    (``batch x (padded prompt + step)`` positions reserved; a live row's prompt and generated tokens real).
    """
    model.set_attn_implementation("sdpa")  # our ModelRunner switches it back at its next execute
    clock = forward_clock(model)
    dev = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    pending = sorted(requests, key=lambda r: r.arrival)
    records: list[RequestRecord] = []
    steps: list[StepRecord] = []
    t0 = time.perf_counter()
    while pending:
        now = time.perf_counter() - t0
        if pending[0].arrival > now:
            time.sleep(pending[0].arrival - now)
            now = time.perf_counter() - t0
        batch = [r for r in pending if r.arrival <= now][:batch_size]
        for r in batch:
            pending.remove(r)
        P = max(len(r.prompt_token_ids) for r in batch)
        M = max(r.max_tokens for r in batch)
        ids = torch.full((len(batch), P), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), P), dtype=torch.long)
        for i, r in enumerate(batch):
            n = len(r.prompt_token_ids)
            ids[i, P - n:] = torch.tensor(r.prompt_token_ids)
            mask[i, P - n:] = 1
        clocker = _StepTimes()
        c0, f0 = clock.read()
        b0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=M, eos_token_id=None,
                do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=pad,
                logits_processor=[clocker],
            )
        b1 = time.perf_counter()
        c1, f1 = clock.read()
        n_steps = len(clocker.times)
        # step k: from the previous step's logits to this step's (one forward each)
        edges = [b0] + clocker.times
        spans = clock.spans[c0:c1]
        for k in range(n_steps):
            live = [r for r in batch if k < r.max_tokens]
            real = sum(len(r.prompt_token_ids) + k for r in live)
            fwd = spans[k][1] - spans[k][0] if k < len(spans) else 0.0
            steps.append(StepRecord(edges[k + 1] - edges[k], fwd, len(live), len(pending),
                                    len(batch) * (P if k == 0 else 1), len(batch) - len(live),
                                    len(batch) * (P + k), real))
        if steps:
            steps[-1].duration += b1 - edges[-1]
        gen = out[:, P:].tolist()
        for i, r in enumerate(batch):
            toks = gen[i][: r.max_tokens]
            records.append(RequestRecord(r.request_id, len(r.prompt_token_ids), len(toks), r.arrival,
                                         clocker.times[0] - t0, clocker.times[r.max_tokens - 1] - t0, toks))
    wall = time.perf_counter() - t0
    return SystemRun("hf-static", wall, steps, records, preemptions=None, max_num_seqs=batch_size,
                     notes=["KV from the cache shape: batch x (padded prompt + step)"],
                     config={"batch_size": batch_size, "attn_implementation": "sdpa"})


# ==================================================================================================
# transformers' built-in continuous batching
# ==================================================================================================
def run_hf_cb(
    model,
    tokenizer,
    requests: Sequence[BenchRequest],
    page_size: int = 16,
    num_blocks: int | None = None,
    max_batch_tokens: int = 2048,
    max_requests_per_batch: int = 64,
) -> SystemRun:
    """transformers' built-in continuous batching (``init_continuous_batching``) with a bounded cache.

    Args:
        model: its OWN model instance (transformers switches it to its paged attention while running).
        page_size: tokens per cache page (block).
        num_blocks: pages in the cache (whole-model blocks of ``page_size`` tokens); None sizes it to
            hold every request of the workload at once.
        max_batch_tokens: tokens per forward.
        max_requests_per_batch: requests per forward (our ``max_num_seqs``).

    Steps and forward time come from the model's forward calls; TTFT/TPOT from transformers' per-token
    timestamps. Its KV occupancy per step is not exposed, so the KV columns are left empty.
    """
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    if num_blocks is None:
        num_blocks = sum(-(-(len(r.prompt_token_ids) + r.max_tokens) // page_size) for r in requests) + 1
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in requests),
                               eos_token_id=-1, pad_token_id=pad)
    cb_cfg = ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                      max_requests_per_batch=max_requests_per_batch, use_cuda_graph=False,
                                      use_async_batching=False)
    if model.config._attn_implementation not in ("sdpa", "paged|eager"):
        model.set_attn_implementation("sdpa")
    clock = forward_clock(model)
    pending = sorted(requests, key=lambda r: r.arrival)
    by_id = {r.request_id: r for r in pending}
    results: dict = {}
    mgr = model.init_continuous_batching(generation_config=gen_cfg, continuous_batching_config=cb_cfg)
    try:
        with torch.inference_mode():
            mgr.start()
            # warm-up: one tiny request, so that the cache allocation and first-call costs fall before t0
            first = requests[0].prompt_token_ids[:8]
            mgr.add_request(list(first), request_id="__warmup__", max_new_tokens=2, eos_token_id=-1)
            while True:
                res = mgr.get_result(timeout=60)
                if res is None or res.is_finished():
                    break
            t0 = time.perf_counter()
            arrivals: dict[str, float] = {}
            while len(results) < len(requests):
                now = time.perf_counter() - t0
                while pending and pending[0].arrival <= now:
                    r = pending.pop(0)
                    arrivals[r.request_id] = t0 + r.arrival
                    mgr.add_request(list(r.prompt_token_ids), request_id=r.request_id, max_new_tokens=r.max_tokens,
                                    record_timestamps=True, eos_token_id=-1)
                wait = 0.05 if not pending else max(0.0, min(0.05, pending[0].arrival - now))
                res = mgr.get_result(timeout=wait)
                if res is not None and res.is_finished():
                    if res.error:
                        raise RuntimeError(f"hf-cb request {res.request_id} failed: {res.error}")
                    results[res.request_id] = (res, time.perf_counter())
                elif res is None and not mgr.is_running() and not pending:
                    raise RuntimeError("transformers' continuous batching thread stopped early")
            wall = time.perf_counter() - t0
    finally:
        mgr.stop(block=True, timeout=10)
        try:
            mgr.destroy()
        except Exception:  # pragma: no cover - best effort cleanup
            pass
    records = []
    for rid, (res, done) in results.items():
        br = by_id[rid]
        toks = list(res.generated_tokens)
        ts = res.timestamps or []
        first = ts[0] if ts else None
        finish = ts[-1] if ts else done
        records.append(RequestRecord(rid, len(br.prompt_token_ids), len(toks), arrivals[rid] - t0,
                                     None if first is None else first - t0, finish - t0, toks))
    fw = [(s, e) for s, e in clock.spans if t0 <= s and e <= t0 + wall]
    # a step = from the end of the previous forward to the end of this one (the loop's own work included)
    steps = [StepRecord(e - (fw[i - 1][1] if i else t0), e - s, 0, 0, 0, 0, None, None) for i, (s, e) in enumerate(fw)]
    return SystemRun("hf-cb", wall, steps, records, preemptions=None, max_num_seqs=max_requests_per_batch,
                     notes=[f"page_size={page_size} num_blocks={num_blocks} max_batch_tokens={max_batch_tokens}",
                            "KV occupancy per step not exposed by transformers"],
                     config={"page_size": page_size, "num_blocks": num_blocks, "max_batch_tokens": max_batch_tokens,
                             "max_requests_per_batch": max_requests_per_batch,
                             "attn_implementation": model.config._attn_implementation})


# ==================================================================================================
# scheduler-only replay (no model)
# ==================================================================================================
def replay_schedule(requests: Sequence[BenchRequest], policy: str = "continuous", **engine_args) -> dict:
    """Replay an offline workload through our :class:`Scheduler` and :class:`KVCacheManager` alone, with
    a fake sampler (token 0) and no model: steps, idle slot-steps and KV shares in a second.

    With EOS ignored the schedule does not depend on the tokens, so this gives exactly the engine's steps,
    idle slot-steps and KV accounting (as :func:`kv_from_snapshot` computes it) for any ``block_size``,
    ``max_num_seqs`` or pool size.

    Returns:
        ``{"policy", "block_size", "steps", "idle_slot_steps", "kv_real_pct_mean" (%), "kv_reserved_peak"
        (tokens), "preemptions"}``.
    """
    from engine.kv_cache import KVCacheManager
    from engine.request import Request
    from engine.scheduler import Scheduler

    engine_args.setdefault("num_blocks", 11648 // engine_args.get("block_size", 16))
    cfg = EngineConfig.from_kwargs(policy=policy, **engine_args)
    bs, nb = cfg.block_size, cfg.num_blocks
    kv = KVCacheManager(nb, bs, cfg.enable_prefix_caching)
    sched = Scheduler(cfg, kv, max_model_len=nb * bs)
    for r in requests:
        sched.add_request(Request(r.request_id, r.prompt_token_ids,
                                  SamplingParams(max_tokens=r.max_tokens, ignore_eos=True), max_model_len=nb * bs))
    steps = idle = reserved_sum = real_sum = peak = 0
    while sched.has_unfinished():
        out = sched.schedule()
        slots = list(sched.slots)
        n_sched = {q.request_id for q, _ in out.scheduled}
        idle += sum(1 for q in slots if q is not None and q.request_id not in n_sched)
        sampled = {q.request_id: 0 for q, n in out.scheduled if q.num_computed_tokens + n == q.num_tokens}
        sched.update(out, sampled)
        steps += 1
        tokens = [0] * nb
        for q in sched.running:
            for j, b in enumerate(q.block_ids):
                tokens[b] = max(tokens[b], min(bs, max(0, q.num_computed_tokens - j * bs)))
        res = sum(bs for ref in kv.pool.ref_cnt if ref > 0)
        reserved_sum += res
        real_sum += sum(t for ref, t in zip(kv.pool.ref_cnt, tokens) if ref > 0)
        peak = max(peak, res)
    return {"policy": policy, "block_size": bs, "steps": steps, "idle_slot_steps": idle,
            "kv_real_pct_mean": 100.0 * real_sum / max(1, reserved_sum), "kv_reserved_peak": peak,
            "preemptions": sched.num_preemptions}


# ==================================================================================================
# the profile of one decode step
# ==================================================================================================
def profile_decode_step(model, tokenizer, num_requests: int = 64, context: int = 150, steps: int = 5,
                        torch_profile: bool = True, **engine_args) -> dict:
    """Where one decode step at ``num_requests`` running requests spends its time.

    ``num_requests`` requests (built-in prompts, EOS ignored) are prefilled and decoded until their
    contexts reach about ``context`` tokens; then ``steps`` decode steps are timed with each part of
    the step wrapped: scheduling, packing the batch (``ModelRunner.prepare``), the model forward (split
    into attention and the rest), sampling, ``Scheduler.update`` (detokenizing included), outputs and
    telemetry. With ``torch_profile`` one more step runs under ``torch.profiler`` and its top operators
    are returned as a printed table.

    Returns:
        ``{"parts_ms": {part: mean ms per step}, "step_ms": mean, "num_running": n, "context": tokens,
        "torch_table": str or None}``.
    """
    import kernels

    engine_args.setdefault("max_num_seqs", max(64, num_requests))
    core = EngineCore(EngineConfig.from_kwargs(**engine_args), model=model, tokenizer=tokenizer)
    prompts = [render_chat(tokenizer, m) for m in chat_prompts(num_requests)]
    for i, ids in enumerate(prompts):
        core.add_request(f"p{i}", ids, SamplingParams(temperature=0.0, max_tokens=context + steps + 8, ignore_eos=True))
    while True:
        core.step()
        running = core.scheduler.running
        if len(running) == num_requests and min(r.num_tokens for r in running) >= context:
            break
    acc: dict[str, float] = {}

    def wrap(obj, name, part):
        fn = getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[part] = acc.get(part, 0.0) + time.perf_counter() - t

        setattr(obj, name, timed)
        return fn

    originals = [
        (core.scheduler, "schedule", wrap(core.scheduler, "schedule", "schedule")),
        (core.runner, "prepare", wrap(core.runner, "prepare", "prepare (pack batch)")),
        (core.sampler, "sample", wrap(core.sampler, "sample", "sample")),
        (core.scheduler, "update", wrap(core.scheduler, "update", "update + detokenize")),
        (core, "_outputs", wrap(core, "_outputs", "outputs")),
        (core, "_record", wrap(core, "_record", "telemetry")),
        (kernels, "paged_attention", wrap(kernels, "paged_attention", "attention (paged_attention)")),
        (kernels, "reshape_and_cache", wrap(kernels, "reshape_and_cache", "attention (cache write)")),
    ]
    clock = forward_clock(model)
    _, f0 = clock.read()
    t = time.perf_counter()
    for _ in range(steps):
        core.step()
    total = time.perf_counter() - t
    _, f1 = clock.read()
    for obj, name, fn in originals:
        if obj is kernels:
            setattr(obj, name, fn)  # a module function: put the original back
        elif name in vars(obj):
            delattr(obj, name)  # an instance attribute shadowing the method: remove it
    fwd = f1 - f0
    attn = acc.get("attention (paged_attention)", 0.0) + acc.get("attention (cache write)", 0.0)
    parts = {k: 1000 * v / steps for k, v in acc.items()}
    parts["forward: linear layers, norms, RoPE, lm_head"] = 1000 * (fwd - attn) / steps
    outside = sum(v for k, v in acc.items() if not k.startswith("attention"))
    parts["other (step glue)"] = 1000 * (total - fwd - outside) / steps
    table = None
    if torch_profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            core.step()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
    ctx = sum(r.num_tokens for r in core.scheduler.running) / max(1, len(core.scheduler.running))
    out = {"parts_ms": parts, "step_ms": 1000 * total / steps, "num_running": len(core.scheduler.running),
           "context": ctx, "forward_ms": 1000 * fwd / steps, "torch_table": table,
           "tokens_per_s": len(core.scheduler.running) / (total / steps)}
    del core
    gc.collect()
    return out


def print_profile(p: dict) -> None:
    """Print :func:`profile_decode_step`'s result."""
    print(f"\n== one decode step: {p['num_running']} running requests, mean context {p['context']:.0f} tokens ==")
    print(f"step {p['step_ms']:.1f} ms ({p['tokens_per_s']:.0f} tokens/s at this batch), "
          f"model forward {p['forward_ms']:.1f} ms ({100 * p['forward_ms'] / p['step_ms']:.1f}% of the step)")
    for k, v in sorted(p["parts_ms"].items(), key=lambda kv: -kv[1]):
        print(f"  {k:<46} {v:8.2f} ms  {100 * v / p['step_ms']:5.1f}%")
    if p.get("torch_table"):
        print("\ntorch.profiler, one step, top operators by self CPU time:")
        print(p["torch_table"])


# ==================================================================================================
# orchestration
# ==================================================================================================
def load_models(args, need_hf_cb: bool):
    """``(model, tokenizer, cb_model or None)`` with the chosen dtype and device."""
    from engine.model_loader import load_model

    model, tok = load_model(args.model, args.dtype, args.device)
    cb_model = None
    if need_hf_cb:
        cb_model, _ = load_model(args.model, next(model.parameters()).dtype, args.device)
    return model, tok, cb_model


def engine_args_from(args) -> dict:
    """Engine settings shared by both of our systems."""
    kw = {"max_num_seqs": args.max_num_seqs, "block_size": args.block_size,
          "max_num_batched_tokens": args.max_num_batched_tokens,
          "enable_prefix_caching": not args.no_prefix_caching}
    if args.num_blocks is not None:
        kw["num_blocks"] = args.num_blocks
    elif args.kv_cache_memory is not None:
        kw["kv_cache_memory"] = args.kv_cache_memory
    return kw


def warm_up(model, tokenizer, requests: Sequence[BenchRequest], systems: Sequence[str]) -> None:
    """Run two 2-token requests through our engine and through ``generate`` (if used), so first-call
    costs (allocator, thread pool, lazy imports) fall on no measured system."""
    tiny = [BenchRequest(f"warm{i}", list(r.prompt_token_ids), 2) for i, r in enumerate(requests[:2])]
    if any(s.startswith("ours") for s in systems):
        run_ours(model, tokenizer, tiny, "continuous", num_blocks=64, max_num_seqs=4)
    if "hf-static" in systems:
        run_hf_static(model, tokenizer, tiny, 2)


def run_systems(systems: Sequence[str], model, tokenizer, cb_model, requests: Sequence[BenchRequest], args,
                label: str) -> list[dict]:
    """Run ``requests`` through each system in ``systems``; returns their :func:`summarize` dicts, each
    with ``same_tokens_as_ours`` (requests whose tokens equal ``ours-continuous``'s, when it ran)."""
    results = []
    ref_tokens = None
    warm_up(model, tokenizer, requests, systems)
    for name in systems:
        print(f"[{label}] {name} ...", flush=True)
        load_before = os.getloadavg()[0]
        t = time.perf_counter()
        if name == "ours-continuous":
            run = run_ours(model, tokenizer, requests, "continuous", **engine_args_from(args))
        elif name == "ours-static":
            run = run_ours(model, tokenizer, requests, "static", **engine_args_from(args))
        elif name == "hf-static":
            run = run_hf_static(model, tokenizer, requests, args.hf_batch_size)
        elif name == "hf-cb":
            run = run_hf_cb(cb_model, tokenizer, requests, page_size=args.hf_cb_page_size,
                            num_blocks=args.hf_cb_num_blocks, max_batch_tokens=args.max_num_batched_tokens,
                            max_requests_per_batch=args.max_num_seqs)
        else:
            raise ValueError(f"unknown system {name!r}; choose from {SYSTEMS}")
        m = summarize(run)
        toks = {r.request_id: r.output_token_ids for r in run.requests}
        if name == "ours-continuous":
            ref_tokens = toks
        m["same_tokens_as_ours"] = (None if ref_tokens is None
                                    else sum(1 for k, v in toks.items() if ref_tokens.get(k) == v))
        m["workload"] = label
        m["series"] = step_series(run)
        m["load_before"], m["load_after"] = load_before, os.getloadavg()[0]
        results.append(m)
        print(f"[{label}] {name}: {m['generated_tokens']} tokens in {m['wall_s']:.1f} s = "
              f"{m['tokens_per_s']:.1f} tokens/s ({time.perf_counter() - t:.1f} s; 1-min load average "
              f"{m['load_before']:.2f} -> {m['load_after']:.2f})", flush=True)
    return results


def run_multiturn(model, tokenizer, args) -> list[dict]:
    """The multi-turn workload through ``ours-continuous`` with prefix caching on, then off."""
    out = []
    warm_up(model, tokenizer, MultiTurn(tokenizer, 2, 1, 2, args.seed).first_turns(), ["ours-continuous"])
    for caching in (True, False):
        mt = MultiTurn(tokenizer, args.conversations, args.turns, args.turn_tokens, args.seed)
        kw = engine_args_from(args)
        kw["enable_prefix_caching"] = caching
        print(f"[multiturn] prefix caching {'on' if caching else 'off'} ...", flush=True)
        run = run_ours(model, tokenizer, mt.first_turns(), "continuous", next_turn=mt.next_turn, **kw)
        m = summarize(run)
        m["system"] = f"ours-continuous, prefix caching {'on' if caching else 'off'}"
        m["workload"] = f"multiturn {args.conversations}x{args.turns}"
        m["prefix_caching"] = caching
        m["series"] = step_series(run)
        out.append(m)
    return out


def _fmt(v, spec=".1f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def format_table(results: Sequence[dict], baseline: str = "hf-static") -> str:
    """A plain-text table of :func:`summarize` dicts (one row per system), with each system's tokens/s
    as a multiple of ``baseline``'s when it ran."""
    base = next((r["tokens_per_s"] for r in results if r["system"] == baseline), None)
    cols = [
        ("system", lambda r: r["system"], "<"),
        ("tok/s", lambda r: _fmt(r["tokens_per_s"]), ">"),
        (f"x {baseline}", lambda r: "-" if not base else f"{r['tokens_per_s'] / base:.2f}", ">"),
        ("req/s", lambda r: _fmt(r["requests_per_s"], ".2f"), ">"),
        ("steps", lambda r: _fmt(r["steps"]), ">"),
        ("idle slot-steps", lambda r: _fmt(r["idle_slot_steps"]), ">"),
        ("KV real % mean", lambda r: _fmt(r["kv_real_pct_mean"]), ">"),
        ("KV real % @peak", lambda r: _fmt(r["kv_real_pct_at_peak"]), ">"),
        ("KV peak tok", lambda r: _fmt(r["kv_reserved_peak"]), ">"),
        ("preempt", lambda r: _fmt(r["preemptions"]), ">"),
        ("outside fwd %", lambda r: _fmt(r["outside_forward_pct"]), ">"),
        ("@full batch %", lambda r: _fmt(r["outside_forward_pct_full"]), ">"),
        ("TTFT p50/p99 ms", lambda r: f"{_fmt(r['ttft_p50_ms'], '.0f')}/{_fmt(r['ttft_p99_ms'], '.0f')}", ">"),
        ("TPOT p50/p99 ms", lambda r: f"{_fmt(r['tpot_p50_ms'], '.0f')}/{_fmt(r['tpot_p99_ms'], '.0f')}", ">"),
        ("e2e p50/p90/p99 s", lambda r: "/".join(_fmt(None if r[f'e2e_p{q}_ms'] is None else r[f'e2e_p{q}_ms'] / 1000)
                                                 for q in (50, 90, 99)), ">"),
        ("same tok", lambda r: _fmt(r.get("same_tokens_as_ours")), ">"),
        ("load", lambda r: "-" if r.get("load_before") is None else f"{r['load_before']:.1f}->{r['load_after']:.1f}",
         ">"),
    ]
    rows = [[c[0] for c in cols]] + [[c[1](r) for c in cols] for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = []
    for j, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(widths[i]) if cols[i][2] == "<" else cell.rjust(widths[i])
                               for i, cell in enumerate(row)))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_multiturn(results: Sequence[dict]) -> str:
    """A plain-text table of the multi-turn runs (prefix caching on / off)."""
    lines = [f"{'prefix caching':<15} {'prefill tok':>11} {'cache hit tok':>13} {'TTFT p50 ms':>11} "
             f"{'TTFT p99 ms':>11} {'tok/s':>7} {'steps':>6}"]
    for r in results:
        lines.append(f"{'on' if r['prefix_caching'] else 'off':<15} {_fmt(r['prefill_tokens']):>11} "
                     f"{_fmt(r['prefix_hit_tokens']):>13} {_fmt(r['ttft_p50_ms'], '.0f'):>11} "
                     f"{_fmt(r['ttft_p99_ms'], '.0f'):>11} {_fmt(r['tokens_per_s']):>7} {_fmt(r['steps']):>6}")
    return "\n".join(lines)


def environment(model) -> dict:
    """Machine, versions, dtype and threads of this run."""
    import transformers

    from engine.model_loader import cpu_supports_bf16

    return {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "device": str(next(model.parameters()).device),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "cpu_native_bf16": cpu_supports_bf16(),
        "machine": platform.machine(), "processor": _cpu_name(),
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m engine.bench`` (see ``--help``)."""
    p = argparse.ArgumentParser(prog="python -m engine.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="offline", choices=["offline", "online", "multiturn", "all", "replay"],
                   help="workload kind (default: offline); all = offline, online and multiturn; replay = our "
                   "scheduler and KV manager alone, no model, at block sizes 8/16/32 (steps, idle slots, KV)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--workload", default=None, help="a W64-style JSON file (e.g. bench/w64.json); "
                   "default: built-in prompts with skewed max_tokens")
    p.add_argument("--num-requests", type=int, default=None, help="requests (default 64; quick 16)")
    p.add_argument("--max-tokens-low", type=int, default=16)
    p.add_argument("--max-tokens-high", type=int, default=None, help="longest output (default 256; quick 48)")
    p.add_argument("--quick", action="store_true", help="a short smoke run: 16 requests, outputs 16..48 tokens, "
                   "multiturn 4x3 turns of 16 tokens")
    p.add_argument("--rate", type=float, default=None, help="online arrivals per second (default 4; quick 8)")
    p.add_argument("--conversations", type=int, default=None, help="multiturn chats (default 16; quick 4)")
    p.add_argument("--turns", type=int, default=None, help="turns per chat (default 4; quick 3)")
    p.add_argument("--turn-tokens", type=int, default=None, help="tokens per answer (default 64; quick 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="model folder, .gguf or hub id (default: embedded SmolLM2-135M)")
    p.add_argument("--dtype", default=None, help="bfloat16 / float32 (default: the engine's auto choice)")
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory", default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--no-prefix-caching", action="store_true", help="offline/online runs without prefix caching")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--hf-cb-page-size", type=int, default=16)
    p.add_argument("--hf-cb-num-blocks", type=int, default=None, help="default: enough for all requests at once")
    p.add_argument("--profile", action="store_true", help="profile one decode step at 64 running requests and exit")
    p.add_argument("--profile-context", type=int, default=150)
    p.add_argument("--json", default=None, help="write all results to this JSON file")
    p.add_argument("--html", default=None, help="write a Plotly HTML report (needs plotly)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark chosen by ``argv``; print tables, write ``--json`` / ``--html``. Returns the exit
    status (0, or 2 for an unknown system)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.threads:
        torch.set_num_threads(args.threads)
    q = args.quick
    n = args.num_requests or (16 if q else 64)
    high = args.max_tokens_high or (48 if q else 256)
    args.rate = args.rate or (8.0 if q else 4.0)
    args.conversations = args.conversations or (4 if q else 16)
    args.turns = args.turns or (3 if q else 4)
    args.turn_tokens = args.turn_tokens or (16 if q else 64)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        if s not in SYSTEMS:
            print(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}", file=sys.stderr)
            return 2
    load_start = os.getloadavg()
    print(f"load average at start: {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f} "
          f"({os.cpu_count()} CPUs)", flush=True)
    if load_start[0] > (os.cpu_count() or 1) and torch.get_num_threads() > 1:
        print(f"warning: load average {load_start[0]:.1f} > {os.cpu_count()} CPUs: {torch.get_num_threads()}-thread "
              "OpenMP matmuls slow down several times when other processes hold the cores; compare systems "
              "only within this run, or use --threads 1 (or OMP_WAIT_POLICY=PASSIVE)", flush=True)
    if args.mode == "replay":
        from engine.model_loader import load_tokenizer

        requests = (load_workload(args.workload) if args.workload
                    else offline_workload(load_tokenizer(args.model), n, args.max_tokens_low, high, args.seed))
        kw = engine_args_from(args)
        print(f"{'policy':<11} {'block':>5} {'steps':>6} {'idle slot-steps':>15} {'KV real %':>9} "
              f"{'KV peak tok':>11}")
        for policy in ("continuous", "static"):
            for bs in (8, 16, 32):
                kw.update(block_size=bs, num_blocks=args.num_blocks or 11648 // bs)
                r = replay_schedule(requests, policy, **kw)
                print(f"{policy:<11} {bs:>5} {r['steps']:>6} {r['idle_slot_steps']:>15} "
                      f"{r['kv_real_pct_mean']:>9.1f} {r['kv_reserved_peak']:>11}")
        return 0
    need_cb = "hf-cb" in systems and args.mode in ("offline", "online", "all") and not args.profile
    t = time.perf_counter()
    model, tok, cb_model = load_models(args, need_cb)
    env = environment(model)
    print(f"model loaded in {time.perf_counter() - t:.1f} s: dtype={env['dtype']} device={env['device']} "
          f"threads={env['threads']} torch={env['torch']} transformers={env['transformers']} cpu={env['processor']!r} "
          f"native bf16={env['cpu_native_bf16']}", flush=True)
    report: dict = {"environment": env, "args": {k: v for k, v in vars(args).items()}, "load_start": load_start}

    if args.profile:
        kw = engine_args_from(args)
        kw["max_num_seqs"] = max(64, args.max_num_seqs)
        p = profile_decode_step(model, tok, 64, args.profile_context, **kw)
        print_profile(p)
        report["profile"] = p
    elif args.mode == "multiturn":
        res = run_multiturn(model, tok, args)
        report["multiturn"] = res
        print(f"\n== multiturn: {args.conversations} conversations x {args.turns} turns, {args.turn_tokens} "
              f"tokens per answer, dtype {env['dtype']} ==")
        print(format_multiturn(res))
    else:
        if args.workload:
            requests = load_workload(args.workload, n if (args.num_requests or q) else None,
                                     high if (args.max_tokens_high or q) else None)
            label = os.path.basename(args.workload)
        else:
            requests = offline_workload(tok, n, args.max_tokens_low, high, args.seed)
            label = f"builtin-{n}"
        print(f"workload {label}: {len(requests)} requests, {sum(len(r.prompt_token_ids) for r in requests)} prompt "
              f"tokens, {sum(r.max_tokens for r in requests)} tokens to generate", flush=True)
        if args.mode in ("offline", "all"):
            res = run_systems(systems, model, tok, cb_model, requests, args, f"{label} offline")
            report["offline"] = res
            print(f"\n== offline: {label}, dtype {env['dtype']}, {env['threads']} threads ==")
            print(format_table(res))
        if args.mode in ("online", "all"):
            online = poisson_arrivals(requests, args.rate, args.seed)
            res = run_systems(systems, model, tok, cb_model, online, args, f"{label} online {args.rate:g}/s")
            report["online"] = res
            print(f"\n== online: {label}, Poisson {args.rate:g} requests/s, dtype {env['dtype']} ==")
            print(format_table(res))
        if args.mode in ("multiturn", "all"):
            res = run_multiturn(model, tok, args)
            report["multiturn"] = res
            print(f"\n== multiturn: {args.conversations} conversations x {args.turns} turns, {args.turn_tokens} "
                  f"tokens per answer, dtype {env['dtype']} ==")
            print(format_multiturn(res))
    load_end = os.getloadavg()
    report["load_end"] = load_end
    print(f"\nload average at end: {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}; dtype {env['dtype']}, "
          f"{env['threads']} threads")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"wrote {args.json}")
    if args.html:
        from ui.report import write_report  # plotly lives in ui/, never imported by the engine itself

        write_report(report, args.html)
        print(f"wrote {args.html}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
