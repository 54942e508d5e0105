"""Request bodies of the generation endpoints, read at a bounded cost to the event loop.

FastAPI would decode and validate a body on the event loop in one go, whatever it holds: a 2 MB body with a
million ``stop`` items (integers) cost pydantic a million error objects, 7-39 s during which no other request
(``/health`` included) was served. Here a body goes through cheap checks before the full validation, and a
large one goes through all of it in a worker thread (:class:`BodyReader`):

1. ``Content-Type`` must be JSON (``application/json`` or ``application/*+json``; absent or another type: 400,
   so that a page of another origin cannot make a browser post a body without asking the server first: a
   JSON content type makes the browser send a CORS preflight, which the server refuses by default); the body
   must be UTF-8 (no byte-order mark) and is decoded with the standard library (malformed JSON, other text,
   numbers of more digits than Python converts, or nesting past the interpreter's limit: 400);
2. the list-valued fields are checked by length first, then by item type (``stop``: at most 64 strings;
   ``stop_token_ids`` / ``allowed_token_ids``: at most the vocabulary's size of integers; ``logit_bias``: at
   most that many numbers; ``messages``: at most the context length, as each takes a token at least;
   ``prompt``: token ids), so the validation that follows only ever sees a few items of the wrong type;
3. one walk over the rest of the document counts its values and their depth (over
   :attr:`BodyLimits.max_values` values or :attr:`BodyLimits.max_depth` levels: 400 naming the top-level
   field; a list too long is refused by its length before it is walked), and, only when the raw body holds
   a ``\\ud8..``-``\\udf..`` escape, looks for lone surrogates (keys included: 400);
4. pydantic validates the model (strict types; its first error becomes the 400).

Bodies of :attr:`BodyLimits.off_loop_bytes` or more are checked in a separate process first, then read in a
worker thread (:class:`BodyReader`): in a thread alone, decoding a hostile 2-4 MB body (a C call that holds
the GIL for 50-150 ms) still stalled the event loop that long. ``python -m bench.hostile`` measures
``/health`` while such bodies arrive.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import multiprocessing
import re
import threading
from dataclasses import dataclass
from typing import TypeVar

import anyio
from fastapi import Request
from pydantic import BaseModel, ValidationError

from engine import MAX_STOP_STRINGS
from server.protocol import APIError

M = TypeVar("M", bound=BaseModel)
log = logging.getLogger(__name__)

_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"})
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
NOT_JSON_OBJECT = "the request body must be a JSON object, sent with Content-Type: application/json"


@dataclass(frozen=True)
class BodyLimits:
    """Bounds of a request body's shape, checked before its validation.

    Attributes:
        max_values: most JSON values in a body (each array item and object member counts; the API sets
            131,072 or twice the vocabulary if more: a ``logit_bias`` and an ``allowed_token_ids`` over the
            whole vocabulary together).
        max_depth: most levels of nesting (a chat body needs 5).
        max_token_ids: most items of ``stop_token_ids``, ``allowed_token_ids`` and ``logit_bias`` (the API
            sets the vocabulary's size: more must repeat ids).
        max_messages: most chat messages (the API sets the context length: each message takes a token).
        off_loop_bytes: bodies at least this large are read in a worker thread.
    """

    max_values: int = 131_072
    max_depth: int = 32
    max_token_ids: int = 131_072
    max_messages: int = 131_072
    off_loop_bytes: int = 32 * 1024


def _field_path(loc) -> list[str]:
    """The request field a pydantic error location names: "body" and the union member tags pydantic adds
    after the field (``("stop", "str")`` for ``"stop": 5``) left out."""
    out = []
    for x in loc:
        if x == "body":
            continue
        if isinstance(x, str) and (x in _TYPE_TAGS or "[" in x):
            break
        out.append(str(x))
    return out


def validation_error(errors: list) -> APIError:
    """The 400 of pydantic's (or FastAPI's) validation ``errors``: its first error, naming the field."""
    first = errors[0] if errors else {}
    loc = _field_path(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg', ''))}",
                        code="invalid_json")
    if first.get("type") == "string_unicode":
        return APIError(400, "the request body holds a string that is not valid Unicode (a lone surrogate escape "
                             "such as \\ud800)", param=".".join(loc) or None)
    if not loc:
        return APIError(400, NOT_JSON_OBJECT)
    param = ".".join(loc)
    if first.get("type") == "model_attributes_type":
        return APIError(400, f"{param}: must be a JSON object", param=param)
    return APIError(400, f"{param}: {first.get('msg', 'invalid value')}", param=param)


def _not_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


_FLAT = ("stop", "stop_token_ids", "allowed_token_ids", "logit_bias")  # checked item by item by check_lists


def check_shape(doc: dict, limits: BodyLimits, unicode: bool = True) -> None:
    """Step 3 of the module's list: count ``doc``'s values and levels; with ``unicode``, look for lone
    surrogates in its strings and keys. The fields :func:`check_lists` has checked item by item are counted by
    their length, not walked (unless ``unicode``).

    Raises:
        APIError: 400 naming the top-level field where a limit was passed.
    """
    count = 0
    stack: list[tuple[object, int, str]] = []
    for k, v in doc.items():
        flat = (k in _FLAT and isinstance(v, (list, dict))) or (k == "prompt" and isinstance(v, list)
                                                                 and all(map(_is_int, v)))
        if flat and not unicode:
            count += 1 + len(v)
        else:
            stack.append((v, 1, k))
    if count > limits.max_values:
        raise APIError(400, f"the request body holds more than {limits.max_values} JSON values",
                       code="request_too_complex")
    while stack:
        value, depth, field = stack.pop()
        count += 1
        if isinstance(value, dict):
            items: list = list(value.values())
            if unicode and any(_not_unicode(k) for k in value):
                raise APIError(400, f"{field}: a key is not valid Unicode text (lone surrogate)", param=field)
        elif isinstance(value, list):
            items = value
        else:
            if unicode and isinstance(value, str) and _not_unicode(value):
                raise APIError(400, f"{field} holds a string that is not valid Unicode text (lone surrogate)",
                               param=field)
            continue
        if count + len(stack) + len(items) > limits.max_values:
            raise APIError(400, f"{field}: the request body holds more than {limits.max_values} JSON values",
                           param=field, code="request_too_complex")
        if items and depth >= limits.max_depth:
            raise APIError(400, f"{field}: nested deeper than {limits.max_depth} levels", param=field,
                           code="request_too_complex")
        stack.extend((v, depth + 1, field) for v in items)


def _is_int(x) -> bool:
    return type(x) is int


def _is_number(x) -> bool:
    return type(x) is int or type(x) is float


def check_lists(doc: dict, limits: BodyLimits) -> None:
    """Step 2 of the module's list: the list-valued fields by length, then by item type.

    Raises:
        APIError: 400 naming the field (and the first bad item).
    """
    messages = doc.get("messages")
    if isinstance(messages, list) and len(messages) > limits.max_messages:
        raise APIError(400, f"messages: at most {limits.max_messages} messages fit in the context, got "
                            f"{len(messages)}", param="messages", code="context_length_exceeded")
    prompt = doc.get("prompt")
    if isinstance(prompt, list) and len(prompt) > limits.max_values:
        raise APIError(400, f"prompt: at most {limits.max_values} token ids, got {len(prompt)}", param="prompt")
    stop = doc.get("stop")
    if isinstance(stop, list):
        if len(stop) > MAX_STOP_STRINGS:
            raise APIError(400, f"stop accepts at most {MAX_STOP_STRINGS} strings, got {len(stop)}", param="stop")
        bad = next((i for i, s in enumerate(stop) if not isinstance(s, str)), None)
        if bad is not None:
            raise APIError(400, f"stop[{bad}]: must be a string", param="stop")
    for name in ("stop_token_ids", "allowed_token_ids"):
        ids = doc.get(name)
        if isinstance(ids, list):
            if len(ids) > limits.max_token_ids:
                raise APIError(400, f"{name} accepts at most {limits.max_token_ids} token ids (the vocabulary's "
                                    f"size), got {len(ids)}", param=name)
            if not all(map(_is_int, ids)):
                bad = next(i for i, t in enumerate(ids) if not _is_int(t))
                raise APIError(400, f"{name}[{bad}]: must be an integer", param=name)
    bias = doc.get("logit_bias")
    if isinstance(bias, dict):
        if len(bias) > limits.max_token_ids:
            raise APIError(400, f"logit_bias accepts at most {limits.max_token_ids} token ids (the vocabulary's "
                                f"size), got {len(bias)}", param="logit_bias")
        if not all(map(_is_number, bias.values())):
            key = next(k for k, v in bias.items() if not _is_number(v))
            raise APIError(400, f"logit_bias[{key[:32]!r}]: must be a number", param="logit_bias")


def parse_body(raw: bytes, model: type[M], limits: BodyLimits) -> M:
    """Steps 1-4 of the module's list on one body (any thread).

    Raises:
        APIError: 400 for a body that is not a JSON object, breaks a limit or does not validate.
    """
    try:
        doc = json.loads(raw.decode("utf-8"))  # decoded here: json.loads would guess UTF-16 / UTF-32 from bytes
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not UTF-8 text", code="invalid_json") from None
    except json.JSONDecodeError as e:
        raise APIError(400, f"malformed JSON body: {e.msg} (line {e.lineno}, column {e.colno})",
                       code="invalid_json") from None
    except ValueError as e:  # an integer of more digits than sys.get_int_max_str_digits() (4,300)
        raise APIError(400, f"malformed JSON body: {str(e).split(';')[0]}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, f"the request body is nested deeper than {limits.max_depth} levels",
                       code="request_too_complex") from None
    if not isinstance(doc, dict):
        raise APIError(400, NOT_JSON_OBJECT)
    check_lists(doc, limits)
    check_shape(doc, limits, unicode=_SURROGATE_ESCAPE.search(raw) is not None)
    try:
        return model.model_validate(doc)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False, include_input=False)) from None


def _is_json(content_type: str) -> bool:
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def check_body(raw: bytes, model: type[BaseModel], limits: BodyLimits) -> tuple | None:
    """:func:`parse_body` for its verdict only (run in the checking process): None when ``raw`` is a valid
    ``model``, else the 400's ``(status, message, param, code)``."""
    try:
        parse_body(raw, model, limits)
    except APIError as e:
        return e.status, e.message, e.param, e.code
    return None


