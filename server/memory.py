"""Give the memory of large request bodies back to the system once they are answered.

Measured with ``python -m bench.memory_burst`` (issue 22; figures in ``docs/performance.md``): a burst of
bodies near the 4 MiB limit (a prompt refused by its length, malformed JSON, a prompt tokenized and then
refused) left the server's resident set size (RSS) 50-70% above its pre-burst level for good, for two
reasons:

- **reference cycles**: a refused request's exception keeps its traceback, whose frames keep the body
  (``bytes``) and the parsed text (``str``) as locals, in a cycle (FastAPI's ``RequestValidationError``
  raised ``from`` a ``JSONDecodeError`` holding the whole document; an exception kept by an asyncio task
  whose frame holds the task). Only a full collection of the cyclic garbage collector frees them, and it
  runs rarely in a process of about 500,000 long-lived objects (torch, transformers, Gradio);
- **glibc's allocator keeps freed pages**: many body chunks and strings freed in the middle of the heap
  and of the per-thread arenas (the tokenizer runs in worker threads) stay resident until
  ``malloc_trim`` gives them back.

:class:`MemoryRelease` runs both, ``gc.collect()`` then ``malloc_trim(0)``, a short while after a request
whose body was at least ``large_bytes`` ends, at most once every ``min_interval_s`` seconds, so a long
burst of large bodies is released as it goes and ordinary traffic (bodies of a few KiB) never pays for
it. The collection takes milliseconds in the served app, whose start-up objects are frozen out of the
collector's sight (``gc.freeze`` in :func:`server.serving.serve`; without it, about 150 ms for the
playground's objects). ``malloc_trim`` runs in a worker thread (ctypes releases the GIL); where the C
library has no ``malloc_trim`` (not glibc), only the collection runs.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

LARGE_BODY_BYTES = 1024 * 1024  # bytes: a body at least this large is followed by a release (1 MiB)


def _find_malloc_trim() -> Callable[[], None] | None:
    """``malloc_trim(0)`` of the C library, or None where there is none (musl, macOS, Windows)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


class MemoryRelease:
    """Collect cyclic garbage and trim the C heap after large request bodies (see the module's doc).

    Args:
        large_bytes: the smallest body (bytes) whose end schedules a release.
        delay_s: seconds between the end of a large request and its release (more large requests ending
            meanwhile share it).
        min_interval_s: least seconds between two releases.
        trim: whether to trim the C heap after the collection (glibc's ``malloc_trim(0)``, where there is one).

    Attributes:
        releases: releases run so far.
        last_seconds: how long the last collection held the interpreter (seconds).
    """

    def __init__(self, large_bytes: int = LARGE_BODY_BYTES, delay_s: float = 0.2, min_interval_s: float = 1.0,
                 trim: bool = True) -> None:
        self.large_bytes = int(large_bytes)
        self.delay_s = float(delay_s)
        self.min_interval_s = float(min_interval_s)
        self.trim = _find_malloc_trim() if trim else None
        self.releases = 0
        self.last_seconds = 0.0
        self._last = float("-inf")
        self._handle: asyncio.TimerHandle | None = None

    def request_ended(self, body_bytes: int) -> None:
        """Called (on the event loop) when a request whose body had ``body_bytes`` bytes has been answered."""
        if body_bytes < self.large_bytes or self._handle is not None:
            return
        loop = asyncio.get_running_loop()
        wait = max(self.delay_s, self._last + self.min_interval_s - time.monotonic())
        self._handle = loop.call_later(wait, self._release, loop)

    def _release(self, loop: asyncio.AbstractEventLoop) -> None:
        self._handle = None
        t0 = time.monotonic()
        gc.collect()
        self._last = time.monotonic()
        self.last_seconds = self._last - t0
        self.releases += 1
        if self.trim is not None:
            loop.run_in_executor(None, self.trim)
        log.debug("memory release %d after large bodies: collection %.3f s", self.releases, self.last_seconds)
