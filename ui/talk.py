"""Talk-mode actions of the pacing row beyond one engine call: "run to the next hand-over" (a batch slot
changes owner) and "run to the next block reuse" (a block freed by one request is taken by another). Both
start ``engine.run_until`` with a condition of :mod:`engine.handover` and stop paused on that step; the pace
line then says what was found."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from engine import NextBlockReuse, NextHandover
from ui.i18n import PACE_TEXTS

if TYPE_CHECKING:
    from engine import AsyncEngine

KINDS = ("handover", "reuse")


def condition_for(engine: AsyncEngine, kind: str) -> NextHandover | NextBlockReuse:
    """A fresh condition object for ``kind`` (``"handover"`` or ``"reuse"``), for ``engine.run_until``.

    Raises:
        ValueError: an unknown kind.
    """
    if kind == "handover":  # the slots' current holders come from the steps already recorded
        return NextHandover(engine.telemetry.snapshots())
    if kind == "reuse":
        return NextBlockReuse()
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


async def run_to(engine: AsyncEngine, kind: str, wait_s: float = 10.0, poll_s: float = 0.03) -> bool:
    """Run the engine to the next ``kind`` event and wait (at most ``wait_s`` seconds, polling every ``poll_s``
    seconds) until it stops there.

    Returns:
        True when the engine stopped (paused on the event's step, or after ``run_until``'s step budget);
        False when it is still running to it (e.g. no request runs yet): the pace line says so.

    Raises:
        ValueError: an unknown kind.
    """
    engine.run_until(condition_for(engine, kind))
    deadline = time.monotonic() + wait_s
    while engine.seeking and time.monotonic() < deadline:
        await asyncio.sleep(poll_s)
    return not engine.seeking


def seek_text(engine: AsyncEngine, lang: str) -> str:
    """The part of the pace line about run-to: "running to the next hand-over…" while it runs; what it found
    while the engine is paused on that step ("hand-over: slot 2 from A to D"); "" otherwise."""
    L = PACE_TEXTS.get(lang, PACE_TEXTS["en"])
    cond = engine.until_condition
    if not isinstance(cond, (NextHandover, NextBlockReuse)):
        return ""
    kind = "handover" if isinstance(cond, NextHandover) else "reuse"
    if engine.seeking:
        return L["seeking_" + kind]
    handover = cond.found if isinstance(cond, NextHandover) else None
    reuse = cond.found if isinstance(cond, NextBlockReuse) else None
    found = handover or reuse
    if not engine.paused or engine.until_met is not True or found is None:
        if engine.until_met is False and engine.paused and found is None:
            return L["not_found_" + kind]
        return ""
    if found[0] != engine.step_count:  # stepped on since: the find is old news
        return ""
    if handover is not None:
        _step, slot, prev, new = handover
        return L["found_handover"].format(slot=slot, prev=prev, new=new)
    if reuse is not None:
        _step, block, prev, freed, new, how = reuse
        return L["found_" + how].format(block=block, prev=prev, freed=freed, new=new)
    return ""
