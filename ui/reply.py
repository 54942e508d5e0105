"""One reply model for both pages (the local engine's and remote mode's): a chat turn is plain state.

A :class:`ReplyStream` holds one turn: the user's message, the conversation shown before it, and what is
known of the reply (request id, state, tokens, text, finish reason, error). One task (see
:class:`ui.chat.ChatHandlers`) reads the backend's stream of :class:`ReplyUpdate` and applies each with
:meth:`ReplyStream.apply`; nothing else writes the reply. The page draws from that state: the status line
and the text when the tab polls, the turn's ``gr.Chatbot`` messages once it has ended
(:meth:`ReplyStream.messages`). A backend (:class:`ReplyBackend`) is the local ``AsyncEngine``
(:mod:`ui.engine_backend`) or a remote OpenAI-compatible server (:mod:`ui.remote.backend`).

Failed turns (refused at admission, an HTTP error, a dropped stream, an engine fault) and stopped ones are
marked in their status line (``metadata.id`` :data:`FAILED_ID` / :data:`STOPPED_ID`) and
:func:`to_messages` drops them whole: their user message, partial text and error never reach a model again.
Sampling settings travel as one :class:`ChatSettings`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from ui.i18n import state_text

SENT, QUEUED, PREFILLING, DECODING = "sent", "queued", "prefilling", "decoding"
FINISHED, STOPPED, FAILED = "finished", "stopped", "failed"
ENDED = frozenset({FINISHED, STOPPED, FAILED})
FAILED_ID, STOPPED_ID = "cbp-failed", "cbp-stopped"  # status-line ids of the turns never sent to a model again
DROPPED_IDS = frozenset({FAILED_ID, STOPPED_ID})


@dataclass(frozen=True)
class ChatSettings:
    """A chat's sampling settings, as one object from the page's controls to the backend.

    Attributes:
        temperature: sampling temperature (0: greedy).
        top_p: nucleus sampling mass, in (0, 1].
        max_tokens: most new tokens of the reply.
        seed: sampling seed; None: unseeded.
    """

    temperature: float = 0.7
    top_p: float = 0.9
    max_tokens: int = 256
    seed: int | None = None

    @classmethod
    def from_controls(cls, temperature: float = 0.7, top_p: float = 0.9, max_new_tokens: float = 256,
                      seed: float | str | None = None) -> ChatSettings:
        """The settings from the page's controls (by name, see :data:`CONTROL_NAMES`); a negative or empty
        seed means unseeded. Ranges are the backend's to check (:meth:`ReplyBackend.check`).

        Raises:
            TypeError, ValueError: a value that is not a number.
        """
        seed_i = None if seed is None or seed == "" or int(seed) < 0 else int(seed)
        return cls(float(temperature), float(top_p), int(max_new_tokens), seed_i)


CONTROL_NAMES = ("temperature", "top_p", "max_new_tokens", "seed")  # the controls' names (Gradio inputs_kwargs)


@dataclass
class ReplyUpdate:
    """What one event of a backend's stream says of a reply. None: unchanged.

    Attributes:
        text: the whole reply text so far.
        tokens: tokens generated so far.
        state: ``"queued"``, ``"prefilling"`` or ``"decoding"`` (where the request stands).
        where: queued: ``position`` and ``waiting``; prefilling: ``computed`` and ``prompt`` (tokens).
        preempted: the request has been preempted (its state "queued" then means queued again).
        finish_reason: set on the stream's last update: ``"stop"``, ``"length"``, ``"abort"`` or ``"error"``.
        error: why it failed (a plain sentence first, the technical text after it).
    """

    text: str | None = None
    tokens: int | None = None
    state: str | None = None
    where: dict[str, int] | None = None
    preempted: bool = False
    finish_reason: str | None = None
    error: str | None = None


class ReplyBackend(Protocol):
    """What a page needs of the model behind it (the local engine or a remote server)."""

    @property
    def paused(self) -> bool:
        """The engine is held by the presenter (the status line says so); False where nobody can pause it."""
        ...

    def check(self, settings: ChatSettings) -> None:
        """Raise ``ValueError`` (a sentence naming the setting) for settings this backend refuses."""
        ...

    def stream(self, messages: list[dict[str, str]], settings: ChatSettings,
               request_id: str) -> AsyncIterator[ReplyUpdate]:
        """Send one chat and yield its updates, the last with a ``finish_reason``; a refusal or a failure is
        a last update with ``error`` (not an exception). Leaving the iteration aborts the request."""
        ...


@dataclass
class ReplyStream:
    """One chat turn as plain state, written only by its feeding task (:meth:`apply`, :meth:`end`).

    Attributes:
        request_id: the request's id (``chat-…``), as the engine or the server knows it.
        message: the user's message.
        history: the tab's conversation before this turn (``gr.Chatbot`` messages).
        state: ``sent``, ``queued``, ``prefilling``, ``decoding``, then ``finished``, ``stopped`` or ``failed``.
        tokens: tokens generated so far.
        text: the reply text so far.
        finish_reason: the backend's (``stop``, ``length``...) once finished.
        error: why it failed.
        where: the latest position in the queue or prefill progress (see :class:`ReplyUpdate`).
        started: it has held a batch slot (queued again means preempted).
        changed: set at every change (the ``/chat`` API's stream waits on it).
    """

    request_id: str
    message: str
    history: list[dict] = field(default_factory=list)
    state: str = SENT
    tokens: int = 0
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    where: dict[str, int] = field(default_factory=dict)
    started: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    task: asyncio.Task | None = field(default=None, repr=False)

    @property
    def ended(self) -> bool:
        """Finished, stopped or failed: nothing changes it any more."""
        return self.state in ENDED

    def apply(self, update: ReplyUpdate) -> None:
        """Apply one update of the backend's stream (ignored once the reply has ended: a token that arrives
        after Stop changes nothing)."""
        if self.ended:
            return
        if update.text is not None:
            self.text = update.text
        if update.tokens is not None:
            self.tokens = update.tokens
        if update.state is not None:
            self.state = update.state
            self.where = dict(update.where or {})
        self.started = self.started or update.preempted or self.state in (PREFILLING, DECODING)
        if update.finish_reason is not None:
            reason = update.finish_reason
            state = FAILED if update.error or reason == "error" else STOPPED if reason == "abort" else FINISHED
            self.end(state, reason, update.error)
        self.changed.set()

    def end(self, state: str, finish_reason: str | None = None, error: str | None = None) -> None:
        """End the reply as ``state`` (``finished``, ``stopped`` or ``failed``) unless it has ended already."""
        if self.ended:
            return
        self.state, self.finish_reason = state, finish_reason
        if error:
            self.error = error
        self.changed.set()

    def status(self, lang: str, paused: bool = False) -> str:
        """The status line's state part in ``lang``: sent, queued (n of m) or preempted, prefilling (n of m
        prompt tokens), decoding (n tokens), finished (n tokens, reason), stopped or failed; with "engine
        paused" appended while the engine is held and the reply goes on."""
        kind, w = self.state, self.where
        if kind == QUEUED:
            text = state_text(lang, "preempted" if self.tokens or self.started else "queued",
                              position=w.get("position", "?"), waiting=w.get("waiting", "?"))
        elif kind == PREFILLING:
            text = state_text(lang, "prefilling", computed=w.get("computed", "?"), prompt=w.get("prompt", "?"))
        elif kind == DECODING:
            text = state_text(lang, "decoding", tokens=self.tokens)
        elif kind == FINISHED:
            text = state_text(lang, "finished", tokens=self.tokens, reason=self.finish_reason or "stop")
        elif kind in (STOPPED, FAILED):
            text = state_text(lang, kind, tokens=self.tokens)
        else:
            text = state_text(lang, "sent")
        if paused and not self.ended:
            text += state_text(lang, "paused")
        return text

    def shown_text(self) -> str:
        """The reply as shown: its text, then the error (a failed reply) after a warning sign."""
        if not self.error:
            return self.text
        return f"{self.text}\n\n⚠️ {self.error}" if self.text else f"⚠️ {self.error}"

    def messages(self, title: str) -> list[dict[str, Any]]:
        """The turn as ``gr.Chatbot`` messages: the user's message, the status line (``title``; a failed or
        stopped turn's carries :data:`FAILED_ID` / :data:`STOPPED_ID`), and the reply when it has text."""
        meta: dict[str, str] = {"title": title, "status": "done" if self.ended else "pending"}
        if self.state == FAILED:
            meta["id"] = FAILED_ID
        elif self.state == STOPPED:
            meta["id"] = STOPPED_ID
        out: list[dict[str, Any]] = [{"role": "user", "content": self.message},
                                     {"role": "assistant", "content": "", "metadata": meta}]
        body = self.shown_text()
        if body:
            out.append({"role": "assistant", "content": body})
        return out


