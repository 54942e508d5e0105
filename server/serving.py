"""Running an ASGI app with uvicorn as the playground does: its httptools protocol bound to the HTTP limits
of :mod:`server.http_edge`, on a socket bound before anything slow loaded (:mod:`server.address`), with the
playground's exit on Ctrl-C / SIGTERM (:func:`serve`), or in a background thread (:class:`ServerThread`: tests,
notebooks). It imports neither the engine nor torch: remote mode serves its page through it too.
"""

from __future__ import annotations

import gc
import socket
import threading
import time
from collections.abc import Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI

from server.address import DEFAULT_HOST, bind
from server.http_edge import HTTPLimits, protocol_class


class _Server(uvicorn.Server):
    """uvicorn's server, with the playground's exit. At the first Ctrl-C / SIGTERM ``on_exit`` runs (the engine
    ends every request with an error, so each API stream sends its error event and ``[DONE]``, each page chat
    its final status), and uvicorn's own shutdown starts :data:`EXIT_GRACE_S` later, so those last events go
    out on the open connections before uvicorn stops accepting and closes them; a second Ctrl-C exits at once.
    The signal is not raised again afterwards (uvicorn does that to mimic the default handler, which turns a
    Ctrl-C into a ``KeyboardInterrupt`` traceback)."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.on_exit = on_exit
        self._exiting = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._exiting or self.on_exit is None:
            super().handle_exit(sig, frame)
            self._captured_signals.clear()
            return
        self._exiting = True
        self.on_exit()
        timer = threading.Timer(EXIT_GRACE_S, self._begin_shutdown, args=(sig,))
        timer.daemon = True
        timer.start()

    def _begin_shutdown(self, sig: int) -> None:
        if not self.should_exit:
            super().handle_exit(sig, None)
            self._captured_signals.clear()


EXIT_GRACE_S = 0.5  # seconds between the engine ending its streams and uvicorn closing the connections


def uvicorn_config(app, host: str, port: int, log_level: str, limits: HTTPLimits | None = None,
                   timeout_graceful_shutdown: int = 2) -> uvicorn.Config:
    """uvicorn's configuration for ``app``: its httptools protocol bound to ``limits`` (None: ``app.state.http_limits``,
    else the defaults; :mod:`server.http_edge`) and their keep-alive timeout."""
    if limits is None:
        state = getattr(app, "state", None)
        limits = getattr(state, "http_limits", None) or HTTPLimits()
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol_class(limits),
                          timeout_keep_alive=limits.timeout_keep_alive,
                          timeout_graceful_shutdown=timeout_graceful_shutdown)


def serve(app: FastAPI, host: str | None = None, port: int | None = None, log_level: str = "info",
          sock: socket.socket | None = None, on_exit: Callable[[], None] | None = None,
          banner: str = "(UI at /, OpenAI API at /v1, metrics at /metrics)", limits: HTTPLimits | None = None) -> None:
    """Run ``app`` with uvicorn until interrupted (Ctrl-C or SIGTERM), then return, with the HTTP limits of
    :func:`uvicorn_config` (``limits``, else ``app.state.http_limits``). Address: ``sock`` (bound by
    :func:`server.address.bind` before the engine loaded) or :func:`server.address.resolve_address`.
    ``on_exit`` runs (in the signal handler) at the first Ctrl-C / SIGTERM, before the connections close: the
    app ends its streams there. ``banner`` follows the address on the "Running on" line. The objects alive at
    the call are frozen out of the cyclic garbage collector (``gc.freeze``)."""
    if sock is None:
        sock = bind(host, port)
    host, port = sock.getsockname()[:2]
    # What is alive now (model, engine, page: about 500,000 objects for the playground) lives as long as
    # the process: collect the start's garbage, then freeze the rest out of the cyclic collector's sight,
    # so a full collection (server.memory.MemoryRelease after large bodies, or Python's own) takes
    # milliseconds instead of about 150 ms that would stall the event loop and the engine.
    gc.collect()
    gc.freeze()
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    print(f"* Running on http://{shown}:{port}  {banner}", flush=True)
    _Server(uvicorn_config(app, host, port, log_level, limits), on_exit).run(sockets=[sock])


class ServerThread:
    """``app`` served by uvicorn in a daemon thread (tests, notebooks); ``port=0`` picks a free port; the HTTP
    limits are ``limits``, else those of :func:`uvicorn_config`.

    Attributes:
        url: ``http://host:port`` once :meth:`start` returned.
    """

    def __init__(self, app: FastAPI, host: str = DEFAULT_HOST, port: int = 0, log_level: str = "warning",
                 limits: HTTPLimits | None = None) -> None:
        self.server = uvicorn.Server(uvicorn_config(app, host, port, log_level, limits, timeout_graceful_shutdown=2))
        self.host = host
        self.port = port
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    @property
    def url(self) -> str:
        """``http://host:port`` (the real port once started)."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        """Start and wait until the server accepts connections (raises ``RuntimeError`` after ``timeout``)."""
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the server to exit and wait for its thread."""
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
