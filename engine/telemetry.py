"""Per-step, read-only snapshots of the engine's state for the live panels and the benchmarks.

The engine thread calls :meth:`Telemetry.observe` once per step (a :class:`StepView`: what the core has at the
end of the step; :mod:`engine.step_snapshot` builds the :class:`StepSnapshot` from it); readers (the UI, benches, tests) call
:meth:`Telemetry.snapshots` / :meth:`Telemetry.stats` from any thread. Snapshots are plain data
(tuples, dicts of ints and strings), never live engine objects, so readers can keep them.

KV blocks: every step carries its KV events (``StepSnapshot.kv_events``, :mod:`engine.kv_events`: blocks
taken, freed, stored, evicted), its block tables and each request's computed tokens, all O(what changed or
runs), whatever the pool's size. The per-block fields (``block_refcount`` ... ``block_origins``,
O(num_blocks) each) are not stored: they are rebuilt on first read from the telemetry's
:class:`engine.kv_history.KVHistory` (replay of the events), while the step is in the ring. The events
themselves are the block pool's, with whose each block was added here (:mod:`engine.kv_provenance`).

Counters are counted when they happen, never rebuilt from the rings: totals per step in :meth:`Telemetry.record`,
per finished request in :meth:`Telemetry.record_finished`, which also hands each record to the listeners of
:meth:`Telemetry.on_finished` (the Prometheus metrics), so they see every request whatever the finish rate.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv_events import KVFeed
from engine.kv_history import KVHistory
from engine.kv_provenance import Provenance
from engine.step_snapshot import (  # the snapshot types are re-exported: readers import them from here
    PHASE_DECODE,
    PHASE_IDLE,
    PHASE_PREFILL,
    BatchSlotSnapshot,
    BlockTables,
    StepSnapshot,
    StepView,
    state_fields,
    step_fields,
)

log = logging.getLogger(__name__)

__all__ = ["PHASE_DECODE", "PHASE_IDLE", "PHASE_PREFILL", "BatchSlotSnapshot", "FinishedRequestStats",
           "StepSnapshot", "StepView", "Telemetry", "finished_stats", "percentile"]



@dataclass
class FinishedRequestStats:
    """Latency record of one finished request (seconds)."""

    request_id: str
    ttft: float | None
    tpot: float | None
    e2e: float
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None


def finished_stats(r, now: float, held: Callable[..., float]) -> FinishedRequestStats:
    """The latency record of finished sequence ``r`` (an :class:`engine.request.Request`) at ``now``
    (``time.monotonic()``); the time the engine was held by a pause (``held(start, end, now)``, seconds) is
    left out of TTFT, TPOT and e2e: it measures the presenter, not the engine."""
    end = r.finish_time or now
    ttft, tpot = r.ttft, r.tpot
    first, last = r.first_token_time, r.finish_time  # set whenever ttft / tpot are
    if ttft is not None and first is not None:
        ttft = max(0.0, ttft - held(r.arrival_time, first, now))
    if tpot is not None and first is not None and last is not None:
        tpot = max(0.0, tpot - held(first, last, now) / (len(r.output_token_ids) - 1))
    return FinishedRequestStats(r.request_id, ttft, tpot, max(0.0, end - r.arrival_time - held(r.arrival_time, end, now)),
                                r.num_prompt_tokens, len(r.output_token_ids), r.status.finish_reason)


def percentile(values, q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``values`` with linear interpolation; None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class Telemetry:
    """Thread-safe ring buffer of :class:`StepSnapshot` plus latency records.

    Args:
        capacity: number of most recent steps kept.
        max_finished: number of most recent finished-request records kept.
    """

    capacity: int = 512
    max_finished: int = 2048
    _steps: collections.deque = field(init=False)
    _finished: collections.deque = field(init=False)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    total_generated_tokens: int = field(init=False, default=0)
    total_prompt_tokens: int = field(init=False, default=0)
    total_steps: int = field(init=False, default=0)
    total_finished: int = field(init=False, default=0)  # finished-request records ever appended
    total_idle_slot_steps: int = field(init=False, default=0)
    start_time: float = field(init=False, default_factory=time.monotonic)
    queue: tuple = field(init=False, default=())  # ids of the waiting requests now, in queue order
    version: int = field(init=False, default=0)  # changes whenever the newest snapshot does (record or amend)
    kv_history: KVHistory = field(init=False)
    # every step since the start by its scheduled tokens (tokens -> steps): vLLM's iteration_tokens histogram
    step_tokens: collections.Counter = field(init=False, default_factory=collections.Counter)
    _finish_listeners: list = field(init=False, default_factory=list)
    _provenance: Provenance = field(init=False, default_factory=Provenance)  # whose each block was (engine thread)
    _tables: BlockTables = field(init=False, default_factory=BlockTables)
    _pending: tuple = field(init=False, default=())  # KV events before the first snapshot (none to amend yet)

    def __post_init__(self) -> None:
        self._steps = collections.deque(maxlen=self.capacity)
        self._finished = collections.deque(maxlen=self.max_finished)
        self.kv_history = KVHistory(self._steps, self._lock)

    def observe(self, view: StepView) -> None:
        """The engine's one call per step (stepping thread): a new snapshot of a scheduled step, or, between
        steps (``view.scheduled`` None), the newest snapshot amended to the state now (its pool, block tables
        and queue: the panels show freed blocks and queued requests at once); then the latency records of
        the sequences that ended.

        The block pool's events become the step's KV events first (:class:`engine.kv_provenance.Provenance`:
        whose each block was, the step it was freed); if building or recording the snapshot then raises, they
        reached no reader, and the next step's events start with a :class:`engine.kv_events.KVFrame`.

        Raises:
            Exception: what building or recording the snapshot raised (the caller decides whether an
                observer's fault matters: a step's outputs are delivered all the same).
        """
        now = time.monotonic()
        events = self._provenance.stamp(view.kv_events, view.step)
        try:
            tables = self._tables(view.running, events)
            last = self.latest()
            if view.scheduled is not None:
                events, self._pending = self._pending + events, ()
                self.record(StepSnapshot(**step_fields(view, now, events),
                                         **state_fields(view, tables, events, self.kv_history)))
            elif last is None:  # before the first step: only the queue; the events wait for the first snapshot
                self._pending += events
                self.set_queue(view.waiting)
            else:
                self.amend_latest(dataclasses.replace(
                    last, **state_fields(view, tables, last.kv_events + events, self.kv_history)))
        except Exception:
            self._provenance.lost(view.step)
            self._tables.clear()
            raise
        for r in view.finished:
            self.record_finished(finished_stats(r, now, view.held_time))

    def kv_feed(self, since: tuple[int, int] | None = None) -> KVFeed:
        """The KV events for a reader that follows the cache from elsewhere (another process, the remote
        mode): with ``since`` (the ``cursor`` of its previous feed) the steps after it; with None, or a cursor
        older than the ring, a :class:`engine.kv_events.KVFrame` of the newest step to start from (O(num_blocks)).
        Replaying the steps onto the frame gives the state :meth:`StepSnapshot.block_arrays` shows."""
        with self._lock:
            return self.kv_history.feed(since)

    def record(self, snap: StepSnapshot) -> None:
        """Append one step's snapshot (engine thread)."""
        with self._lock:
            steps = self._steps
            evicted = steps[0] if len(steps) == steps.maxlen else None
            steps.append(snap)
            self.kv_history.on_record(snap, evicted)
            self.queue = snap.waiting
            self.version += 1
            self.total_steps += 1
            self.step_tokens[snap.num_scheduled_tokens] += 1
            self.total_generated_tokens += snap.num_generated_tokens
            self.total_idle_slot_steps += sum(
                1 for s in snap.batch_slots if s.request_id is not None and s.phase == PHASE_IDLE
            )

    def amend_latest(self, snap: StepSnapshot) -> None:
        """Replace the newest snapshot by ``snap`` (same step: the state changed between steps, e.g. an abort
        while paused freed blocks; its ``kv_events`` extend the replaced one's). Totals are not counted again.

        Raises:
            ValueError: there is no snapshot yet, or ``snap.step`` is not the newest step.
        """
        with self._lock:
            if not self._steps or self._steps[-1].step != snap.step:
                raise ValueError("amend_latest replaces the newest snapshot with one of the same step")
            old, self._steps[-1] = self._steps[-1], snap
            self.kv_history.on_amend(old, snap)
            self.queue = snap.waiting
            self.version += 1

    def set_queue(self, waiting: tuple[str, ...]) -> None:
        """The waiting queue changed without a step (a paused engine took new requests or aborts)."""
        with self._lock:
            self.queue = tuple(waiting)

    def request_state(self, request_id: str) -> dict | None:
        """Where a request stands now: as :meth:`StepSnapshot.request_state` of the newest step, except that
        the queue position comes from the queue now (requests also queue while the engine is paused).

        Returns:
            a dict (see :meth:`StepSnapshot.request_state`), or None when the engine has not seen the request
            yet (still in its inbox) or it ended before the newest step.
        """
        with self._lock:
            queue = self.queue
            last = self._steps[-1] if self._steps else None
        if request_id in queue:
            return {"state": "queued", "position": queue.index(request_id) + 1, "waiting": len(queue)}
        return last.request_state(request_id) if last is not None else None

    def record_finished(self, stats: FinishedRequestStats) -> None:
        """Append the latency record of a finished request and hand it to each :meth:`on_finished` listener
        (engine thread; a listener that raises is logged and skipped)."""
        with self._lock:
            self._finished.append(stats)
            self.total_finished += 1
            self.total_prompt_tokens += stats.num_prompt_tokens
            listeners = tuple(self._finish_listeners)
        for listener in listeners:
            try:
                listener(stats)
            except Exception:
                log.exception("a finished-request listener failed")

    def on_finished(self, listener: Callable[[FinishedRequestStats], None]) -> list[FinishedRequestStats]:
        """Call ``listener(record)`` with every request record finished from now on (on the engine thread: keep
        it cheap), and return the records kept so far; together they hold each record exactly once."""
        with self._lock:
            self._finish_listeners.append(listener)
            return list(self._finished)

    def step_token_counts(self) -> dict[int, int]:
        """Every step since the start by its scheduled tokens: ``{tokens: steps}`` (a copy)."""
        with self._lock:
            return dict(self.step_tokens)

    def snapshots(self, last_n: int | None = None) -> list[StepSnapshot]:
        """The most recent snapshots, oldest first (at most ``last_n``)."""
        with self._lock:
            steps = list(self._steps)
        return steps if last_n is None else steps[-last_n:]

    def latest(self) -> StepSnapshot | None:
        with self._lock:
            return self._steps[-1] if self._steps else None

    def finished_requests(self) -> list[FinishedRequestStats]:
        with self._lock:
            return list(self._finished)

    def finished_since(self, count: int) -> tuple[list[FinishedRequestStats], int]:
        """The finished-request records after the first ``count`` ever recorded (those still kept: the ring holds
        ``max_finished``), and the total recorded so far (give it back next time)."""
        with self._lock:
            new = min(self.total_finished - count, len(self._finished))
            return (list(self._finished)[len(self._finished) - new:] if new > 0 else []), self.total_finished

    def stats(self, window: float = 5.0, prefix_window_steps: int = 64) -> dict:
        """Counters for the panels.

        Returns a dict with ``running``, ``waiting``, ``kv_usage`` (0..1), ``tokens_per_s`` (generated
        tokens per second over the last ``window`` seconds of steps), ``steps``, ``preemptions``,
        ``generated_tokens``, ``prefix_hit_rate`` (0..1, None before any lookup),
        ``prefill_tokens_saved`` (tokens), the same two over the last ``prefix_window_steps`` steps:
        ``prefix_hit_rate_window`` (0..1, None when no prompt was looked up in them) and
        ``prefill_tokens_saved_window`` (tokens), with ``prefix_window_steps`` (the steps they cover:
        fewer at the start) and ``ttft_p50``/``ttft_p90``/``ttft_p99``, ``tpot_p50``/``tpot_p90``/
        ``tpot_p99`` (seconds, over the kept finished requests; None when there are none).
        """
        with self._lock:
            steps = list(self._steps)
            finished = list(self._finished)
            total_gen = self.total_generated_tokens
            total_steps = self.total_steps
        now = time.monotonic()
        out: dict = {
            "running": 0,
            "waiting": 0,
            "kv_usage": 0.0,
            "tokens_per_s": 0.0,
            "steps": total_steps,
            "preemptions": 0,
            "generated_tokens": total_gen,
            "prefix_hit_rate": None,
            "prefill_tokens_saved": 0,
            "prefix_hit_rate_window": None,
            "prefill_tokens_saved_window": 0,
            "prefix_window_steps": 0,
        }
        if steps:
            last = steps[-1]
            out.update(
                running=last.num_running,
                waiting=last.num_waiting,
                kv_usage=last.kv_usage,
                preemptions=last.num_preemptions,
                prefill_tokens_saved=last.prefix_cache_hits,
                prefix_hit_rate=(last.prefix_cache_hits / last.prefix_cache_queries) if last.prefix_cache_queries else None,
            )
            # per window: the cumulative counters of the last step minus those just before the window
            # (zero when the window reaches back to the engine's first step)
            k = max(1, prefix_window_steps)
            if len(steps) > k:
                base_q, base_h, covered = steps[-k - 1].prefix_cache_queries, steps[-k - 1].prefix_cache_hits, k
            elif total_steps <= len(steps):
                base_q, base_h, covered = 0, 0, len(steps)
            else:  # the ring buffer is shorter than the window: from its oldest step
                base_q, base_h, covered = steps[0].prefix_cache_queries, steps[0].prefix_cache_hits, len(steps) - 1
            queries, hits = last.prefix_cache_queries - base_q, last.prefix_cache_hits - base_h
            out.update(prefix_hit_rate_window=hits / queries if queries > 0 else None,
                       prefill_tokens_saved_window=hits, prefix_window_steps=covered)
            recent = [s for s in steps if s.time >= now - window]
            if recent:
                span = max(recent[-1].time - (recent[0].time - recent[0].duration), 1e-6)
                span = max(span, min(window, now - recent[0].time + recent[0].duration))
                out["tokens_per_s"] = sum(s.num_generated_tokens for s in recent) / span
        ttfts = [f.ttft for f in finished if f.ttft is not None]
        tpots = [f.tpot for f in finished if f.tpot is not None]
        for name, vals in (("ttft", ttfts), ("tpot", tpots)):
            for q in (50, 90, 99):
                out[f"{name}_p{q}"] = percentile(vals, q)
        return out
