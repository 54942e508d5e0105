"""Per-tab chat over any backend: one :class:`ui.reply.ReplyStream` per tab, fed by one task, drawn at poll time.

Both pages use these handlers: the local playground on the process's ``AsyncEngine``
(:class:`ui.engine_backend.EngineBackend`) and remote mode on an OpenAI-compatible server
(:class:`ui.remote.backend.RemoteBackend`). Send (:meth:`ChatHandlers.start`) checks the settings, starts
the reply's task and returns at once; the task reads the backend's updates into the tab's ``ReplyStream``
(:meth:`ChatHandlers._feed`), the only writer of that state. The tab's polls (``GET /cbp/live``,
:mod:`ui.live`) read it (:meth:`ChatHandlers.live_reply`: status line and text), and once it has ended the
page's hidden commit button writes the turn into the tab's ``gr.Chatbot`` (:meth:`ChatHandlers.commit`).
The ``/chat`` API (``gradio_client``) streams the same state as one event (:meth:`ChatHandlers.respond_api`).

Stop ends the reply as stopped and cancels its task, which leaves the backend's stream: the engine aborts
the request (its KV blocks return at its next step, at once while paused) or the HTTP stream is closed (the
server aborts it). Clear does the same and drops the turn: nothing of it is written back. A failed or
stopped turn is marked in its status line and never sent to a model again (:func:`ui.reply.to_messages`).
One reply at a time per tab: a message sent while a reply streams is refused with a warning (the Send button
is disabled meanwhile), so a double click never starts a hidden second request.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any

import gradio as gr

from ui.i18n import language, state_text
from ui.reply import FAILED, FINISHED, STOPPED, ChatSettings, ReplyBackend, ReplyStream, to_messages


def session_of(request: gr.Request | None) -> str:
    """The Gradio session (browser tab) of a request; ``"anonymous"`` when there is none."""
    return getattr(request, "session_hash", None) or "anonymous"


def lang_of(request: Any) -> str:
    """The language (``"en"``/``"ko"``) of a Gradio event's request, from its Accept-Language."""
    headers = getattr(request, "headers", None) or {}
    return language(headers.get("accept-language"))


def _cancel(task: asyncio.Task | None) -> None:
    """Cancel ``task`` from any thread (Gradio may run a handler in a worker thread)."""
    if task is None or task.done():
        return
    loop = task.get_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    with contextlib.suppress(RuntimeError):  # its loop has closed: nothing left to cancel
        if running is loop:
            task.cancel()
        else:
            loop.call_soon_threadsafe(task.cancel)


