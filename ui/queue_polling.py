"""Gradio's queue without its millisecond polling.

Gradio's event queue looks for new events by sleeping and looking again: every 1 ms for new events and
every 10 ms for progress updates on Linux and macOS (50 ms and 100 ms on Windows), idle or not
(``gradio.queueing.Queue.sleep_when_free`` and ``progress_update_sleep_when_free``, gradio 6.31). That is
about 1,100 wake-ups a second of the event loop thread, which shares the engine's process (its GIL) and,
on a laptop or a free Space, its two cores: every wake-up takes a core from one of the engine's compute
threads in the middle of a step. :func:`quiet_queue` sets both to Gradio's own Windows values, so a click
waits at most 50 ms more before its handler starts; streams, the page's live channel and the OpenAI API do
not go through these loops.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

QUEUE_POLL_S = 0.05  # seconds between looks for new events (Gradio: 0.001; 0.05 on Windows)
PROGRESS_POLL_S = 0.1  # seconds between looks for progress updates (Gradio: 0.01; 0.1 on Windows)


def quiet_queue(demo, poll_s: float = QUEUE_POLL_S, progress_s: float = PROGRESS_POLL_S) -> bool:
    """Make ``demo``'s Gradio queue look for new events every ``poll_s`` seconds and for progress updates
    every ``progress_s`` seconds (never more often than Gradio's own setting). Call it after the last
    ``demo.queue()`` (each call builds a new queue) and before the app starts; later works too: the loops
    read both values on every turn.

    Returns False, and logs a warning, when ``demo`` has no queue or this Gradio's queue lacks the two
    attributes (a Gradio release that changed them): the page works as before then, only busier.

    Raises:
        ValueError: ``poll_s`` or ``progress_s`` not positive.
    """
    if not (poll_s > 0 and progress_s > 0):
        raise ValueError(f"poll intervals must be positive seconds, got {poll_s!r} and {progress_s!r}")
    queue = getattr(demo, "_queue", None)
    if queue is None or not all(hasattr(queue, a) for a in ("sleep_when_free", "progress_update_sleep_when_free")):
        log.warning("Gradio's queue has no poll intervals to set (Gradio changed?): it polls as it likes")
        return False
    queue.sleep_when_free = max(float(queue.sleep_when_free), poll_s)
    queue.progress_update_sleep_when_free = max(float(queue.progress_update_sleep_when_free), progress_s)
    return True
