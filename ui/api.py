"""OpenAI-compatible HTTP API and Prometheus metrics over one :class:`AsyncEngine`.

:func:`create_api` returns a FastAPI app with

- ``POST /v1/chat/completions`` and ``POST /v1/completions``: streaming (server-sent events) or not; the
  official ``openai`` client works unchanged. ``usage`` is in every non-streamed response and, with
  ``stream_options: {"include_usage": true}``, in a last chunk with no choices (as OpenAI does).
- ``GET /v1/models``, ``GET /health`` (200 while the engine thread runs, else 503) and ``GET /metrics``
  (Prometheus text format, vLLM's metric meanings, ``cbp:`` instead of ``vllm:``).

Every request is checked before the engine allocates anything (bad JSON or messages, empty prompt,
prompt over the context length, sampling values out of range, ``n`` over ``MAX_N`` or the batch slots,
an unknown model): a 4xx with an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``.
A full engine (its ``max_pending`` reached) answers 429 with ``Retry-After``; so does a client host past
its rate limit.
A client that goes away, streaming or not, aborts its engine request at the next engine step, so its
KV blocks return to the pool at once. The module imports nothing from Gradio.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from asyncio_throttle import Throttler
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.async_engine import AsyncEngine, EngineOverloadedError
from engine.request import MAX_N, RequestOutput, SamplingParams

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
CHAT_ROLES = ("system", "user", "assistant", "developer")  # developer = system (OpenAI's newer name)
STATUS_CLIENT_CLOSED = 499  # nginx's "client closed request": logged, never seen by the client

# Histogram buckets: vLLM's (seconds; tokens).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


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


def _check_unicode(value, path: str = "body") -> None:
    """Raise a 400 :class:`APIError` naming the first string in a parsed body that is not valid Unicode
    (a lone surrogate is valid JSON but cannot be encoded as UTF-8 for the tokenizer)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, f"{path} is not valid Unicode text (lone surrogate)", param=path) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_unicode(v, f"{path}.{k}" if path != "body" else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_unicode(v, f"{path}[{i}]")


class _ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


_PARAM_NAMES = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens", "seed",
                "stop", "stop_token_ids")


def _param_of(message: str, prompt_param: str) -> tuple[str | None, str | None]:
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


class _SamplingFields(BaseModel):
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


class ChatCompletionRequest(_SamplingFields):
    """Body of ``POST /v1/chat/completions``."""

    messages: Any = None  # checked by hand for clear messages
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list | None = None
    response_format: dict | None = None


class CompletionRequest(_SamplingFields):
    """Body of ``POST /v1/completions``."""

    prompt: Any = None  # a string, token ids, or a list holding one of those
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


def sampling_params_from(body: _SamplingFields, default_max_tokens: int | None) -> SamplingParams:
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
        param, _ = _param_of(msg, "prompt")
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


# ---------------------------------------------------------------------------------------------- rate limit
class ClientRateLimiter:
    """Per-client request rate limit: at most ``rate`` requests per ``period`` seconds per key (the
    client's host), on ``asyncio_throttle.Throttler``'s sliding window, without waiting: a request past
    the limit is refused at once (HTTP 429), never queued.

    Args:
        rate: requests allowed per ``period`` per key.
        period: window length (seconds).
    """

    MAX_KEYS = 4096  # beyond this many keys, idle ones are forgotten

    def __init__(self, rate: int, period: float = 1.0) -> None:
        if rate < 1 or period <= 0:
            raise ValueError("rate limit must be >= 1 request per period > 0 s")
        self.rate = rate
        self.period = period
        self._throttlers: dict[str, Throttler] = {}
        self._last_used: dict[str, float] = {}

    @property
    def retry_after(self) -> int:
        """Seconds a refused client should wait (whole seconds, for the ``Retry-After`` header)."""
        return max(1, math.ceil(self.period))

    def try_acquire(self, key: str) -> bool:
        """Count one request for ``key`` if the window has room; False (nothing counted) if not.

        Must be called on the event loop. ``Throttler.acquire`` either takes a place and returns
        without suspending, or suspends in ``asyncio.sleep`` to wait for one: it is stepped once, and
        when it would wait it is closed instead, which takes nothing.
        """
        now = time.monotonic()
        throttler = self._throttlers.get(key)
        if throttler is None:
            if len(self._throttlers) >= self.MAX_KEYS:
                self._forget_idle(now)
            throttler = self._throttlers[key] = Throttler(rate_limit=self.rate, period=self.period)
        self._last_used[key] = now
        step = throttler.acquire()
        try:
            step.send(None)
        except StopIteration:
            return True
        step.close()
        return False

    def _forget_idle(self, now: float) -> None:
        for k, t in list(self._last_used.items()):
            if now - t > self.period:
                self._throttlers.pop(k, None)
                self._last_used.pop(k, None)


