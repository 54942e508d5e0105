"""OpenAI-compatible HTTP API and Prometheus metrics over one :class:`AsyncEngine`.

:func:`create_api` returns a FastAPI app with

- ``POST /v1/chat/completions`` and ``POST /v1/completions``: streaming (server-sent events) or not; the
  official ``openai`` client works unchanged. ``usage`` is in every non-streamed response and, with
  ``stream_options: {"include_usage": true}``, in a last chunk with no choices (as OpenAI does).
- ``GET /v1/models``, ``GET /health`` (200 with ``step`` and ``paused`` while the engine thread runs, else 503) and ``GET /metrics``
  (Prometheus text format, vLLM's metric meanings, ``cbp:`` instead of ``vllm:``; see
  :mod:`server.metrics`).

Every request is checked before the engine allocates anything (bad JSON or messages, empty prompt,
prompt over the context length, sampling values out of range, ``n`` over ``MAX_N`` or the batch slots,
an unknown model; see :mod:`server.protocol`): a 4xx with an OpenAI-style body
``{"error": {"message", "type", "param", "code"}}``. Bodies are read by :mod:`server.request_body` (cheap
shape checks first, large bodies off the event loop); the OpenAPI document is :mod:`server.openapi_schema`'s.
Chat messages are tokenized as text (a typed ``<|im_end|>`` is text, not a control token) unless the request's
``special_tokens_in_messages`` (default: the server's) says otherwise.
Every field of OpenAI's and vLLM's requests is honoured or refused with a 400 naming it
(:func:`server.protocol.check_refused`); response bodies, logprobs included, are built by
:mod:`server.responses` and :mod:`server.logprobs`.
``HEAD`` answers like ``GET`` on ``/health``, ``/v1/models`` and ``/metrics``; a known path asked with a
method it does not serve answers 405 with ``Allow``; a body over ``max_body_bytes`` answers 413, a body in a
coding other than gzip or deflate 415, and the API's paths answer other origins as ``cors`` allows
(:mod:`server.http_guards`). Every refusal is counted in ``cbp:api_rejected_requests_total``.
A full engine (its ``max_pending`` reached) answers 429 with ``Retry-After``; so does a client host past
its rate limit (:mod:`server.ratelimit`).
A client that goes away, streaming or not, aborts its engine request at the next engine step, so its
KV blocks return to the pool at once. The module imports nothing from Gradio.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine import (
    PROMPT,
    AsyncEngine,
    ChatPrompt,
    EngineOverloadedError,
    RequestError,
    RequestOutput,
    SamplingParams,
    TextPrompt,
)
from server import openapi_schema
from server.http_guards import DEFAULT_MAX_BODY_BYTES, APICors, BodySizeLimit, MethodCheck
from server.logprobs import TokenText
from server.metrics import EngineMetrics
from server.options import CORSSettings
from server.protocol import (
    REFUSED_CHAT,
    REFUSED_COMPLETIONS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    chat_logprobs_count,
    chat_messages,
    check_common,
    check_refused,
    completion_prompt,
    sampling_params_from,
)
from server.ratelimit import ClientRateLimiter
from server.request_body import BodyLimits, BodyReader, validation_error
from server.responses import ChatResponder, CompletionResponder, ResponseOptions

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
STATUS_CLIENT_CLOSED = 499  # nginx's "client closed request": logged, never seen by the client


class _ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


# ---------------------------------------------------------------------------------------------- disconnects
async def _wait_disconnect(request: Request) -> None:
    """Return when the client has gone (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(request: Request, awaitable: Awaitable) -> Any:
    """Await ``awaitable`` unless the client disconnects first; then cancel it (which, inside
    ``engine.generate``, aborts the request) and raise :class:`_ClientGone`."""

    async def run():
        return await awaitable

    task = asyncio.ensure_future(run())
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if task.cancelled():
        raise _ClientGone()
    return task.result()


# ---------------------------------------------------------------------------------------------- app
def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _error_of(out: RequestOutput) -> str | None:
    """The error of a failed request (any of its completions failed), else None."""
    if out.error or any(o.finish_reason == "error" for o in out.outputs):
        return out.error or "engine error"
    return None


class OpenAIServer:
    """The handlers behind :func:`create_api` (one per app)."""

    def __init__(self, engine: AsyncEngine, model_name: str, rate_limiter: ClientRateLimiter | None,
                 retry_after: int, metrics: EngineMetrics, special_tokens_in_messages: bool = False) -> None:
        self.special_tokens_in_messages = special_tokens_in_messages
        self.engine = engine
        self.model_name = model_name
        self.rate_limiter = rate_limiter
        self.retry_after = retry_after
        self.metrics = metrics
        self.created = int(time.time())

    # -------------------------------------------------------------- checks
    def admit(self, request: Request, body: SamplingFields) -> None:
        """Checks that need no tokenizing: model name, rate limit, engine alive."""
        if body.model is not None and body.model != self.model_name:
            self.metrics.reject("invalid")
            raise APIError(404, f"The model `{body.model}` does not exist. This server serves `{self.model_name}`.",
                           param="model", code="model_not_found")
        if self.rate_limiter is not None:
            host = request.client.host if request.client else "unknown"
            if not self.rate_limiter.try_acquire(host):
                self.metrics.reject("rate_limited")
                raise APIError(429, f"rate limit reached for {host}: at most {self.rate_limiter.rate} requests per "
                               f"{self.rate_limiter.period:g} s; retry later", type="rate_limit_error",
                               code="rate_limit_exceeded", headers={"Retry-After": str(self.rate_limiter.retry_after)})
        if not self.engine.is_running:
            self.metrics.reject("unavailable")
            raise APIError(503, "the engine is not running", type="service_unavailable", code="engine_not_running")

    def _failure(self, out: RequestOutput) -> APIError | None:
        """The error a request's (final) output ends with: a failed request's (500), or a 503 for a request
        aborted because the server is shutting down (``engine.closing``); None otherwise."""
        error = _error_of(out)
        if error is not None:
            return APIError(500, error, type="internal_error", code=500)
        closing = getattr(self.engine, "closing", None)
        if closing and out.finished and any(o.finish_reason == "abort" for o in out.outputs):
            return APIError(503, closing, type="service_unavailable", code="server_shutting_down")
        return None

    # -------------------------------------------------------------- generation
    async def start(self, request: Request, prompt, params: SamplingParams, rid: str, prompt_param: str,
                    cache_salt: str | None) -> tuple[AsyncGenerator[RequestOutput, None], RequestOutput]:
        """Submit to the engine and wait for the first output with a token, or the final one (the engine
        validates first: a :class:`engine.errors.RequestError` there means nothing was allocated)."""
        # generate is an async generator function (annotated as returning an AsyncIterator): it has aclose()
        agen = cast(AsyncGenerator[RequestOutput, None],
                    self.engine.generate(prompt, params, request_id=rid, cache_salt=cache_salt))
        try:
            first = await until_disconnected(request, agen.__anext__())
            while not first.finished and not any(c.token_ids for c in first.outputs):
                # outputs that only say where the request stands (queued, prefilling): the response starts
                # with its first token, so a request that fails before one is still a plain 500
                first = await until_disconnected(request, agen.__anext__())
        except RequestError as e:  # typed: the field and the code come with the error
            self.metrics.reject("invalid")
            param = prompt_param if e.param == PROMPT else e.param
            raise APIError(400, f"n too large: {e}" if e.param == "n" else str(e), param=param, code=e.code) from None
        except ValueError as e:  # an untyped refusal: about the request as a whole
            self.metrics.reject("invalid")
            raise APIError(400, str(e)) from None
        except EngineOverloadedError as e:
            self.metrics.reject("overloaded")
            raise APIError(429, str(e), type="server_overloaded", code="engine_overloaded",
                           headers={"Retry-After": str(self.retry_after)}) from None
        except RuntimeError as e:
            self.metrics.reject("unavailable")
            raise APIError(503, str(e), type="service_unavailable", code="engine_not_running") from None
        failure = self._failure(first) if first.finished or first.error else None  # n > 1: a child may fail first
        if failure is not None:  # failed before anything was sent: a plain 500 (503 at shutdown), streaming or not
            await agen.aclose()
            raise failure
        return agen, first

    async def complete(self, request: Request, agen, first: RequestOutput) -> RequestOutput:
        """Wait for the last output; a disconnect aborts (raises :class:`_ClientGone`)."""

        async def last(out: RequestOutput) -> RequestOutput:
            while not out.finished:
                out = await agen.__anext__()
            return out

        try:
            return await until_disconnected(request, last(first))
        finally:
            await agen.aclose()

    def stream(self, agen, first: RequestOutput, rid: str, responder, include_usage: bool) -> StreamingResponse:
        """Server-sent events from the engine's outputs. ``responder`` (:mod:`server.responses`) builds the
        opening chunks (chat: each choice's role) and then each choice's chunk of new text and tokens.
        Each choice's finish reason is sent once, with its last text; a failed request, or one aborted by
        the server's shutdown, ends with an ``{"error": ...}`` event (then ``[DONE]``). Leaving early (client
        gone) aborts the request."""
        state = {"finished": False}

        async def events():
            try:
                for chunk in responder.opening(first):
                    yield _sse(chunk)
                out, ended = first, set()
                while True:
                    failure = self._failure(out)
                    if failure is not None:
                        yield _sse(failure.body())
                        break
                    for c in out.outputs:
                        if c.index in ended:
                            continue
                        chunk = responder.chunk(c)
                        if chunk is not None:
                            yield _sse(chunk)
                        if c.finish_reason is not None:
                            ended.add(c.index)
                    if out.finished:
                        if include_usage:
                            yield _sse(responder.usage_chunk(out))
                        break
                    out = await agen.__anext__()
                state["finished"] = True
                yield "data: [DONE]\n\n"
            finally:
                await agen.aclose()

        async def cleanup():
            # After a disconnect Starlette may drop the body iterator at a yield: make sure the engine
            # request is aborted at once and its stream closed (closing an unfinished one aborts it).
            if not state["finished"]:
                self.engine.abort(rid)
                try:
                    await agen.aclose()
                except RuntimeError:  # still running in a task being torn down: the abort above suffices
                    pass

        return StreamingResponse(events(), media_type="text/event-stream", background=BackgroundTask(cleanup),
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # -------------------------------------------------------------- endpoints
    def _options(self, request: Request, body: SamplingFields, prefix: str, logprobs: int | None,
                 echo: str = "") -> ResponseOptions:
        """The response's id (vLLM's: ``X-Request-Id`` header, else ``request_id``, else random), and what
        the body asked of the response."""
        own = f"{prefix}-{uuid.uuid4().hex}"
        given = request.headers.get("x-request-id") or body.request_id
        base = {"id": f"{prefix}-{given}" if given else own, "created": int(time.time()), "model": self.model_name}
        so = body.stream_options
        return ResponseOptions(base, own, TokenText.of(self.engine.tokenizer), logprobs,
                               as_ids=bool(body.return_tokens_as_token_ids), token_ids=bool(body.return_token_ids),
                               echo=echo, include_usage=bool(body.stream and so and so.include_usage),
                               continuous_usage=bool(body.stream and so and so.include_usage
                                                     and so.continuous_usage_stats))

    async def _respond(self, request: Request, body: SamplingFields, prompt, params: SamplingParams,
                       prompt_param: str, responder) -> Response:
        """Run the request; stream the responder's chunks or answer its whole body."""
        rid = responder.o.engine_id
        agen, first = await self.start(request, prompt, params, rid, prompt_param, body.cache_salt)
        if body.stream:
            return self.stream(agen, first, rid, responder, responder.o.include_usage)
        final = await self.complete(request, agen, first)
        failure = self._failure(final)
        if failure is not None:
            raise failure
        responder.opening(final)
        return JSONResponse(responder.response(final))

    def _invalid(self, e: APIError) -> APIError:
        if e.status == 400:
            self.metrics.reject("invalid")
        return e

    async def chat(self, request: Request, body: ChatCompletionRequest) -> Response:
        """``POST /v1/chat/completions``."""
        try:
            self.admit(request, body)
            messages = chat_messages(body.messages)
            check_refused(body, REFUSED_CHAT)
            check_common(body)
            cont = bool(body.continue_final_message)
            if cont and body.add_generation_prompt:
                raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true "
                               "(send add_generation_prompt: false)", param="continue_final_message")
            add_gen = (not cont) if body.add_generation_prompt is None else bool(body.add_generation_prompt)
            logprobs = chat_logprobs_count(body)
            params = sampling_params_from(body, default_max_tokens=None, logprobs=logprobs,
                                          logprobs_param="top_logprobs")
        except APIError as e:
            raise self._invalid(e) from None
        role = "assistant" if add_gen else messages[-1]["role"]  # vLLM's rule
        last = messages[-1]
        echo = last["content"] if body.echo and last["role"] == role else ""
        special = body.special_tokens_in_messages
        prompt = ChatPrompt(messages, add_generation_prompt=add_gen, continue_final_message=cont,
                            add_special_tokens=bool(body.add_special_tokens),
                            chat_template_kwargs=body.chat_template_kwargs,
                            special_tokens_in_messages=self.special_tokens_in_messages if special is None else special)
        responder = ChatResponder(self._options(request, body, "chatcmpl", logprobs, echo), role)
        return await self._respond(request, body, prompt, params, "messages", responder)

    async def completions(self, request: Request, body: CompletionRequest) -> Response:
        """``POST /v1/completions``."""
        try:
            self.admit(request, body)
            prompt: str | list[int] | TextPrompt = completion_prompt(body.prompt)
            check_refused(body, REFUSED_COMPLETIONS)
            check_common(body)
            if body.echo and body.logprobs is not None:
                raise APIError(400, "echo with logprobs needs prompt logprobs, which are not supported",
                               param="echo")
            params = sampling_params_from(body, default_max_tokens=16, logprobs=body.logprobs)  # OpenAI's 16
        except APIError as e:
            raise self._invalid(e) from None
        echo = ""
        if body.echo:
            echo = prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(prompt)
        if isinstance(prompt, str) and body.add_special_tokens is not None:
            prompt = TextPrompt(prompt, add_special_tokens=bool(body.add_special_tokens))
        responder = CompletionResponder(self._options(request, body, "cmpl", body.logprobs, echo))
        responder.o.base["object"] = "text_completion"
        return await self._respond(request, body, prompt, params, "prompt", responder)

    def model_card(self) -> dict:
        """The served model as ``/v1/models`` lists it."""
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "cbp",
                "root": self.model_name, "parent": None, "max_model_len": self.engine.config.max_model_len}


