"""Per-client request rate limit of the API (HTTP 429 past it), on ``asyncio_throttle``'s sliding window."""

from __future__ import annotations

import math
import time

from asyncio_throttle import Throttler


class ClientRateLimiter:
    """Per-client request rate limit: at most ``rate`` requests per ``period`` seconds per key (the
    client's host), on ``asyncio_throttle.Throttler``'s sliding window, without waiting: a request past
    the limit is refused at once (HTTP 429), never queued.

    Args:
        rate: requests allowed per ``period`` per key.
        period: window length (seconds).
    """

    MAX_KEYS = 4096  # beyond this many keys, idle ones are forgotten

    def __init__(self, rate: int, period: float = 1.0) -> None:
        if rate < 1 or period <= 0:
            raise ValueError("rate limit must be >= 1 request per period > 0 s")
        self.rate = rate
        self.period = period
        self._throttlers: dict[str, Throttler] = {}
        self._last_used: dict[str, float] = {}

    @property
    def retry_after(self) -> int:
        """Seconds a refused client should wait (whole seconds, for the ``Retry-After`` header)."""
        return max(1, math.ceil(self.period))

    def try_acquire(self, key: str) -> bool:
        """Count one request for ``key`` if the window has room; False (nothing counted) if not.

        Must be called on the event loop. ``Throttler.acquire`` either takes a place and returns
        without suspending, or suspends in ``asyncio.sleep`` to wait for one: it is stepped once, and
        when it would wait it is closed instead, which takes nothing.
        """
        now = time.monotonic()
        throttler = self._throttlers.get(key)
        if throttler is None:
            if len(self._throttlers) >= self.MAX_KEYS:
                self._forget_idle(now)
            throttler = self._throttlers[key] = Throttler(rate_limit=self.rate, period=self.period)
        self._last_used[key] = now
        step = throttler.acquire()
        try:
            step.send(None)
        except StopIteration:
            return True
        step.close()
        return False

    def _forget_idle(self, now: float) -> None:
        for k, t in list(self._last_used.items()):
            if now - t > self.period:
                self._throttlers.pop(k, None)
                self._last_used.pop(k, None)
