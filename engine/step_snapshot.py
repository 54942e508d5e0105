"""What one engine step looks like to its readers: :class:`StepSnapshot` and :class:`BatchSlotSnapshot`
(plain data), and the one builder of their fields from a :class:`StepView`.

The engine core hands the telemetry one :class:`StepView` per step (what it has at the end of the step,
collected without computing anything); :func:`step_fields` and :func:`state_fields` are the only places
that say how each snapshot field is computed: the fields of what the step did (a new snapshot), and the
fields of the state after it (a new snapshot, or the newest one amended between steps, when a paused engine
took aborts). A new field is declared in :class:`StepSnapshot` and computed in one of the two.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.kv_events import BlockArrays, BlockTake, owner_array

PHASE_IDLE = "idle"
PHASE_PREFILL = "prefill"
PHASE_DECODE = "decode"


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
        block_takes: the blocks requests took in this step, in order: one ``engine.kv_events.BlockTake``
            each (block id, request, kind: new / reused / cached / shared / own, previous owner, the step it
            was freed in).
        block_origins: held block id -> the ``BlockTake`` by which its (first) holder got it, so a block
            taken earlier still says whose it was.
        kv_events: the KV events of this step, in order (:mod:`engine.kv_events`; the panels and remote
            readers follow the cache by them).
        request_fill: request id -> ``(num_computed_tokens, num_hit_blocks)`` of each running request.
        used_blocks: blocks held (None: counted from ``block_refcount``).
        pool_blocks: blocks in the pool (None: ``len(block_refcount)``).
        kv_history: the telemetry's :class:`engine.kv_history.KVHistory`, which rebuilds the per-block fields
            given as None (``block_refcount`` to ``block_origins``: the engine's snapshots give none).
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


@dataclass(frozen=True)
class StepView:
    """One engine step as the core hands it to :meth:`engine.telemetry.Telemetry.observe`: what the core has at
    the end of the step, gathered without computing anything. The requests in it are the engine's live objects:
    it is read once, on the stepping thread, and the snapshot built from it is plain data.

    Attributes:
        step: the engine step (between steps: the newest step, whose snapshot is amended).
        scheduled: the step's :class:`engine.scheduler.SchedulerOutput`; None between steps (a paused engine
            took requests or aborts, or every request was failed): the newest snapshot is amended then.
        start: ``time.monotonic()`` when the step began (seconds).
        forward_time: seconds of the step spent in the forward and the sampling.
        num_generated_tokens: tokens sampled in the step.
        running: the running requests after the step, in order (block tables, computed tokens, prefix hits).
        waiting: ids of the waiting requests, in queue order.
        finished: the sequences that ended (their latency records).
        num_preemptions: preemptions so far.
        kv_events: the block pool's events since the last view (:meth:`engine.kv_cache.BlockPool.pop_events`).
        num_blocks / block_size / num_used_blocks: the pool (blocks; tokens per block; blocks held).
        prefix_cache_queries / prefix_cache_hits: prompt tokens looked up / found in the prefix cache so far.
        held_time: ``held_time(start, end, now)``: seconds the engine was held by a pause in that interval
            (:meth:`engine.pacing.Pacing.held_time`), left out of the latency records.
    """

    step: int
    scheduled: Any
    start: float
    forward_time: float
    num_generated_tokens: int
    running: Sequence[Any]
    waiting: tuple[str, ...]
    finished: Sequence[Any]
    num_preemptions: int
    kv_events: tuple
    num_blocks: int
    block_size: int
    num_used_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    held_time: Callable[..., float]


def batch_slots_of(scheduled) -> tuple[BatchSlotSnapshot, ...]:
    """One :class:`BatchSlotSnapshot` per batch slot of a scheduled step (``scheduled``: its
    :class:`engine.scheduler.SchedulerOutput`, whose ``batch_slots`` say who held each slot: an
    :class:`engine.scheduler.SlotState` or None)."""
    n_sched = {r.request_id: n for r, n in scheduled.scheduled}
    rows = []
    for i, s in enumerate(scheduled.batch_slots):
        if s is None:
            rows.append(BatchSlotSnapshot(i, None, PHASE_IDLE))
            continue
        n = n_sched.get(s.request_id, 0)
        if n == 0:
            phase = PHASE_IDLE
        elif n > 1 or s.num_computed_tokens < s.num_prompt_tokens:
            phase = PHASE_PREFILL
        else:
            phase = PHASE_DECODE
        rows.append(BatchSlotSnapshot(i, s.request_id, phase, n, s.num_computed_tokens + n, s.num_prompt_tokens,
                                      s.num_cached_tokens))
    return tuple(rows)


def step_fields(view: StepView, now: float, events: tuple) -> dict:
    """The snapshot fields of what a scheduled step did (a new snapshot; an amended one keeps them).

    Args:
        view: the step.
        now: ``time.monotonic()`` at the end of the step (seconds).
        events: the step's KV events (:mod:`engine.kv_events`), in order.
    """
    sched = view.scheduled
    return dict(step=view.step, time=now, duration=now - view.start, forward_time=view.forward_time,
                batch_slots=batch_slots_of(sched), num_scheduled_tokens=sched.num_scheduled_tokens,
                num_generated_tokens=view.num_generated_tokens, finished=tuple(r.request_id for r in view.finished),
                admitted=tuple(r.request_id for r in sched.admitted),
                block_takes=tuple(e for e in events if type(e) is BlockTake))


def state_fields(view: StepView, block_tables: dict[str, tuple[int, ...]], events: tuple, kv_history) -> dict:
    """The snapshot fields of the state after a step (a new snapshot, or the newest one amended).

    Args:
        view: the step.
        block_tables: request id -> block table of each running request (:class:`BlockTables`).
        events: the snapshot's KV events, in order (an amended step's: its earlier ones, then the new ones).
        kv_history: the telemetry's :class:`engine.kv_history.KVHistory`.
    """
    return dict(block_tables=block_tables, block_refcount=None, block_tokens=None, block_reuses=None,
                cached_blocks=None, cache_hit_blocks=None, block_origins=None,  # rebuilt from the events on demand
                num_running=len(view.running), num_waiting=len(view.waiting),
                waiting=view.waiting, num_preemptions=view.num_preemptions,
                prefix_cache_queries=view.prefix_cache_queries, prefix_cache_hits=view.prefix_cache_hits,
                kv_events=events, request_fill={r.request_id: (r.num_computed_tokens, r.num_hit_blocks) for r in view.running},
                used_blocks=view.num_used_blocks, pool_blocks=view.num_blocks, kv_history=kv_history)


class BlockTables:
    """Request id -> block table (a tuple) of the running requests, step after step: a table that did not
    change is the same tuple again (the ring shares it), so a step costs O(running requests + blocks taken).
    A running request's table changes only by the blocks it takes (new ones, prefix hits, copies on write),
    each of which is a :class:`engine.kv_events.BlockTake` of it in the step's events."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[int, ...]] = {}

    def __call__(self, running: Sequence[Any], events: tuple) -> dict[str, tuple[int, ...]]:
        """The tables of ``running`` after a step whose KV events are ``events``."""
        taken = {e.request_id for e in events if type(e) is BlockTake}
        last, out = self._last, {}
        for r in running:
            rid, ids = r.request_id, r.block_ids
            t = last.get(rid)
            if t is None or rid in taken or len(t) != len(ids) or (ids and t[-1] != ids[-1]):
                t = tuple(ids)
            out[rid] = t
        self._last = out
        return out

    def clear(self) -> None:
        """Forget the tables (a step's events were lost): the next call builds every table again."""
        self._last = {}
