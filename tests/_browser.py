"""Shared set-up of the app and browser tests (``tests/test_app_live.py``, ``tests/test_browser_*.py``,
``tests/test_compare.py``): Debian's chromium and its flags, serving a Gradio app on a free loopback port,
and bounded waits."""

from __future__ import annotations

import socket
import time

from bench.browser import CHROMIUM, CHROMIUM_FLAGS
from ui.layout import launch

__all__ = ["CHROMIUM", "CHROMIUM_FLAGS", "free_port", "serve", "wait"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(demo) -> str:
    """Launch ``demo`` (a ``gr.Blocks``) with the app's look on a free loopback port, without blocking;
    returns its URL. Close it with ``demo.close()``."""
    port = free_port()
    launch(demo, server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    return f"http://127.0.0.1:{port}/"


def wait(cond, timeout: float = 30.0, every: float = 0.05):
    """Call ``cond()`` every ``every`` seconds until it returns something truthy or ``timeout`` seconds pass;
    returns its last value."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(every)
    return cond()