def create_api(engine: AsyncEngine, model_name: str | None = None, *, rate_limit: int | None = None,
               rate_period: float = 1.0, retry_after: int = 1, metrics_prefix: str = "cbp",
               app: FastAPI | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               cors: CORSSettings | None = None, special_tokens_in_messages: bool = False) -> FastAPI:
    """The OpenAI-compatible API, ``/health`` and ``/metrics`` for ``engine``.

    Args:
        engine: a started :class:`AsyncEngine`; its ``max_pending`` bounds the requests in flight
            (past it: HTTP 429).
        model_name: the name clients must give as ``model`` (omitted = accepted); default
            ``SmolLM2-135M-Instruct`` or the engine's ``config.model``.
        rate_limit: most generation requests per ``rate_period`` seconds per client host (None = no limit).
        rate_period: the rate-limit window (seconds).
        retry_after: ``Retry-After`` seconds sent with an engine-overload 429.
        metrics_prefix: metric name prefix (``cbp:num_requests_running``...).
        app: add the routes to this FastAPI app instead of a new one (they must come before any
            catch-all mount such as Gradio's at ``/``).
        max_body_bytes: the largest request body of a ``/v1/`` route (bytes); larger ones get 413 and
            are never read whole (:class:`server.http_guards.BodySizeLimit`).
        cors: which other origins may read the API from a browser (:class:`server.http_guards.APICors`); None or
            no origins: none (no ``Access-Control-*`` headers; a preflight gets 405).
        special_tokens_in_messages: the default of a chat request's ``special_tokens_in_messages``: whether
            special-token strings typed in its messages become control tokens (False: they are text).

    Returns:
        The FastAPI app; ``app.state.openai_server`` and ``app.state.metrics`` hold the handlers.
    """
    if model_name is None:
        model_name = getattr(engine.config, "model", None) or DEFAULT_MODEL_NAME
    app = app if app is not None else FastAPI(title="Continuous Batching Playground API")
    metrics = EngineMetrics(engine, model_name, prefix=metrics_prefix)
    limiter = ClientRateLimiter(rate_limit, rate_period) if rate_limit else None
    server = OpenAIServer(engine, model_name, limiter, retry_after, metrics, special_tokens_in_messages)
    vocab = max(1, engine.core.input_processor.vocab_size)
    reader = BodyReader(BodyLimits(max_values=max(131_072, 2 * vocab + 1024), max_token_ids=vocab,
                                   max_messages=engine.core.max_model_len))
    app.state.openai_server = server
    app.state.body_reader = reader
    app.state.metrics = metrics
    app.add_middleware(BodySizeLimit, max_body_bytes=max_body_bytes, on_reject=metrics.reject)
    app.add_middleware(MethodCheck, router_app=app, on_reject=metrics.reject)  # before any body
    if cors is not None and cors.origins:
        app.add_middleware(APICors, settings=cors)  # outermost: preflights, and the headers on every answer
    openapi_schema.install(app, {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest})
    _add_error_handlers(app, metrics)
    _add_generation_routes(app, server, reader, metrics)
    _add_state_routes(app, engine, server, metrics)
    return app


