"""Block provenance: whose a block was, and when it was freed, derived from the block pool's events.

The block pool (:class:`engine.kv_cache.BlockPool`) reports only what it does: which block went to which
request and from where (:class:`engine.kv_events.BlockAllocated`), which block's refcount reached 0
(:class:`engine.kv_events.BlockReleased`). :class:`Provenance` reads those events once per step, on the
stepping thread, and remembers per block its last holder and the step it was last freed in, so that it
can say of each take what the panels show ("was A's, freed at step F"):

- a block from the free queue is ``new`` (never held), ``own`` (its last holder again: a preemption or a
  copy-on-write of its own) or ``reused`` (another request held and freed it);
- a cached-free block found by a prefix lookup is ``cached``; a block another request holds is ``shared``
  (it keeps its first holder: its last holder and origin do not change).

It also keeps the replayed :class:`engine.kv_events.BlockState` of every event so far (reuse counts,
cached hashes, the take of every held block): when a step's events were lost (a telemetry record that
failed), the next step's events start with a :class:`engine.kv_events.KVFrame` of it, so every reader of
the stream is whole again.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.kv_events import (
    FROM_CACHED,
    FROM_HELD,
    TAKE_CACHED,
    TAKE_NEW,
    TAKE_OWN,
    TAKE_REUSED,
    TAKE_SHARED,
    BlockAllocated,
    BlockFreed,
    BlockReleased,
    BlockState,
    BlockTake,
    KVFrame,
)


class Provenance:
    """Turns the block pool's events into the KV events of a step (stepping thread only).

    Attributes:
        state: the :class:`engine.kv_events.BlockState` after every event stamped so far.
        last_owner: per block, the request that last took it from the pool (None: never taken).
        freed_step: per block, the step it was last freed in (None: never freed).
    """

    def __init__(self) -> None:
        self.state = BlockState()
        self.last_owner: list[str | None] = []
        self.freed_step: list[int | None] = []
        self._lost_step: int | None = None  # a step whose events no reader got

    def stamp(self, events: Iterable, step: int) -> tuple:
        """The KV events of ``events`` (the pool's, in order) in engine step ``step``: each
        :class:`BlockAllocated` with a request as a :class:`BlockTake`, each :class:`BlockReleased` as a
        :class:`BlockFreed`, the others as they are; first a :class:`KVFrame` when events were lost since the
        last call (:meth:`lost`). O(events)."""
        out: list = []
        if self._lost_step is not None and self.state.num_blocks:
            out.append(self.state.frame(self._lost_step))
        self._lost_step = None
        last_owner, freed_step = self.last_owner, self.freed_step
        for e in events:
            t = type(e)
            if t is BlockAllocated:
                if e.request_id is None:  # a fork's siblings: the block keeps its holder's take
                    continue
                b, prev = e.block_id, last_owner[e.block_id]
                if e.source == FROM_HELD:
                    e = BlockTake(b, e.request_id, step, TAKE_SHARED, prev)
                else:
                    kind = (TAKE_CACHED if e.source == FROM_CACHED else TAKE_NEW if prev is None
                            else TAKE_OWN if prev == e.request_id else TAKE_REUSED)
                    e = BlockTake(b, e.request_id, step, kind, prev, freed_step[b])
                    last_owner[b] = e.request_id
            elif t is BlockReleased:
                freed_step[e.block_id] = step
                e = BlockFreed(e.block_id, last_owner[e.block_id], step)
            elif t is KVFrame and e.num_blocks != len(last_owner):  # the pool's first event: its size
                self.last_owner = last_owner = [None] * e.num_blocks
                self.freed_step = freed_step = [None] * e.num_blocks
            out.append(e)
        self.state.apply(out)
        return tuple(out)

    def lost(self, step: int) -> None:
        """The events stamped for ``step`` reached no reader: the next :meth:`stamp` starts with a frame."""
        self._lost_step = step
