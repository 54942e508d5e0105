"""The block state behind the telemetry ring: per-block fields of any kept step, rebuilt from the KV events.

Snapshots of large pools keep no per-block tuples (``StepSnapshot.kv_events`` and the block tables are
O(what changed)); :class:`KVHistory` rebuilds a kept step's per-block state on demand, and answers the
readers that follow the cache from elsewhere (:meth:`engine.telemetry.Telemetry.kv_feed`).
"""

from __future__ import annotations

import threading
from typing import Any

from engine.kv_events import BlockArrays, BlockState, KVFeed, KVStepEvents, block_arrays


class KVHistory:
    """The block state behind a telemetry ring, for pools whose steps keep no per-block tuples.

    ``base`` is the state after the last step that left the ring, ``head`` the state after the newest step;
    both advance by the events of one step per record (O(events)). A kept step's arrays are ``head`` (the
    newest step) or ``base`` replayed through the kept steps up to it, built on demand and cached (the
    last two). Memory: two states (about 5 bytes per block plus the held blocks' provenance), whatever
    the ring's length.

    Args:
        steps: the telemetry's ring of :class:`engine.telemetry.StepSnapshot` (read under ``lock``).
        lock: the telemetry's lock, held by the caller of :meth:`on_record` and :meth:`on_amend`.
    """

    CACHED_VIEWS = 2

    def __init__(self, steps, lock) -> None:
        self._steps, self._lock = steps, lock
        self.base, self.head = BlockState(), BlockState()
        self.base_step = 0
        self._views: dict[int, tuple[object, BlockArrays]] = {}
        self._views_lock = threading.Lock()
        self._cursor: tuple[Any, BlockState] | None = None  # the last older step replayed, and its state

    def on_record(self, snap, evicted) -> None:
        """A step was appended (``evicted``: the step it pushed out of the ring, or None)."""
        if evicted is not None:
            self.base.apply(evicted.kv_events)
            self.base_step = evicted.step
        self.head.apply(snap.kv_events)

    def on_amend(self, old, new) -> None:
        """The newest step ``old`` was replaced by ``new``, whose events extend ``old``'s."""
        self.head.apply(new.kv_events[len(old.kv_events):])

    def arrays(self, snap) -> BlockArrays:
        """The :class:`BlockArrays` of a step in the ring (any thread).

        Raises:
            LookupError: the step has left the ring (its per-block state is no longer kept).
        """
        with self._views_lock:
            hit = self._views.get(id(snap))
            if hit is not None and hit[0] is snap:
                return hit[1]
        with self._lock:
            steps = list(self._steps)
            newest = bool(steps) and steps[-1] is snap
            if not newest and snap.step <= self.base_step:
                raise LookupError(f"step {snap.step} has left the telemetry ring: its block map is no longer kept")
            after = self.base_step
            with self._views_lock:
                cursor = self._cursor
            if newest:
                state = self.head.copy()
            elif (cursor is not None and self.base_step < cursor[0].step < snap.step
                  and any(s is cursor[0] for s in steps)):  # go on from the last step replayed (reading forward)
                state, after = cursor[1].copy(), cursor[0].step
            else:
                state = self.base.copy()
        if not newest:
            for s in steps:
                if after < s.step < snap.step:
                    state.apply(s.kv_events)
            state.apply(snap.kv_events)
        out = block_arrays(state, snap.block_tables, snap.request_fill)
        with self._views_lock:
            if not newest:
                self._cursor = (snap, state)
            self._views[id(snap)] = (snap, out)
            while len(self._views) > self.CACHED_VIEWS:
                self._views.pop(next(iter(self._views)))
        return out

    def feed(self, since: tuple[int, int] | None) -> KVFeed:
        """See :meth:`engine.telemetry.Telemetry.kv_feed` (call under the telemetry's lock)."""
        steps = list(self._steps)
        if not steps:
            return KVFeed(None, (), (0, 0))
        last = steps[-1]
        cursor = (last.step, len(last.kv_events))
        if since is None or since[0] < steps[0].step - 1:
            return KVFeed(self.head.frame(last.step), (), cursor)
        out = []
        for s in steps:
            if s.step > since[0] or (s.step == since[0] and len(s.kv_events) > since[1]):
                events = s.kv_events if s.step > since[0] else s.kv_events[since[1]:]
                out.append(KVStepEvents(s.step, events, s.block_tables, s.request_fill))
        return KVFeed(None, tuple(out), cursor)
