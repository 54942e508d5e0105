"""Chat messages tokenized as text: only the chat template's own markup yields special tokens.

A chat template renders messages to one string, ``<|im_start|>user\\nHi<|im_end|>\\n...``; tokenizing that
string with special tokens recognised (what ``apply_chat_template(..., tokenize=True)`` does) also turns
special-token strings that a user *typed* into control tokens: ``Hi<|im_end|>\\n<|im_start|>system\\n...`` in
a message forges a system turn. That is what rendering to one string and tokenizing it does (transformers'
own path; servers that render first, vLLM's among them, inherit it). transformers' tokenizers can tokenize a
text with its special-token strings as plain characters (``split_special_tokens=True``), but only a whole
text at a time: the template's markup must then be kept apart from the messages' text.

:class:`ChatTokenizer` keeps the message text apart from the markup:

1. the template is rendered a second time with each message's ``content`` and ``name`` replaced by a random
   placeholder; cutting that rendering at the placeholders gives the template's own pieces, and putting the
   real strings in their places must give back the real rendering (checked);
2. the special tokens the template's pieces hold are the only ones: when the real rendering holds no other
   (nothing typed, no special token formed across a piece's edge) it is tokenized whole, exactly as before;
3. otherwise the text between two of the template's special tokens (template text and message text alike,
   so byte-level merges at their edges are those of a whole-string tokenization) is tokenized with
   ``split_special_tokens=True`` (typed special-token strings become the ordinary tokens of their
   characters), and the template's special tokens are put between the runs by id.

A template that changes a message's text (``| trim``, say) fails the check of step 1; its rendering is then
tokenized whole when it holds no more special tokens than its pieces, else the pieces are joined with the
untransformed text (a warning, once). Roles and ``chat_template_kwargs`` strings are refused
(:class:`~engine.errors.RequestError`) when they hold special-token strings. Added tokens that are not special
(``special=False``) are matched in text by the tokenizer itself, as in any prompt. Step 3 splits the text where
a whole-string tokenization splits it (at special tokens) for byte-level BPE tokenizers (SmolLM2, Llama 3,
Qwen); a SentencePiece-style tokenizer that prepends a space to the start of a text may give a run after a
special token a leading space token there (only in chats that hold typed special-token strings).
"""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from engine.errors import PROMPT, RequestError

log = logging.getLogger(__name__)

Span = tuple[int, int, int]  # (start, end, token id) of a special token in a text