# ---------------------------------------------------------------------------------------------- metrics
class EngineMetrics:
    """Prometheus metrics of one engine in its own :class:`CollectorRegistry` (one per app, so tests
    can build several apps). Meanings are vLLM's; names use ``{prefix}:`` instead of ``vllm:``.

    Gauges and counters are read from the engine at each scrape; histograms are fed from the engine's
    finished-request records (``Telemetry.finished_requests()``) at each scrape, so they cover every
    request of the engine (UI chats too), not only API ones.
    """

    def __init__(self, engine: AsyncEngine, model_name: str, prefix: str = "cbp",
                 registry: CollectorRegistry | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.prefix = prefix
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=False)
        self._lock = threading.Lock()
        self._last_seen = None
        p, labels = prefix, ["model_name"]

        def hist(name, doc, buckets):
            return Histogram(f"{p}:{name}", doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds",
                         "Histogram of time per output token in seconds (per request: (e2e - ttft) / "
                         "(generated tokens - 1)).", TPOT_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                        E2E_BUCKETS)
        self.prompt_len = hist("request_prompt_tokens", "Number of prefill tokens processed (per request).",
                               TOKEN_BUCKETS)
        self.gen_len = hist("request_generation_tokens", "Number of generation tokens processed (per request).",
                            TOKEN_BUCKETS)
        self.success = Counter(f"{p}:request_success", "Count of finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=self.registry)
        self.rejected = Counter(f"{p}:api_rejected_requests",
                                "API requests refused before reaching the engine, by reason "
                                "(invalid, overloaded, rate_limited, unavailable).",
                                ["model_name", "reason"], registry=self.registry)
        self.registry.register(self)

    def reject(self, reason: str) -> None:
        """Count one refused API request."""
        self.rejected.labels(self.model_name, reason).inc()

    def sync(self) -> None:
        """Feed the histograms with the requests finished since the last call."""
        with self._lock:
            records = self.engine.telemetry.finished_requests()
            start = 0
            if self._last_seen is not None:
                for i in range(len(records) - 1, -1, -1):
                    if records[i] is self._last_seen:
                        start = i + 1
                        break
            for r in records[start:]:
                if r.ttft is not None:
                    self.ttft.observe(r.ttft)
                if r.tpot is not None:
                    self.tpot.observe(r.tpot)
                self.e2e.observe(r.e2e)
                self.prompt_len.observe(r.num_prompt_tokens)
                self.gen_len.observe(r.num_output_tokens)
                self.success.labels(self.model_name, r.finish_reason or "unknown").inc()
            if records:
                self._last_seen = records[-1]

    def collect(self):
        """Live gauges and cumulative counters (called by the registry at each scrape), read from the
        engine's latest telemetry snapshot and totals, never from the scheduler itself."""
        p, m = self.prefix, [self.model_name]
        tel = self.engine.telemetry
        snap = tel.latest()

        def gauge(name, doc, value):
            g = GaugeMetricFamily(f"{p}:{name}", doc, labels=["model_name"])
            g.add_metric(m, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(f"{p}:{name}", doc, labels=["model_name"])
            c.add_metric(m, value)
            return c

        yield gauge("num_requests_running", "Number of requests in model execution batches.",
                    snap.num_running if snap else 0)
        yield gauge("num_requests_waiting", "Number of requests waiting to be processed.",
                    snap.num_waiting if snap else 0)
        yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    snap.kv_usage if snap else 0.0)
        yield gauge("num_requests_pending", "Requests streaming now (admitted to the engine, not finished).",
                    self.engine.num_pending)
        yield gauge("engine_healthy", "1 while the engine thread runs, else 0.", 1 if self.engine.healthy else 0)
        yield counter("prompt_tokens", "Number of prefill tokens processed (counted when a request ends).",
                      tel.total_prompt_tokens)
        yield counter("generation_tokens", "Number of generation tokens processed.", tel.total_generated_tokens)
        yield counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      getattr(snap, "prefix_cache_queries", 0))
        yield counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      getattr(snap, "prefix_cache_hits", 0))
        yield counter("num_preemptions", "Cumulative number of preemption from the engine.",
                      snap.num_preemptions if snap else 0)

    def render(self) -> bytes:
        """The registry in Prometheus text format (after :meth:`sync`)."""
        self.sync()
        return generate_latest(self.registry)


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


