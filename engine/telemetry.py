"""Per-step, read-only snapshots of the engine's state for the live panels and the benchmarks.

The engine thread calls :meth:`Telemetry.record` once per step; readers (the UI, benches, tests) call
:meth:`Telemetry.snapshots` / :meth:`Telemetry.stats` from any thread. Snapshots are plain data
(tuples, dicts of ints and strings), never live engine objects, so readers can keep them.

KV blocks: every step carries its KV events (``StepSnapshot.kv_events``, :mod:`engine.kv_events`: blocks
taken, freed, stored, evicted), its block tables and each request's computed tokens, all O(what changed or
runs). The per-block fields (``block_refcount`` ... ``block_origins``, O(num_blocks) each) are stored in
the snapshot only for pools up to :attr:`Telemetry.eager_block_limit` blocks (talks: the snapshot is
self-contained, as before); for larger pools they are rebuilt on first read from the telemetry's
:class:`engine.kv_events.KVHistory` (replay of the events), while the step is in the ring.

Counters are counted when they happen, never rebuilt from the rings: totals per step in :meth:`Telemetry.record`,
per finished request in :meth:`Telemetry.record_finished`, which also hands each record to the listeners of
:meth:`Telemetry.on_finished` (the Prometheus metrics), so they see every request whatever the finish rate.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.kv_events import BlockArrays, KVFeed, KVHistory, owner_array

log = logging.getLogger(__name__)

PHASE_IDLE = "idle"
PHASE_PREFILL = "prefill"
PHASE_DECODE = "decode"
EAGER_BLOCK_LIMIT = 512  # pools up to this many blocks (talks) keep per-block tuples in every snapshot (docs/performance.md)


class _EmptyMapping(Mapping):
    """An immutable, hashable empty mapping (a dataclass default)."""

    def __getitem__(self, key):
        raise KeyError(key)

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "{}"


_EMPTY: Mapping = _EmptyMapping()


class _PerBlock:
    """A per-block field of :class:`StepSnapshot` (a dataclass field whose default is this descriptor): the
    value given, or, when None was given, the value rebuilt from the telemetry's KV events on first read."""

    def __init__(self, default: Any = None) -> None:
        self.default = default

    def __set_name__(self, owner, name: str) -> None:
        self.name, self.slot = name, "_" + name

    def __get__(self, obj, objtype=None) -> Any:
        if obj is None:
            if self.default is None:  # a required field
                raise AttributeError(self.name)
            return self.default
        value = obj.__dict__[self.slot]
        return value if value is not None else obj.block_arrays().as_fields[self.name]

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.slot] = value


