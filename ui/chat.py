"""Per-session chat: stream a reply from ``engine.generate`` into the tab's Chatbot, Stop aborts it.

Each browser tab (Gradio session) keeps its own conversation in its own ``gr.Chatbot`` value; the engine
renders it with the model's chat template. The handler is an async generator, so many tabs stream at once
on Gradio's event loop (the event is registered with ``concurrency_limit=None``) while the engine thread
computes. Leaving the ``async for`` (Stop, a closed tab, a cancelled task) aborts the request in the
engine, which frees its KV blocks at its next step.
"""

from __future__ import annotations

import contextlib
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

import gradio as gr

from engine.async_engine import EngineOverloadedError
from engine.request import SamplingParams


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


def to_messages(history: list[dict] | None) -> list[dict[str, str]]:
    """Chat-template messages (``{"role", "content"}`` with string content) from a Chatbot value.

    Empty assistant messages (a reply that was stopped before its first token) are dropped.
    """
    out = []
    for m in history or []:
        role = m.get("role") if isinstance(m, dict) else getattr(m, "role", None)
        content = m.get("content") if isinstance(m, dict) else getattr(m, "content", None)
        text = message_text(content)
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


class ChatHandlers:
    """The Gradio handlers of the chat column, bound to one engine.

    Args:
        engine: the process's ``AsyncEngine`` (only ``generate`` and ``abort`` are used).
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.active = ActiveRequests()

    async def respond(
        self,
        message: str,
        history: list[dict] | None,
        temperature: float,
        top_p: float,
        max_new_tokens: float,
        seed: float | None,
        request: gr.Request,
    ) -> AsyncIterator[tuple]:
        """Stream the assistant's reply to ``message``: yields ``(chatbot value, textbox value)``.

        The first yield shows the user's message and clears the textbox; later ones leave the textbox
        alone (``gr.skip()``) so the user can type the next message while the reply streams.
        """
        message = (message or "").strip()
        if not message:
            yield (gr.skip(), gr.skip())
            return
        messages = to_messages(history) + [{"role": "user", "content": message}]
        try:
            params = sampling_params(temperature, top_p, max_new_tokens, seed)
        except (TypeError, ValueError) as exc:
            raise gr.Error(str(exc)) from exc
        def shown(reply: str) -> list[dict[str, str]]:  # a new list per yield: Gradio diffs old vs new
            return [*messages, {"role": "assistant", "content": reply}]

        yield (shown(""), "")
        session = getattr(request, "session_hash", None) or "anonymous"
        request_id = f"chat-{uuid.uuid4().hex[:8]}"
        self.active.add(session, request_id)
        try:
            async with contextlib.aclosing(self.engine.generate(messages, params, request_id=request_id)) as stream:
                async for out in stream:
                    text = out.text
                    if out.error:
                        text = f"{text}\n\n⚠️ {out.error}" if text else f"⚠️ {out.error}"
                    if out.delta or out.finished or out.error:
                        yield (shown(text), gr.skip())
        except ValueError as exc:  # rejected at admission (e.g. prompt longer than the context)
            yield (shown(f"⚠️ {exc}"), gr.skip())
        except EngineOverloadedError as exc:  # too many requests in flight: ask to retry
            yield (shown(f"⏳ {exc}"), gr.skip())
        finally:
            self.active.discard(session, request_id)

    def stop(self, request: gr.Request) -> None:
        """Abort every request the calling session is streaming (its KV blocks are freed at once)."""
        session = getattr(request, "session_hash", None) or "anonymous"
        for request_id in self.active.of(session):
            self.engine.abort(request_id)

    def unload(self, request: gr.Request) -> None:
        """When a tab closes, abort what it was still streaming (same as :meth:`stop`)."""
        self.stop(request)
