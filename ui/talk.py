"""Talk-mode actions of the pacing row beyond one engine call: "run to the next hand-over" (a batch slot
changes owner) and "run to the next block reuse" (a block freed by one request is taken by another). Both
start ``engine.run_until`` with a condition of :mod:`engine.handover` and stop paused on that step; the pace
line then says what was found, naming requests as the panels draw them ("slot 2: red A → teal D").

The talk preset (``python app.py --talk`` or the page's Talk preset button): :data:`engine.options.TALK_PRESET`
for the engine and :data:`TALK_WINDOW` steps for the panels (:func:`apply_preset`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine import TALK_PRESET, NextBlockReuse, NextHandover
from ui.i18n import PACE_TEXTS

if TYPE_CHECKING:
    from engine import AsyncEngine

KINDS = ("handover", "reuse")
# steps shown by the talk preset: at 1366x768 the occupancy plot area is about 700 px wide, so a cell is about
# 22 px wide (and 4 slot rows about 45 px high): a ▷ and a request's letter read from the back of a room
TALK_WINDOW = 32


def is_talk_config(config) -> bool:
    """Whether an engine configuration already is the talk preset's (slots, pool, free-block order)."""
    return all(getattr(config, k) == v for k, v in TALK_PRESET.items())


def apply_preset(engine: AsyncEngine) -> bool:
    """Give ``engine`` the talk preset's settings (:meth:`AsyncEngine.reconfigure`: in-flight requests end)
    unless it has them already; returns True when the engine was restarted."""
    if is_talk_config(engine.config):
        return False
    engine.reconfigure(**TALK_PRESET)
    return True


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


def seek_text(engine: AsyncEngine, lang: str, name: Callable[[str], str] = str) -> str:
    """The part of the pace line about run-to: "running to the next hand-over…" while it runs; what it found
    while the engine is paused on that step ("hand-over: slot 2: red A → teal D"); "" otherwise. ``name`` gives
    the text that names a request id (default: the id itself)."""
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
        return L["found_handover"].format(slot=slot, prev=name(prev), new=name(new))
    if reuse is not None:
        _step, block, prev, freed, new, how = reuse
        return L["found_" + how].format(block=block, prev=name(prev), freed=freed, new=name(new))
    return ""
