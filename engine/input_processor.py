"""Input processing: a prompt and its sampling parameters in, a ready :class:`engine.request.Request` out.

Prompt rendering (chat templates, continue-final-message), tokenizing and validation live here, as in
vLLM's front end (its ``InputProcessor``), not in the engine core: :class:`engine.async_engine.AsyncEngine`
runs :meth:`InputProcessor.process` in a worker thread and :class:`engine.llm.LLM` in the caller's, so the
stepping thread never tokenizes. The processor touches no engine state: it reads the tokenizer, the
vocabulary size and the context length, and asks the scheduler's read-only fit check.

Every refusal is a :class:`engine.errors.RequestError` naming the field (``param``) and, for prompts that
cannot fit, :class:`engine.errors.ContextLengthError`; the server maps these types to its error bodies.

Chat messages (the API's, the page's chats, the Compare and invariance runs: every chat goes through
:meth:`InputProcessor.tokenize`) are tokenized as text by default: a special-token string typed in a message
stays text, only the chat template's own markup yields control tokens (:mod:`engine.chat_tokens`;
``ChatPrompt.special_tokens_in_messages`` restores the plain tokenization of the rendered string). A plain
string prompt is the caller's whole prompt and is tokenized with special tokens recognised, as vLLM does.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from typing import Any

from engine.chat_tokens import ChatTokenizer
from engine.detokenizer import max_token_chars
from engine.errors import PROMPT, ContextLengthError, RequestError
from engine.request import ChatPrompt, Request, SamplingParams, TextPrompt

# arguments of apply_chat_template that the engine sets itself: a request may not pass them
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tokenize", "add_generation_prompt",
                                      "continue_final_message", "chat_template", "tools", "documents"})


def check_text(text: str, what: str, param: str | None = PROMPT) -> None:
    """Raise :class:`RequestError` (``param``) when ``text`` cannot be encoded as UTF-8 (a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{what} is not valid Unicode text: {e.reason} at position {e.start}", param) from None


class InputProcessor:
    """Renders, tokenizes and validates requests (any thread; no engine state is touched).

    Args:
        tokenizer: the model's transformers tokenizer (chat template included).
        vocab_size: the model's vocabulary size (token ids must be below it).
        max_model_len: the engine's context length (tokens).
        eos_token_ids: the model's end-of-sequence token ids.
        output_processor: the engine's :class:`engine.output_processor.OutputProcessor` (its
            ``new_detokenizer`` gives each sequence its incremental detokenizer).
        check_fit: the scheduler's read-only check that a request can ever run (raises
            :class:`ContextLengthError` / :class:`RequestError`).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, eos_token_ids: frozenset[int],
                 output_processor: Any, check_fit: Callable[[Request], None]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.max_model_len = int(max_model_len)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.output_processor = output_processor
        self.check_fit = check_fit
        self.chat_tokens = ChatTokenizer(tokenizer)

    # ------------------------------------------------------------------ prompts
    def tokenize(self, prompt: Any, check_length: bool = True) -> list[int]:
        """Prompt -> token ids. A string (or a :class:`TextPrompt`) is tokenized as is; a list of
        ``{"role", "content"}`` dicts is rendered with the chat template (generation prompt added), a
        :class:`ChatPrompt` with its own flags; a list of ints is taken as ids.

        With ``check_length``, text longer than the context length can hold (``max_model_len`` x the
        longest vocabulary entry, in characters) is refused before it is tokenized, so a huge prompt costs
        no tokenizer time or memory.

        Raises:
            RequestError: an empty or malformed prompt (``param`` prompt).
            ContextLengthError: text that cannot fit in the context length.
        """
        add_special_tokens = True
        if isinstance(prompt, TextPrompt):
            prompt, add_special_tokens = prompt.text, bool(prompt.add_special_tokens)
            if not isinstance(prompt, str):
                raise RequestError("a TextPrompt's text must be a string", PROMPT)
        if isinstance(prompt, ChatPrompt):
            return self._render_chat(prompt, check_length)
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("the prompt is empty", PROMPT)
            check_text(prompt, "the prompt")
            if check_length:
                self._check_chars(len(prompt))
            return self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt):
            if any(t < 0 or t >= self.vocab_size for t in prompt):
                raise RequestError(f"prompt token ids must be in [0, {self.vocab_size})", PROMPT)
            return list(prompt)
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            return self._render_chat(ChatPrompt(list(prompt)), check_length)
        if isinstance(prompt, (list, tuple)) and not prompt:
            raise RequestError("the prompt is empty", PROMPT)
        raise RequestError("a prompt must be a string, a list of chat messages or a list of token ids", PROMPT)

    def _check_chars(self, num_chars: int) -> None:
        """Raise :class:`ContextLengthError` when text of ``num_chars`` characters needs more tokens than
        the context length."""
        limit = self.max_model_len * max_token_chars(self.tokenizer)
        if num_chars > limit:
            raise ContextLengthError(f"the prompt has {num_chars} characters, more than the context length of "
                                     f"{self.max_model_len} tokens can hold (at most {limit} characters)")

    def _render_chat(self, chat: ChatPrompt, check_length: bool = True) -> list[int]:
        """A chat rendered with the chat template and its flags, then tokenized: the messages' text as text unless
        ``chat.special_tokens_in_messages`` (:mod:`engine.chat_tokens`).

        Raises:
            RequestError: malformed messages (``param`` prompt), both continue flags
                (``continue_final_message``), reserved or failing template arguments (``chat_template_kwargs``),
                a special-token string in a role or in a template argument (unless
                ``special_tokens_in_messages``).
            ContextLengthError: contents that cannot fit in the context length.
        """
        messages = chat.messages
        if not isinstance(messages, (list, tuple)) or not messages:
            raise RequestError("the prompt is empty", PROMPT)
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise RequestError("each chat message needs a string 'role' and a string 'content'", PROMPT)
            check_text(m["role"], "a chat message role")
            check_text(m["content"], "a chat message")
        if check_length:  # the template only adds text: the contents alone must fit
            self._check_chars(sum(len(m["content"]) for m in messages))
        if chat.continue_final_message and chat.add_generation_prompt:
            raise RequestError("continue_final_message cannot be used together with add_generation_prompt",
                               "continue_final_message")
        kwargs = dict(chat.chat_template_kwargs or {})
        reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise RequestError(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
        raw = bool(chat.special_tokens_in_messages)
        if not raw and self.chat_tokens.holds_special(kwargs):
            raise RequestError("chat_template_kwargs holds a special-token string (only the template's own markup "
                               "may; set special_tokens_in_messages to allow it)", "chat_template_kwargs")

        def render(msgs: list[dict]) -> str:
            return self.tokenizer.apply_chat_template(msgs, tokenize=False, **kwargs,
                                                      add_generation_prompt=bool(chat.add_generation_prompt),
                                                      continue_final_message=bool(chat.continue_final_message))

        try:
            text = render(list(messages))
        except Exception as e:  # a template error (jinja, a bad variable): this request's fault
            raise RequestError(f"the chat template failed on these messages: {e}", PROMPT) from None
        if raw:
            return self.tokenizer(text, add_special_tokens=bool(chat.add_special_tokens))["input_ids"]
        return self.chat_tokens.encode_chat(list(messages), text, render, bool(chat.add_special_tokens))

    # ------------------------------------------------------------------ requests
    def _check_token_ids(self, params: SamplingParams) -> None:
        vocab = self.vocab_size
        if params.logit_bias and any(t >= vocab for t in params.logit_bias):
            raise RequestError(f"logit_bias has a token id outside the vocabulary [0, {vocab})", "logit_bias")
        stop_token_ids = params.stop_token_ids
        assert stop_token_ids is not None  # a list since SamplingParams.__post_init__
        if any(t >= vocab for t in stop_token_ids):
            raise RequestError(f"stop_token_ids has a token id outside the vocabulary [0, {vocab})", "stop_token_ids")
        if params.allowed_token_ids is not None and any(t >= vocab for t in params.allowed_token_ids):
            raise RequestError(f"allowed_token_ids has a token id outside the vocabulary [0, {vocab})",
                               "allowed_token_ids")
        if params.allowed_token_ids is not None and params.min_tokens > 0:
            # before min_tokens, EOS (unless ignore_eos) and stop token ids are masked: something must remain
            masked = set(stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
            if set(params.allowed_token_ids) <= masked:
                raise RequestError("allowed_token_ids leaves nothing to sample before min_tokens: every allowed "
                                   "id is an end-of-sequence or stop token id", "allowed_token_ids")

    def process(self, request_id: str | None, prompt: Any, params: SamplingParams | None = None,
                cache_salt: str | None = None) -> Request:
        """Validate and build a :class:`Request` (with ``params.n - 1`` sibling sequences in
        ``pending_forks`` for parallel sampling: ids ``<id>#<i>``, seeds ``seed + i``).

        Raises:
            RequestError: bad sampling values (``param`` the field), a bad request id or ``cache_salt``,
                an empty or malformed prompt, ``n`` over the batch slots.
            ContextLengthError: a prompt over the context length, or a request that can never fit in the
                KV pool.
        """
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError("params must be a SamplingParams")
        params.validate()
        if cache_salt is not None:
            if not isinstance(cache_salt, str) or not cache_salt:
                raise RequestError("cache_salt must be a non-empty string", "cache_salt")
            check_text(cache_salt, "cache_salt", "cache_salt")
        if request_id is not None and (not isinstance(request_id, str) or "#" in request_id):
            raise RequestError("a request id must be a string without '#'")
        if request_id is not None:
            check_text(request_id, "the request id", None)
        ids = self.tokenize(prompt, check_length=params.truncate_prompt_tokens is None)
        if params.truncate_prompt_tokens is not None:  # vLLM's: keep the last k prompt tokens
            keep = self.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            ids = ids[-keep:]
        self._check_token_ids(params)
        rid = request_id or uuid.uuid4().hex
        seqs = []
        for i in range(params.n):
            sp = params if params.n == 1 else dataclasses.replace(
                params, n=1, seed=None if params.seed is None else params.seed + i)
            req = Request(rid if params.n == 1 else f"{rid}#{i}", ids, sp, self.eos_token_ids, self.max_model_len,
                          prompt=prompt)
            req.group_id, req.index, req.cache_salt = rid, i, cache_salt
            req.detokenizer = self.output_processor.new_detokenizer(ids, sp)
            seqs.append(req)
        seqs[0].pending_forks = seqs[1:]
        self.check_fit(seqs[0])
        return seqs[0]