class ChatHandlers:
    """The Gradio handlers of a chat column, bound to one backend.

    Args:
        backend: where replies come from (:class:`ui.reply.ReplyBackend`).
        describe: ``(request id, lang) -> colour name`` of the request in the panels (None until drawn).
        poll_s: how often the ``/chat`` API's stream redraws the status line without a new update (the pause,
            the colour once drawn) (seconds).

    Attributes:
        replies: session -> the tab's reply while it streams, and once ended until committed.
    """

    def __init__(self, backend: ReplyBackend, describe: Callable[[str, str], str | None] | None = None,
                 poll_s: float = 0.25) -> None:
        self.backend = backend
        self.describe = describe
        self.poll_s = poll_s
        self.replies: dict[str, ReplyStream] = {}
        self._latest: dict[str, str] = {}  # session -> its latest request id (outlined in the panels)

    # ------------------------------------------------------------------ the reply's state
    def busy(self, session: str) -> bool:
        """Whether ``session`` streams a reply now."""
        stream = self.replies.get(session)
        return stream is not None and not stream.ended

    def title(self, stream: ReplyStream, lang: str) -> str:
        """The status line: the state, then the request id and its colour once drawn (readable on a projector)."""
        color = self.describe(stream.request_id, lang) if self.describe is not None else None
        mine = state_text(lang, "mine", rid=stream.request_id, color=color) if color else stream.request_id
        return f"{stream.status(lang, self.backend.paused)} · {mine}"

    def shown(self, stream: ReplyStream, lang: str) -> list[dict]:
        """The tab's conversation with this turn as it stands (a new list: Gradio diffs old and new values)."""
        return [*stream.history, *stream.messages(self.title(stream, lang))]

    def _begin(self, request: Any, message: str | None, history: list | None,
               settings: dict[str, Any]) -> ReplyStream | None:
        """Start a reply for ``session``: None when nothing starts (an empty message; a reply already
        streaming, with a warning). Raises ``gr.Error`` for settings the backend refuses (no traceback)."""
        message, session = (message or "").strip(), session_of(request)
        if not message:
            return None
        if self.busy(session):  # checked and claimed with no await in between: one reply per tab
            gr.Warning(state_text(lang_of(request), "busy"))
            return None
        try:
            chat_settings = ChatSettings.from_controls(**settings)
            self.backend.check(chat_settings)
        except (TypeError, ValueError) as exc:
            raise gr.Error(str(exc), print_exception=False) from exc  # a refused value: no traceback in the log
        ended = self.replies.get(session)
        if ended is not None:  # the last turn ended but the page has not written it into the chat yet (a message
            # sent within the poll's interval): the chat holds its user message bare; take the turn as the
            # commit would have written it, status line included, so a stopped or failed turn is marked (shown,
            # and dropped from what the model is sent)
            history = self.shown(ended, lang_of(request))
        stream = ReplyStream(f"chat-{uuid.uuid4().hex[:8]}", message, list(history or []))
        messages = [*to_messages(history), {"role": "user", "content": message}]
        stream.task = asyncio.get_running_loop().create_task(self._feed(stream, messages, chat_settings))
        self.replies[session] = stream
        self._latest[session] = stream.request_id
        return stream

    async def _feed(self, stream: ReplyStream, messages: list[dict[str, str]], settings: ChatSettings) -> None:
        """The reply's one task: the backend's updates into ``stream``. Cancelled (Stop, Clear, a closed tab):
        the backend's stream is closed, which aborts the request."""
        try:
            updates = self.backend.stream(messages, settings, stream.request_id)
            async with contextlib.aclosing(updates) as items:  # type: ignore[type-var]
                async for update in items:
                    stream.apply(update)
                    if stream.ended:
                        break
            stream.end(FINISHED, "stop")  # a stream that ended without a last update
        except asyncio.CancelledError:
            stream.end(STOPPED, "abort")
            raise
        except Exception as exc:  # noqa: BLE001 -- whatever failed, the reply ends, marked failed
            stream.end(FAILED, "error", f"The reply failed unexpectedly. ({type(exc).__name__}: {exc})")

    # ------------------------------------------------------------------ the page: Send, polls, commit
    async def start(self, message: str, history: list[dict] | None, request: gr.Request,
                    **settings: Any) -> tuple:
        """Send: start a reply and return at once ``(chatbot, textbox, request id)``: the conversation with the
        user's message, an empty textbox. Refused messages (empty, a reply already streaming) change nothing
        (``gr.skip()`` each); settings the backend refuses raise ``gr.Error``. ``settings``: the controls by
        name (:data:`ui.reply.CONTROL_NAMES`)."""
        stream = self._begin(request, message, history, settings)
        if stream is None:
            return gr.skip(), gr.skip(), gr.skip()
        return [*stream.history, {"role": "user", "content": stream.message}], "", stream.request_id

    def live_reply(self, session: str, lang: str = "en") -> dict | None:
        """The tab's reply for its poll: ``{rid, state, title, text, final}`` (the status line, the text so far
        with the error of a failed reply, whether it has ended), or None when the tab streams nothing."""
        stream = self.replies.get(session)
        if stream is None:
            return None
        return {"rid": stream.request_id, "state": stream.state, "title": self.title(stream, lang),
                "text": stream.shown_text(), "final": stream.ended}

    def commit(self, request: gr.Request) -> tuple:
        """Write the tab's ended reply into its chatbot: ``(chatbot, send button update)``; nothing changes
        while the reply streams, or when there is none (after Clear)."""
        session = session_of(request)
        stream = self.replies.get(session)
        if stream is None or not stream.ended:
            return gr.skip(), gr.update(interactive=not self.busy(session))
        del self.replies[session]
        return self.shown(stream, lang_of(request)), gr.update(interactive=True)

    def unlock_send(self, request: gr.Request) -> Any:
        """The Send button's state after Send: enabled unless the tab streams a reply."""
        return gr.update(interactive=not self.busy(session_of(request)))

    # ------------------------------------------------------------------ the /chat API: one streaming event
    async def respond_api(self, message: str, history: list[dict] | None, request: gr.Request,
                          **settings: Any) -> AsyncGenerator[tuple, None]:
        """The ``/chat`` API (``gradio_client``): yields ``(chatbot, textbox)`` as the reply changes (the first
        clears the textbox, later ones leave it alone), the last once it has ended. A client that goes away
        or cancels stops the reply."""
        session = session_of(request)
        stream = self._begin(request, message, history, settings)
        if stream is None:
            yield gr.skip(), gr.skip()
            return
        lang, box = lang_of(request), ""
        try:
            while True:
                ended = stream.ended
                stream.changed.clear()
                yield self.shown(stream, lang), box
                box = gr.skip()
                if ended:
                    return
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.poll_s):  # (redraws the status line for the pause)
                        await stream.changed.wait()
        finally:
            if not stream.ended:
                self._stop(stream)
            if self.replies.get(session) is stream:
                del self.replies[session]
            if stream.task is not None:  # its backend stream closed (the request aborted) before this returns
                await asyncio.wait([stream.task])

    # ------------------------------------------------------------------ Stop, Clear, closed tabs
    def _stop(self, stream: ReplyStream) -> None:
        stream.end(STOPPED, "abort")
        _cancel(stream.task)

    def abort_session(self, session: str) -> None:
        """Stop the reply ``session`` streams (a closed tab, Stop): it ends as stopped, its task is cancelled
        and the backend aborts the request."""
        stream = self.replies.get(session)
        if stream is not None and not stream.ended:
            self._stop(stream)

    async def stop(self, request: gr.Request) -> None:
        """Stop the calling tab's reply; its status line says "stopped" and the turn is kept, marked stopped."""
        self.abort_session(session_of(request))

    async def clear(self, request: gr.Request) -> tuple:
        """Stop the calling tab's reply and empty its chat: ``(chatbot, textbox, send button update)``; the
        turn is dropped, so no later write brings it back."""
        self.forget(session_of(request))
        return [], "", gr.update(interactive=True)

    def forget(self, session: str) -> None:
        """Stop and drop what is kept for ``session`` (Clear, a closed tab): its reply and latest request id."""
        self.abort_session(session)
        self.replies.pop(session, None)
        self._latest.pop(session, None)

    def latest_request(self, session: str) -> str | None:
        """The session's latest request id (streaming or ended), None after Clear or before any."""
        return self._latest.get(session)


def settings_inputs(temperature: Any, top_p: Any, max_new_tokens: Any, seed: Any = None) -> dict[str, Any]:
    """The sampling controls as Gradio ``inputs_kwargs`` (by name: no positional order to keep in step);
    a page without a seed control passes None."""
    named = {"temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens, "seed": seed}
    return {k: v for k, v in named.items() if v is not None}