def _usage(out: RequestOutput) -> dict:
    p, c = len(out.prompt_token_ids), sum(len(o.token_ids) for o in out.outputs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _error_of(out: RequestOutput) -> str | None:
    """The error of a failed request (any of its completions failed), else None."""
    if out.error or any(o.finish_reason == "error" for o in out.outputs):
        return out.error or "engine error"
    return None


class OpenAIServer:
    """The handlers behind :func:`create_api` (one per app)."""

    def __init__(self, engine: AsyncEngine, model_name: str, rate_limiter: ClientRateLimiter | None,
                 retry_after: int, metrics: EngineMetrics) -> None:
        self.engine = engine
        self.model_name = model_name
        self.rate_limiter = rate_limiter
        self.retry_after = retry_after
        self.metrics = metrics
        self.created = int(time.time())

    # -------------------------------------------------------------- checks
    def admit(self, request: Request, body: _SamplingFields) -> None:
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
        if not self.engine.healthy:
            self.metrics.reject("unavailable")
            raise APIError(503, "the engine is not running", type="service_unavailable", code="engine_not_running")

    # -------------------------------------------------------------- generation
    async def start(self, request: Request, prompt, params: SamplingParams, rid: str, prompt_param: str,
                    cache_salt: str | None) -> tuple[AsyncIterator[RequestOutput], RequestOutput]:
        """Submit to the engine and wait for the first output (the engine validates first: a
        ``ValueError`` there means nothing was allocated)."""
        agen = self.engine.generate(prompt, params, request_id=rid, cache_salt=cache_salt)
        try:
            first = await until_disconnected(request, agen.__anext__())
        except ValueError as e:
            self.metrics.reject("invalid")
            msg = str(e)
            param, code = _param_of(msg, prompt_param)
            if param == "n":
                msg = f"n too large: {msg}"
            raise APIError(400, msg, param=param, code=code) from None
        except EngineOverloadedError as e:
            self.metrics.reject("overloaded")
            raise APIError(429, str(e), type="server_overloaded", code="engine_overloaded",
                           headers={"Retry-After": str(self.retry_after)}) from None
        except RuntimeError as e:
            self.metrics.reject("unavailable")
            raise APIError(503, str(e), type="service_unavailable", code="engine_not_running") from None
        error = _error_of(first) if first.finished else None
        if error is not None:  # failed before anything was sent: a plain 500, streaming or not
            await agen.aclose()
            raise APIError(500, error, type="internal_error", code=500)
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

    def stream(self, agen, first: RequestOutput, rid: str, chunk_of, include_usage: bool,
               opening_of=None) -> StreamingResponse:
        """Server-sent events from the engine's outputs. ``chunk_of(completion, delta, finish_reason)``
        builds the chunk of one choice; ``opening_of(index)`` (the chat role chunk) is sent first for each
        choice. Each choice's finish reason is sent once, with its last text; a failed request ends with
        an ``{"error": ...}`` event. Leaving early (client gone) aborts the request."""
        state = {"finished": False}

        async def events():
            try:
                if opening_of is not None:
                    for c in first.outputs:
                        yield _sse(opening_of(c.index))
                out, ended = first, set()
                while True:
                    error = _error_of(out)
                    if error is not None:
                        yield _sse(APIError(500, error, type="internal_error", code=500).body())
                        break
                    for c in out.outputs:
                        if c.index in ended:
                            continue
                        if c.delta or c.finish_reason is not None:
                            yield _sse(chunk_of(c, c.delta, c.finish_reason))
                        if c.finish_reason is not None:
                            ended.add(c.index)
                    if out.finished:
                        if include_usage:
                            yield _sse(chunk_of(out.outputs[0], None, None) | {"choices": [], "usage": _usage(out)})
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
    async def chat(self, request: Request, body: ChatCompletionRequest) -> Response:
        """``POST /v1/chat/completions``."""
        try:
            self.admit(request, body)
            messages = chat_messages(body.messages)
            for name in ("tools", "logprobs", "top_logprobs"):
                if getattr(body, name):
                    raise APIError(400, f"{name} is not supported by this server", param=name)
            if body.response_format and body.response_format.get("type", "text") != "text":
                raise APIError(400, "response_format other than text is not supported", param="response_format")
            params = sampling_params_from(body, default_max_tokens=None)
        except APIError as e:
            if e.status == 400:
                self.metrics.reject("invalid")
            raise
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        agen, first = await self.start(request, messages, params, rid, "messages", body.cache_salt)
        created = int(time.time())
        base = {"id": rid, "created": created, "model": self.model_name}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def chunk(c, delta, finish_reason, message=None):
                ch = {"index": c if isinstance(c, int) else c.index,
                      "delta": message if message is not None else ({"content": delta} if delta else {}),
                      "logprobs": None, "finish_reason": finish_reason}
                if finish_reason is not None:
                    ch["stop_reason"] = c.stop_reason
                out = base | {"object": "chat.completion.chunk", "system_fingerprint": None, "choices": [ch]}
                if include_usage:
                    out["usage"] = None
                return out

            def opening(index):
                return chunk(index, None, None, message={"role": "assistant", "content": ""})

            return self.stream(agen, first, rid, chunk, include_usage, opening)
        final = await self.complete(request, agen, first)
        error = _error_of(final)
        if error is not None:
            raise APIError(500, error, type="internal_error", code=500)
        return JSONResponse(base | {
            "object": "chat.completion", "system_fingerprint": None,
            "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                         "logprobs": None, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                        for c in final.outputs],
            "usage": _usage(final),
        })

    async def completions(self, request: Request, body: CompletionRequest) -> Response:
        """``POST /v1/completions``."""
        try:
            self.admit(request, body)
            prompt = completion_prompt(body.prompt)
            if body.echo:
                raise APIError(400, "echo is not supported by this server", param="echo")
            if body.logprobs:
                raise APIError(400, "logprobs is not supported by this server", param="logprobs")
            if body.suffix:
                raise APIError(400, "suffix is not supported by this server", param="suffix")
            if body.best_of not in (None, 1):
                raise APIError(400, f"best_of too large: only 1 is supported, got {body.best_of}", param="best_of")
            params = sampling_params_from(body, default_max_tokens=16)  # OpenAI's default for completions
        except APIError as e:
            if e.status == 400:
                self.metrics.reject("invalid")
            raise
        rid = f"cmpl-{uuid.uuid4().hex}"
        agen, first = await self.start(request, prompt, params, rid, "prompt", body.cache_salt)
        base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def chunk(c, delta, finish_reason):
                ch = {"index": c.index, "text": delta or "", "logprobs": None, "finish_reason": finish_reason}
                if finish_reason is not None:
                    ch["stop_reason"] = c.stop_reason
                out = base | {"choices": [ch]}
                if include_usage:
                    out["usage"] = None
                return out

            return self.stream(agen, first, rid, chunk, include_usage)
        final = await self.complete(request, agen, first)
        error = _error_of(final)
        if error is not None:
            raise APIError(500, error, type="internal_error", code=500)
        return JSONResponse(base | {
            "choices": [{"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason,
                         "stop_reason": c.stop_reason} for c in final.outputs],
            "usage": _usage(final),
        })

    def model_card(self) -> dict:
        """The served model as ``/v1/models`` lists it."""
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "cbp",
                "root": self.model_name, "parent": None, "max_model_len": self.engine.config.max_model_len}


