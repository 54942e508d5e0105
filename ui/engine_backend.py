"""The local page's backend: chats on the process's ``AsyncEngine`` (:class:`ui.reply.ReplyBackend`).

Each of the engine's outputs becomes one :class:`ui.reply.ReplyUpdate`: the whole text so far, the tokens,
where the request stands (``RequestOutput.state``: the engine sends an output when only that changed), and
on the last one its finish reason and error. A request the engine refuses at admission (a prompt longer
than the context, too many requests in flight, the engine down) ends as one failed update.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import cast

from engine import AsyncEngine, EngineOverloadedError, RequestOutput, SamplingParams
from ui.reply import DECODING, PREFILLING, QUEUED, ChatSettings, ReplyUpdate

_WHERE = ("position", "waiting", "computed", "prompt")


def sampling_params(settings: ChatSettings) -> SamplingParams:
    """The engine's ``SamplingParams`` of a chat's settings.

    Raises:
        engine.RequestError: a value out of range (a ``ValueError`` naming it).
    """
    params = SamplingParams(temperature=settings.temperature, top_p=settings.top_p, max_tokens=settings.max_tokens,
                            seed=settings.seed)
    params.validate()
    return params


def update_of(out: RequestOutput) -> ReplyUpdate:
    """One engine output as a reply update (the engine's "finished" state in its last step reads as decoding;
    the finished output itself carries the finish reason)."""
    st = out.state
    where = {k: v for k in _WHERE if st is not None and (v := getattr(st, k)) is not None}
    kind = None if st is None else DECODING if st.kind == "finished" else st.kind
    reason = (out.finish_reason or ("error" if out.error else "stop")) if out.finished else None
    return ReplyUpdate(text=out.text, tokens=len(out.token_ids),
                       state=kind if kind in (QUEUED, PREFILLING, DECODING) else None, where=where,
                       preempted=bool(st is not None and st.preempted), finish_reason=reason, error=out.error)


class EngineBackend:
    """Chats on a local ``AsyncEngine`` (its ``generate``, ``abort`` and ``paused``)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    @property
    def paused(self) -> bool:
        """The presenter holds the engine (Pause)."""
        return bool(self.engine.paused)

    def check(self, settings: ChatSettings) -> None:
        """Raise ``ValueError`` for settings the engine refuses (:func:`sampling_params`)."""
        sampling_params(settings)

    async def stream(self, messages: list[dict[str, str]], settings: ChatSettings,
                     request_id: str) -> AsyncIterator[ReplyUpdate]:
        """The engine's outputs of one chat as updates; leaving early closes the engine's stream, which aborts
        the request (its KV blocks return at the engine's next step, at once while paused)."""
        try:
            # generate is an async generator function (annotated as returning an AsyncIterator): it has aclose()
            outputs = cast(AsyncGenerator[RequestOutput, None],
                           self.engine.generate(messages, sampling_params(settings), request_id=request_id))
            async with contextlib.aclosing(outputs) as stream:
                async for out in stream:
                    yield update_of(out)
        except EngineOverloadedError as exc:
            yield ReplyUpdate(finish_reason="error", error=f"The engine is busy: send again in a moment. ({exc})")
        except Exception as exc:  # noqa: BLE001 -- refused at admission (a RequestError), or the engine is down
            yield ReplyUpdate(finish_reason="error", error=str(exc) or type(exc).__name__)
