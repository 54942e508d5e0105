"""HTTP limits at the edge: what a client may send before the app sees a request, enforced in uvicorn's
fast HTTP/1.1 protocol (httptools, llhttp's parser).

llhttp parses any request head, however long: httptools gathers a header value in one ``bytes`` object
grown by concatenation until the value ends (a 128 MiB header took 86 s and then reached the app), and
uvicorn puts every field in the ASGI scope (100,000 fields reached the app too); uvicorn's only timeout
is the keep-alive one, armed after a response, so a client that opens a connection and sends its head
one byte a second (slowloris) holds it forever. h11, uvicorn's other parser, bounds the head's size
(``h11_max_incomplete_event_size``, answered 400) but not its fields or its pace, and serves about half
as many small requests a second as httptools here (``python -m bench.hostile --parsers``). So the
limits are a small subclass of uvicorn's httptools protocol, :class:`EdgeProtocol`, bound to one
:class:`HTTPLimits` with :func:`protocol_class` and given to ``uvicorn.Config(http=...)``:

- **head size**: request line and header fields together over ``max_header_bytes`` -> 431, counted per
  read while the head is incomplete (at most one read, 64-256 KiB, past the limit is ever buffered), and
  from the parsed fields once it is complete;
- **field count**: more than ``max_header_fields`` fields -> 431;
- **request target**: a URL over ``max_url_bytes`` -> 414;
- **slow head**: the head not complete ``timeout_request_head`` seconds after the connection opened (its
  first request) or after the request's first byte (later ones on a kept-alive connection) -> 408, closed;
- **slow body**: a body not complete ``timeout_request_body`` seconds after its head (time while the app
  has not yet asked for it does not count) -> 408 when nothing was answered yet, then closed;
- **idle keep-alive**: uvicorn's own ``timeout_keep_alive``.

Each refusal is an OpenAI-style JSON error body with ``Connection: close``; the connection is closed after it.
The request body's own limit (413) sits in the app, :class:`server.http_guards.BodySizeLimit`.
"""

from __future__ import annotations

import asyncio
import json
import time

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from server.options import HTTPLimits  # re-exported: the limits live with the options that set them

__all__ = ["HTTPLimits", "EdgeProtocol", "protocol_class"]


_REASONS = {408: "Request Timeout", 414: "URI Too Long", 431: "Request Header Fields Too Large"}


class _Refused(Exception):
    """Raised from a parser callback to stop parsing a request that breaks a limit."""


class EdgeProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with :class:`HTTPLimits` (the class attribute ``limits``; make a bound
    subclass with :func:`protocol_class`). Phases of a connection: ``idle`` (no request begun), ``head``
    (a request begun, its head incomplete), ``body`` (head complete, message incomplete)."""

    limits: HTTPLimits = HTTPLimits()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._phase = "idle"
        self._head_bytes = 0
        self._fields = 0
        self._url_bytes = 0
        self._begun = 0  # requests begun during the current read
        self._refusal: tuple[int, str] | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_started = 0.0

    # ------------------------------------------------------------------ connection
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Feed the parser (as uvicorn does), then check the head's size; a broken limit is answered here."""
        self._unset_keepalive_if_required()
        before, self._begun = self._phase, 0
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self._refusal is not None:
                self._refuse(*self._refusal)
                return
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self._cancel_timers()
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        if self._phase == "head":
            # all of this read is head when the head was already under way, or when this read began the only
            # request it holds on an idle connection; after a pipelined message it is not counted (under-count)
            if (before == "head" and self._begun == 0) or (before == "idle" and self._begun == 1):
                self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_header_bytes:
                self._refuse(431, self._head_too_large())

    def _head_too_large(self) -> str:
        return f"the request head is larger than the server's limit of {self.limits.max_header_bytes} bytes " \
               "(--max-header-bytes)"

    # ------------------------------------------------------------------ parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._phase, self._head_bytes, self._fields, self._url_bytes = "head", 0, 0, 0
        self._begun += 1
        if self._head_timer is None:
            self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        self._url_bytes += len(url)
        if self._url_bytes > self.limits.max_url_bytes:
            self._refusal = (414, f"the request target is longer than the server's limit of "
                                  f"{self.limits.max_url_bytes} bytes (--max-url-bytes)")
            raise _Refused()
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields += 1
        if self._fields > self.limits.max_header_fields:
            self._refusal = (431, f"the request has more header fields than the server's limit of "
                                  f"{self.limits.max_header_fields} (--max-header-fields)")
            raise _Refused()
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        # a head that arrived whole in one read was not counted by data_received: its fields are all here
        size = self._url_bytes + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > self.limits.max_header_bytes:
            self._refusal = (431, self._head_too_large())
            raise _Refused()
        self._phase = "body"
        self._cancel_head_timer()
        super().on_headers_complete()
        if self._has_body():
            self._body_started = time.monotonic()
            self._body_timer = self.loop.call_later(self.limits.timeout_request_body, self._body_timeout)

    def on_message_complete(self) -> None:
        self._phase = "idle"
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    # ------------------------------------------------------------------ timeouts
    def _has_body(self) -> bool:
        for name, value in self.headers:
            if name == b"transfer-encoding" or (name == b"content-length" and value.strip() not in (b"0", b"")):
                return True
        return False

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.limits.timeout_request_head, self._head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _cancel_timers(self) -> None:
        self._cancel_head_timer()
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self._phase == "body":
            return
        if self.cycle is not None and not self.cycle.response_complete:  # a pipelined head behind a response
            self._arm_head_timer()
            return
        self._refuse(408, f"the request head did not arrive within {self.limits.timeout_request_head:g} s "
                          "(--timeout-request-head)")

    def _body_timeout(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self._phase != "body":
            return
        cycle = self.cycle
        if self.flow.read_paused or (cycle is not None and cycle.waiting_for_100_continue):
            # the app has not asked for the body yet: the client is not the slow one
            self._body_started = time.monotonic()
            self._body_timer = self.loop.call_later(self.limits.timeout_request_body, self._body_timeout)
            return
        if cycle is not None and cycle.response_started:
            self.transport.close()
            return
        self._refuse(408, f"the request body did not arrive within {self.limits.timeout_request_body:g} s "
                          "(--timeout-request-body)")

    # ------------------------------------------------------------------ refusals
    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` with an OpenAI-style error body and close the connection."""
        self._cancel_timers()
        self._refusal = None
        if self.transport.is_closing():
            return
        code = {408: "request_timeout", 414: "uri_too_long", 431: "request_header_fields_too_large"}[status]
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": code}}).encode("ascii")
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                 b"connection: close\r\n\r\n"]
        self.logger.info("refused a request: %d %s (%s)", status, _REASONS[status], message)
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the app's task (if any) sees a disconnect, writes nothing more
            self.cycle.message_event.set()
        self.transport.write(b"".join(head) + body)
        self.transport.close()


def protocol_class(limits: HTTPLimits) -> type[EdgeProtocol]:
    """A subclass of :class:`EdgeProtocol` bound to ``limits``, for ``uvicorn.Config(http=...)``."""
    return type("EdgeProtocol", (EdgeProtocol,), {"limits": limits})
