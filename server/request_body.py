"""Request bodies of the generation endpoints, read at a bounded cost to the event loop.

FastAPI would decode and validate a body on the event loop in one go, whatever it holds: a 2 MB body with a
million ``stop`` items (integers) cost pydantic a million error objects, 7-39 s during which no other request
(``/health`` included) was served. Here a body goes through cheap checks before the full validation, and a
large one goes through all of it in a worker thread (:class:`BodyReader`):

1. ``Content-Type`` must be JSON (or absent); the body is decoded with the standard library (malformed JSON,
   text that is not UTF-8 or nesting past the interpreter's limit: 400);
2. one walk over the decoded document counts its values and their depth (over :attr:`BodyLimits.max_values`
   values or :attr:`BodyLimits.max_depth` levels: 400 naming the top-level field), and, only when the raw
   body holds a ``\\ud8..``-``\\udf..`` escape, looks for lone surrogates (keys included: 400);
3. the list-valued fields are checked by length and item type in Python (``stop``: at most 64 strings;
   ``stop_token_ids`` / ``allowed_token_ids``: at most the vocabulary's size of integers; ``logit_bias``: at
   most that many numbers), so the validation that follows only ever sees a few items of the wrong type;
4. pydantic validates the model (strict types; its first error becomes the 400).

Bodies of :attr:`BodyLimits.off_loop_bytes` or more are read in a worker thread, at most two at a time. The
GIL still passes to the event loop between bytecodes, so what the loop can wait for is one C call: the
decoding of one body of at most ``--max-request-body-bytes`` (tens of milliseconds for 4 MiB), never a
validation of millions of items. ``python -m bench.hostile`` measures ``/health`` while such bodies arrive.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TypeVar

import anyio
from fastapi import Request
from pydantic import BaseModel, ValidationError

from engine.request import MAX_STOP_STRINGS
from server.protocol import APIError

M = TypeVar("M", bound=BaseModel)

_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"})
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
NOT_JSON_OBJECT = "the request body must be a JSON object, sent with Content-Type: application/json"


@dataclass(frozen=True)
class BodyLimits:
    """Bounds of a request body's shape, checked before its validation.

    Attributes:
        max_values: most JSON values in a body (each array item and object member counts; 262,144 holds a
            ``logit_bias`` and an ``allowed_token_ids`` over a 128k vocabulary together).
        max_depth: most levels of nesting (a chat body needs 5).
        max_token_ids: most items of ``stop_token_ids``, ``allowed_token_ids`` and ``logit_bias`` (the
            vocabulary's size: more must repeat ids).
        off_loop_bytes: bodies at least this large are read in a worker thread.
    """

    max_values: int = 262_144
    max_depth: int = 32
    max_token_ids: int = 262_144
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


def check_shape(doc: dict, limits: BodyLimits, unicode: bool = True) -> None:
    """Step 2 of the module's list: count ``doc``'s values and levels; with ``unicode``, look for lone
    surrogates in its strings and keys.

    Raises:
        APIError: 400 naming the top-level field where a limit was passed.
    """
    count = 0
    stack: list[tuple[object, int, str]] = [(v, 1, k) for k, v in doc.items()]
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
    """Step 3 of the module's list: the list-valued fields by length, then by item type.

    Raises:
        APIError: 400 naming the field (and the first bad item).
    """
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
        doc = json.loads(raw)
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not UTF-8 text", code="invalid_json") from None
    except json.JSONDecodeError as e:
        raise APIError(400, f"malformed JSON body: {e.msg} (line {e.lineno}, column {e.colno})",
                       code="invalid_json") from None
    except RecursionError:
        raise APIError(400, f"the request body is nested deeper than {limits.max_depth} levels",
                       code="request_too_complex") from None
    if not isinstance(doc, dict):
        raise APIError(400, NOT_JSON_OBJECT)
    check_shape(doc, limits, unicode=_SURROGATE_ESCAPE.search(raw) is not None)
    check_lists(doc, limits)
    try:
        return model.model_validate(doc)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False, include_input=False)) from None


def _is_json(content_type: str) -> bool:
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


class BodyReader:
    """Reads and validates request bodies (:func:`parse_body`): small ones on the event loop, large ones in a
    worker thread, at most ``threads`` at a time.

    Args:
        limits: the bounds of a body's shape.
        threads: most bodies read in worker threads at once.
    """

    def __init__(self, limits: BodyLimits | None = None, threads: int = 2) -> None:
        self.limits = limits or BodyLimits()
        self._limiter = anyio.CapacityLimiter(threads)

    async def read(self, request: Request, model: type[M]) -> M:
        """The body of ``request`` as ``model``.

        Raises:
            APIError: 400 (a ``Content-Type`` other than JSON, or see :func:`parse_body`).
        """
        content_type = request.headers.get("content-type")
        if content_type is not None and not _is_json(content_type):
            raise APIError(400, NOT_JSON_OBJECT)
        raw = await request.body()
        if len(raw) < self.limits.off_loop_bytes:
            return parse_body(raw, model, self.limits)
        return await anyio.to_thread.run_sync(parse_body, raw, model, self.limits, limiter=self._limiter)
