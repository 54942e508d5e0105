"""The chat handler's refusals: a setting the engine refuses ends that turn with a Gradio error for that
user alone, with no traceback in the log (tracebacks are for --log-level debug)."""

from __future__ import annotations

import asyncio

import gradio as gr
import pytest

from tests.test_ui_handlers import StubEngine, collect, handlers, respond


def test_a_refused_control_value_is_a_clean_error_without_a_traceback_in_the_log():
    """A seed outside 64 bits (or any value the engine refuses) ends the turn with a Gradio error for that
    user, marked not to print a traceback: tracebacks in the log are for --log-level debug."""
    chat = handlers(StubEngine(), poll_s=0.01)
    with pytest.raises(gr.Error) as info:
        asyncio.run(collect(respond(chat, "hi", [], 0.7, 0.9, 16, 2**70)))
    assert "seed" in str(info.value) and info.value.print_exception is False
    assert chat.replies == {}
