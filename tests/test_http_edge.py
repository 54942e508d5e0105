"""HTTP limits at the edge (``server/http_edge.py``): what a client may send before the app sees a request.

Raw sockets against a small app served by :class:`server.ServerThread` (the same uvicorn protocol as the
playground), with short timeouts so that the slow-client cases take about a second. Before these limits, a
128 MiB header got a 200 after 86 s, 100,000 header fields a 200, and a client sending its head one byte a
second kept its connection for as long as it liked.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
from fastapi import FastAPI, Request

from server.http_edge import HTTPLimits
from server.serving import ServerThread

LIMITS = HTTPLimits(max_header_bytes=8192, max_header_fields=32, max_url_bytes=1024, timeout_request_head=1.0,
                    timeout_request_body=1.0, timeout_keep_alive=5)


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"ok": True}

    @app.get("/slow")
    async def slow():
        await asyncio.sleep(1.5)  # longer than the head and body timeouts: the app's own time is not limited
        return {"ok": True}

    @app.post("/echo")
    async def echo(request: Request):
        return {"bytes": len(await request.body())}

    return app


@pytest.fixture(scope="module")
def edge():
    server = ServerThread(_app(), limits=LIMITS).start()
    yield server
    server.stop()


def exchange(server: ServerThread, *parts: bytes, gap: float = 0.0, timeout: float = 10.0) -> tuple[bytes, float]:
    """Send ``parts`` (``gap`` seconds apart) on a fresh connection and read until the server closes it:
    ``(everything read, seconds from the first byte sent to the close)``. A send that fails because the server
    closed first is not an error."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        start = time.monotonic()
        try:
            for i, part in enumerate(parts):
                if i and gap:
                    time.sleep(gap)
                sock.sendall(part)
        except OSError:  # closed by the server while we were sending: read what it answered
            pass
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except OSError:
            pass
        return got, time.monotonic() - start


def status(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0


def error_code(reply: bytes) -> str:
    return json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"]


def get(path: bytes = b"/health", extra: bytes = b"") -> bytes:
    return b"GET " + path + b" HTTP/1.1\r\nHost: t\r\nConnection: close\r\n" + extra + b"\r\n"


def test_header_block_over_the_limit_gets_431_and_under_it_200(edge):
    reply, _ = exchange(edge, get(extra=b"X-Big: " + b"a" * 100_000 + b"\r\n"))
    assert status(reply) == 431 and error_code(reply) == "request_header_fields_too_large"
    assert b"connection: close" in reply
    assert status(exchange(edge, get(extra=b"X-Big: " + b"a" * 7000 + b"\r\n"))[0]) == 200


def test_header_block_sent_in_pieces_is_counted_across_reads(edge):
    head = get(extra=b"X-Big: " + b"a" * 20_000 + b"\r\n")
    reply, _ = exchange(edge, *(head[i:i + 1000] for i in range(0, len(head), 1000)), gap=0.001)
    assert status(reply) == 431


def test_too_many_header_fields_get_431(edge):
    fields = b"".join(b"X-F%d: 1\r\n" % i for i in range(100))
    reply, _ = exchange(edge, get(extra=fields))
    assert status(reply) == 431 and b"header fields" in reply
    assert status(exchange(edge, get(extra=b"".join(b"X-F%d: 1\r\n" % i for i in range(25))))[0]) == 200


def test_long_request_target_gets_414(edge):
    reply, _ = exchange(edge, get(b"/health?q=" + b"a" * 2000))
    assert status(reply) == 414 and error_code(reply) == "uri_too_long"
    assert status(exchange(edge, get(b"/health?q=" + b"a" * 900))[0]) == 200


def test_slowloris_head_is_dropped_with_408(edge):
    """One byte every 0.1 s: the head would take 6 s; the 1 s head timeout drops it."""
    head = get(extra=b"X-Slow: " + b"s" * 30 + b"\r\n")
    reply, seconds = exchange(edge, *(head[i:i + 1] for i in range(len(head))), gap=0.1)
    assert status(reply) == 408 and error_code(reply) == "request_timeout"
    assert seconds < 3.0


def test_a_connection_that_sends_nothing_is_closed(edge):
    reply, seconds = exchange(edge, b"")
    assert status(reply) == 408 and seconds < 3.0


def test_slow_body_is_dropped_with_408(edge):
    head = b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Type: application/octet-stream\r\nContent-Length: 100\r\n\r\n"
    reply, seconds = exchange(edge, head, b"0123456789")  # then nothing: 90 bytes never come
    assert status(reply) == 408 and b"body" in reply and seconds < 3.0
    ok, _ = exchange(edge, head.replace(b"100", b"10"), b"0123456789")
    assert status(ok) == 200 and ok.endswith(b'{"bytes":10}')


def test_slow_app_and_kept_alive_connections_are_not_cut(edge):
    """The app's own time is not the client's: a 1.5 s answer comes back; on a kept-alive connection the head
    timeout counts from each request's first byte, not from the connection's opening."""
    assert status(exchange(edge, get(b"/slow"))[0]) == 200
    with socket.create_connection(("127.0.0.1", edge.port), timeout=10) as sock:
        for pause in (0.0, 0.7, 0.7):  # 1.4 s after the opening, past the 1 s head timeout
            time.sleep(pause)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")


def test_limits_are_validated():
    for bad in (dict(max_header_bytes=0), dict(max_header_fields=0), dict(timeout_request_head=0.0),
                dict(timeout_request_body=-1.0)):
        with pytest.raises(ValueError):
            HTTPLimits(**bad)
