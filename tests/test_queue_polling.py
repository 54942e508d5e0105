"""Gradio's queue polls quietly in every way the app serves a page (``ui.queue_polling``): its 1 ms loop
would wake the event loop ~1,000 times a second beside the engine's compute threads."""

from __future__ import annotations

from types import SimpleNamespace

import gradio as gr
import pytest

import app
from ui.queue_polling import PROGRESS_POLL_S, QUEUE_POLL_S, quiet_queue


def _demo_unqueued() -> gr.Blocks:
    with gr.Blocks() as demo:
        gr.Textbox()
    return demo


def _queued_demo() -> gr.Blocks:
    return _demo_unqueued().queue()


def test_quiet_queue_sets_gradio_poll_intervals_and_never_shortens_them():
    demo = _queued_demo()
    assert demo._queue.sleep_when_free < QUEUE_POLL_S  # Gradio's own: 1 ms (50 ms on Windows)
    assert quiet_queue(demo)
    assert demo._queue.sleep_when_free == QUEUE_POLL_S
    assert demo._queue.progress_update_sleep_when_free == PROGRESS_POLL_S
    assert quiet_queue(demo, poll_s=0.001, progress_s=0.001)  # never more often than already set
    assert demo._queue.sleep_when_free == QUEUE_POLL_S
    assert demo._queue.progress_update_sleep_when_free == PROGRESS_POLL_S


def test_quiet_queue_without_a_queue_is_a_warning_not_an_error(caplog):
    assert quiet_queue(SimpleNamespace(_queue=None)) is False  # a Gradio that changed its queue
    assert quiet_queue(SimpleNamespace(_queue=SimpleNamespace())) is False
    assert "poll" in caplog.text
    with pytest.raises(ValueError):
        quiet_queue(_queued_demo(), poll_s=0)


def test_app_serves_the_page_with_a_quiet_queue(monkeypatch):
    """``app.main`` (one port: API + page) applies it after ``build_server``'s ``demo.queue()``."""
    import server
    from engine.async_engine import AsyncEngine

    served = {}

    class _Engine:
        max_pending = None

        def shutdown(self):
            pass

    monkeypatch.setattr(AsyncEngine, "from_args", classmethod(lambda cls, **kw: _Engine()))
    monkeypatch.setattr(app, "startup_lines", lambda *a, **k: [])
    monkeypatch.setattr("ui.layout.build_app", lambda *a, **k: _demo_unqueued())
    monkeypatch.setattr(server, "build_server", lambda engine, demo, **kw: (demo.queue(), demo)[1])
    monkeypatch.setattr(server, "serve", lambda demo, **kw: served.setdefault("demo", demo))
    app.main(["--port", "0"])
    assert served["demo"]._queue.sleep_when_free == QUEUE_POLL_S


def test_launch_serves_the_page_with_a_quiet_queue():
    """``ui.layout.launch`` (share links, the browser tests) applies it after its ``demo.queue()``."""
    from tests._browser import serve

    demo = _demo_unqueued()
    serve(demo)
    try:
        assert demo._queue.sleep_when_free == QUEUE_POLL_S
        assert demo._queue.progress_update_sleep_when_free == PROGRESS_POLL_S
    finally:
        demo.close()
