"""Synthetic chats for talks: add N chats with built-in prompts of varied length at a chosen rate.

The prompts and lengths come from :func:`engine.prompts.synthetic_chat` (one line to a long preamble,
16..256 new tokens each).

The chats run as asyncio tasks on the server's event loop (the same loop the Gradio handlers run on), each
one an ordinary ``engine.generate`` stream, so they show up in the panels exactly like browser chats.

Runs: every :meth:`LoadGenerator.start` begins a new run, numbered from 1, whose counts start from zero, also
while an earlier run still has chats: a presenter who presses Start again sees "run 4: 12 requested", the load
just asked for, not a sum with what is still running. Earlier runs' chats are not cancelled (they end on their
own, or with :meth:`LoadGenerator.stop`, which ends every run); the status line counts them apart ("+ 5 of
earlier runs"). A run's request ids are ``load-<run>-<hex>``, so the engine's telemetry can be read per run:
the status line's "running" and "waiting" are counted from the newest engine step snapshot, the same one the
page's Running/Waiting counters come from.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections.abc import AsyncGenerator, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from engine import RequestOutput, SamplingParams, synthetic_chat

if TYPE_CHECKING:
    from engine import AsyncEngine, StepSnapshot

__all__ = ["LoadGenerator", "LoadStats", "synthetic_chat"]


@dataclass
class LoadStats:
    """Counts of one run's synthetic chats (requests, and generated text chunks).

    Attributes:
        run: the run number (1, 2, ...; 0 before the first start).
        requested: chats asked for by the run's starts.
        started: chats handed to ``engine.generate`` so far.
        finished: chats that ended normally (stop string, EOS or their token limit).
        failed: chats the engine refused or ended with an error.
        cancelled: chats ended by :meth:`LoadGenerator.stop` or aborted in the engine ("stopped").
        chunks: streamed outputs received (one per engine step that gave a chat a token).
    """

    run: int = 0
    requested: int = 0
    started: int = 0
    finished: int = 0
    failed: int = 0
    cancelled: int = 0
    chunks: int = 0

    @property
    def ended(self) -> int:
        """Chats of the run that are over (finished, stopped or failed)."""
        return self.finished + self.failed + self.cancelled


_STATUS = {
    "en": {"none": "no run yet", "queued": " · {} queued", "earlier": " · + {} of earlier runs",
           "line": "run {run}: {requested} requested · {running} running · {waiting} waiting{queued} · "
                   "{finished} finished · {stopped} stopped · {failed} failed"},
    "ko": {"none": "아직 실행 없음", "queued": " · 전달 중 {}", "earlier": " · 이전 실행 {}개 진행 중",
           "line": "실행 {run}: 요청 {requested} · 실행 중 {running} · 대기 중 {waiting}{queued} · "
                   "완료 {finished} · 중지 {stopped} · 실패 {failed}"},
}


class ChatTasks:
    """The tasks of a load generator: chats and pacing tasks on the running event loop, all cancellable at
    once. Shared by :class:`LoadGenerator` (local engine) and ``ui.remote.client.RemoteLoad``."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task] = set()  # every run's tasks not yet done

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task:
        """Run ``coro`` as a task, kept in :attr:`tasks` until it is done.

        Raises:
            RuntimeError: no running event loop.
        """
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def pace(self, n: int, rate: float, chat: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Spawn ``chat()`` ``n`` times, ``1 / rate`` seconds apart."""
        for i in range(n):
            self.spawn(chat())
            if i + 1 < n:
                await asyncio.sleep(1.0 / rate)

    def cancel_all(self) -> int:
        """Cancel every task not yet done; returns how many."""
        tasks = [t for t in self.tasks if not t.done()]
        for t in tasks:
            t.cancel()
        return len(tasks)

    @property
    def active(self) -> int:
        """Tasks not yet done, of every run."""
        return sum(1 for t in self.tasks if not t.done())


def run_size(n: float, rate: float) -> tuple[int, float] | None:
    """A run's ``(chats, chats per second)`` as numbers; None when ``n <= 0`` (nothing to start).

    Raises:
        ValueError: ``rate <= 0``.
    """
    n, rate = int(n), float(rate)
    if n <= 0:
        return None
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    return n, rate


class LoadGenerator:
    """Adds synthetic chats to an engine; one instance per process, shared by all tabs.

    Call :meth:`start`, :meth:`stop` and :meth:`status` from the server's event loop (the Gradio handlers'
    loop): the counts are plain attributes updated by tasks on that loop.

    Args:
        engine: the ``AsyncEngine`` (``generate`` is used, and ``telemetry.latest()``).
        seed: seed of the prompt/length choice, so a talk can replay the same load.

    Attributes:
        stats: the current run's :class:`LoadStats` (a new object at each new run).
    """

    def __init__(self, engine: AsyncEngine, seed: int = 20261129) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self.stats = LoadStats()
        self._chats = ChatTasks()  # every run's tasks (stop() cancels them all)
        self._live: set[str] = set()  # the current run's request ids handed to the engine and not ended
        self._earlier: list[set[str]] = []  # earlier runs' live request ids (chats still going)
        # (snapshot, run, running ids, waiting ids, ended ids): status() cache
        self._counted: tuple[StepSnapshot, int, frozenset[str], frozenset[str], frozenset[str]] | None = None

    @property
    def run(self) -> int:
        """The current run's number (0 before the first :meth:`start`)."""
        return self.stats.run

    @property
    def active(self) -> int:
        """Synthetic chats (and pacing tasks) not yet done, of every run."""
        return self._chats.active

    def _prefix(self, run: int) -> str:
        return f"load-{run}-"

    async def _one(self, stats: LoadStats, live: set[str], temperature: float) -> None:
        messages, max_tokens = synthetic_chat(self.rng)
        params = SamplingParams(temperature=temperature, top_p=0.95, max_tokens=max_tokens,
                                seed=self.rng.randrange(1 << 30))
        rid = f"{self._prefix(stats.run)}{uuid.uuid4().hex[:8]}"
        stats.started += 1
        live.add(rid)
        reason = None
        try:
            # generate is an async generator function (annotated as returning an AsyncIterator): it has aclose()
            outputs = cast(AsyncGenerator[RequestOutput, None], self.engine.generate(messages, params, request_id=rid))
            async with contextlib.aclosing(outputs) as stream:
                async for out in stream:
                    stats.chunks += 1
                    if out.finished:
                        reason = out.finish_reason
                        break
            if reason == "error":
                stats.failed += 1
            elif reason == "abort":
                stats.cancelled += 1
            else:
                stats.finished += 1
        except asyncio.CancelledError:
            stats.cancelled += 1
            raise
        except Exception:  # a rejected synthetic chat must not stop the others
            stats.failed += 1
        finally:
            live.discard(rid)

    def start(self, n: int, rate: float, temperature: float = 0.8) -> None:
        """Add ``n`` chats at ``rate`` chats per second (from within the server's event loop).

        Always begins a new run: its number is the previous one plus 1 and its counts start from zero. Chats of
        earlier runs still going are left alone (the status line counts them apart); :meth:`stop` ends them all.

        Args:
            n: number of chats; ``n <= 0`` does nothing.
            rate: chats per second (> 0).
            temperature: sampling temperature of the chats.

        Raises:
            ValueError: ``rate <= 0`` (nothing is started).
            RuntimeError: no running event loop.
        """
        size = run_size(n, rate)
        if size is None:
            return
        n, rate = size
        self._earlier = [live for live in (*self._earlier, self._live) if live]
        self.stats = stats = LoadStats(run=self.stats.run + 1)
        self._live = live = set[str]()
        stats.requested += n
        self._chats.spawn(self._chats.pace(n, rate, lambda: self._one(stats, live, temperature)))

    def stop(self) -> int:
        """Cancel every synthetic chat and pending start, and end the current run (the next :meth:`start`
        begins a new one).

        Returns:
            how many tasks (chats and pacing tasks) were cancelled.
        """
        return self._chats.cancel_all()

    def _engine_counts(self) -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
        """This run's request ids running and waiting in the newest step snapshot, and the ids that ended in
        that step; empty sets when there is no step yet. Cached per snapshot and run."""
        empty: frozenset[str] = frozenset()
        snap = self.engine.telemetry.latest()
        if snap is None:
            return empty, empty, empty
        cached = self._counted
        if cached is not None and cached[0] is snap and cached[1] == self.stats.run:
            return cached[2], cached[3], cached[4]
        prefix = self._prefix(self.stats.run)
        # a slot counts while its request is still running after the step (it holds a block table): the
        # slots are taken before the step ends requests, and the static policy keeps an ended row's slot
        running = frozenset(s.request_id for s in snap.batch_slots
                            if s.request_id is not None and s.request_id.startswith(prefix)
                            and s.request_id in snap.block_tables)
        waiting = frozenset(r for r in snap.waiting if r.startswith(prefix))
        ended = frozenset(r for r in snap.finished if r.startswith(prefix))
        self._counted = (snap, self.stats.run, running, waiting, ended)
        return running, waiting, ended

    def status(self, lang: str = "en") -> str:
        """One line for the UI about the current run (English, or Korean for ``lang="ko"``), e.g.
        ``"run 2: 32 requested · 16 running · 16 waiting · 0 finished · 0 stopped · 0 failed"``.

        "running" and "waiting" count the run's requests in the engine's newest step snapshot
        (``engine.telemetry.latest()``: batch slots still running after the step, and the waiting queue), so
        they agree with the page's Running/Waiting counters when only synthetic chats run. Chats handed to the
        engine but not in that snapshot yet (submitted since the last step, e.g. while the engine is paused)
        show as ``· N queued`` after "waiting", only when N > 0. Chats of the run not started yet (the rate
        holds them back) are in "requested" only.

        Cheap (one snapshot read, counted once per snapshot) and never raises for an engine with no step yet
        (then "running" and "waiting" are 0).

        Returns:
            the line; ``"no run yet"`` before the first :meth:`start`.
        """
        s = self.stats
        text = _STATUS.get(lang, _STATUS["en"])
        if s.run == 0:
            return text["none"]
        running, waiting, ended = self._engine_counts()
        queued = sum(1 for r in self._live if r not in running and r not in waiting and r not in ended)
        queued_part = text["queued"].format(queued) if queued else ""
        earlier = sum(len(live) for live in self._earlier)
        line = text["line"].format(run=s.run, requested=s.requested, running=len(running), waiting=len(waiting),
                                   queued=queued_part, finished=s.finished, stopped=s.cancelled, failed=s.failed)
        return line + (text["earlier"].format(earlier) if earlier else "")
