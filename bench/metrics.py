"""Measurements of the benchmark: forward timing, per-step and per-request records, their summaries,
the printed tables and the machine's description.

Units: times in seconds unless a key ends in ``_ms``; rates per second; KV in tokens (one token = K and
V of every layer); shares in percent.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.telemetry import StepSnapshot, percentile

__all__ = [
    "ForwardClock", "RequestRecord", "StepRecord", "SystemRun", "environment", "format_multiturn", "format_table",
    "engine_forward_clock", "forward_clock", "kv_from_snapshot", "percentile", "step_series", "summarize",
]


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
        self._cuda = torch.cuda.is_available() and _device_of(model).type == "cuda"

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


def _device_of(model) -> torch.device:
    if hasattr(model, "parameters"):
        return next(model.parameters()).device
    return model.embed.device  # the engine's own forward (engine.models)


def engine_forward_clock(core) -> ForwardClock:
    """The clock of the forward an :class:`engine.core.EngineCore` runs: its own forward, or the
    transformers model's."""
    own = core.runner.own_forward
    return forward_clock(own if own is not None else core.model)


def forward_clock(model) -> ForwardClock:
    """The :class:`ForwardClock` of ``model`` (a transformers model, or the engine's own forward object,
    whose ``forward`` method the engine calls), installed on first use."""
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

