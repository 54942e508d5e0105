"""The engine's pacing state for talk mode: pause, single steps, slow motion, run-until, and held time.

One :class:`Pacing` object per engine (``EngineCore.pacing``) holds all of it, so that nothing else writes
pacing state anywhere: :class:`engine.async_engine.AsyncEngine` changes it from the callers' threads
(Pause, Step, Resume, the slow-motion slider, "run to the next hand-over") and reads it on the stepping
thread; the core reads the held intervals to leave paused time out of TTFT, TPOT and end-to-end latency
(it measures the presenter, not the engine); the UI and the server read ``paused``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

MAX_MIN_STEP_TIME = 10.0  # seconds: the slowest slow motion


class Pacing:
    """Pacing state of one engine (thread-safe).

    Args:
        max_held: held (paused) intervals kept for :meth:`held_time`.

    Attributes:
        paused: True while a pause holds the engine (no step runs; requests queue, aborts still apply).
        single_steps: steps granted by :meth:`grant` while paused.
        min_step_time: slow motion: the least wall time of one step (seconds; 0 = full speed).
        until_condition: the last :meth:`start_until` condition; ``until_met`` whether it held (None while it
            runs, False when its step budget ran out or it was called off).
    """

    def __init__(self, max_held: int = 4096) -> None:
        self.lock = threading.Lock()
        self.paused = False
        self.single_steps = 0
        self.min_step_time = 0.0
        self.until_condition: Callable[[Any], bool] | None = None
        self.until_met: bool | None = None
        self._until: Callable[[Any], bool] | None = None  # the condition while it runs
        self._until_left = 0  # steps it may still run
        self._held: collections.deque[tuple[float, float]] = collections.deque(maxlen=max_held)
        self._held_since: float | None = None  # start of the interval the engine is held now

    # ------------------------------------------------------------------ callers' threads
    @property
    def seeking(self) -> bool:
        """True while a :meth:`start_until` condition runs (it has not held yet)."""
        return self._until is not None

    def pause(self) -> None:
        """Hold the engine between two steps; calls off a running run-until."""
        with self.lock:
            self.paused, self.single_steps = True, 0
            self._call_off_until()

    def resume(self) -> None:
        """Run steps again at the set pace; calls off a running run-until."""
        with self.lock:
            self.paused, self.single_steps = False, 0
            self._call_off_until()

    def grant(self, steps: int) -> None:
        """While paused, allow ``steps`` more steps (ignored when not paused).

        Raises:
            ValueError: ``steps`` < 1.
        """
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be a positive integer, got {steps!r}")
        with self.lock:
            if self.paused:
                self.single_steps += steps

    def set_min_step_time(self, seconds: float) -> None:
        """Slow motion: every step lasts at least ``seconds`` (0 to :data:`MAX_MIN_STEP_TIME`).

        Raises:
            ValueError: a value outside that range or not a number.
        """
        if not isinstance(seconds, (int, float)) or not 0.0 <= seconds <= MAX_MIN_STEP_TIME:
            raise ValueError(f"the minimum step time must be in [0, {MAX_MIN_STEP_TIME:g}] seconds, got {seconds!r}")
        self.min_step_time = float(seconds)

    def start_until(self, condition: Callable[[Any], bool], max_steps: int) -> None:
        """Run (unpaused) until ``condition(snapshot)`` holds for a new step, at most ``max_steps`` steps.

        Raises:
            ValueError: ``max_steps`` < 1 or ``condition`` not callable.
        """
        if not callable(condition):
            raise ValueError("condition must be callable")
        if not isinstance(max_steps, int) or max_steps < 1:
            raise ValueError(f"max_steps must be a positive integer, got {max_steps!r}")
        with self.lock:
            self._until, self._until_left = condition, max_steps
            self.until_condition, self.until_met = condition, None
            self.paused, self.single_steps = False, 0

    def _call_off_until(self) -> None:
        """Under :attr:`lock`: end a running run-until unmet."""
        if self._until is not None:
            self._until, self.until_met = None, False

    # ------------------------------------------------------------------ stepping thread
    def may_step(self) -> bool:
        """Whether the stepping thread may run a step now (not paused, or a granted single step)."""
        with self.lock:
            return not self.paused or self.single_steps > 0

    def spend_step(self) -> None:
        """A step ran: a granted single step is used up."""
        with self.lock:
            if self.paused and self.single_steps > 0:
                self.single_steps -= 1

    def idle(self) -> None:
        """Nothing to run: a granted single step with nothing to do is spent."""
        with self.lock:
            self.single_steps = 0

    def check_until(self, snapshot: Any) -> None:
        """After a new step: evaluate the run-until condition on its snapshot; pause when it holds or its
        step budget is spent. A condition that raises stops the run, paused."""
        with self.lock:
            cond = self._until
        if cond is None:
            return
        try:
            met = bool(cond(snapshot))
        except Exception:
            log.exception("run_until condition failed")
            met, self._until_left = False, 0
        self._until_left -= 1
        if met or self._until_left <= 0:
            with self.lock:
                if self._until is cond:
                    self._until, self.paused, self.single_steps = None, True, 0
                    self.until_met = met

    # ------------------------------------------------------------------ held time
    def set_held(self, held: bool, now: float | None = None) -> None:
        """Record that the engine is held by a pause (no step runs) from now on, or no longer (stepping
        thread). Cheap when nothing changes. ``now`` defaults to ``time.monotonic()`` (seconds)."""
        if held == (self._held_since is not None):
            return
        now = time.monotonic() if now is None else now
        with self.lock:
            if held:
                self._held_since = now
            elif self._held_since is not None:
                self._held.append((self._held_since, now))
                self._held_since = None

    def held_time(self, start: float, end: float, now: float | None = None) -> float:
        """Seconds of ``[start, end]`` (``time.monotonic()`` times) during which the engine was held by a
        pause; the interval it is held now counts up to ``now``. Only the last ``max_held`` intervals are
        kept."""
        now = time.monotonic() if now is None else now
        with self.lock:
            intervals = list(self._held)
            if self._held_since is not None:
                intervals.append((self._held_since, now))
        total = 0.0
        for a, b in reversed(intervals):
            if b <= start:
                break
            total += max(0.0, min(b, end) - max(a, start))
        return total
