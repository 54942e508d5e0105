"""The OpenAI wire protocol of the server: request bodies (pydantic models), :class:`APIError` and the
checks that turn a request body into engine inputs before the engine allocates anything.

- :class:`ChatCompletionRequest`, :class:`CompletionRequest`: the bodies of ``POST /v1/chat/completions``
  and ``POST /v1/completions`` (OpenAI's fields, then vLLM's extra sampling fields; unknown fields are
  ignored).
- :func:`sampling_params_from`, :func:`chat_messages`, :func:`completion_prompt`: checks and mapping to
  :class:`SamplingParams`, chat messages and prompts; each raises a 400 :class:`APIError` naming the
  bad field.
- :func:`check_refused`: a 400 naming any field this server does not implement, when it is set to
  anything but its no-op value (:data:`REFUSED_COMMON`, :data:`REFUSED_CHAT`, :data:`REFUSED_COMPLETIONS`).
- :func:`check_unicode`: a 400 for a string that is not valid Unicode (a lone surrogate).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, WithJsonSchema

from engine import MAX_LOGPROBS, MAX_N, MAX_STOP_STRINGS, SEED_MAX, SEED_MIN, RequestError, SamplingParams

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


# ---------------------------------------------------------------------------------------------- request bodies
def _doc(**schema: Any) -> Any:
    """A field's default (None) whose OpenAPI schema also states ``schema`` (ranges the checks below enforce with
    their own messages; pydantic does not validate them)."""
    return Field(None, json_schema_extra=schema)


class StreamOptions(BaseModel):
    """``stream_options`` of a streamed request."""

    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: usage (so far) in every chunk, with include_usage


class SamplingFields(BaseModel):
    """Fields shared by both endpoints: OpenAI's, then vLLM's extra sampling fields.

    Numbers and booleans are strict JSON types, as OpenAI's API takes them: ``"n": "2"``, ``"stream":
    "yes"``, ``"max_tokens": 5.0`` or ``"temperature": true`` are refused with a 400 naming the field (an
    integer is accepted where a number is expected)."""

    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, as vLLM does
    model: str | None = None
    max_tokens: StrictInt | None = _doc(minimum=1)
    temperature: StrictFloat | None = _doc(minimum=0)
    top_p: StrictFloat | None = _doc(exclusiveMinimum=0, maximum=1)
    n: StrictInt | None = _doc(minimum=1, maximum=MAX_N)
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = _doc(maxItems=MAX_STOP_STRINGS, minLength=1)
    seed: StrictInt | None = _doc(minimum=SEED_MIN, maximum=SEED_MAX)
    presence_penalty: StrictFloat | None = _doc(minimum=-2, maximum=2)
    frequency_penalty: StrictFloat | None = _doc(minimum=-2, maximum=2)
    logit_bias: dict[str, StrictFloat] | None = None
    user: str | None = None
    echo: StrictBool | None = None
    best_of: StrictInt | None = None
    response_format: dict | None = None
    # vLLM's extra fields (``extra_body`` in the openai client)
    top_k: StrictInt | None = _doc(minimum=-1)
    min_p: StrictFloat | None = _doc(minimum=0, maximum=1)
    repetition_penalty: StrictFloat | None = _doc(minimum=0.01, maximum=100)
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool | None = False
    skip_special_tokens: StrictBool | None = True
    cache_salt: str | None = None
    min_tokens: StrictInt | None = _doc(minimum=0)
    include_stop_str_in_output: StrictBool | None = None
    allowed_token_ids: list[StrictInt] | None = None
    truncate_prompt_tokens: StrictInt | None = None
    add_special_tokens: StrictBool | None = None
    request_id: str | None = None
    return_tokens_as_token_ids: StrictBool | None = None
    return_token_ids: StrictBool | None = None


_TEXT_PART = {"type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
              "required": ["type", "text"]}
_MESSAGES_SCHEMA = {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["role", "content"],
    "properties": {"role": {"enum": list(CHAT_ROLES)}, "name": {"type": "string"},
                   "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}}}}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}}
_PROMPT_SCHEMA = {"anyOf": [{"type": "string"}, _TOKEN_IDS,
                            {"type": "array", "maxItems": 1, "items": {"anyOf": [{"type": "string"}, _TOKEN_IDS]}}]}


class ChatCompletionRequest(SamplingFields):
    """Body of ``POST /v1/chat/completions``.

    ``special_tokens_in_messages`` (ours): true reads special-token strings typed in the messages
    (``<|im_end|>``...) as control tokens, as a plain render of the chat template would, so the request may
    forge turns of its own conversation; false (the server's default unless ``--special-tokens-in-messages``)
    tokenizes every message's text as text: only the template's own markup is special."""

    messages: Annotated[Any, WithJsonSchema(_MESSAGES_SCHEMA)] = None  # checked by hand for clear messages
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = _doc(minimum=0, maximum=MAX_LOGPROBS)
    # vLLM's chat rendering fields
    add_generation_prompt: StrictBool | None = None
    continue_final_message: StrictBool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    special_tokens_in_messages: StrictBool | None = None


class CompletionRequest(SamplingFields):
    """Body of ``POST /v1/completions``."""

    prompt: Annotated[Any, WithJsonSchema(_PROMPT_SCHEMA)] = None  # a string, token ids, or a list holding one
    logprobs: StrictInt | None = _doc(minimum=0, maximum=MAX_LOGPROBS)


# ---------------------------------------------------------------------------------------------- refused fields
_STRUCTURED = "structured outputs (guided decoding, JSON schemas, grammars) are not supported"
# field -> (values that leave it unused, why any other value is refused). A field of OpenAI's or vLLM's
# request that is neither implemented nor listed here nor harmless (no effect on the output) must be added.
REFUSED_COMMON: dict[str, tuple[tuple, str]] = {
    "use_beam_search": ((None, False), "beam search is not supported"),
    "length_penalty": ((None, 1, 1.0), "length_penalty applies to beam search only, which is not supported"),
    "early_stopping": ((None, False), "early_stopping applies to beam search only, which is not supported"),
    "prompt_logprobs": ((None,), "prompt logprobs are not supported: the engine computes the logits of the "
                                 "last prompt position only"),
    "logprob_token_ids": ((None,), "logprob_token_ids is not supported (use logprobs)"),
    "bad_words": ((None, []), "bad_words is not supported (use logit_bias or allowed_token_ids)"),
    "structured_outputs": ((None,), _STRUCTURED),
    "guided_json": ((None,), _STRUCTURED),
    "guided_regex": ((None,), _STRUCTURED),
    "guided_choice": ((None,), _STRUCTURED),
    "guided_grammar": ((None,), _STRUCTURED),
    "structural_tag": ((None,), _STRUCTURED),
    "guided_decoding_backend": ((None,), _STRUCTURED),
    "guided_whitespace_pattern": ((None,), _STRUCTURED),
    "logits_processors": ((None, []), "custom logits processors are not supported"),
    "priority": ((None, 0), "priority scheduling is not enabled: requests are served first come, first served"),
    "truncation_side": ((None, "left"), "only truncation_side 'left' (keep the last prompt tokens) is supported"),
    "kv_transfer_params": ((None, {}), "disaggregated serving (KV transfer) is not supported"),
    "ec_transfer_params": ((None, {}), "disaggregated serving (encoder-cache transfer) is not supported"),
    "vllm_xargs": ((None, {}), "vllm_xargs (custom extensions) is not supported"),
    "mm_processor_kwargs": ((None, {}), "multimodal inputs are not supported"),
    "media_io_kwargs": ((None, {}), "multimodal inputs are not supported"),
    "thinking_token_budget": ((None,), "this model does not reason: thinking_token_budget is not supported"),
    "repetition_detection": ((None,), "repetition_detection is not supported"),
    "watermarking": ((None, False), "watermarking is not supported"),
    "lora_request": ((None,), "LoRA adapters are not supported"),
}
REFUSED_CHAT: dict[str, tuple[tuple, str]] = {
    "tools": ((None,), "tool calling is not supported by this server"),
    "tool_choice": ((None, "none"), "tool calling is not supported by this server"),
    "functions": ((None,), "function calling is not supported by this server"),
    "function_call": ((None, "none"), "function calling is not supported by this server"),
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), "only text output is supported"),
    "reasoning_effort": ((None,), "this model does not reason: reasoning_effort is not supported"),
    "verbosity": ((None,), "verbosity is not supported"),
    "web_search_options": ((None,), "web search is not supported"),
    "documents": ((None, []), "documents (RAG templates) are not supported by this model's chat template"),
    "chat_template": ((None,), "a chat template sent with the request is not trusted (vLLM's default without "
                               "--trust-request-chat-template); the model's own template is used"),
}
REFUSED_COMPLETIONS: dict[str, tuple[tuple, str]] = {
    "suffix": ((None, ""), "suffix (fill-in-the-middle) is not supported by this model"),
    "prompt_embeds": ((None,), "prompt embeddings are not supported"),
}


def check_refused(body: BaseModel, *tables: dict[str, tuple[tuple, str]]) -> None:
    """Raise a 400 :class:`APIError` naming the first field of ``tables`` set to a value that uses it."""
    for table in tables:
        for name, (unused, why) in table.items():
            value = getattr(body, name, None)
            if value is not None and not any(type(value) is type(u) and value == u for u in unused):
                raise APIError(400, f"{name}: {why}", param=name)


def check_common(body: SamplingFields) -> None:
    """Checks of fields both endpoints share that :class:`SamplingParams` cannot make: ``stream_options``
    without ``stream``, ``response_format``, ``best_of``, the refused fields.

    Raises:
        APIError: 400 naming the field.
    """
    check_refused(body, REFUSED_COMMON)
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options can only be given when stream is true", param="stream_options")
    rf = body.response_format
    if rf is not None and (not isinstance(rf, dict) or rf.get("type", "text") != "text"):
        raise APIError(400, f"response_format: {_STRUCTURED}; only {{\"type\": \"text\"}} is accepted",
                       param="response_format")
    n = 1 if body.n is None else body.n
    if body.best_of is not None and body.best_of not in (1, n):
        raise APIError(400, f"best_of other than n is not supported (no ranking of extra samples), got "
                       f"best_of={body.best_of}", param="best_of")


def sampling_params_from(body: SamplingFields, default_max_tokens: int | None, logprobs: int | None = None,
                         logprobs_param: str = "logprobs") -> SamplingParams:
    """Map an OpenAI request body to :class:`SamplingParams` (vLLM's mapping).

    ``temperature`` defaults to 1.0 and ``top_p`` to 1.0 (OpenAI's defaults); ``max_completion_tokens``
    wins over ``max_tokens``; ``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``,
    ``ignore_eos``, ``skip_special_tokens``, ``min_tokens``, ``include_stop_str_in_output``,
    ``allowed_token_ids`` and ``truncate_prompt_tokens`` are vLLM's extra fields. ``logprobs`` is the
    number of top logprobs per token (None: none), from the endpoint's own fields (``logprobs_param``).

    Raises:
        APIError: 400 for a value out of range.
    """
    bias = None
    if body.logit_bias:
        try:
            bias = {int(k): float(v) for k, v in body.logit_bias.items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids (integers as strings)", param="logit_bias") from None
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
        presence_penalty=0.0 if body.presence_penalty is None else body.presence_penalty,
        frequency_penalty=0.0 if body.frequency_penalty is None else body.frequency_penalty,
        min_tokens=0 if body.min_tokens is None else body.min_tokens,
        logprobs=logprobs,
        logit_bias=bias,
        allowed_token_ids=body.allowed_token_ids,
        include_stop_str_in_output=bool(body.include_stop_str_in_output),
        truncate_prompt_tokens=body.truncate_prompt_tokens,
    )
    if isinstance(params.n, int) and params.n > MAX_N:
        raise APIError(400, f"n too large: at most {MAX_N} completions per request, got n={params.n}", param="n")
    try:
        params.validate()
    except RequestError as e:  # the field's engine name -> this endpoint's name
        param = {"max_tokens": max_name, "logprobs": logprobs_param}.get(e.param or "", e.param)
        raise APIError(400, str(e), param=param) from None
    return params


def chat_messages(raw: Any) -> list[dict[str, str]]:
    """Check and normalise OpenAI chat messages to ``{"role", "content"}`` dicts of strings.

    ``content`` may be a string or a list of ``{"type": "text", "text": ...}`` parts, joined with a
    newline (vLLM's convention); a part of another type (image, audio, file) is refused. ``developer`` is
    taken as ``system``; a string ``name`` is passed to the template.

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
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    what = f"parts of type {kind!r} are" if isinstance(kind, str) else "this part is"
                    raise APIError(400, f"{where}.content[{j}]: {what} not supported; only text parts "
                                   "({\"type\": \"text\", \"text\": ...}) are", param=f"{where}.content")
                if not isinstance(part.get("text"), str):
                    raise APIError(400, f"{where}.content[{j}].text must be a string", param=f"{where}.content")
                texts.append(part["text"])
            content = "\n".join(texts)
        if not isinstance(content, str):
            raise APIError(400, f"{where}.content must be a string or a list of text parts", param=f"{where}.content")
        if m.get("tool_calls"):
            raise APIError(400, f"{where}.tool_calls: tool calling is not supported by this server",
                           param=f"{where}.tool_calls")
        msg = {"role": "system" if role == "developer" else role, "content": content}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def chat_logprobs_count(body: ChatCompletionRequest) -> int | None:
    """How many top logprobs a chat request asks for per token (``logprobs`` + ``top_logprobs``), or None.

    Raises:
        APIError: 400 naming ``top_logprobs`` when it is out of [0, MAX_LOGPROBS] or given without
            ``logprobs: true``.
    """
    top = body.top_logprobs
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}", param="top_logprobs")
    if not body.logprobs:
        if top:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return None
    return top or 0


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
