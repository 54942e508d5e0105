"""The chat's controls on both pages (the local playground, :mod:`ui.layout`, and remote mode,
:mod:`ui.remote.page`) and their events on :class:`ui.chat.ChatHandlers`: the chatbot with the streaming reply
under it, the message row (Send, Stop, Clear), the sampling settings, and the hidden parts the live channel
and the ``/chat`` API use.

Send disables itself and starts the reply (:meth:`ChatHandlers.start`); the tab's poller (``ui/live.js``)
clicks the hidden commit button once the reply has ended (:meth:`ChatHandlers.commit`); a hidden button
carries the streaming ``/chat`` API for ``gradio_client`` (:meth:`ChatHandlers.respond_api`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import gradio as gr

from ui.chat import ChatHandlers, settings_inputs

LIVE_REPLY_HTML = ('<div id="live-reply" hidden><div id="live-reply-title"></div>'
                   '<div id="live-reply-text"></div></div>')


@dataclass
class ChatColumn:
    """The chat's visible controls (``seed`` None on a page without one)."""

    chatbot: gr.Chatbot
    msg: gr.Textbox
    send: gr.Button
    stop: gr.Button
    clear: gr.Button
    temperature: gr.Slider
    top_p: gr.Slider
    max_new: gr.Slider
    seed: gr.Number | None


@dataclass
class ChatHidden:
    """The chat's hidden parts: the reply's request id (start's third output), the commit button clicked by
    ``ui/live.js`` and the button that carries the ``/chat`` API."""

    mine_box: gr.Textbox
    commit: gr.Button
    api_chat: gr.Button


def chat_column(texts: Mapping[str, Any], max_new_tokens: int = 1024, seed: bool = True) -> ChatColumn:
    """The chat's controls in the current Gradio context.

    Args:
        texts: the labels by key (``chat``, ``placeholder``, ``send``, ``stop``, ``clear``, ``sampling``,
            ``temperature``, ``top_p``, ``max_new_tokens`` and, with ``seed``, ``seed``): strings or
            ``ui.i18n.t`` texts.
        max_new_tokens: the top of the max-new-tokens slider.
        seed: whether the page has a seed control.
    """
    chatbot = gr.Chatbot(label=texts["chat"], height=430, elem_id="chatbot", buttons=["copy"], feedback_options=None)
    gr.HTML(LIVE_REPLY_HTML, padding=False, elem_id="live-reply-area")
    with gr.Row():
        msg = gr.Textbox(show_label=False, placeholder=texts["placeholder"], scale=5, lines=1, max_lines=4,
                         elem_id="msg", submit_btn=False)
        send = gr.Button(texts["send"], variant="primary", scale=1, min_width=70, elem_id="send")
        stop = gr.Button(texts["stop"], variant="stop", scale=1, min_width=70, elem_id="stop")
        clear = gr.Button(texts["clear"], scale=1, min_width=70, elem_id="clear")
    with gr.Accordion(texts["sampling"], open=False):
        temperature = gr.Slider(0.0, 2.0, value=0.7, step=0.05, label=texts["temperature"])
        top_p = gr.Slider(0.05, 1.0, value=0.9, step=0.05, label=texts["top_p"])
        max_new = gr.Slider(1, max_new_tokens, value=256, step=1, label=texts["max_new_tokens"])
        seed_box = gr.Number(value=-1, precision=0, label=texts["seed"]) if seed else None
    return ChatColumn(chatbot, msg, send, stop, clear, temperature, top_p, max_new, seed_box)


def chat_hidden() -> ChatHidden:
    """The chat's hidden parts in the current Gradio context."""
    mine_box = gr.Textbox(visible=False)  # the reply's request id (start's third output)
    commit_btn = gr.Button("commit", visible="hidden", elem_id="cbp-commit")  # clicked by ui/live.js
    api_chat = gr.Button("chat", visible=False)  # carries the streaming /chat API for gradio_client
    return ChatHidden(mine_box, commit_btn, api_chat)


def lock_send():
    """Send disabled while a message is being sent (:meth:`ChatHandlers.unlock_send` enables it again)."""
    return gr.update(interactive=False)


def wire_chat(chat: ChatHandlers, col: ChatColumn, hidden: ChatHidden) -> None:
    """The chat's events: Send / Enter, commit, ``/chat``, ``/stop`` and ``/clear``."""
    # trigger_mode="multiple": a second Send or Enter reaches start(), which refuses it with a warning
    # the sampling controls go by name (one ChatSettings in the handlers), after the message and history
    settings = settings_inputs(col.temperature, col.top_p, col.max_new, col.seed)
    locked = gr.on([col.msg.submit, col.send.click], lock_send, None, col.send, api_visibility="private",
                   queue=False, trigger_mode="multiple")
    started = locked.then(chat.start, [col.msg, col.chatbot], [col.chatbot, col.msg, hidden.mine_box],
                          inputs_kwargs=settings, api_visibility="private", concurrency_limit=None,
                          show_progress="hidden", trigger_mode="multiple")
    started.then(chat.unlock_send, None, col.send, api_visibility="private", queue=False)
    hidden.commit.click(chat.commit, None, [col.chatbot, col.send], api_visibility="private", queue=False,
                        trigger_mode="multiple")
    hidden.api_chat.click(chat.respond_api, [col.msg, col.chatbot], [col.chatbot, col.msg], inputs_kwargs=settings,
                          api_name="chat", concurrency_limit=None)
    col.stop.click(chat.stop, None, None, api_name="stop", concurrency_limit=None)
    col.clear.click(chat.clear, None, [col.chatbot, col.msg, col.send], api_name="clear", concurrency_limit=None)