# ---------------------------------------------------------------------------------------------- Chatbot values
def message_text(content: Any) -> str:
    """Plain text of a Chatbot message content (a string, a ``{"type": "text"}`` dict or a list of them)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text") or "") if content.get("type", "text") == "text" else ""
    if isinstance(content, (list, tuple)):
        return "\n".join(t for t in (message_text(c) for c in content) if t)
    return str(content)


def _field(m: Any, name: str) -> Any:
    return m.get(name) if isinstance(m, dict) else getattr(m, name, None)


def is_status(message: Any) -> bool:
    """True for a status line (a Chatbot message with ``metadata.title``): shown, never sent to the model."""
    meta = _field(message, "metadata")
    return bool(meta and meta.get("title"))


def to_messages(history: list | None) -> list[dict[str, str]]:
    """Chat-template messages (``{"role", "content"}`` with string content) from a Chatbot value.

    Status lines are dropped, and so is every failed or stopped turn (a status line whose ``metadata.id``
    is :data:`FAILED_ID` or :data:`STOPPED_ID`: the user message before it and everything after it up to
    the next user message), so a refused prompt, an error text or a cut-off reply never goes to a model.
    Empty assistant messages are dropped.
    """
    out: list[dict[str, str]] = []
    skipping = False  # inside a dropped turn: its reply and error text
    for m in history or []:
        role = _field(m, "role")
        if is_status(m):
            if (_field(m, "metadata") or {}).get("id") in DROPPED_IDS:
                if out and out[-1]["role"] == "user":
                    out.pop()
                skipping = True
            continue
        if role == "user":
            skipping = False
        text = message_text(_field(m, "content"))
        if not skipping and role in ("user", "assistant", "system") and (text or role == "user"):
            out.append({"role": role, "content": text})
    return out
