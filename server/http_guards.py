"""HTTP-level guards of the API, in front of FastAPI's routing (plain ASGI middleware).

- :class:`BodySizeLimit`: a request body over ``max_body_bytes`` is answered 413 without being read
  whole: a ``Content-Length`` over the limit is refused before any byte of the body is read, and a body
  without one (chunked) is counted while it streams in and refused as soon as it passes the limit. At
  most ``max_body_bytes`` are ever buffered per request. A body sent with ``Content-Encoding: gzip`` or
  ``deflate`` is decoded as it arrives, under the same limit for its decoded size (a zip bomb stops at the
  limit: 413), and handed on decoded; a body in any other coding is answered 415 with ``Accept-Encoding``.
  Once a large body has been answered, its memory is given back (:class:`server.memory.MemoryRelease`:
  cyclic garbage collected, C heap trimmed).
- :class:`MethodCheck`: a known API path asked with a method it does not serve (``GET
  /v1/chat/completions``) is answered 405 with an ``Allow`` header, even when a catch-all mount
  (the Gradio page at ``/``) would otherwise take it and answer 404.
- :class:`APICors`: Starlette's ``CORSMiddleware`` on the API's paths only (preflights answered, and the
  ``Access-Control-*`` headers on every actual response, errors included); the Gradio page keeps its own rule.

Both answer with the API's OpenAI-style error body (:class:`server.protocol.APIError`) and count the
refusal in ``cbp:api_rejected_requests_total`` through ``on_reject(reason)``.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Match, Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.memory import MemoryRelease
from server.options import DEFAULT_MAX_BODY_BYTES, CORSSettings
from server.protocol import APIError

__all__ = ["DEFAULT_MAX_BODY_BYTES", "APICors", "BodySizeLimit", "MethodCheck"]

ACCEPTED_ENCODINGS = "gzip, deflate"  # request body codings decoded (answered in a 415's Accept-Encoding)


async def _answer(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    await error.response()(scope, receive, send)


class BodySizeLimit:
    """Refuse request bodies over ``max_body_bytes`` (HTTP 413) on paths starting with one of ``prefixes``.

    Args:
        app: the ASGI app behind.
        max_body_bytes: the largest body accepted (bytes, >= 1), sent and, for a coded body, decoded.
        on_reject: called with ``"too_large"`` (413), ``"unsupported_encoding"`` (415) or ``"invalid"`` (a
            malformed ``Content-Length`` or coded body: 400).
        prefixes: the guarded paths (the API's; the page's own routes are left to Gradio).
        release: told the size of each body read once its request has ended (None: a default
            :class:`~server.memory.MemoryRelease`, which acts after bodies of 1 MiB or more).
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int, on_reject: Callable[[str], None],
                 prefixes: tuple[str, ...] = ("/v1/",), release: MemoryRelease | None = None) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        self.app = app
        self.max_body_bytes = int(max_body_bytes)
        self.on_reject = on_reject
        self.prefixes = prefixes
        self.release = release if release is not None else MemoryRelease()

    def _too_large(self) -> APIError:
        self.on_reject("too_large")
        return APIError(413, f"the request body is larger than the server's limit of {self.max_body_bytes} bytes "
                        "(--max-request-body-bytes)", param=None, code="request_too_large")

    def _decoder(self, scope: Scope) -> tuple[zlib._Decompress | None, APIError | None]:
        """The decoder of the body's ``Content-Encoding`` (None: identity), or the error answering it."""
        coding = b",".join(v for k, v in scope["headers"] if k == b"content-encoding").strip().lower()
        if coding in (b"", b"identity"):
            return None, None
        if coding in (b"gzip", b"x-gzip"):
            return zlib.decompressobj(16 + zlib.MAX_WBITS), None
        if coding == b"deflate":  # zlib-wrapped (RFC 9110) or raw, as clients send both
            return zlib.decompressobj(32 + zlib.MAX_WBITS), None
        self.on_reject("unsupported_encoding")
        shown = coding.decode("latin-1")[:64]
        return None, APIError(415, f"request bodies in Content-Encoding {shown!r} are not accepted; send them "
                              f"plain or in one of: {ACCEPTED_ENCODINGS}", code="unsupported_content_encoding",
                              headers={"Accept-Encoding": ACCEPTED_ENCODINGS})

    def _decode(self, decoder: zlib._Decompress, data: bytes, decoded: int) -> bytes:
        """``data`` decoded, at most one byte past the limit (``decoded``: bytes decoded before).

        Raises:
            zlib.error: not valid data of the coding.
        """
        room = self.max_body_bytes - decoded + 1
        return decoder.decompress(data, room) if room > 0 else b""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefixes):
            await self.app(scope, receive, send)
            return
        decoder, refusal = self._decoder(scope)
        if refusal is not None:
            await _answer(refusal, scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = -1
            if declared < 0:
                self.on_reject("invalid")
                await _answer(APIError(400, "malformed Content-Length header", code="invalid_request"),
                              scope, receive, send)
                return
            if declared > self.max_body_bytes:
                await _answer(self._too_large(), scope, receive, send)
                return
        chunks: list[bytes] = []
        size = decoded = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left (or was dropped as too slow) mid-body
                self.release.request_ended(size)
                return  # nothing to answer (the app would only fail to read the body)
            body = message.get("body", b"")
            size += len(body)
            if decoder is not None and body:
                try:
                    body = self._decode(decoder, body, decoded)
                except zlib.error:
                    chunks.clear()
                    self.on_reject("invalid")
                    await _answer(APIError(400, "the request body is not valid data of its Content-Encoding",
                                           code="invalid_content_encoding"), scope, receive, send)
                    self.release.request_ended(size)
                    return
                decoded += len(body)
            if size > self.max_body_bytes or decoded > self.max_body_bytes:
                chunks.clear()
                await _answer(self._too_large(), scope, receive, send)
                self.release.request_ended(size + decoded)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                if decoder is not None and not decoder.eof:
                    chunks.clear()
                    self.on_reject("invalid")
                    await _answer(APIError(400, "the request body ends before the end of its Content-Encoding's "
                                           "data", code="invalid_content_encoding"), scope, receive, send)
                    self.release.request_ended(size)
                    return
                chunks_message: Message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                break
        if decoder is not None:  # the app sees the decoded body, as if sent plain
            headers = [(k, v) for k, v in scope["headers"] if k not in (b"content-encoding", b"content-length")]
            headers.append((b"content-length", str(decoded).encode("ascii")))
            scope = {**scope, "headers": headers}
            size += decoded
        replayed = False

        async def replay() -> Message:
            nonlocal replayed, chunks_message
            if not replayed:  # handed over once, then not kept here (the app holds the body while it needs it)
                replayed = True
                message, chunks_message = chunks_message, {}
                return message
            return await receive()

        chunks.clear()
        try:
            await self.app(scope, replay, send)
        finally:
            self.release.request_ended(size)


class MethodCheck:
    """Answer 405 with ``Allow`` for a path one of the app's API routes serves, asked with another method.

    Args:
        app: the ASGI app behind.
        router_app: the FastAPI / Starlette app whose routes are checked (mounts are skipped).
        on_reject: called with ``"method_not_allowed"``.
    """

    def __init__(self, app: ASGIApp, router_app, on_reject: Callable[[str], None]) -> None:
        self.app = app
        self.router_app = router_app
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            allowed: set[str] = set()
            for route in self.router_app.router.routes:
                if isinstance(route, Mount):
                    continue
                match, _ = route.matches(scope)
                if match == Match.FULL:
                    allowed = set()
                    break
                if match == Match.PARTIAL:
                    allowed |= set(getattr(route, "methods", None) or ())
            if allowed:
                self.on_reject("method_not_allowed")
                allow = ", ".join(sorted(allowed))
                await _answer(APIError(405, f"method {scope['method']} is not allowed on {scope['path']}; "
                                       f"allowed: {allow}", code="method_not_allowed", headers={"Allow": allow}),
                              scope, receive, send)
                return
        await self.app(scope, receive, send)


class APICors:
    """Starlette's ``CORSMiddleware`` with ``settings`` on the paths starting with one of ``prefixes`` (the API's),
    other paths passed on untouched (the Gradio page answers its own preflights).

    Args:
        app: the ASGI app behind.
        settings: the allowed origins, methods, headers and credentials (:class:`server.options.CORSSettings`).
        prefixes: the paths it applies to.
    """

    def __init__(self, app: ASGIApp, settings: CORSSettings,
                 prefixes: tuple[str, ...] = ("/v1/", "/health", "/metrics")) -> None:
        self.app = app
        self.prefixes = prefixes
        self.cors = CORSMiddleware(app, allow_origins=list(settings.origins), allow_methods=list(settings.methods),
                                   allow_headers=list(settings.headers), allow_credentials=settings.credentials)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.prefixes):
            await self.cors(scope, receive, send)
        else:
            await self.app(scope, receive, send)