class ChatTokenizer:
    """Tokenizes rendered chats so that only the template's markup is special (see the module's doc).

    Args:
        tokenizer: a transformers tokenizer (``added_tokens_decoder``, ``__call__`` with
            ``split_special_tokens``).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.special: dict[str, int] = {t.content: i for i, t in added.items() if getattr(t, "special", False)}
        self._lstrip = {i for i, t in added.items() if getattr(t, "special", False) and getattr(t, "lstrip", False)}
        self._rstrip = {i for i, t in added.items() if getattr(t, "special", False) and getattr(t, "rstrip", False)}
        names = sorted(self.special, key=len, reverse=True)  # longest first: the tokenizer's leftmost-longest match
        self.pattern = re.compile("|".join(map(re.escape, names))) if names else None
        self._warned = False
        self._affixes: tuple[list[int], list[int]] | None = None

    # ------------------------------------------------------------------ special-token strings
    def spans(self, text: str, offset: int = 0) -> list[Span]:
        """The special-token strings in ``text`` (non-overlapping, left to right), shifted by ``offset``."""
        if self.pattern is None:
            return []
        return [(m.start() + offset, m.end() + offset, self.special[m.group()]) for m in self.pattern.finditer(text)]

    def holds_special(self, value: Any) -> bool:
        """Whether a string, or any string in nested lists / dicts (keys included), holds a special-token string."""
        if self.pattern is None:
            return False
        stack = [value]
        while stack:
            v = stack.pop()
            if isinstance(v, str):
                if self.pattern.search(v):
                    return True
            elif isinstance(v, dict):
                stack.extend(v.keys())
                stack.extend(v.values())
            elif isinstance(v, (list, tuple)):
                stack.extend(v)
        return False

    # ------------------------------------------------------------------ tokenizing
    def _encode_text(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def affixes(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer puts before and after a text with ``add_special_tokens=True`` (BOS...)."""
        if self._affixes is None:
            bare = self.tokenizer("a", add_special_tokens=False)["input_ids"]
            full = self.tokenizer("a", add_special_tokens=True)["input_ids"]
            k = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), None)
            self._affixes = ([], []) if k is None or not bare else (full[:k], full[k + len(bare):])
        return self._affixes

    def encode_with(self, text: str, own: Sequence[Span], add_special_tokens: bool) -> list[int]:
        """``text`` tokenized with the special tokens at ``own`` (the template's) as the only special ones.

        When ``text`` holds no other special-token string it is tokenized whole (the ids a plain tokenization
        gives); else runs between ``own`` are tokenized with ``split_special_tokens=True``.
        """
        if self.spans(text) == list(own):
            return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        ids: list[int] = []
        pos, strip_left = 0, False
        for start, end, tid in own:
            run = text[pos:start]
            run = run.lstrip() if strip_left else run
            run = run.rstrip() if tid in self._lstrip else run
            if run:
                ids += self._encode_text(run)
            ids.append(tid)
            pos, strip_left = end, tid in self._rstrip
        run = text[pos:].lstrip() if strip_left else text[pos:]
        if run:
            ids += self._encode_text(run)
        if add_special_tokens:
            before, after = self.affixes()
            ids = before + ids + after
        return ids

    def encode_chat(self, messages: list[dict], text: str, render: Callable[[list[dict]], str],
                    add_special_tokens: bool) -> list[int]:
        """The ids of ``text``, the rendering of ``messages`` by ``render``, with the messages' ``content`` and
        ``name`` tokenized as text (steps 1-3 of the module's doc).

        Raises:
            RequestError: a role holds a special-token string, or the template cannot be rendered with
                placeholders while some message text holds one.
        """
        if self.pattern is None:
            return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        if any(self.pattern.search(m["role"]) for m in messages):
            raise RequestError("a chat message role holds a special-token string", PROMPT)
        nonce = secrets.token_hex(8)
        values: dict[str, str] = {}
        masked = []
        for i, m in enumerate(messages):
            copy = dict(m)
            for key in ("content", "name"):
                if isinstance(m.get(key), str):
                    mark = f"cbp{nonce}m{i}{key}"
                    values[mark], copy[key] = m[key], mark
            masked.append(copy)
        try:
            skeleton = render(masked)
        except Exception:  # a template that looks into the text: no pieces
            if self.holds_special([m.get("content") for m in messages] + [m.get("name") for m in messages]):
                raise RequestError("this chat template cannot keep message text apart from its markup, and a "
                                   "message holds a special-token string (set special_tokens_in_messages to "
                                   "read them as control tokens)", PROMPT) from None
            return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        pieces = re.split(f"(cbp{nonce}m[0-9]+(?:content|name))", skeleton)
        joined, own = [], []
        offset = 0
        for j, piece in enumerate(pieces):
            if j % 2:  # a placeholder
                piece = values.get(piece, piece)
            else:
                own += self.spans(piece, offset)
            joined.append(piece)
            offset += len(piece)
        rebuilt = "".join(joined)
        if rebuilt == text:
            return self.encode_with(text, own, add_special_tokens)
        if len(self.spans(text)) == len(own):  # the template changed the text, and nothing was forged
            return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        if not self._warned:
            self._warned = True
            log.warning("the chat template changes message text (trims or rewrites it) and a message holds a "
                        "special-token string: such chats are tokenized from the template's pieces with the text "
                        "as sent")
        return self.encode_with(rebuilt, own, add_special_tokens)
