"""Per-session chat: stream a reply from ``engine.generate`` into the tab's Chatbot, Stop aborts it.

Each browser tab (Gradio session) keeps its own conversation in its own ``gr.Chatbot`` value; the engine
renders it with the model's chat template. :meth:`ChatHandlers.respond` is an async generator over the
engine's stream. The page runs it in a background task (:meth:`ChatHandlers.start`): the tab reads the
reply through its polls (:meth:`ChatHandlers.live_reply`, :mod:`ui.live`) and :meth:`ChatHandlers.commit`
writes the ended turn into the chatbot, so no event holds a connection while a reply streams. The ``/chat``
API streams it as one event (:meth:`ChatHandlers.respond_api`). Leaving the stream (Stop, Clear, a closed
tab, a cancelled task) aborts the request in the engine, which frees its KV blocks at its next step (at
once while the engine is paused).

Every reply has a status line of its own (a Chatbot "thought" message above the reply, ``metadata.title``)
that says where the request is, from the state each of its outputs carries (``RequestOutput.state``: the
engine sends an output when only that changed), redrawn a few times a second for the pause: sent, queued
(position in the waiting queue), prefilling (n of m prompt tokens), decoding, preempted, finished or
stopped, with "engine paused" while the presenter holds the engine; it also names the request and its
colour in the panels. One reply at a time per tab: a message sent while a reply streams is refused with a
warning (the Send button is disabled meanwhile), so a double click never starts a hidden second request.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import defaultdict
from collections.abc import AsyncGenerator, Callable
from typing import Any, cast

import gradio as gr

from engine import AsyncEngine, EngineOverloadedError, RequestOutput, RequestState, SamplingParams
from ui.i18n import language, state_text


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


FAILED_ID = "cbp-failed"  # metadata id of the status line of a failed turn


def _meta(m: Any) -> dict:
    return (m.get("metadata") if isinstance(m, dict) else getattr(m, "metadata", None)) or {}


def to_messages(history: list[dict] | None) -> list[dict[str, str]]:
    """Chat-template messages (``{"role", "content"}`` with string content) from a Chatbot value.

    Status lines are dropped, and so is every failed turn (a status line with ``metadata.id`` equal to
    :data:`FAILED_ID`: the user message before it and the error shown after it), so a refused prompt never
    goes to the model again. Empty assistant messages (a reply stopped before its first token) are dropped.
    """
    out: list[dict[str, str]] = []
    skipping = False  # inside a failed turn: drop its reply (the error text)
    for m in history or []:
        role = m.get("role") if isinstance(m, dict) else getattr(m, "role", None)
        content = m.get("content") if isinstance(m, dict) else getattr(m, "content", None)
        text = message_text(content)
        if is_status(m):
            if _meta(m).get("id") == FAILED_ID:
                if out and out[-1]["role"] == "user":
                    out.pop()
                skipping = True
            continue
        if role == "user":
            skipping = False
        if skipping:
            continue
        if role in ("user", "assistant", "system") and (text or role == "user"):
            out.append({"role": role, "content": text})
    return out


def sampling_params(temperature: float, top_p: float, max_new_tokens: float, seed: float | None) -> SamplingParams:
    """SamplingParams from the accordion's values; a negative or empty seed means unseeded.

    Raises:
        ValueError: when a value is out of range (from :meth:`SamplingParams.validate`).
    """
    seed_i = None if seed is None or seed == "" or int(seed) < 0 else int(seed)
    params = SamplingParams(temperature=float(temperature), top_p=float(top_p),
                            max_tokens=int(max_new_tokens), seed=seed_i)
    params.validate()
    return params


class ActiveRequests:
    """Which engine requests each Gradio session is streaming now, so Stop can abort them."""

    def __init__(self) -> None:
        self._by_session: dict[str, set[str]] = defaultdict(set)

    def add(self, session: str, request_id: str) -> None:
        """Record that ``session`` streams ``request_id``."""
        self._by_session[session].add(request_id)

    def discard(self, session: str, request_id: str) -> None:
        """Forget ``request_id`` (finished or aborted)."""
        ids = self._by_session.get(session)
        if ids is not None:
            ids.discard(request_id)
            if not ids:
                del self._by_session[session]

    def of(self, session: str) -> list[str]:
        """The request ids ``session`` streams now."""
        return sorted(self._by_session.get(session, ()))

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_session.values())


def session_of(request: gr.Request | None) -> str:
    """The Gradio session (browser tab) of a request; ``"anonymous"`` when there is none."""
    return getattr(request, "session_hash", None) or "anonymous"


def is_status(message: Any) -> bool:
    """True for a status line (a Chatbot message with ``metadata.title``): shown, never sent to the model."""
    meta = message.get("metadata") if isinstance(message, dict) else getattr(message, "metadata", None)
    return bool(meta and meta.get("title"))


def state_dict(state: RequestState | None) -> dict[str, Any] | None:
    """A :class:`engine.request.RequestState` (carried by each output) as :func:`status_text` takes it."""
    if state is None:
        return None
    return {"state": state.kind, "position": state.position, "waiting": state.waiting, "computed": state.computed,
            "prompt": state.prompt}


def status_text(lang: str, state: dict | None, tokens: int, paused: bool, started: bool = False) -> tuple[str, bool]:
    """The status line of a streaming reply and whether it is final.

    Args:
        lang: ``"en"`` or ``"ko"``.
        state: where the request stands, from its newest output (:func:`state_dict` of ``RequestOutput.state``;
            None: not seen by the engine yet), or ``{"state": "done" | "stopped" | "failed", "reason": str}`` from the stream's end.
        tokens: tokens generated so far; a queued request that already generated some was preempted.
        paused: the engine is paused (appends "engine paused" to a line that is not final).
        started: the request has held a batch slot before (queued again means preempted, even in prefill).
    """
    state = state or {}
    kind = state.get("state")
    final = kind in ("done", "stopped", "failed")
    if kind == "queued":
        key = "preempted" if tokens or started else "queued"
        text = state_text(lang, key, position=state.get("position", "?"), waiting=state.get("waiting", "?"))
    elif kind == "prefilling":
        text = state_text(lang, "prefilling", computed=state["computed"], prompt=state["prompt"])
    elif kind in ("decoding", "finished"):  # "finished" in the engine's last step; the stream ends next
        text = state_text(lang, "decoding", tokens=tokens)
    elif kind == "done":
        text = state_text(lang, "finished", tokens=tokens, reason=state.get("reason") or "stop")
    elif kind in ("stopped", "failed"):
        text = state_text(lang, kind, tokens=tokens)
    else:
        text = state_text(lang, "sent")
    if paused and not final:
        text += state_text(lang, "paused")
    return text, final


_END = object()  # put in a reply's queue when its engine stream has ended


class LiveReply:
    """A reply that the page streams through its polls (:mod:`ui.live`) rather than through an event.

    Attributes:
        request_id: the engine request.
        chatbot: the tab's conversation as it should show now: the history, the user message, the status
            line and the reply so far (the value :meth:`ChatHandlers.respond` yields).
        done: the reply has ended (finished, stopped or failed); :meth:`ChatHandlers.commit` then writes it
            into the tab's ``gr.Chatbot``.
    """

    def __init__(self, request_id: str, chatbot: list[dict]) -> None:
        self.request_id = request_id
        self.chatbot = chatbot
        self.done = False
        self.task: asyncio.Task | None = None


class ChatHandlers:
    """The Gradio handlers of the chat column, bound to one engine.

    Args:
        engine: the process's ``AsyncEngine`` (``generate`` and ``abort``; its outputs' ``state`` and
            ``paused`` for the status line).
        describe: ``(request id, lang) -> colour name`` of the request in the panels (None until drawn).
        poll_s: how often a waiting reply redraws its status line without a new output (the pause, the
            colour once drawn) (seconds).
    """

    def __init__(self, engine: AsyncEngine, describe: Callable[[str, str], str | None] | None = None,
                 poll_s: float = 0.25) -> None:
        self.engine = engine
        self.active = ActiveRequests()
        self.describe = describe
        self.poll_s = poll_s
        self._stopping: set[str] = set()  # Stop pressed: the reply ends with a "stopped" status line
        self._cleared: set[str] = set()  # Clear pressed: the reply ends without another update
        self.replies: dict[str, LiveReply] = {}  # session -> the reply the page streams through its polls
        self._latest: dict[str, str] = {}  # session -> its latest request id (outlined in the panels)

    def _status(self, lang: str, request_id: str, state: dict | None, tokens: int, started: bool = False) -> dict:
        """The status line message: state, then the request id and its colour (once drawn) in the title, so
        it stays readable on a projector; a failed turn's line carries ``metadata.id`` :data:`FAILED_ID`."""
        text, final = status_text(lang, state, tokens, self.engine.paused, started)
        color = self.describe(request_id, lang) if self.describe is not None else None
        mine = state_text(lang, "mine", rid=request_id, color=color) if color else request_id
        meta: dict[str, str] = {"title": f"{text} · {mine}", "status": "done" if final else "pending"}
        if (state or {}).get("state") == "failed":
            meta["id"] = FAILED_ID
        return {"role": "assistant", "content": "", "metadata": meta}

    async def respond(
        self,
        message: str,
        history: list[dict] | None,
        temperature: float,
        top_p: float,
        max_new_tokens: float,
        seed: float | None,
        request: gr.Request,
    ) -> AsyncGenerator[tuple, None]:
        """Stream the assistant's reply to ``message``: yields ``(chatbot value, textbox value, request id)``.

        The first yield shows the user's message and the reply's status line and clears the textbox; later
        ones leave the textbox alone (``gr.skip()``) so the user can type the next message while the reply
        streams. While this session already streams a reply, nothing starts: a warning says so and the
        message stays in the textbox.
        """
        message = (message or "").strip()
        session = session_of(request)
        headers = getattr(request, "headers", None) or {}
        lang = language(headers.get("accept-language"))
        if not message:
            yield (gr.skip(), gr.skip(), gr.skip())
            return
        if self.active.of(session):  # checked and claimed with no await in between: one reply per tab
            gr.Warning(state_text(lang, "busy"))
            yield (gr.skip(), gr.skip(), gr.skip())
            return
        request_id = f"chat-{uuid.uuid4().hex[:8]}"
        self.active.add(session, request_id)
        try:
            messages = to_messages(history) + [{"role": "user", "content": message}]
            try:
                params = sampling_params(temperature, top_p, max_new_tokens, seed)
            except (TypeError, ValueError) as exc:
                raise gr.Error(str(exc), print_exception=False) from exc  # a refused value: no traceback in the log
            async with contextlib.aclosing(self._stream(history, message, messages, params, request_id, lang)) as items:
                async for item in items:  # closed here, not when collected: its engine stream ends with this one
                    yield item
        finally:
            self.active.discard(session, request_id)
            self._stopping.discard(request_id)
            self._cleared.discard(request_id)

    async def respond_api(self, message: str, history: list[dict] | None, temperature: float, top_p: float,
                          max_new_tokens: float, seed: float | None, request: gr.Request) -> AsyncGenerator[tuple, None]:
        """:meth:`respond` for the ``/chat`` API (``gradio_client``): yields ``(chatbot value, textbox value)``."""
        async with contextlib.aclosing(self.respond(message, history, temperature, top_p, max_new_tokens, seed,
                                                    request)) as replies:
            async for chatbot, box, _request_id in replies:
                yield chatbot, box

    async def _stream(self, history: list[dict] | None, message: str, messages: list[dict[str, str]],
                      params: SamplingParams, request_id: str, lang: str) -> AsyncGenerator[tuple, None]:
        shown_before = [*(history or []), {"role": "user", "content": message}]

        def shown(status: dict, reply: str) -> list[dict]:  # a new list per yield: Gradio diffs old vs new
            return [*shown_before, status, *([{"role": "assistant", "content": reply}] if reply else [])]

        text, tokens, started = "", 0, False
        engine_state: dict[str, Any] | None = None  # where the request stands, from its newest output
        status = self._status(lang, request_id, None, 0)
        yield (shown(status, ""), "", request_id)
        queue: asyncio.Queue[object] = asyncio.Queue()  # RequestOutput, an exception or _END
        final: dict[str, Any] | None  # the reply's final state (as status_text takes it), once it has ended
        pump = asyncio.get_running_loop().create_task(self._pump(messages, params, request_id, queue))
        try:
            while True:
                try:  # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns an output that arrives in
                    # the same loop turn as a cancel and drops the cancel (the cancelled reply then ran to its end)
                    async with asyncio.timeout(self.poll_s):
                        out = await queue.get()
                except TimeoutError:
                    out = None
                if request_id in self._cleared:  # the tab was cleared: nothing more to show
                    return
                if request_id in self._stopping:
                    final = {"state": "stopped"}
                elif out is _END:
                    final = {"state": "done", "reason": None}
                elif isinstance(out, BaseException):
                    text = f"⏳ {out}" if isinstance(out, EngineOverloadedError) else f"⚠️ {out}"
                    final = {"state": "failed"}
                elif isinstance(out, RequestOutput):
                    text, tokens = out.text, len(out.token_ids)
                    engine_state = state_dict(out.state) or engine_state
                    if out.error:
                        text = f"{text}\n\n⚠️ {out.error}" if text else f"⚠️ {out.error}"
                    final = None
                    if out.finished:
                        reason = out.outputs[0].finish_reason if out.outputs else None
                        final = ({"state": "failed"} if out.error else
                                 {"state": "stopped"} if reason == "abort" else
                                 {"state": "done", "reason": reason})
                else:
                    final = None
                state = final or engine_state
                started = started or (state or {}).get("state") in ("prefilling", "decoding") or bool(
                    out is not None and isinstance(out, RequestOutput) and out.state and out.state.preempted)
                new_status = self._status(lang, request_id, state, tokens, started)
                if out is not None or final is not None or new_status != status:
                    status = new_status
                    yield (shown(status, text), gr.skip(), gr.skip())
                if final is not None:
                    return
        finally:
            pump.cancel()  # closes the engine stream: a request that did not finish is aborted
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pump

    async def _pump(self, messages: list[dict[str, str]], params: SamplingParams, request_id: str,
                    queue: asyncio.Queue[object]) -> None:
        """Copy the engine stream's outputs into ``queue``; an admission error is put there too."""
        try:
            # generate is an async generator function (annotated as returning an AsyncIterator): it has aclose()
            outputs = cast(AsyncGenerator[RequestOutput, None],
                           self.engine.generate(messages, params, request_id=request_id))
            async with contextlib.aclosing(outputs) as stream:
                async for out in stream:
                    queue.put_nowait(out)
        except Exception as exc:  # refused at admission (or the engine is down): shown in the bubble
            queue.put_nowait(exc)
        else:
            queue.put_nowait(_END)  # the stream ended (normally after its finished output)

    # ------------------------------------------------------------------ the page: replies through polls
    async def start(self, message: str, history: list[dict] | None, temperature: float, top_p: float,
                    max_new_tokens: float, seed: float | None, request: gr.Request) -> tuple:
        """Start a reply for the page and return at once: ``(chatbot, textbox, request id)``.

        The same checks and request as :meth:`respond` (which it runs in a background task); the chatbot
        shows the user's message, and the reply streams to the tab through :meth:`live_reply` (its polls)
        until :meth:`commit` writes the finished turn into the chatbot. Refused messages (empty, a reply
        already streaming) change nothing; bad sampling values raise ``gr.Error``.
        """
        session = session_of(request)
        replies = self.respond(message, history, temperature, top_p, max_new_tokens, seed, request)
        first = await replies.__anext__()  # validates, claims the session's one reply, shows the message
        if not isinstance(first[0], list):  # refused: gr.skip() for every output
            await replies.aclose()
            return first
        reply = LiveReply(first[2], first[0])
        self.replies[session] = reply
        self._latest[session] = reply.request_id

        async def drain() -> None:
            try:
                async for chatbot, _text, _rid in replies:
                    if isinstance(chatbot, list):
                        reply.chatbot = chatbot
            finally:
                reply.done = True

        reply.task = asyncio.get_running_loop().create_task(drain())
        return first[0][:-1], "", reply.request_id  # the status line shows in the live bubble meanwhile

    def live_reply(self, session: str, lang: str = "en") -> dict | None:
        """The tab's streaming reply for its poll: ``{rid, title, text, final}`` (the status line, the reply
        text so far, whether it has ended), or None when the tab streams nothing."""
        reply = self.replies.get(session)
        if reply is None:
            return None
        title, text = "", ""
        for m in reply.chatbot[-2:]:
            if is_status(m):
                title = _meta(m).get("title", "")
            elif isinstance(m, dict) and m.get("role") == "assistant":
                text = message_text(m.get("content"))
        return {"rid": reply.request_id, "title": title, "text": text, "final": reply.done}

    def commit(self, request: gr.Request) -> tuple:
        """Write the tab's ended reply into its chatbot: ``(chatbot, send button update)``; nothing changes
        while the reply still streams (or when there is none, e.g. after Clear)."""
        session = session_of(request)
        reply = self.replies.get(session)
        if reply is None or not reply.done:
            return gr.skip(), gr.update(interactive=not self.active.of(session))
        del self.replies[session]
        return reply.chatbot, gr.update(interactive=True)

    def forget(self, session: str) -> None:
        """Drop what is kept for ``session`` (its tab closed): its live reply and latest request id."""
        self.replies.pop(session, None)
        self._latest.pop(session, None)

    def latest_request(self, session: str) -> str | None:
        """The session's latest request id (streaming or ended), None after Clear or before any."""
        return self._latest.get(session)

    # ------------------------------------------------------------------ aborts
    def abort_session(self, session: str, mark: set[str] | None = None) -> None:
        """Abort every reply ``session`` streams (their KV blocks return to the pool at the engine's next
        step, at once while paused), after adding their request ids to ``mark`` (default: "stopped")."""
        mark = self._stopping if mark is None else mark
        for request_id in self.active.of(session):
            mark.add(request_id)
            self.engine.abort(request_id)

    def stop(self, request: gr.Request) -> None:
        """Stop every reply the calling session is streaming: its request is aborted in the engine (KV
        blocks freed at its next step, at once while paused) and its status line says "stopped"."""
        self.abort_session(session_of(request), self._stopping)

    def clear(self, request: gr.Request) -> None:
        """Abort every reply the calling session is streaming, with no further update of its chat (the tab's
        conversation is being emptied: a late "stopped" line must not bring it back)."""
        session = session_of(request)
        self.abort_session(session, self._cleared)
        self.forget(session)