def create_api(engine: AsyncEngine, model_name: str | None = None, *, rate_limit: int | None = None,
               rate_period: float = 1.0, retry_after: int = 1, metrics_prefix: str = "cbp",
               app: FastAPI | None = None) -> FastAPI:
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

    Returns:
        The FastAPI app; ``app.state.openai_server`` and ``app.state.metrics`` hold the handlers.
    """
    if model_name is None:
        model_name = getattr(engine.config, "model", None) or DEFAULT_MODEL_NAME
    app = app if app is not None else FastAPI(title="Continuous Batching Playground API")
    metrics = EngineMetrics(engine, model_name, prefix=metrics_prefix)
    limiter = ClientRateLimiter(rate_limit, rate_period) if rate_limit else None
    server = OpenAIServer(engine, model_name, limiter, retry_after, metrics)
    app.state.openai_server = server
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(_ClientGone)
    async def _client_gone(request: Request, exc: _ClientGone):
        return Response(status_code=STATUS_CLIENT_CLOSED)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        metrics.reject("invalid")
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            msg = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg', ''))}"
            return APIError(400, msg, code="invalid_json").response()
        if first.get("type") == "model_attributes_type" or not loc:
            return APIError(400, "the request body must be a JSON object").response()
        param = ".".join(loc)
        return APIError(400, f"{param}: {first.get('msg', 'invalid value')}", param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail), type="invalid_request_error" if exc.status_code < 500
                        else "server_error").response()

    def _unicode_error(body) -> Response | None:
        """A 400 response when a string of the parsed body is not valid Unicode, else None."""
        try:
            _check_unicode(body.model_dump())
        except APIError as e:
            metrics.reject("invalid")
            return e.response()
        return None

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        """OpenAI chat completions (streaming with ``stream: true``)."""
        return _unicode_error(body) or await server.chat(request, body)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        """OpenAI (legacy) text completions (streaming with ``stream: true``)."""
        return _unicode_error(body) or await server.completions(request, body)

    @app.get("/v1/models")
    async def models():
        """The served model."""
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        """One model, 404 when it is not the served one."""
        if model != model_name:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return server.model_card()

    @app.get("/health")
    async def health():
        """200 while the engine thread runs, 503 otherwise."""
        if engine.healthy:
            return {"status": "ok", "model": model_name, "running": engine.num_pending}
        return JSONResponse({"status": "unavailable", "detail": "the engine thread is not running"}, status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics():
        """Prometheus text format."""
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