def _add_error_handlers(app: FastAPI, metrics: EngineMetrics) -> None:
    """Every error as OpenAI's error body: ours (:class:`APIError`), FastAPI's validation and HTTP errors
    (counted as rejected), and a client gone mid-request (no body)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(_ClientGone)
    async def _client_gone(request: Request, exc: _ClientGone):
        return Response(status_code=STATUS_CLIENT_CLOSED)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        metrics.reject("invalid")
        return validation_error(list(exc.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 400:  # e.g. a body that is not UTF-8: FastAPI's "error parsing the body"
            metrics.reject("invalid")
        return APIError(exc.status_code, str(exc.detail), type="invalid_request_error" if exc.status_code < 500
                        else "server_error", headers=getattr(exc, "headers", None)).response()


def _add_generation_routes(app: FastAPI, server: OpenAIServer, reader: BodyReader, metrics: EngineMetrics) -> None:
    """``POST /v1/chat/completions`` and ``POST /v1/completions``: the body read and checked by ``reader``
    (a body that fails is counted as rejected), then served by ``server``."""

    async def read(request: Request, model):
        try:
            return await reader.read(request, model)
        except APIError:
            metrics.reject("invalid")
            raise

    @app.post("/v1/chat/completions", responses=openapi_schema.GENERATION_RESPONSES)
    async def chat_completions(request: Request):
        """OpenAI chat completions (streaming with ``stream: true``)."""
        return await server.chat(request, await read(request, ChatCompletionRequest))

    @app.post("/v1/completions", responses=openapi_schema.GENERATION_RESPONSES)
    async def completions(request: Request):
        """OpenAI (legacy) text completions (streaming with ``stream: true``)."""
        return await server.completions(request, await read(request, CompletionRequest))


def _add_state_routes(app: FastAPI, engine: AsyncEngine, server: OpenAIServer, metrics: EngineMetrics) -> None:
    """``/v1/models`` (and one model), ``/health`` and ``/metrics`` (GET and HEAD)."""
    model_name = server.model_name

    @app.api_route("/v1/models", methods=["GET", "HEAD"], response_model=openapi_schema.ModelList)
    async def models():
        """The served model."""
        return {"object": "list", "data": [server.model_card()]}

    @app.api_route("/v1/models/{model:path}", methods=["GET", "HEAD"], response_model=openapi_schema.ModelCard,
                   responses=openapi_schema.MODEL_RESPONSES)
    async def model(model: str):
        """One model, 404 when it is not the served one."""
        if model != model_name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return server.model_card()

    @app.api_route("/health", methods=["GET", "HEAD"], response_model=openapi_schema.Health,
                   responses=openapi_schema.HEALTH_RESPONSES)
    async def health():
        """200 while the engine thread runs, 503 otherwise. The body has the engine's step counter, whether it
        is paused, running and waiting requests (as the page's counters: the newest step, the queue now) and
        ``in_flight`` (requests accepted and not finished: streams of the page and the API)."""
        if engine.is_running:
            latest = engine.telemetry.latest()
            return {"status": "ok", "model": model_name, "step": engine.step_count, "paused": engine.paused,
                    "running": latest.num_running if latest else 0, "waiting": len(engine.telemetry.queue),
                    "in_flight": engine.num_pending}
        return JSONResponse({"status": "unavailable", "detail": "the engine thread is not running"}, status_code=503)

    @app.api_route("/metrics", methods=["GET", "HEAD"], responses=openapi_schema.METRICS_RESPONSES)
    async def prometheus_metrics():
        """Prometheus text format."""
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)