def log_ignored_fields(body: BaseModel) -> None:
    """Log the fields of a request that are neither honoured nor refused (unknown names, e.g. a misspelt
    ``max_token``): accepted and ignored as vLLM does, and named in a WARNING as vLLM's server names them, so
    a typo is found in the log (at most 8 names of at most 64 characters each)."""
    extra = body.model_extra
    if extra:
        names = sorted(extra)
        shown = ", ".join(repr(n[:64]) for n in names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        log.warning("fields present in the request but ignored (not fields of the API): %s", shown)


class BodyReader:
    """Reads and validates request bodies (:func:`parse_body`).

    A body under :attr:`BodyLimits.off_loop_bytes` is read on the event loop (a few milliseconds at most). A
    larger one is first checked in a separate process (:func:`check_body`; one process, started on the first
    large body, about a second): decoding a hostile body holds that process's interpreter, never this one's, so
    the event loop goes on serving. A body that passes is bounded by the limits and is read again here, in a
    worker thread (tens of milliseconds for the largest valid bodies). Where no process can be started, or it
    died, large bodies are read in the worker thread directly from then on (a warning says so).

    Args:
        limits: the bounds of a body's shape.
        check_in_process: check large bodies in a separate process first (False: worker thread only).
    """

    def __init__(self, limits: BodyLimits | None = None, check_in_process: bool = True) -> None:
        self.limits = limits or BodyLimits()
        self.check_in_process = check_in_process
        self._limiter = anyio.CapacityLimiter(1)
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def _checker(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                # spawn: a fresh interpreter (forking a process that runs the engine's threads is unsafe)
                self._pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
            return self._pool

    def close(self) -> None:
        """Stop the checking process (a later large body starts another)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    async def _check_elsewhere(self, raw: bytes, model: type[BaseModel]) -> None:
        try:
            verdict = await asyncio.get_running_loop().run_in_executor(self._checker(), check_body, raw, model,
                                                                       self.limits)
        except (concurrent.futures.process.BrokenProcessPool, OSError, RuntimeError):
            log.warning("the request body checking process failed (or could not start); large request bodies are "
                        "read in a worker thread from now on")
            self.check_in_process = False
            self.close()
            return
        if verdict is not None:
            status, message, param, code = verdict
            raise APIError(status, message, param=param, code=code)

    async def read(self, request: Request, model: type[M]) -> M:
        """The body of ``request`` as ``model``.

        Raises:
            APIError: 400 (a ``Content-Type`` other than JSON, or see :func:`parse_body`).
        """
        if not _is_json(request.headers.get("content-type", "")):
            raise APIError(400, NOT_JSON_OBJECT)
        raw = await request.body()
        if len(raw) < self.limits.off_loop_bytes:
            body = parse_body(raw, model, self.limits)
        else:
            if self.check_in_process:
                await self._check_elsewhere(raw, model)
            body = await anyio.to_thread.run_sync(parse_body, raw, model, self.limits, limiter=self._limiter)
        log_ignored_fields(body)
        return body
