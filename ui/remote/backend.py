"""Remote mode's chat backend (:class:`ui.reply.ReplyBackend` over :class:`ui.remote.client.RemoteClient`) and
what the page knows of the server: whether it answers and which model it serves (:class:`BackendState`).

The state follows the server: every chat says whether it got through, and :meth:`RemoteBackend.probe` asks
``GET /v1/models`` (at start, then every few seconds from the page's refresh, more often while the server is
down or its model unknown). The header, the notice and the model name sent are drawn from it, so a server
that comes up after the page started is seen as up, in every tab, without a restart.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ui.remote.client import RemoteClient
from ui.remote.errors import RemoteError
from ui.reply import DECODING, ChatSettings, ReplyUpdate


@dataclass
class BackendState:
    """What the page knows of the server now.

    Attributes:
        reachable: it answered the latest probe or chat (None: not asked yet).
        error: the latest failure, a sentence first (None while it answers).
        since: when ``reachable`` last changed (``time.time()`` seconds).
        checked: when it was last probed (``time.monotonic()`` seconds; 0: never).
    """

    reachable: bool | None = None
    error: str | None = None
    since: float = 0.0
    checked: float = 0.0


class RemoteBackend:
    """Chats sent to a remote OpenAI-compatible server; also tracks whether it answers.

    Args:
        client: the chat client (its ``model`` is filled from ``/v1/models`` when not given).
        up_probe_s, down_probe_s: seconds between two probes while the server answers (and its model is known),
            and while it does not.
    """

    paused = False  # nobody here can pause a remote engine

    def __init__(self, client: RemoteClient, up_probe_s: float = 10.0, down_probe_s: float = 2.0) -> None:
        self.client = client
        self.pinned_model = client.model  # --backend-model: sent as given, whatever /v1/models lists
        self.state = BackendState()
        self.up_probe_s, self.down_probe_s = up_probe_s, down_probe_s

    # ------------------------------------------------------------------ the server's state
    def _mark(self, reachable: bool, error: str | None = None) -> None:
        if reachable != self.state.reachable:
            self.state.since = time.time()
        self.state.reachable, self.state.error = reachable, error

    def note_error(self, exc: RemoteError) -> None:
        """A chat failed: a server that could not be reached is marked down (a refusal means it is up)."""
        self._mark(not exc.unreachable, str(exc) if exc.unreachable else None)

    async def probe(self, timeout: float = 5.0) -> BackendState:
        """Ask ``GET /v1/models`` now: the server's state, and the model name to send when none was pinned."""
        self.state.checked = time.monotonic()
        try:
            models = await self.client.list_models(timeout=timeout)
        except RemoteError as exc:
            self._mark(not exc.unreachable, str(exc))
            return self.state
        if not self.pinned_model:
            self.client.model = models[0]
        self._mark(True)
        return self.state

    def probe_due(self, now: float | None = None) -> bool:
        """Whether a probe is due: at most every ``up_probe_s`` seconds while the server answers and its model
        is known, every ``down_probe_s`` seconds otherwise."""
        now = time.monotonic() if now is None else now
        up = self.state.reachable and self.client.model
        return now - self.state.checked >= (self.up_probe_s if up else self.down_probe_s)

    # ------------------------------------------------------------------ ReplyBackend
    def check(self, settings: ChatSettings) -> None:
        """Raise ``ValueError`` for settings no OpenAI-compatible server takes (the server checks the rest)."""
        if not settings.temperature >= 0:
            raise ValueError(f"temperature must be at least 0, not {settings.temperature}")
        if not 0 < settings.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {settings.top_p}")
        if settings.max_tokens < 1:
            raise ValueError(f"max new tokens must be at least 1, not {settings.max_tokens}")

    async def stream(self, messages: list[dict[str, str]], settings: ChatSettings,
                     request_id: str) -> AsyncIterator[ReplyUpdate]:
        """One chat's text as updates (tokens: the text chunks received, the server's count at the end when it
        sends usage); a failure is one last update whose error starts with what probably happened. Leaving
        early closes the HTTP stream: the server aborts the request."""
        text, chunks = "", 0
        try:
            async for delta in self.client.stream_chat(messages, max_tokens=settings.max_tokens,
                                                       temperature=settings.temperature, top_p=settings.top_p,
                                                       seed=settings.seed, request_id=request_id):
                if chunks == 0:
                    self._mark(True)
                text, chunks = text + delta, chunks + 1
                yield ReplyUpdate(text=text, tokens=chunks, state=DECODING)
        except RemoteError as exc:
            self.note_error(exc)
            yield ReplyUpdate(finish_reason="error", error=str(exc))
            return
        self._mark(True)
        rec = self.client.log.get(request_id)
        tokens = rec.completion_tokens if rec is not None and rec.completion_tokens is not None else chunks
        yield ReplyUpdate(text=text, tokens=tokens, finish_reason=(rec.finish_reason if rec else None) or "stop")
