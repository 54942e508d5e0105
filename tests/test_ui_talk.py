"""The pacing row's run-to buttons (ui/talk.py): the condition per kind, waiting for the stop, the pace
line's run-to part in English and Korean; against stand-in engines."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from engine.handover import NextBlockReuse, NextHandover
from ui import talk
from ui.live import pacing_line


class FakeEngine:
    """Stops ``steps`` polls after run_until, as if the condition held at step ``at``."""

    def __init__(self, at: int = 7, polls: int = 3) -> None:
        self.telemetry = SimpleNamespace(snapshots=lambda: [])
        self.step_count, self.paused, self.min_step_time = 0, True, 0.0
        self.until_condition, self.until_met, self._at, self._polls = None, None, at, polls

    def run_until(self, cond):
        self.until_condition, self.until_met, self.paused = cond, None, False

    @property
    def seeking(self) -> bool:
        if self.until_met is None and self.until_condition is not None:
            self._polls -= 1
            if self._polls <= 0:
                self.step_count, self.paused, self.until_met = self._at, True, True
                cond = self.until_condition
                cond.found = ((self._at, 2, "A", "D") if isinstance(cond, NextHandover)
                              else (self._at, 38, "A", 6, "D", "reused"))
        return self.until_met is None


def test_run_to_waits_for_the_stop_and_the_pace_line_says_what_was_found():
    eng = FakeEngine()
    assert asyncio.run(talk.run_to(eng, "handover", poll_s=0.001)) is True
    assert isinstance(eng.until_condition, NextHandover)
    line = pacing_line(eng, None, "en")
    assert "Engine paused" in line and "step 7" in line and "**hand-over** · slot 2: A → D" in line
    named = pacing_line(eng, None, "en", lambda rid: {"A": "red A", "D": "teal D"}[rid])
    assert "slot 2: red A → teal D" in named
    assert "슬롯 인계" in pacing_line(eng, None, "ko")
    eng.step_count = 8  # one step later the find is old news
    assert "hand-over" not in pacing_line(eng, None, "en")

    eng = FakeEngine()
    assert asyncio.run(talk.run_to(eng, "reuse", poll_s=0.001)) is True
    assert isinstance(eng.until_condition, NextBlockReuse)
    assert "block 38: A (freed at step 6) → D" in pacing_line(eng, None, "en")
    with pytest.raises(ValueError):
        asyncio.run(talk.run_to(eng, "nope"))


def test_run_to_returns_while_still_running_and_the_line_says_so():
    eng = FakeEngine(polls=10**9)
    assert asyncio.run(talk.run_to(eng, "reuse", wait_s=0.05, poll_s=0.01)) is False
    assert "running to the next block reuse" in pacing_line(eng, None, "en")
    assert "다음 블록 재사용" in pacing_line(eng, None, "ko")
    eng.until_met, eng.paused = False, True  # called off, or its step budget ran out
    assert "no block reuse" in pacing_line(eng, None, "en")


def test_the_run_to_buttons_are_translated():
    from ui.i18n import EN, KO

    assert EN["next_handover"].startswith("▶▶|") and KO["next_reuse"] == "▶▶| 다음 블록 재사용"