@dataclass(frozen=True)
class BatchSlotSnapshot:
    """One batch slot (row of the batch) in one step.

    A *batch slot* is one of the ``max_num_seqs`` rows of the batch; it is not a KV-cache slot (a token
    position in the paged cache, as in ``slot_mapping``).

    Attributes:
        batch_slot: slot index in ``[0, max_num_seqs)``.
        request_id: the request holding the slot, or None when the slot is empty.
        phase: ``"prefill"`` (computing prompt tokens), ``"decode"`` (one new token), or ``"idle"``
            (empty, or held but not computed this step, e.g. a finished row under the static policy).
        num_scheduled_tokens: tokens computed for this request in this step (tokens).
        num_computed_tokens: tokens in the KV cache for this request after the step (tokens).
        num_prompt_tokens: the request's prompt length (tokens): while ``num_computed_tokens`` is
            below it, the request is prefilling ("n of m prompt tokens").
        num_cached_tokens: tokens the request found in the prefix cache when it took its slot (its
            latest admission), counted in ``num_computed_tokens`` without being computed (tokens).
    """

    batch_slot: int
    request_id: str | None
    phase: str
    num_scheduled_tokens: int = 0
    num_computed_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class StepSnapshot:
    """The engine's state after one step.

    Attributes:
        step: engine step number (starts at 1).
        time: ``time.monotonic()`` at the end of the step (seconds).
        duration: wall time of the step (seconds); ``forward_time`` of it went to the model forward.
        batch_slots: one :class:`BatchSlotSnapshot` per batch slot, length ``max_num_seqs``.
        block_tables: request id -> physical block ids it holds, for every running request.
        block_refcount: per physical block, the number of block tables holding it (length num_blocks).
        block_tokens: per physical block, tokens filled in it (0..block_size).
        block_reuses: per physical block, how many times it was handed to a request other than its
            previous owner.
        cached_blocks: ids of blocks that are free but still hold a findable prefix (prefix caching).
        num_running / num_waiting: request counts after the step.
        num_scheduled_tokens: tokens computed in this step (tokens).
        num_generated_tokens: tokens sampled in this step (tokens).
        num_preemptions: total preemptions so far.
        finished: ids of requests that finished in this step.
        admitted: ids of requests that took a slot in this step.
        prefix_cache_queries: prompt tokens looked up in the prefix cache so far (tokens).
        prefix_cache_hits: of those, tokens found cached and not recomputed (tokens).
        cache_hit_blocks: ids of held blocks that a request got from the prefix cache.
        waiting: ids of the waiting requests, in queue order (the first is admitted next).
        block_takes: the blocks requests took in this step, in order: one ``engine.kv_cache.BlockTake``
            each (block id, request, kind: new / reused / cached / shared / own, previous owner, the step it
            was freed in).
        block_origins: held block id -> the ``BlockTake`` by which its (first) holder got it, so a block
            taken earlier still says whose it was.
        kv_events: the KV events of this step, in order (:mod:`engine.kv_events`; the panels and remote
            readers follow the cache by them).
        request_fill: request id -> ``(num_computed_tokens, num_hit_blocks)`` of each running request.
        used_blocks: blocks held (None: counted from ``block_refcount``).
        pool_blocks: blocks in the pool (None: ``len(block_refcount)``).
        kv_history: the telemetry's :class:`engine.kv_events.KVHistory`, which rebuilds the per-block fields
            given as None (``block_refcount`` to ``block_origins``; pools above ``Telemetry.eager_block_limit``).
    """

    step: int
    time: float
    duration: float
    forward_time: float
    batch_slots: tuple[BatchSlotSnapshot, ...]
    block_tables: dict[str, tuple[int, ...]]
    block_refcount: tuple[int, ...] = _PerBlock()  # type: ignore[assignment]
    block_tokens: tuple[int, ...] = _PerBlock()  # type: ignore[assignment]
    block_reuses: tuple[int, ...] = _PerBlock()  # type: ignore[assignment]
    cached_blocks: frozenset[int] = _PerBlock()  # type: ignore[assignment]
    # required at run time (the four above are too: their descriptor has no default); mypy sees a default
    num_running: int  # type: ignore[misc]
    num_waiting: int  # type: ignore[misc]
    num_scheduled_tokens: int  # type: ignore[misc]
    num_generated_tokens: int  # type: ignore[misc]
    num_preemptions: int  # type: ignore[misc]
    finished: tuple[str, ...] = ()
    admitted: tuple[str, ...] = ()
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    cache_hit_blocks: frozenset[int] = _PerBlock(frozenset())  # type: ignore[assignment]
    waiting: tuple[str, ...] = ()
    block_takes: tuple = ()
    block_origins: Mapping[int, Any] = _PerBlock(_EMPTY)  # type: ignore[assignment]
    kv_events: tuple = ()
    request_fill: Mapping[str, tuple[int, int]] = _EMPTY
    used_blocks: int | None = None
    pool_blocks: int | None = None
    kv_history: Any = field(default=None, compare=False, repr=False)

    @property
    def num_blocks(self) -> int:
        return self.pool_blocks if self.pool_blocks is not None else len(self.block_refcount)

    @property
    def num_used_blocks(self) -> int:
        return self.used_blocks if self.used_blocks is not None else sum(1 for r in self.block_refcount if r > 0)

    def block_arrays(self) -> BlockArrays:
        """The per-block state as numpy arrays (:class:`engine.kv_events.BlockArrays`, length num_blocks):
        from the stored fields, or rebuilt from the KV events (then cached by the history).

        Raises:
            LookupError: rebuilt, and the step has left the telemetry ring.
        """
        d = self.__dict__
        if d["_block_refcount"] is None:
            if self.kv_history is None:
                raise ValueError("a snapshot without per-block fields needs its telemetry's kv_history")
            return self.kv_history.arrays(self)
        n = len(d["_block_refcount"])
        cached, hit = np.zeros(n, bool), np.zeros(n, bool)
        cached[list(d["_cached_blocks"] or ())] = True
        hit[list(d["_cache_hit_blocks"] or ())] = True
        owner, ids = owner_array(n, self.block_tables)
        return BlockArrays(np.asarray(d["_block_refcount"], np.int32), np.asarray(d["_block_tokens"], np.int32),
                           np.asarray(d["_block_reuses"], np.uint32), cached, hit, owner, ids,
                           d["_block_origins"] or {})

    @property
    def kv_usage(self) -> float:
        """Fraction of blocks held by running requests (0..1)."""
        return self.num_used_blocks / max(1, self.num_blocks)

    def request_state(self, request_id: str) -> dict | None:
        """Where a request stands after this step, for a chat that waits for its first token.

        Returns:
            ``{"state": "queued", "position": k}`` (k-th in the waiting queue, from 1),
            ``{"state": "prefilling", "computed": n, "prompt": m}`` (n of its m prompt tokens in the
            cache), ``{"state": "decoding"}``, ``{"state": "finished"}`` (it ended in this step), or
            None when the request is not in this step (unknown, or ended earlier).
        """
        if request_id in self.finished:
            return {"state": "finished"}
        if request_id in self.waiting:
            return {"state": "queued", "position": self.waiting.index(request_id) + 1}
        for s in self.batch_slots:
            if s.request_id == request_id:
                if s.num_computed_tokens < s.num_prompt_tokens:
                    return {"state": "prefilling", "computed": s.num_computed_tokens, "prompt": s.num_prompt_tokens}
                return {"state": "decoding"}
        return None

    def block_owners(self) -> list[list[str]]:
        """Per physical block, the ids of the requests whose block tables hold it."""
        owners: list[list[str]] = [[] for _ in range(self.num_blocks)]
        for rid, blocks in self.block_tables.items():
            for b in blocks:
                owners[b].append(rid)
        return owners


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
        eager_block_limit: pools up to this many blocks keep their per-block tuples in every snapshot;
            larger ones keep only the KV events, and :attr:`kv_history` rebuilds a kept step's blocks.
    """

    capacity: int = 512
    max_finished: int = 2048
    eager_block_limit: int = EAGER_BLOCK_LIMIT
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

    def __post_init__(self) -> None:
        self._steps = collections.deque(maxlen=self.capacity)
        self._finished = collections.deque(maxlen=self.max_finished)
        self.kv_history = KVHistory(self._steps, self._lock)

    def keeps_block_tuples(self, num_blocks: int) -> bool:
        """Whether snapshots of a pool of ``num_blocks`` blocks carry their per-block tuples."""
        return num_blocks <= self.eager_block_limit

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
