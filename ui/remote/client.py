"""Remote mode: chats streamed from an OpenAI-compatible server (vLLM, SGLang, a router in front of them, or this
project's own server), each one recorded as the client sees it.

:class:`RemoteClient` posts ``/v1/chat/completions`` with ``stream: true`` and yields the text as it arrives;
leaving the stream (``aclose()``, a cancelled task, Stop) closes the HTTP connection, which vLLM, SGLang and our
server take as an abort. Every request leaves a :class:`RequestRecord` in a :class:`RequestLog`: when it was sent,
when its first token came, when it ended and how, and the replica that served it when a response header names it
(:data:`REPLICA_HEADERS`; else None, "unknown"). :class:`RemoteLoad` is the load generator: synthetic chats
(:func:`engine.prompts.synthetic_chat`) at a rate, through the same client.

Times are the client's wall clock (``time.time()``, seconds): "queued" (sent until the first token) thus holds the
network, the server's queue and its prefill together; nothing here sees inside the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from engine import synthetic_chat
from ui.loadgen import ChatTasks, run_size
from ui.remote.errors import RemoteError, from_exception, from_status

__all__ = ["REPLICA_HEADERS", "STATUSES", "RemoteClient", "RemoteError", "RemoteLoad", "RequestLog", "RequestRecord"]

# response headers that name the replica behind a router (the first present wins); none is standard
REPLICA_HEADERS: tuple[str, ...] = ("x-replica", "x-served-by", "x-backend-server", "x-upstream-addr",
                                    "x-worker-id", "x-instance-id")
STATUSES = ("queued", "decoding", "finished", "aborted", "error")


@dataclass
class RequestRecord:
    """One request as the client saw it (times: ``time.time()`` seconds).

    Attributes:
        request_id: the id sent as ``X-Request-Id`` (``chat-…`` or ``load-<run>-…``).
        source: ``"chat"`` or ``"load"``.
        submitted: when the request was sent.
        first_token: when the first text arrived (None: not yet / never).
        ended: when the stream ended (None: still streaming).
        status: ``"queued"`` (sent, no token yet), ``"decoding"``, ``"finished"``, ``"aborted"`` (the client
            left: Stop, cancelled) or ``"error"``.
        finish_reason: the server's (``stop``, ``length``...), None when it sent none.
        replica: the replica a response header named, None when unknown.
        chunks: text chunks received.
        completion_tokens: the server's usage count, when it sent one.
        error: the error message (status ``"error"``).
    """

    request_id: str
    source: str
    submitted: float
    first_token: float | None = None
    ended: float | None = None
    status: str = "queued"
    finish_reason: str | None = None
    replica: str | None = None
    chunks: int = 0
    completion_tokens: int | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        """Seconds from sending to the first text, as the client saw it."""
        return None if self.first_token is None else self.first_token - self.submitted


class RequestLog:
    """The newest ``maxlen`` requests of this page (all tabs), oldest first; thread-safe."""

    def __init__(self, maxlen: int = 2000) -> None:
        self.maxlen = maxlen
        self._records: deque[RequestRecord] = deque()
        self._by_id: dict[str, RequestRecord] = {}
        self._lock = threading.Lock()

    def new(self, source: str, request_id: str | None = None) -> RequestRecord:
        """A record for a request being sent now (``request_id`` default: ``<source>-<12 hex>``)."""
        rec = RequestRecord(request_id or f"{source}-{uuid.uuid4().hex[:12]}", source, time.time())
        with self._lock:
            self._records.append(rec)
            self._by_id[rec.request_id] = rec
            while len(self._records) > self.maxlen:
                old = self._records.popleft()
                if self._by_id.get(old.request_id) is old:
                    del self._by_id[old.request_id]
        return rec

    def records(self, since: float | None = None) -> list[RequestRecord]:
        """The records (the objects themselves, oldest first); ``since``: only those still going or ended
        after that time (seconds since the epoch)."""
        with self._lock:
            recs = list(self._records)
        if since is None:
            return recs
        return [r for r in recs if r.ended is None or r.ended >= since]

    def get(self, request_id: str) -> RequestRecord | None:
        """The record of ``request_id``, None when unknown (or dropped as old)."""
        with self._lock:
            return self._by_id.get(request_id)


def _replica_of(headers: httpx.Headers, names: Sequence[str]) -> str | None:
    return next((headers[n] for n in names if headers.get(n)), None)


MAX_LINE_CHARS = 4 * 1024 * 1024  # one server-sent event line (a chunk is a few hundred bytes)
_UNREADABLE = "The server sent a reply this page cannot read: is the URL an OpenAI-compatible server? Check --backend-url."


class RemoteClient:
    """Streams chat completions from one OpenAI-compatible server.

    Args:
        base_url: the server (``http://host:8000``; a trailing ``/v1`` is accepted).
        model: the ``model`` field sent; None: the first id of the server's ``/v1/models`` (asked once).
        api_key: sent as ``Authorization: Bearer …`` when given.
        timeout: seconds to wait for the next bytes of a response (a stream may last longer in total).
        connect_timeout: seconds to connect.
        log: where the requests are recorded (default: a new :class:`RequestLog`).
        replica_headers: response headers that may name the replica (see :data:`REPLICA_HEADERS`).
        transport: an ``httpx`` async transport (tests); default: the network.

    Each stream opens its own connection, so closing it is seen by the server at once.
    """

    def __init__(self, base_url: str, model: str | None = None, *, api_key: str | None = None,
                 timeout: float = 600.0, connect_timeout: float = 10.0, log: RequestLog | None = None,
                 replica_headers: Sequence[str] = REPLICA_HEADERS,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.model = model
        self.log = log if log is not None else RequestLog()
        self.replica_headers = tuple(h.lower() for h in replica_headers)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = httpx.Timeout(timeout, connect=connect_timeout)
        self._transport = transport

    def _http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, headers=self._headers, timeout=self._timeout,
                                 transport=self._transport)

    async def list_models(self, timeout: float | None = None) -> list[str]:
        """The model ids of ``GET /v1/models``, in the server's order (``timeout``: seconds, default the client's).

        Raises:
            RemoteError: the server cannot be reached, answers an error status or no model list.
        """
        try:
            async with self._http() as http:
                r = await http.get("/v1/models", timeout=timeout if timeout is not None else self._timeout)
                if r.status_code != 200:
                    raise from_status(r.status_code, _message(r.text), "/v1/models")
                body = r.json()
        except httpx.HTTPError as exc:
            raise from_exception(exc, self.base_url) from None
        except ValueError as exc:
            raise RemoteError("The server's /v1/models is not JSON: is the URL an OpenAI-compatible server? Check "
                              "--backend-url.", f"{type(exc).__name__}: {exc}") from None
        data = body.get("data") if isinstance(body, dict) else None
        ids = [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m] if isinstance(data, list) else []
        if not ids:
            raise RemoteError("The server lists no model at /v1/models: pass the model's name with --backend-model.",
                              f"{self.base_url}/v1/models lists no model")
        return ids

    async def resolve_model(self) -> str:
        """The model name to send: ``model`` if given, else the first of ``GET /v1/models`` (then kept).

        Raises:
            RemoteError: the server cannot be reached or lists no model.
        """
        if not self.model:
            self.model = (await self.list_models())[0]
        return self.model

    async def stream_chat(self, messages: list[dict[str, Any]], *, max_tokens: int = 256, temperature: float = 0.7,
                          top_p: float = 1.0, seed: int | None = None, source: str = "chat",
                          request_id: str | None = None, extra: dict[str, Any] | None = None) -> AsyncIterator[str]:
        """Stream one chat completion: yields each text delta (str) as it arrives.

        Leaving the iteration early (``aclose()``, ``break``, a cancelled task) closes the connection (the server
        aborts the request) and records the request as ``"aborted"``.

        Args:
            messages: OpenAI chat messages.
            max_tokens: most tokens to generate.
            temperature, top_p: sampling (as the OpenAI API).
            seed: sampling seed (None: the server's choice).
            source: ``"chat"`` or ``"load"`` (recorded).
            request_id: sent as ``X-Request-Id`` (default: a new one).
            extra: more body fields (``ignore_eos``, ``min_tokens``...), sent as given.

        Raises:
            RemoteError: the server answered with an error status, sent an error event, closed the stream
                before its end (no ``[DONE]`` and no finish reason), or could not be reached (the record's status
                is then ``"error"``).
        """
        rec = self.log.new(source, request_id)
        try:
            model = await self.resolve_model()
            body: dict[str, Any] = {"model": model, "messages": messages, "stream": True, "max_tokens": int(max_tokens),
                                    "temperature": float(temperature), "top_p": float(top_p),
                                    "stream_options": {"include_usage": True}}
            if seed is not None:
                body["seed"] = int(seed)
            body.update(extra or {})
            async with self._http() as http, http.stream("POST", "/v1/chat/completions", json=body,
                                                         headers={"X-Request-Id": rec.request_id}) as resp:
                rec.replica = _replica_of(resp.headers, self.replica_headers)
                if resp.status_code != 200:
                    text = (await resp.aread()).decode("utf-8", "replace")
                    raise from_status(resp.status_code, _message(text))
                kind = resp.headers.get("content-type", "")
                if not kind.startswith("text/event-stream"):
                    raise RemoteError("The server did not answer with a stream of events: the URL is probably not "
                                      "an OpenAI-compatible server; check --backend-url.",
                                      f"it answered {kind or 'no content type'}, not text/event-stream")
                done = False
                async for line in resp.aiter_lines():
                    if len(line) > MAX_LINE_CHARS:
                        raise RemoteError(_UNREADABLE, f"an event line of over {MAX_LINE_CHARS:,} characters")
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    text = self._chunk(rec, data)
                    if text:
                        yield text
                if not done and rec.finish_reason is None:  # closed mid-reply: the text is cut, not a reply
                    raise RemoteError("The server closed the reply before it was finished; check its log.",
                                      "the event stream ended without [DONE] or a finish reason")
            rec.status = "finished"
        except (GeneratorExit, asyncio.CancelledError):
            rec.status = "aborted"
            raise
        except RemoteError as exc:
            rec.status, rec.error = "error", str(exc)
            raise
        except Exception as exc:  # noqa: BLE001 -- whatever a server sends, the chat ends with an error
            err = from_exception(exc, self.base_url)
            rec.status, rec.error = "error", str(err)
            raise err from None
        finally:
            rec.ended = time.time()

    def _chunk(self, rec: RequestRecord, data: str) -> str:
        """Apply one SSE data line to ``rec``; the text it carries."""
        try:
            obj = json.loads(data)
        except ValueError:
            return ""
        if not isinstance(obj, dict):
            return ""
        if "error" in obj:
            raise RemoteError("The server ended the reply with an error; check its log.", _message(json.dumps(obj)))
        usage = obj.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            rec.completion_tokens = usage["completion_tokens"]
        text = ""
        choices = obj.get("choices") or []
        if not isinstance(choices, list):
            raise RemoteError(_UNREADABLE, "a stream chunk whose choices is not a list")
        for choice in choices:
            delta = choice.get("delta") if isinstance(choice, dict) else None
            content = delta.get("content") if isinstance(delta, dict) else None
            if not isinstance(choice, dict) or not isinstance(delta or {}, dict) or \
                    not isinstance(content, (str, type(None))):
                raise RemoteError(_UNREADABLE, "a stream chunk not shaped as OpenAI's (choices[].delta.content)")
            text += content or ""
            if choice.get("finish_reason"):
                rec.finish_reason = str(choice["finish_reason"])
        if text:
            if rec.first_token is None:
                rec.first_token = time.time()
                rec.status = "decoding"
            rec.chunks += 1
        return text


def _message(text: str) -> str:
    """The ``error.message`` of an OpenAI-style error body (or the top-level ``message`` of vLLM's older one),
    else the text's start."""
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        body = json.loads(text)
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if isinstance(body.get("message"), str):
            return body["message"]
    return text.strip()[:300]


class RemoteLoad:
    """The load generator of remote mode: synthetic chats at a rate, streamed through ``client``; one per process.

    Call :meth:`start` and :meth:`stop` from the event loop the chats should run on (the page's handlers').

    Args:
        client: the :class:`RemoteClient` (its log records the chats, source ``"load"``).
        seed: seed of the prompts, lengths and sampling seeds.
    """

    def __init__(self, client: RemoteClient, seed: int = 20261129) -> None:
        self.client = client
        self.rng = random.Random(seed)
        self.run = 0
        self.requested = 0
        self._ids: list[str] = []  # the current run's request ids
        self._chats = ChatTasks()

    async def _one(self, run: int, temperature: float) -> None:
        messages, max_tokens = synthetic_chat(self.rng)
        rid = f"load-{run}-{uuid.uuid4().hex[:8]}"
        if run == self.run:
            self._ids.append(rid)
        with contextlib.suppress(RemoteError):  # recorded in the log; one failed chat must not stop the others
            async for _ in self.client.stream_chat(messages, max_tokens=max_tokens, temperature=temperature,
                                                   top_p=0.95, seed=self.rng.randrange(1 << 30), source="load",
                                                   request_id=rid):
                pass

    def start(self, n: int, rate: float, temperature: float = 0.8) -> None:
        """Begin a new run of ``n`` chats at ``rate`` chats per second (earlier runs' chats go on).

        Raises:
            ValueError: ``rate <= 0``.
            RuntimeError: no running event loop.
        """
        size = run_size(n, rate)
        if size is None:
            return
        n, rate = size
        self.run += 1
        self.requested, self._ids = n, []
        run = self.run
        self._chats.spawn(self._chats.pace(n, rate, lambda: self._one(run, temperature)))

    def stop(self) -> int:
        """Cancel every synthetic chat (their connections close: the server aborts them) and pending start.

        Returns:
            how many tasks were cancelled.
        """
        return self._chats.cancel_all()

    @property
    def active(self) -> int:
        """Chats and pacing tasks not done, of every run."""
        return self._chats.active

    def counts(self) -> dict[str, int]:
        """The current run's requests by status (keys :data:`STATUSES`, plus ``"requested"``)."""
        out = dict.fromkeys(STATUSES, 0)
        for rid in list(self._ids):
            rec = self.client.log.get(rid)
            if rec is not None:
                out[rec.status] += 1
        out["requested"] = self.requested
        return out

    def status(self) -> str:
        """One line: ``run 2: 16 requested · 3 queued · 5 decoding · 8 finished · 0 stopped · 0 failed``."""
        if self.run == 0:
            return "no run yet"
        c = self.counts()
        return (f"run {self.run}: {c['requested']} requested · {c['queued']} queued · {c['decoding']} decoding · "
                f"{c['finished']} finished · {c['aborted']} stopped · {c['error']} failed")
