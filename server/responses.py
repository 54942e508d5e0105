"""Response bodies of the generation endpoints, streamed (one chunk at a time) and not.

:class:`ChatResponder` and :class:`CompletionResponder` turn the engine's :class:`RequestOutput` objects
into OpenAI's JSON: the text (with ``echo``), ``logprobs`` (:mod:`server.logprobs`), ``finish_reason`` and
vLLM's ``stop_reason``, vLLM's ``return_token_ids`` fields (``prompt_token_ids``, ``token_ids``) and the
usage, in every chunk with ``stream_options.continuous_usage_stats`` (vLLM's). Each keeps per choice
what it has streamed already, so a chunk carries only what is new: the text delta and the tokens (with
their logprobs) generated since the previous chunk of that choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine import CompletionOutput, RequestOutput
from server.logprobs import TokenText, chat_logprobs, completion_logprobs


def usage_of(out: RequestOutput) -> dict:
    """``usage``: prompt tokens, completion tokens over all choices, their sum."""
    p, c = len(out.prompt_token_ids), sum(len(o.token_ids) for o in out.outputs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


@dataclass
class ResponseOptions:
    """What a request asked of its response.

    Attributes:
        base: ``id``, ``created``, ``model`` (and ``object`` for completions) of every body.
        engine_id: the request's id in the engine (unique in flight; the response id unless the client
            chose that one).
        tokens: the tokenizer's :class:`TokenText` (logprob token texts).
        logprobs: top logprobs per token, or None for no logprobs.
        as_ids: ``return_tokens_as_token_ids``.
        token_ids: ``return_token_ids``.
        echo: text put in front of every choice's text (``echo``), "" for none.
        include_usage / continuous_usage: ``stream_options``.
    """

    base: dict
    engine_id: str
    tokens: TokenText
    logprobs: int | None = None
    as_ids: bool = False
    token_ids: bool = False
    echo: str = ""
    include_usage: bool = False
    continuous_usage: bool = False
    sent_tokens: dict[int, int] = field(default_factory=dict)  # choice -> tokens already streamed

    def new_tokens(self, c: CompletionOutput) -> tuple[list[int], list | None, list[int]]:
        """Token ids, logprob entries and text offsets of choice ``c`` not streamed yet; marks them streamed."""
        start = self.sent_tokens.get(c.index, 0)
        self.sent_tokens[c.index] = len(c.token_ids)
        return (c.token_ids[start:], (c.logprobs[start:] if c.logprobs is not None else None),
                list(c.text_offsets or [])[start:])

    def has_new_tokens(self, c: CompletionOutput) -> bool:
        return (self.logprobs is not None or self.token_ids) and len(c.token_ids) > self.sent_tokens.get(c.index, 0)

    def usage_fields(self, out_or_prompt_len, c: CompletionOutput | None = None) -> dict:
        """The ``usage`` member of a chunk: null with include_usage, the counts so far with continuous usage."""
        if not self.include_usage:
            return {}
        if not self.continuous_usage or c is None:
            return {"usage": None}
        p = out_or_prompt_len
        return {"usage": {"prompt_tokens": p, "completion_tokens": len(c.token_ids),
                          "total_tokens": p + len(c.token_ids)}}


class ChatResponder:
    """Chat completion bodies. ``role``: the role of the answer (``assistant``, or the last message's role
    when no generation prompt was added, as vLLM)."""

    def __init__(self, opts: ResponseOptions, role: str = "assistant") -> None:
        self.o = opts
        self.role = role
        self.prompt_len = 0

    def _logprobs(self, entries) -> dict | None:
        if self.o.logprobs is None or entries is None:
            return None
        return chat_logprobs(entries, self.o.tokens, self.o.logprobs, self.o.as_ids)

    def _chunk(self, index: int, delta: dict, logprobs=None, finish_reason=None, stop_reason=None,
               token_ids=None, c: CompletionOutput | None = None, extra: dict | None = None) -> dict:
        ch = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason is not None:
            ch["stop_reason"] = stop_reason
        if token_ids is not None:
            ch["token_ids"] = token_ids
        body = self.o.base | {"object": "chat.completion.chunk", "system_fingerprint": None, "choices": [ch]}
        return body | (extra or {}) | self.o.usage_fields(self.prompt_len, c)

    def opening(self, first: RequestOutput) -> list[dict]:
        """The chunks sent before any generated text: the role of each choice (then its echo)."""
        self.prompt_len = len(first.prompt_token_ids)
        out = []
        for i, c in enumerate(first.outputs):
            extra = {"prompt_token_ids": list(first.prompt_token_ids)} if self.o.token_ids and i == 0 else None
            out.append(self._chunk(c.index, {"role": self.role, "content": ""}, extra=extra))
            if self.o.echo:
                out.append(self._chunk(c.index, {"content": self.o.echo}))
        return out

    def chunk(self, c: CompletionOutput) -> dict | None:
        """The chunk of choice ``c``'s new text and tokens, or None when there is nothing new."""
        if not (c.delta or c.finish_reason is not None or self.o.has_new_tokens(c)):
            return None
        ids, entries, _ = self.o.new_tokens(c)
        return self._chunk(c.index, {"content": c.delta} if c.delta else {}, self._logprobs(entries),
                           c.finish_reason, c.stop_reason, ids if self.o.token_ids else None, c)

    def usage_chunk(self, out: RequestOutput) -> dict:
        return self.o.base | {"object": "chat.completion.chunk", "system_fingerprint": None, "choices": [],
                              "usage": usage_of(out)}

    def response(self, final: RequestOutput) -> dict:
        """The non-streamed body."""
        choices = []
        for c in final.outputs:
            ch = {"index": c.index, "message": {"role": self.role, "content": self.o.echo + c.text},
                  "logprobs": self._logprobs(c.logprobs), "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason}
            if self.o.token_ids:
                ch["token_ids"] = list(c.token_ids)
            choices.append(ch)
        body = self.o.base | {"object": "chat.completion", "system_fingerprint": None, "choices": choices,
                              "usage": usage_of(final)}
        if self.o.token_ids:
            body["prompt_token_ids"] = list(final.prompt_token_ids)
        return body


class CompletionResponder:
    """Text completion bodies (``object: text_completion``)."""

    def __init__(self, opts: ResponseOptions) -> None:
        self.o = opts
        self.prompt_len = 0
        self.prompt_ids: list[int] = []
        self.opened: set[int] = set()

    def _logprobs(self, c: CompletionOutput, entries, offsets: list[int]) -> dict | None:
        """The ``logprobs`` of ``entries``; offsets clamped to the returned text once it is whole (``c`` finished)."""
        if self.o.logprobs is None or entries is None:
            return None
        end = len(self.o.echo) + len(c.text) if c.finish_reason is not None else None
        return completion_logprobs(entries, self.o.tokens, self.o.logprobs, offsets, self.o.as_ids,
                                   start=len(self.o.echo), end=end)

    def opening(self, first: RequestOutput) -> list[dict]:
        self.prompt_len = len(first.prompt_token_ids)
        self.prompt_ids = list(first.prompt_token_ids)
        return []

    def chunk(self, c: CompletionOutput) -> dict | None:
        first = c.index not in self.opened
        if not (c.delta or c.finish_reason is not None or self.o.has_new_tokens(c) or (first and self.o.echo)):
            return None
        self.opened.add(c.index)
        ids, entries, offsets = self.o.new_tokens(c)
        ch = {"index": c.index, "text": (self.o.echo if first else "") + (c.delta or ""),
              "logprobs": self._logprobs(c, entries, offsets), "finish_reason": c.finish_reason}
        if c.finish_reason is not None:
            ch["stop_reason"] = c.stop_reason
        if self.o.token_ids:
            if first:
                ch["prompt_token_ids"] = self.prompt_ids
            ch["token_ids"] = ids
        return self.o.base | {"choices": [ch]} | self.o.usage_fields(self.prompt_len, c)

    def usage_chunk(self, out: RequestOutput) -> dict:
        return self.o.base | {"choices": [], "usage": usage_of(out)}

    def response(self, final: RequestOutput) -> dict:
        choices = []
        for c in final.outputs:
            ch = {"index": c.index, "text": self.o.echo + c.text,
                  "logprobs": self._logprobs(c, c.logprobs, list(c.text_offsets or [])),
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if self.o.token_ids:
                ch["prompt_token_ids"] = list(final.prompt_token_ids)
                ch["token_ids"] = list(c.token_ids)
            choices.append(ch)
        return self.o.base | {"choices": choices, "usage": usage_of(final)}
