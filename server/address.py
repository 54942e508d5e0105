"""Where the server listens: the address rules and the listening socket, bound before anything heavy loads.

:func:`bind` binds the port at once (well under a second), so a port in use fails the start before the engine
loads, with one line (:class:`PortInUseError`); uvicorn then serves on that very socket (no race between a
check and the real bind). Imports nothing heavy: ``app.py`` calls it before torch is imported.
"""

from __future__ import annotations

import errno
import os
import socket

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7860


class PortInUseError(OSError):
    """The address cannot be bound (in use, or not an address of this machine); the message is one line."""


def port_free(host: str, port: int) -> bool:
    """Whether ``port`` can be bound on ``host`` now (the socket is closed again)."""
    with socket.socket(_family(host)) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def resolve_address(host: str | None = None, port: int | None = None) -> tuple[str, int]:
    """``host`` / ``port``, else ``GRADIO_SERVER_NAME`` / ``GRADIO_SERVER_PORT`` (as on Hugging Face
    Spaces), else 127.0.0.1 and the first free port from 7860 (as ``demo.launch`` does)."""
    host = host or os.environ.get("GRADIO_SERVER_NAME") or DEFAULT_HOST
    if port is None and os.environ.get("GRADIO_SERVER_PORT"):
        port = int(os.environ["GRADIO_SERVER_PORT"])
    if port is None:
        port = next((p for p in range(DEFAULT_PORT, DEFAULT_PORT + 100) if port_free(host, p)), DEFAULT_PORT)
    return host, port


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def bind(host: str | None = None, port: int | None = None) -> socket.socket:
    """A TCP socket bound to the resolved address (:func:`resolve_address`) and listening, ready for
    ``uvicorn.Server.run(sockets=[...])``.

    Raises:
        PortInUseError: the port is in use or the host is not an address of this machine (one line that says
            which and how to choose another, e.g. ``--port``).
    """
    host, port = resolve_address(host, port)
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is reusable
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        why = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror or exc})"
        raise PortInUseError(f"port {port} on {host} {why}; choose another with --port (or CBP_PORT), or stop "
                             f"the process that holds it") from None
    return sock
