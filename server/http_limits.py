"""The HTTP limits at the server's edge, as values: what a client may send before the app sees a request
(:class:`HTTPLimits`), with their defaults. :mod:`server.options` declares them as options,
:mod:`server.http_edge` enforces them in uvicorn's protocol.
"""

from __future__ import annotations

from dataclasses import dataclass

# The edge's defaults (the options' too, server/options.py): far above what browsers and SDKs send
# (a browser's request head is 0.5-2 KiB in 10-20 fields, 8-16 KiB with many cookies; nginx refuses heads
# over 32 KiB and URLs over 8 KiB, Node.js heads over 16 KiB, Apache more than 100 fields), and small
# enough that a client gets nothing from pushing them: a head is refused before 64 KiB + one read is buffered.
DEFAULT_MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_HEADER_FIELDS = 256  # vLLM's (CVE-2025-48956)
DEFAULT_MAX_URL_BYTES = 16 * 1024
DEFAULT_TIMEOUT_REQUEST_HEAD = 20.0  # seconds (Apache's mod_reqtimeout: 20-40 s for a head)
DEFAULT_TIMEOUT_REQUEST_BODY = 60.0  # seconds
DEFAULT_TIMEOUT_KEEP_ALIVE = 5  # seconds (uvicorn's)


@dataclass(frozen=True)
class HTTPLimits:
    """Limits on what a client sends (defaults: the ``DEFAULT_*`` above, where they are explained).

    Attributes:
        max_header_bytes: most bytes of a request head (request line and header fields) -> 431.
        max_header_fields: most header fields of a request -> 431.
        max_url_bytes: most bytes of a request target (path and query) -> 414.
        timeout_request_head: seconds a request head may take to arrive -> 408.
        timeout_request_body: seconds a request body may take to arrive once its head has -> 408.
        timeout_keep_alive: seconds an idle kept-alive connection stays open (uvicorn's).
    """

    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_header_fields: int = DEFAULT_MAX_HEADER_FIELDS
    max_url_bytes: int = DEFAULT_MAX_URL_BYTES
    timeout_request_head: float = DEFAULT_TIMEOUT_REQUEST_HEAD
    timeout_request_body: float = DEFAULT_TIMEOUT_REQUEST_BODY
    timeout_keep_alive: int = DEFAULT_TIMEOUT_KEEP_ALIVE

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_header_fields", "max_url_bytes", "timeout_keep_alive"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("timeout_request_head", "timeout_request_body"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

