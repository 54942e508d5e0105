"""The API's OpenAPI document (``GET /openapi.json``): what each route takes and answers, for clients, for
``/docs`` and for schema-driven testing (``tests/test_api_fuzz.py`` runs Schemathesis from it).

The generation routes read their bodies themselves (:mod:`server.request_body`, so that a hostile body costs
the event loop little), so FastAPI cannot see their models: :func:`install` adds each route's request
schema (from its pydantic model) to the document FastAPI builds. The response models below describe the
bodies the routes answer; they are documentation only (the routes build plain dicts).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict


class ErrorDetail(BaseModel):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """Every 4xx and 5xx body of the API."""

    error: ErrorDetail


class Usage(BaseModel):
    """Token counts of a request."""

    model_config = ConfigDict(extra="allow")
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    """A non-streamed chat or text completion (``object``: ``chat.completion`` or ``text_completion``); a streamed
    one is ``text/event-stream``: ``data: {chunk}`` lines, then ``data: [DONE]``."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: str
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: Usage | None = None


class ModelCard(BaseModel):
    """The served model."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: str
    created: int
    owned_by: str


class ModelList(BaseModel):
    """``GET /v1/models``."""

    object: str
    data: list[ModelCard]


class Health(BaseModel):
    """``GET /health`` (200 while the engine runs; 503 with ``status`` and ``detail`` otherwise)."""

    model_config = ConfigDict(extra="allow")
    status: str


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": ErrorResponse, "description": _WHY[s]} for s in statuses}


_WHY = {400: "a malformed or refused request (the message and `param` say which field)",
        404: "an unknown model", 413: "a request body over the server's limit (sent or decoded)",
        415: "a request body in a Content-Encoding other than gzip or deflate",
        429: "the engine is full or this client is past its rate limit (Retry-After)",
        500: "the engine failed this request alone", 503: "the engine is not running"}

# one server-sent event (OpenAPI 3.1: the event stream's schema describes each event): a JSON chunk or [DONE]
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": CompletionResponse, "description": "the completion, or its server-sent events with stream: true",
          "content": {"text/event-stream": {"schema": _SSE_EVENT}}},
    **_errors(400, 404, 413, 415, 429, 500, 503),
}
MODEL_RESPONSES: dict[int | str, dict[str, Any]] = {404: {"model": ErrorResponse, "description": _WHY[404]}}
HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {503: {"model": Health, "description": _WHY[503]}}
METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}}


def install(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Make ``app.openapi()`` add, for each ``path -> model`` of ``bodies``, the model as the required JSON body
    of the path's POST operation (its ``$defs`` among the document's component schemas)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = doc.setdefault("components", {}).setdefault("schemas", {})
        for path, model in bodies.items():
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(schema.pop("$defs", {}))
            components[model.__name__] = schema
            operation = doc.get("paths", {}).get(path, {}).get("post")
            if operation is not None:
                operation["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
