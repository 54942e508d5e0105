"""Conditions for talk mode's "run to the next hand-over" (:meth:`engine.async_engine.AsyncEngine.run_until`).

Each condition is called with every new :class:`engine.telemetry.StepSnapshot`, oldest first, and returns
True at the step it looks for; it keeps what it found in ``found`` (plain data), so the page can say
"slot 2: A -> D" or "block 38: A's (freed at step 11) -> D". They read telemetry snapshots only.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.telemetry import StepSnapshot

REUSE_KINDS = ("reused", "cached")  # BlockTake kinds of a block another request held and freed


class NextHandover:
    """True at the first step in which a batch slot changes owner: a request holds a slot whose last holder
    (in an earlier step, maybe with empty steps between) was another request.

    Args:
        history: snapshots already seen (e.g. ``telemetry.snapshots()``), oldest first: they set each slot's
            last holder without counting as a hand-over.

    Attributes:
        found: ``(step, batch slot, previous request id, new request id)`` of the hand-over, or None.
    """

    def __init__(self, history: Iterable[StepSnapshot] = ()) -> None:
        self.holder: dict[int, str] = {}  # batch slot -> the request that held it last
        self.found: tuple[int, int, str, str] | None = None
        for snap in history:
            self._observe(snap)

    def _observe(self, snap: StepSnapshot) -> tuple[int, int, str, str] | None:
        hit = None
        for s in snap.batch_slots:
            if s.request_id is None:
                continue
            prev = self.holder.get(s.batch_slot)
            if prev is not None and prev != s.request_id and hit is None:
                hit = (snap.step, s.batch_slot, prev, s.request_id)
            self.holder[s.batch_slot] = s.request_id
        return hit

    def __call__(self, snap: StepSnapshot) -> bool:
        """Observe one new step; True when a slot changed owner in it (then ``found`` says which)."""
        hit = self._observe(snap)
        if hit is not None:
            self.found = hit
        return hit is not None


class NextBlockReuse:
    """True at the first step in which a request takes a KV block that another request held and freed
    (``BlockTake`` kind ``reused``, or ``cached``: a free cached prefix found again).

    Attributes:
        found: ``(step, block id, previous owner, freed step, new request id, kind)``, or None.
    """

    def __init__(self, history: Iterable[StepSnapshot] = ()) -> None:
        self.found: tuple[int, int, str, int | None, str, str] | None = None

    def __call__(self, snap: StepSnapshot) -> bool:
        """Observe one new step; True when a block changed hands in it (then ``found`` says which)."""
        for t in snap.block_takes:
            if t.kind in REUSE_KINDS and t.previous_owner is not None and t.previous_owner != t.request_id:
                self.found = (snap.step, t.block_id, t.previous_owner, t.freed_step, t.request_id, t.kind)
                return True
        return False
