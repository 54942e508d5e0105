"""The systems the benchmark compares, each run on a preloaded model in this process:

* ``ours-continuous``: :class:`engine.core.EngineCore`, iteration-level batching, paged KV cache
  (:func:`run_ours`);
* ``ours-static``: the same engine with ``policy="static"`` (a batch starts only when the previous one
  is done; each request reserves ``prompt + max_tokens`` of KV up front);
* ``hf-static``: transformers' ``generate`` in static batches with left padding, each batch run to its
  longest ``max_tokens`` (the naive baseline, :func:`run_hf_static`);
* ``hf-cb``: transformers' built-in continuous batching (``init_continuous_batching``) with a bounded
  paged cache, on its own model instance (:func:`run_hf_cb`).

:func:`replay_schedule` replays a workload through our scheduler and KV manager alone (no model).
Times in seconds; KV in tokens.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Sequence

import torch

from bench.metrics import RequestRecord, StepRecord, SystemRun, engine_forward_clock, forward_clock, kv_from_snapshot
from bench.workloads import BenchRequest
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import SamplingParams
from engine.telemetry import PHASE_IDLE, StepSnapshot

SYSTEMS = ("ours-continuous", "ours-static", "hf-static", "hf-cb")


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
    run = _OursRun(EngineCore(cfg, model=model, tokenizer=tokenizer), next_turn)
    pending = sorted(requests, key=lambda r: r.arrival)
    # offline requests are built before the clock starts, as LLM.generate does
    pre = [run.make(br, 0.0) for br in pending if br.arrival <= 0.0]
    pending = [br for br in pending if br.arrival > 0.0]
    core = run.core
    t0 = run.t0 = time.monotonic()
    for req in pre:
        req.arrival_time = t0
        core.enqueue(req)
    while pending or core.has_unfinished_requests():
        now = time.monotonic()
        while pending and t0 + pending[0].arrival <= now:
            br = pending.pop(0)
            core.enqueue(run.make(br, t0 + br.arrival))
        if not core.has_unfinished_requests():
            time.sleep(max(0.0, t0 + pending[0].arrival - time.monotonic()))
            continue
        run.step()
    wall = time.monotonic() - t0
    result = run.result(f"ours-{policy}", wall)
    core = run.core = None  # drop the engine (and its KV cache) before collecting
    gc.collect()
    return result


class _OursRun:
    """One :func:`run_ours` run: the engine, the requests in flight, and the steps and requests recorded."""

    def __init__(self, core: EngineCore, next_turn) -> None:
        self.core, self.next_turn = core, next_turn
        self.clock = engine_forward_clock(core)
        self.t0 = 0.0  # time.monotonic() when the clock started
        self.by_id: dict[str, BenchRequest] = {}
        self.live: dict = {}
        self.records: list[RequestRecord] = []
        self.steps: list[StepRecord] = []
        self.snaps: list[StepSnapshot] = []
        self.scheduled_tokens = 0

    def make(self, br: BenchRequest, arrival_mono: float):
        """The engine request of ``br`` (greedy, EOS ignored), arrived at ``arrival_mono``."""
        sp = SamplingParams(temperature=0.0, max_tokens=br.max_tokens, ignore_eos=True)
        req = self.core.make_request(br.request_id, br.prompt_token_ids, sp)
        req.arrival_time = arrival_mono
        self.by_id[br.request_id] = br
        self.live[br.request_id] = req
        return req

    def step(self) -> None:
        """One engine step, timed (wall and forward), its snapshot kept and its finished requests recorded."""
        c0, f0 = self.clock.read()
        s0 = time.monotonic()
        outs = self.core.step()
        dur = time.monotonic() - s0
        _, f1 = self.clock.read()
        snap = self.core.telemetry.latest()
        if snap is not None and (not self.snaps or snap is not self.snaps[-1]):
            self.snaps.append(snap)
            self.scheduled_tokens += snap.num_scheduled_tokens
            n_sched = sum(1 for s in snap.batch_slots if s.request_id is not None and s.phase != PHASE_IDLE)
            idle = sum(1 for s in snap.batch_slots if s.request_id is not None and s.phase == PHASE_IDLE)
            self.steps.append(StepRecord(dur, f1 - f0, n_sched, snap.num_waiting, snap.num_scheduled_tokens, idle,
                                         None, None))
        for out in outs:
            if out.finished:
                self._finished(out)

    def _finished(self, out) -> None:
        req = self.live.pop(out.request_id)
        if out.error:
            raise RuntimeError(f"request {out.request_id} failed: {out.error}")
        t0 = self.t0
        self.records.append(RequestRecord(
            out.request_id, req.num_prompt_tokens, len(req.output_token_ids), req.arrival_time - t0,
            None if req.first_token_time is None else req.first_token_time - t0, req.finish_time - t0,
            list(req.output_token_ids), req.num_preemptions))
        if self.next_turn is not None:
            nxt = self.next_turn(self.by_id[out.request_id], list(req.output_token_ids))
            if nxt is not None:
                self.core.enqueue(self.make(nxt, time.monotonic()))

    def result(self, system: str, wall: float) -> SystemRun:
        """The :class:`SystemRun`, with the KV accounting of every step from its snapshot (after the clock
        stopped)."""
        cfg = self.core.config
        for st, snap in zip(self.steps, self.snaps):
            st.kv_reserved, st.kv_real = kv_from_snapshot(snap, cfg.block_size)
        decode_tokens = sum(max(0, r.num_output_tokens - 1) for r in self.records)
        stats = self.core.stats()
        return SystemRun(
            system=system, wall=wall, steps=self.steps, requests=self.records,
            preemptions=stats.num_preemptions, max_num_seqs=cfg.max_num_seqs,
            prefix_hit_tokens=stats.prefix_cache_hits if cfg.enable_prefix_caching else 0,
            prefill_tokens=self.scheduled_tokens - decode_tokens,
            config={"max_num_seqs": cfg.max_num_seqs, "block_size": cfg.block_size, "num_blocks": cfg.num_blocks,
                    "max_num_batched_tokens": cfg.max_num_batched_tokens,
                    "enable_prefix_caching": cfg.enable_prefix_caching},
        )


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
    by_id = {r.request_id: r for r in requests}
    mgr = model.init_continuous_batching(generation_config=gen_cfg, continuous_batching_config=cb_cfg)
    try:
        with torch.inference_mode():
            mgr.start()
            _hf_cb_warm_up(mgr, requests[0])
            t0 = time.perf_counter()
            results, arrivals = _hf_cb_serve(mgr, requests, t0)
            wall = time.perf_counter() - t0
    finally:
        mgr.stop(block=True, timeout=10)
        with contextlib.suppress(Exception):  # best effort cleanup
            mgr.destroy()
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


def _hf_cb_warm_up(mgr, first: BenchRequest) -> None:
    """One tiny request through transformers' continuous batching, so that the cache allocation and the
    first-call costs fall before the clock starts."""
    mgr.add_request(list(first.prompt_token_ids[:8]), request_id="__warmup__", max_new_tokens=2, eos_token_id=-1)
    while True:
        res = mgr.get_result(timeout=60)
        if res is None or res.is_finished():
            return


def _hf_cb_serve(mgr, requests: Sequence[BenchRequest], t0: float) -> tuple[dict, dict[str, float]]:
    """Add each request to transformers' continuous batching once its arrival (seconds after ``t0``,
    ``time.perf_counter()``) has passed, and collect the results: ``({id: (result, perf_counter when it
    came)}, {id: arrival perf_counter})``.

    Raises:
        RuntimeError: a request failed, or the manager's thread stopped before every request finished.
    """
    pending = sorted(requests, key=lambda r: r.arrival)
    results: dict = {}
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
    return results, arrivals


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
    while sched.has_unfinished_requests():
        out = sched.schedule()
        slots = list(sched.batch_slots)
        n_sched = {q.request_id for q, _ in out.scheduled}
        idle += sum(1 for q in slots if q is not None and q.request_id not in n_sched)
        sampled = {q.request_id: 0 for q, n in out.scheduled if q.num_computed_tokens + n == q.num_tokens}
        sched.apply_stops(*sched.update_from_output(out, sampled))  # token-level stops (EOS is ignored)
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

