"""AsyncEngine: a background thread steps an :class:`EngineCore`; asyncio callers stream outputs.

Outputs reach each caller's ``asyncio.Queue`` through ``loop.call_soon_threadsafe``; leaving the
``async for`` early (break, cancellation, client gone) aborts the request in the engine.

Pacing (for talks): :meth:`AsyncEngine.pause` stops stepping (requests queue, streams wait; aborts
still free their blocks), :meth:`AsyncEngine.step_once` runs exactly one step while paused, and
:meth:`AsyncEngine.set_min_step_time` slows every step down to a minimum wall time, and
:meth:`AsyncEngine.run_until` runs until a condition on the telemetry holds (the next hand-over of a
batch slot or a KV block, :mod:`engine.handover`), then pauses on that step. All of that state lives in
the core's :class:`engine.pacing.Pacing` (``core.pacing``), which also records the time the engine is
held, so TTFT and TPOT leave it out.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.errors import RequestError
from engine.parallel_sampling import ParentRequest, child_ids
from engine.request import RequestOutput, SamplingParams
from engine.telemetry import FinishedRequestStats

log = logging.getLogger(__name__)


class EngineOverloadedError(RuntimeError):
    """Too many requests are already waiting: retry later (HTTP 429 on the API)."""


class AsyncEngine:
    """Serve many concurrent streams from one :class:`EngineCore`.

    Args:
        core: the engine to step; :meth:`from_args` builds one.
        start: start the stepping thread now.
        max_pending: most requests in flight (running + waiting) at once; one more raises
            :class:`EngineOverloadedError` instead of queueing (None = unbounded).
    """

    def __init__(self, core: EngineCore, start: bool = True, max_pending: int | None = None) -> None:
        self.core = core
        self.max_pending = max_pending
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errored: BaseException | None = None
        self._in_core: set[str] = set()  # ids handed to the core whose final output has not come back
        self._pace = threading.Event()  # set by pause/resume/speed changes/aborts: ends a slow-motion wait
        self.pacing = core.pacing  # pause, single steps, slow motion, run-until, held time
        self._inputs = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="cbp-inputs")
        self._parents: dict[str, ParentRequest] = {}  # n > 1: request id and each child id -> its parent
        self._closing: str | None = None  # set by close(): the error every request in flight ends with
        self._finish_listeners: list[Callable[[FinishedRequestStats], None]] = []  # kept across reconfigure()
        if start:
            self.start()

    @classmethod
    def from_args(cls, model=None, tokenizer=None, max_pending: int | None = None, **engine_args) -> AsyncEngine:
        """Build an engine from :class:`EngineConfig` fields (``model=None`` = embedded default;
        a preloaded model object needs ``tokenizer``) and start it."""
        if model is None or isinstance(model, str):
            core = EngineCore(EngineConfig.from_kwargs(model=model, **engine_args))
        else:
            core = EngineCore(EngineConfig.from_kwargs(**engine_args), model=model, tokenizer=tokenizer)
        return cls(core, max_pending=max_pending)

    @property
    def num_pending(self) -> int:
        """Requests streaming now (admitted to the engine and not finished)."""
        with self._lock:
            return len(self._streams)

    # ------------------------------------------------------------------ properties
    @property
    def config(self) -> EngineConfig:
        return self.core.config

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def telemetry(self):
        return self.core.telemetry

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ thread
    def start(self) -> None:
        """Start the stepping thread (idempotent)."""
        if self.is_running:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="engine-core", daemon=True)
        self._thread.start()

    @property
    def closing(self) -> str | None:
        """The reason given to :meth:`close` once it was called, else None."""
        return self._closing

    def close(self, reason: str = "the server is shutting down") -> None:
        """Abort every request in flight (each stream gets its final output at once, finish reason ``abort``;
        the blocks go back to the pool), refuse new ones (``generate`` raises ``RuntimeError(reason)``), and
        stop the stepping thread after that. Returns at once (safe to call from a signal handler or any
        thread); :meth:`shutdown` waits for the thread. A front end tells an aborted stream from a stopped one by
        :attr:`closing` (the API sends ``reason`` as an error event; the page shows the reply as stopped)."""
        self._closing = reason
        self._wake.set()
        self._pace.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the stepping thread; waits at most ``timeout`` seconds."""
        self._stop.set()
        self._wake.set()
        self._pace.set()
        self._inputs.shutdown(wait=False)
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self._closing is not None:
                self._close_all(self._closing)
                return
            pacing = self.pacing
            if not pacing.may_step():  # paused: no step runs, but new requests queue and aborts free their blocks
                pacing.set_held(True)
                self._process_inbox()
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            if not self.core.has_unfinished_requests():
                pacing.set_held(False)
                pacing.idle()  # a single step with nothing to do is spent
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            pacing.set_held(False)
            t0 = time.monotonic()
            before = self.core.step_count
            try:
                outputs = self.core.step()
            except Exception as e:  # outside the per-request guards: fail what is in flight, keep serving
                log.exception("engine step failed")
                outputs = self._fail_all(e)
            pacing.spend_step()
            if self.core.step_count != before:
                pacing.check_until(self.core.telemetry.latest())
            self._deliver_all(outputs)
            self._slow_motion_wait(t0)

    def _close_all(self, reason: str) -> None:
        """:meth:`close`'s work on the stepping thread: the queued requests admitted, then every request
        aborted and its final output delivered; the thread then ends. A fault there fails them with
        ``reason`` instead (their streams end either way)."""
        try:
            self._deliver_all(self.core.process_inbox())
            scheduler = self.core.scheduler
            for req in [*scheduler.running, *scheduler.waiting]:
                self.core.abort_request(req.request_id)
            self._deliver_all(self.core.process_inbox())
        except Exception:
            log.exception("aborting the requests at shutdown failed")
            self._deliver_all(self.core.fail_all(reason))
        self._stop.set()

    def _process_inbox(self) -> None:
        """Between steps (paused, slow motion): apply adds and aborts and deliver what ended. A fault there
        is an engine-level one, as in a step: everything in flight fails, the thread goes on."""
        try:
            outputs = self.core.process_inbox()
        except Exception as e:
            log.exception("applying queued requests and aborts failed")
            outputs = self._fail_all(e)
        self._deliver_all(outputs)

    def _slow_motion_wait(self, t0: float) -> None:
        """Slow motion: wait until the step that started at ``t0`` has lasted the minimum step time.
        A pause, a new speed or an abort ends the wait early, and aborts free their blocks at once."""
        while not self._stop.is_set() and not self.pacing.paused:
            rest = self.pacing.min_step_time - (time.monotonic() - t0)
            if rest <= 0:
                return
            if self._pace.wait(rest):
                self._pace.clear()
                self._process_inbox()

    # ------------------------------------------------------------------ pacing (talk mode)
    @property
    def paused(self) -> bool:
        """True while :meth:`pause` holds the engine."""
        return self.pacing.paused

    @property
    def step_count(self) -> int:
        """Engine steps run so far."""
        return self.core.step_count

    @property
    def min_step_time(self) -> float:
        """Slow motion: the least wall time of one step (seconds; 0 = full speed)."""
        return self.pacing.min_step_time

    @property
    def seeking(self) -> bool:
        """True while :meth:`run_until` runs (its condition has not held yet)."""
        return self.pacing.seeking

    @property
    def until_condition(self) -> Callable | None:
        """The last :meth:`run_until` condition (e.g. its ``found`` after it held)."""
        return self.pacing.until_condition

    @property
    def until_met(self) -> bool | None:
        """Whether the last :meth:`run_until` condition held (None while it runs; False: ``max_steps`` ran
        out or it was called off)."""
        return self.pacing.until_met

    def run_until(self, condition: Callable, max_steps: int = 5000) -> None:
        """Run steps (at the set pace) until ``condition(snapshot)`` is true for a new step's telemetry
        snapshot, then pause on that step, as :meth:`pause` does. Returns at once; :attr:`seeking` is True
        until then, and :attr:`until_met` says how it ended. With no request to run, it waits for one.

        Args:
            condition: called on the stepping thread with each new :class:`engine.telemetry.StepSnapshot`,
                oldest first (e.g. :class:`engine.handover.NextHandover`); it must be quick.
            max_steps: steps it may run; when they are spent without the condition holding, the engine
                pauses anyway and :attr:`until_met` is False.

        :meth:`pause`, :meth:`resume` or another ``run_until`` call it off (:attr:`until_met` False).

        Raises:
            ValueError: ``max_steps`` < 1 or ``condition`` not callable.
        """
        self.pacing.start_until(condition, max_steps)
        self._wake.set()
        self._pace.set()

    def pause(self) -> None:
        """Stop running steps: requests queue, streams wait; aborts and disconnects still free their
        blocks. Calls off a :meth:`run_until`."""
        self.pacing.pause()
        self._wake.set()
        self._pace.set()

    def resume(self) -> None:
        """Run steps again at the set pace (calls off a :meth:`run_until`)."""
        self.pacing.resume()
        self._wake.set()
        self._pace.set()

    def step_once(self, steps: int = 1) -> None:
        """While paused, run exactly ``steps`` more engine steps (a step with nothing to do is spent);
        ignored when not paused.

        Raises:
            ValueError: ``steps`` < 1.
        """
        self.pacing.grant(steps)
        self._wake.set()

    def set_min_step_time(self, seconds: float) -> None:
        """Slow motion: make every step last at least ``seconds`` (0 to 10; 0 = full speed).

        Raises:
            ValueError: a value outside [0, 10] or not a number.
        """
        self.pacing.set_min_step_time(seconds)
        self._pace.set()

    def _fail_all(self, exc: Exception) -> list[RequestOutput]:
        return self.core.fail_all(f"engine error: {exc!r}")

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        """Deliver one step's outputs: the children of an n > 1 request merged into one output of their
        parent (:class:`engine.parallel_sampling.ParentRequest`), every other output as it is."""
        by_parent: dict[str, list[RequestOutput]] = {}
        for out in outputs:
            parent = self._parents.get(out.request_id)
            if parent is None:
                self._deliver(out)
                continue
            if out.finished:
                with self._lock:
                    self._in_core.discard(out.request_id)
            by_parent.setdefault(parent.request_id, []).append(out)
        for rid, outs in by_parent.items():
            parent = self._parents[rid]
            merged = parent.merge(outs)
            if merged.finished:
                with self._lock:
                    for key in (rid, *parent.children):
                        self._parents.pop(key, None)
            self._deliver(merged)

    def _deliver(self, out: RequestOutput) -> None:
        with self._lock:
            if out.finished:
                self._in_core.discard(out.request_id)  # the core is done with this id: it may be used again
            entry = self._streams.get(out.request_id)
        if entry is None:
            return
        loop, q = entry
        try:
            loop.call_soon_threadsafe(q.put_nowait, out)
        except RuntimeError:  # the caller's loop is closed
            self.abort(out.request_id)

    # ------------------------------------------------------------------ API
    async def generate(
        self,
        prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs: each :class:`RequestOutput` carries the new text in ``.delta``;
        the last one has ``finished=True`` and a ``finish_reason``.

        Args:
            prompt: a string, a list of chat messages, or a list of token ids.
            params: sampling parameters (defaults when None).
            request_id: unique id; a random one when None.
            cache_salt: keeps this request's prefix-cache entries apart from other salts'.

        Raises:
            engine.errors.RequestError: invalid prompt or parameters, or a request id in use (before any
                output, nothing allocated; ``param`` and ``code`` say what the API reports).
            EngineOverloadedError: ``max_pending`` requests are already in flight.
            RuntimeError: the engine thread is not running.
        """
        if self._closing is not None:
            raise RuntimeError(self._closing)
        if not self.is_running:
            raise RuntimeError("the engine is not running")
        rid = request_id or uuid.uuid4().hex
        # input processing (rendering, tokenizing, validation) runs in a worker thread, never on the stepping
        # thread, so a huge prompt stalls neither the engine nor other streams; one worker, so requests reach
        # the queue in the order they were submitted (first come, first served, as in vLLM)
        loop = asyncio.get_running_loop()
        req = await loop.run_in_executor(self._inputs, self.core.input_processor.process, rid, prompt, params,
                                         cache_salt)
        q: asyncio.Queue = asyncio.Queue()
        children = child_ids(req)
        with self._lock:
            if rid in self._streams or any(c in self._in_core for c in (rid, *children)):  # in use, or being aborted
                raise RequestError(f"request id {rid!r} is already in use")
            if self.max_pending is not None and len(self._streams) >= self.max_pending:
                raise EngineOverloadedError(
                    f"the engine is busy ({len(self._streams)} requests in flight, limit {self.max_pending}); retry later"
                )
            self._streams[rid] = (loop, q)
            self._in_core.add(rid)
            if req.pending_forks:  # n > 1: the core reports each child; _deliver_all merges them
                parent = ParentRequest(req)
                for key in (rid, *children):
                    self._parents[key] = parent
                self._in_core.update(children)
            self.core.enqueue(req)  # under the lock: :meth:`reconfigure` never swaps the core in between
        finished = False
        try:
            self._wake.set()
            while True:
                out: RequestOutput = await q.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Abort a request (all its children when n > 1); its blocks go back within one step (at once
        while paused or between slow steps). Unknown ids are ignored."""
        parent = self._parents.get(request_id)
        for rid in parent.children if parent is not None and request_id == parent.request_id else [request_id]:
            self.core.abort_request(rid)
        self._wake.set()
        self._pace.set()

    def on_finished(self, listener: Callable[[FinishedRequestStats], None]) -> list[FinishedRequestStats]:
        """Call ``listener(record)`` with every request record finished from now on in this engine (on the engine
        thread: keep it cheap), across :meth:`reconfigure` (the new core's telemetry calls it too), and return
        the records the current telemetry kept so far; together they hold each record exactly once."""
        with self._lock:
            self._finish_listeners.append(listener)
            return self.core.telemetry.on_finished(listener)

    def reconfigure(self, **changes) -> EngineConfig:
        """Go on with a fresh core whose settings are this one's with ``changes`` applied (e.g. the talk
        preset: ``max_num_seqs=4, num_blocks=96, free_block_order="mru"``), on the same loaded model and
        tokenizer (nothing is loaded again; the new KV pool and packed weights are built while the old core
        still serves). Every request in flight or queued ends with an error ("the engine was restarted with
        new settings") and its stream closes; the telemetry, step count and pacing start afresh, so anything
        holding ``engine.telemetry`` must read it again (listeners of :meth:`on_finished` are carried over;
        cumulative counters of the old telemetry are the holder's to keep). The context length is the model's, capped by the new
        pool, unless ``changes`` gives ``max_model_len``. Call it from any thread except the stepping thread.

        Returns:
            the new configuration.

        Raises:
            TypeError: an unknown setting. ValueError: an invalid value (the old core goes on untouched).
        """
        old = self.core
        cfg = dataclasses.replace(old.config, **{"max_model_len": None, **changes})
        core = EngineCore(cfg, model=old.model, tokenizer=old.tokenizer)
        running = self.is_running
        self._stop.set()
        self._wake.set()
        self._pace.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:  # no generate() enqueues in between: its request goes to the new core
            outputs = old.process_inbox() + old.fail_all("the engine was restarted with new settings")
            for listener in self._finish_listeners:
                core.telemetry.on_finished(listener)
            self.core, self.pacing = core, core.pacing
        self._deliver_all(outputs)
        if running:
            self.start()
        log.info("engine reconfigured: %s", ", ".join(f"{k}={v}" for k, v in changes.items()))
        return cfg

    async def generate_text(self, prompt, params: SamplingParams | None = None, **kw) -> RequestOutput:
        """Run a request to the end and return its final output."""
        last = None
        async for out in self.generate(prompt, params, **kw):
            last = out
        assert last is not None  # generate yields until the final output, or raises
        return last
