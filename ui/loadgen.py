"""Synthetic chats for talks: add N chats with built-in prompts of varied length at a chosen rate.

The prompts and lengths come from :func:`engine.prompts.synthetic_chat` (one line to a long preamble,
16..256 new tokens each).

The chats run as asyncio tasks on the server's event loop (the same loop the Gradio handlers run on), each
one an ordinary ``engine.generate`` stream, so they show up in the panels exactly like browser chats
(their request ids start with ``load-``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from dataclasses import dataclass
from typing import Any

from engine.prompts import synthetic_chat
from engine.request import SamplingParams

__all__ = ["LoadGenerator", "LoadStats", "synthetic_chat"]


@dataclass
class LoadStats:
    """Counts of the synthetic chats since start (requests and generated text chunks)."""

    requested: int = 0
    started: int = 0
    finished: int = 0
    failed: int = 0
    cancelled: int = 0
    chunks: int = 0


class LoadGenerator:
    """Adds synthetic chats to an engine; one instance per process, shared by all tabs.

    Args:
        engine: the ``AsyncEngine`` (``generate`` is used).
        seed: seed of the prompt/length choice, so a talk can replay the same load.
    """

    def __init__(self, engine: Any, seed: int = 20261129) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self.stats = LoadStats()
        self._tasks: set[asyncio.Task] = set()

    @property
    def active(self) -> int:
        """Synthetic chats (and pacing tasks) not yet done."""
        return sum(1 for t in self._tasks if not t.done())

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _one(self, temperature: float) -> None:
        messages, max_tokens = synthetic_chat(self.rng)
        params = SamplingParams(temperature=temperature, top_p=0.95, max_tokens=max_tokens,
                                seed=self.rng.randrange(1 << 30))
        self.stats.started += 1
        try:
            async with contextlib.aclosing(
                self.engine.generate(messages, params, request_id=f"load-{uuid.uuid4().hex[:8]}")
            ) as stream:
                async for out in stream:
                    self.stats.chunks += 1
                    if out.finished:
                        break
            self.stats.finished += 1
        except asyncio.CancelledError:
            self.stats.cancelled += 1
            raise
        except Exception:  # a rejected synthetic chat must not stop the others
            self.stats.failed += 1

    async def _pace(self, n: int, rate: float, temperature: float) -> None:
        for i in range(n):
            self._spawn(self._one(temperature))
            if i + 1 < n:
                await asyncio.sleep(1.0 / rate)

    def start(self, n: int, rate: float, temperature: float = 0.8) -> None:
        """Add ``n`` chats at ``rate`` chats per second (from within the server's event loop)."""
        n, rate = int(n), float(rate)
        if n <= 0:
            return
        if rate <= 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        self.stats.requested += n
        self._spawn(self._pace(n, rate, temperature))

    def stop(self) -> int:
        """Cancel every synthetic chat and pending start; returns how many tasks were cancelled."""
        tasks = [t for t in self._tasks if not t.done()]
        for t in tasks:
            t.cancel()
        return len(tasks)

    def status(self) -> str:
        """One line for the UI: requested, started, running, finished, stopped, failed."""
        s = self.stats
        running = s.started - s.finished - s.failed - s.cancelled
        return (f"{s.requested} requested · {s.started} started · {max(0, running)} running · "
                f"{s.finished} finished · {s.cancelled} stopped · {s.failed} failed")
