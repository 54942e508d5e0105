"""What a failure of the remote server probably means, said first in a plain sentence (what probably happened,
what to check), with the technical text kept after it in parentheses::

    The server closed the connection in the middle of the reply: it probably crashed or restarted; check its
    log. (RemoteProtocolError: peer closed connection without sending complete message body)

:class:`RemoteError` carries both parts; :func:`from_exception` words a network error (httpx) and
:func:`from_status` an HTTP error status.
"""

from __future__ import annotations

import httpx


class RemoteError(RuntimeError):
    """The server refused or failed a request.

    Attributes:
        sentence: what probably happened and what to check, for a person.
        detail: the technical text (the exception, the server's message); may be empty.
        status: the HTTP status (0: a connection error, or an error inside the stream).
    """

    def __init__(self, sentence: str, detail: str = "", status: int = 0) -> None:
        self.sentence, self.detail, self.status = sentence, detail, status
        super().__init__(f"{sentence} ({detail})" if detail else sentence)

    @property
    def unreachable(self) -> bool:
        """The server could not be reached or the connection broke (as opposed to an answer that refused)."""
        return self.status == 0 and self.sentence.startswith(_DOWN_PREFIXES)


_NOT_RUNNING = ("The server does not answer{at}: it is probably not running (or still starting), or the URL or "
                "port is wrong; check that it runs and --backend-url.")
_CLOSED = "The server closed the connection in the middle of the reply: it probably crashed or restarted; check its log."
_BROKEN = "The connection to the server broke: it probably crashed or restarted; check its log."
_SLOW = "The server stopped sending for too long: it may be overloaded or stuck; check its log."
_DOWN_PREFIXES = ("The server does not answer", "The server closed the connection", "The connection to the server")


def technical(exc: BaseException) -> str:
    """``"TypeName: first line of the message"`` (the type alone when the message is empty)."""
    text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def from_exception(exc: BaseException, url: str = "") -> RemoteError:
    """A :class:`RemoteError` for a network failure talking to ``url`` (httpx's exceptions, timeouts)."""
    at = f" at {url}" if url else ""
    if isinstance(exc, RemoteError):
        return exc
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, ConnectionRefusedError)):
        sentence = _NOT_RUNNING.format(at=at)
    elif isinstance(exc, httpx.RemoteProtocolError):
        sentence = _CLOSED
    elif isinstance(exc, httpx.ReadError | httpx.WriteError):
        sentence = _BROKEN
    elif isinstance(exc, httpx.TimeoutException | TimeoutError):
        sentence = _SLOW
    elif isinstance(exc, httpx.HTTPError):
        sentence = f"The request to the server{at} failed; check that it runs and --backend-url."
    else:
        sentence = "The server's answer could not be read: is the URL an OpenAI-compatible server? Check --backend-url."
    return RemoteError(sentence, technical(exc))


def from_status(status: int, message: str, route: str = "/v1/chat/completions") -> RemoteError:
    """A :class:`RemoteError` for an HTTP error ``status`` of ``route`` with the server's ``message``."""
    if status in (400, 413, 422):
        sentence = (f"The server refused the request (HTTP {status}): the conversation may be longer than its "
                    "context, or a setting is out of its range; clear the chat or change the setting.")
    elif status in (401, 403):
        sentence = f"The server refused the request (HTTP {status}): check --backend-api-key."
    elif status == 404 and route == "/v1/chat/completions":
        sentence = (f"The server has no {route} (HTTP 404): the URL is probably not an OpenAI-compatible server, "
                    "or it does not serve the model named; check --backend-url and --backend-model.")
    elif status == 404:
        sentence = (f"The server has no {route} (HTTP 404): the URL is probably not a vLLM, SGLang or other "
                    "OpenAI-compatible server; check --backend-url.")
    elif status in (429, 503):
        sentence = f"The server is busy (HTTP {status}): send again in a moment."
    elif status >= 500:
        sentence = f"The server failed the request (HTTP {status}): check its log."
    else:
        sentence = f"The server answered HTTP {status} to {route}."
    return RemoteError(sentence, message.strip()[:300], status)
