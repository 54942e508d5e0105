"""The OpenAI wire protocol of the server: request bodies (pydantic models), :class:`APIError` and the
checks that turn a request body into engine inputs before the engine allocates anything.

- :class:`ChatCompletionRequest`, :class:`CompletionRequest`: the bodies of ``POST /v1/chat/completions``
  and ``POST /v1/completions`` (OpenAI's fields, then vLLM's extra sampling fields; unknown fields are
  ignored).
- :func:`sampling_params_from`, :func:`chat_messages`, :func:`completion_prompt`: checks and mapping to
  :class:`SamplingParams`, chat messages and prompts; each raises a 400 :class:`APIError` naming the
  bad field.
- :func:`check_unicode`: a 400 for a string that is not valid Unicode (a lone surrogate).
- :func:`param_of`: the request field an engine ``ValueError`` is about.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from engine.request import MAX_N, SamplingParams

CHAT_ROLES = ("system", "user", "assistant", "developer")  # developer = system (OpenAI's newer name)


# ---------------------------------------------------------------------------------------------- errors
class APIError(Exception):
    """An error answered as OpenAI does: HTTP ``status`` and ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | int | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        """The JSON body of the error response."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        """The error as a response (ASCII JSON, so echoed user input can never break the encoding)."""
        return Response(json.dumps(self.body(), ensure_ascii=True), status_code=self.status, headers=self.headers,
                        media_type="application/json")


def check_unicode(value, path: str = "body") -> None:
    """Raise a 400 :class:`APIError` naming the first string in a parsed body that is not valid Unicode
    (a lone surrogate is valid JSON but cannot be encoded as UTF-8 for the tokenizer)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, f"{path} is not valid Unicode text (lone surrogate)", param=path) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_unicode(v, f"{path}.{k}" if path != "body" else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_unicode(v, f"{path}[{i}]")


_PARAM_NAMES = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens", "seed",
                "stop", "stop_token_ids")


def param_of(message: str, prompt_param: str) -> tuple[str | None, str | None]:
    """(param, code) for a ``ValueError`` message of the engine (its first word names the field)."""
    first = message.split(" ", 1)[0]
    if first in _PARAM_NAMES:
        return first, None
    if first.startswith("n=") or "parallel samples" in message:
        return "n", None
    if "context length" in message or "KV blocks" in message:
        return prompt_param, "context_length_exceeded"
    if "prompt" in message:
        return prompt_param, None
    return None, None


# ---------------------------------------------------------------------------------------------- request bodies
class StreamOptions(BaseModel):
    """``stream_options`` of a streamed request."""

    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by both endpoints: OpenAI's, then vLLM's extra sampling fields."""

    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, as vLLM does
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra fields (``extra_body`` in the openai client)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    cache_salt: str | None = None


class ChatCompletionRequest(SamplingFields):
    """Body of ``POST /v1/chat/completions``."""

    messages: Any = None  # checked by hand for clear messages
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list | None = None
    response_format: dict | None = None


class CompletionRequest(SamplingFields):
    """Body of ``POST /v1/completions``."""

    prompt: Any = None  # a string, token ids, or a list holding one of those
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


def sampling_params_from(body: SamplingFields, default_max_tokens: int | None) -> SamplingParams:
    """Map an OpenAI request body to :class:`SamplingParams` (vLLM's mapping).

    ``temperature`` defaults to 1.0 and ``top_p`` to 1.0 (OpenAI's defaults); ``max_completion_tokens``
    wins over ``max_tokens``; ``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``,
    ``ignore_eos`` and ``skip_special_tokens`` are vLLM's extra fields.

    Raises:
        APIError: 400 for an unsupported field or a value out of range.
    """
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0, 0.0):
            raise APIError(400, f"{name} is not supported by this server (use repetition_penalty)", param=name)
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported by this server", param="logit_bias")
    max_tokens = getattr(body, "max_completion_tokens", None)
    max_name = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, max_name = body.max_tokens, "max_tokens"
    if max_tokens is None:
        max_tokens = default_max_tokens
    params = SamplingParams(
        n=1 if body.n is None else body.n,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=-1 if body.top_k is None else body.top_k,
        min_p=0.0 if body.min_p is None else body.min_p,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        seed=body.seed,
        max_tokens=max_tokens,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=bool(body.ignore_eos),
        skip_special_tokens=body.skip_special_tokens is not False,
    )
    if isinstance(params.n, int) and params.n > MAX_N:
        raise APIError(400, f"n too large: at most {MAX_N} completions per request, got n={params.n}", param="n")
    try:
        params.validate()
    except ValueError as e:
        msg = str(e)
        param, _ = param_of(msg, "prompt")
        if param == "max_tokens":
            param = max_name
        raise APIError(400, msg, param=param) from None
    return params


def chat_messages(raw: Any) -> list[dict[str, str]]:
    """Check and normalise OpenAI chat messages to ``{"role", "content"}`` dicts of strings.

    ``content`` may be a string or a list of ``{"type": "text", "text": ...}`` parts; ``developer`` is
    taken as ``system``.

    Raises:
        APIError: 400 naming the first bad message.
    """
    if raw is None:
        raise APIError(400, "messages is required: a non-empty list of chat messages", param="messages")
    if not isinstance(raw, list):
        raise APIError(400, "messages must be a list of chat messages", param="messages")
    if not raw:
        raise APIError(400, "messages is empty: give at least one chat message", param="messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(400, f"{where} must be an object with 'role' and 'content'", param=where)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise APIError(400, f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                           param=f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise APIError(400, f"{where}.content[{j}]: only text parts are supported",
                                   param=f"{where}.content")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise APIError(400, f"{where}.content must be a string or a list of text parts", param=f"{where}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def completion_prompt(raw: Any) -> str | list[int]:
    """Check an OpenAI completions ``prompt``: a string, a list of token ids, or a list of one of those.

    Raises:
        APIError: 400 for an empty, malformed or multi-prompt value.
    """
    if isinstance(raw, list) and raw and all(isinstance(p, (str, list)) for p in raw):
        if len(raw) > 1:
            raise APIError(400, f"only one prompt per request is supported, got {len(raw)}", param="prompt")
        raw = raw[0]
    if raw is None:
        raise APIError(400, "prompt is required", param="prompt")
    if isinstance(raw, str):
        if not raw:
            raise APIError(400, "prompt is empty", param="prompt")
        return raw
    if isinstance(raw, list):
        if not raw:
            raise APIError(400, "prompt is empty", param="prompt")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
            return raw
    raise APIError(400, "prompt must be a string or a list of token ids", param="prompt")
