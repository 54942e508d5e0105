"""Incremental, UTF-8-safe detokenization with stop strings.

Token ids arrive one at a time; :class:`IncrementalDetokenizer` turns them into text deltas that are
safe to stream: never half a character, never text that is later taken back, never a stop string.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# Prompt tokens decoded in front of the first generated token, so that tokenizers whose decoding of a
# token depends on what precedes it (SentencePiece's leading space) start right; vLLM uses 5 too.
PROMPT_CONTEXT_TOKENS = 5
# Tokens that may be held back while the text still ends with U+FFFD (a character that may be still
# incomplete). Real text needs at most 3 (a UTF-8 character is at most 4 bytes); only a run of invalid
# bytes (garbage output) can be longer, where each new byte may complete the last character or not.
# Past this many the text is emitted as it decodes now (bounding the window, so the cost per token);
# only then can the joined deltas differ from decoding the whole sequence (a U+FFFD at the cut).
MAX_HELD_TOKENS = 64
_REPLACEMENT = "\ufffd"

# tokenizer -> ids that decode() drops when skip_special_tokens=True
_SKIPPED_IDS: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def _skipped_special_ids(tokenizer: Any) -> frozenset[int]:
    """Ids that ``tokenizer.decode(..., skip_special_tokens=True)`` removes: special added tokens whose
    text disappears when skipped. Computed once per tokenizer (one decode per special token)."""
    try:
        return _SKIPPED_IDS[tokenizer]
    except (KeyError, TypeError):
        pass
    candidates: set[int] = set(getattr(tokenizer, "all_special_ids", []) or [])
    try:
        candidates |= {i for i, t in tokenizer.added_tokens_decoder.items() if getattr(t, "special", False)}
    except Exception:  # a tokenizer without added_tokens_decoder: all_special_ids only
        pass
    skipped = frozenset(
        i
        for i in candidates
        if tokenizer.decode([i], skip_special_tokens=True, clean_up_tokenization_spaces=False) == ""
        and tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False) != ""
    )
    try:
        _SKIPPED_IDS[tokenizer] = skipped
    except TypeError:  # not weak-referenceable: recomputed per request
        pass
    return skipped


def _decoder_for(tokenizer: Any, skip_special_tokens: bool):
    """A function ``list[int] -> str`` equal to ``tokenizer.decode(ids, skip_special_tokens=...,
    clean_up_tokenization_spaces=False)``. For transformers' ``TokenizersBackend`` (fast tokenizers)
    whose decode is not overridden, it calls the Rust ``tokenizers.Tokenizer.decode`` directly, which is
    what transformers does then, without its per-call Python overhead (measured in docs/performance.md)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        cls = type(tokenizer)
        if (
            isinstance(tokenizer, TokenizersBackend)
            and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is TokenizersBackend._decode
        ):
            # transformers declares ``_tokenizer = None`` on the class; a loaded fast tokenizer holds its Tokenizer
            backend: Tokenizer = tokenizer._tokenizer  # type: ignore[assignment]

            def fast(ids: list[int]) -> str:
                return backend.decode(ids, skip_special_tokens=skip_special_tokens)

            return fast
    except (ImportError, AttributeError):
        pass

    def generic(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    return generic


class IncrementalDetokenizer:
    """Turns a request's generated token ids, one at a time, into streamable text deltas.

    Algorithm (the prefix/read offset scheme of TGI's ``decode_token`` and vLLM's
    ``detokenize_incrementally``; our own code). A small window of token ids is kept: the tokens from
    ``prefix`` (start of the window) up to ``read`` were already turned into text, those after ``read``
    are new. On each token the window is decoded twice, ``decode(window[:read])`` (cached) and
    ``decode(window)``, and the text is the difference of the two. Decoding a few preceding tokens along
    with the new ones gives the new ones the context that some tokenizers need (SentencePiece's leading
    space), and only the difference is emitted, so nothing is repeated. When the new text ends with
    U+FFFD (an incomplete UTF-8 character split over byte tokens) nothing is emitted and the token stays
    unread until the character is complete. After an emission the window starts at the old ``read``:
    the window is a few tokens long, so a step costs O(window), not O(length of the text). Special
    tokens that ``decode`` would skip are not put in the window at all. The window starts with up to 5
    prompt tokens (as vLLM) as context.

    Stop strings: text produced by the tokens goes through a second, text-level hold: the longest
    suffix that could be the beginning of some stop string is kept back (and released as soon as it no
    longer can be). As soon as a stop string is complete in the text, the text is cut right before it,
    that stop string is returned and nothing more is ever emitted; if several complete at the same
    token, the one that starts first wins (then the first listed). This is the streaming rule (vLLM's
    too): a stop string that starts earlier but would only complete later never gets the chance.
    With ``include_stop_str_in_output`` nothing is held back and the text is cut right *after* the stop
    string instead (a stop string that began in text already emitted still counts). ``update(...,
    check_stop=False)`` (before ``min_tokens`` tokens exist) emits text without looking for stop strings.

    Concatenating every delta and :meth:`flush` gives ``tokenizer.decode(generated_ids,
    skip_special_tokens=..., clean_up_tokenization_spaces=False)`` (cut before the stop string if one
    matched), for tokenizers where decoding is concatenative at character boundaries (byte-level BPE
    such as SmolLM2's) and, thanks to the context window, for SentencePiece-style ones.

    Args:
        tokenizer: a transformers tokenizer (``decode`` with ``skip_special_tokens`` and
            ``clean_up_tokenization_spaces``).
        prompt_token_ids: the prompt's token ids; only its last few are used, as context.
        stop: stop strings (non-empty ``str``); empty or None for none.
        skip_special_tokens: passed to ``decode``.
        include_stop_str_in_output: keep the matched stop string at the end of the text.

    Raises:
        ValueError: a stop string is empty or not a ``str``.

    Attributes:
        stop_reason: the stop string that matched, or None.
        finished: True after a stop string matched or :meth:`flush` was called.
        decoded_chars: characters the tokens fed so far have decoded to, complete characters only (the held
            tokens' included), before any stop string cut: read before :meth:`update`, the offset in the
            decoded text at which the new token's text begins (a token that completes a character begins
            where that character does).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        stop: Iterable[str] | None = (),
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.include_stop = bool(include_stop_str_in_output)
        self._stops: list[str] = list(stop or ())
        for s in self._stops:
            if not isinstance(s, str) or s == "":
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._decode = _decoder_for(tokenizer, skip_special_tokens)
        self._skipped = _skipped_special_ids(tokenizer) if skip_special_tokens else frozenset()

        # the window: context + new tokens; self._read = index of the first token not yet turned into text
        context: list[int] = []
        for t in reversed(prompt_token_ids):
            if len(context) == PROMPT_CONTEXT_TOKENS:
                break
            if t not in self._skipped:
                context.append(t)
        context.reverse()
        prefix_text = self._decode(context) if context else ""
        if prefix_text.endswith(_REPLACEMENT):  # the prompt ends inside a character: no context
            context, prefix_text = [], ""
        self._window: list[int] = context
        self._read = len(context)
        self._prefix_text = prefix_text  # decode(self._window[:self._read])

        self.decoded_chars = 0
        self._emitted_chars = 0  # decoded_chars without the held tokens' complete characters
        self._pending = ""  # text held back because it may begin a stop string
        self._chunks: list[str] = []  # emitted text
        self._text_cache: str | None = ""
        self.stop_reason: str | None = None
        self.finished = False

    # ------------------------------------------------------------------ public
    @property
    def text(self) -> str:
        """All text emitted so far (every delta and the flush), without any stop string."""
        if self._text_cache is None:
            self._text_cache = "".join(self._chunks)
            self._chunks = [self._text_cache]
        return self._text_cache

    def update(self, token_id: int, check_stop: bool = True) -> tuple[str, str | None]:
        """Add one generated token.

        Args:
            token_id: the new token id.
            check_stop: look for stop strings (False while the request has fewer than ``min_tokens``).

        Returns:
            ``(delta, stop)``: ``delta`` is the text safe to emit now (possibly ``""``); ``stop`` is the
            stop string that matched at this token (the request should finish: ``delta`` ends right
            before it), else None. After a match (or after :meth:`flush`) it returns ``("", None)``.
        """
        if self.finished:
            return "", None
        if token_id in self._skipped:
            return "", None
        self._window.append(token_id)
        new_text = self._decode(self._window)
        held = len(self._window) - self._read
        if held < MAX_HELD_TOKENS and (new_text.endswith(_REPLACEMENT) or len(new_text) <= len(self._prefix_text)):
            # an incomplete character (or no text yet): wait for the next token
            self.decoded_chars = self._emitted_chars + len(new_text[len(self._prefix_text):].rstrip(_REPLACEMENT))
            return "", None
        delta = new_text[len(self._prefix_text) :]
        self._emitted_chars += len(delta)
        self.decoded_chars = self._emitted_chars
        self._advance()
        return self._emit(delta, final=False, check_stop=check_stop)

    def flush(self, check_stop: bool = True) -> str:
        """Finish: return all held-back text (incomplete bytes as U+FFFD, the possible beginning of a
        stop string), for a request that ends for another reason (EOS, length, abort). A stop string
        completed by the held text still cuts it (``stop_reason`` is then set). Idempotent: a second
        call, or a call after a stop string matched, returns ``""``.

        Returns:
            the remaining text (possibly ``""``).
        """
        if self.finished:
            return ""
        delta = ""
        if len(self._window) > self._read:
            new_text = self._decode(self._window)
            delta = new_text[len(self._prefix_text) :]
            self._emitted_chars += len(delta)
            self.decoded_chars = self._emitted_chars
            self._advance()
        out, _ = self._emit(delta, final=True, check_stop=check_stop)
        self.finished = True
        return out

    # ------------------------------------------------------------------ internals
    def _advance(self) -> None:
        """The unread tokens are now text: the next window starts at the old read offset."""
        self._window = self._window[self._read :]
        self._prefix_text = self._decode(self._window)
        self._read = len(self._window)

    def _emit(self, new: str, final: bool, check_stop: bool = True) -> tuple[str, str | None]:
        """Pass ``new`` text through the stop-string hold; record and return what may be emitted."""
        if self.include_stop:
            return self._emit_including(new, check_stop)
        pending = self._pending + new
        out = pending
        stop = None
        if self._stops and pending and not check_stop:
            hold = 0 if final else self._held_suffix(pending)
            out = pending[: len(pending) - hold]
            self._pending = pending[len(pending) - hold :]
        elif self._stops and pending:
            best = -1
            for s in self._stops:
                i = pending.find(s)
                if i != -1 and (best == -1 or i < best):
                    best, stop = i, s
            if stop is not None:
                out = pending[:best]
                self._pending = ""
                self.stop_reason = stop
                self.finished = True
            elif not final:
                hold = self._held_suffix(pending)
                out = pending[: len(pending) - hold]
                self._pending = pending[len(pending) - hold :]
            else:
                self._pending = ""
        else:
            self._pending = ""
        if out:
            self._chunks.append(out)
            self._text_cache = None
        return out, stop

    def _emit_including(self, new: str, check_stop: bool) -> tuple[str, str | None]:
        """``_emit`` with ``include_stop_str_in_output``: nothing held; a stop string that ends in ``new``
        (it may begin in the text already emitted) cuts the text right after it."""
        stop = None
        out = new
        if self._stops and new and check_stop:
            tail = self.text[-(self._max_stop - 1):] if self._max_stop > 1 else ""
            window = tail + new
            best_end = -1
            for s in self._stops:
                i = window.find(s, max(0, len(tail) - len(s) + 1))
                if i != -1 and (best_end == -1 or i + len(s) < best_end):
                    best_end, stop = i + len(s), s
            if stop is not None:
                out = window[len(tail):best_end]
                self.stop_reason = stop
                self.finished = True
        if out:
            self._chunks.append(out)
            self._text_cache = None
        return out, stop

    def _held_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        for n in range(min(len(text), self._max_stop - 1), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0


_MAX_TOKEN_CHARS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def max_token_chars(tokenizer: Any) -> int:
    """The most characters of text one token can stand for: the longest entry of the vocabulary (added
    tokens included). A byte-level BPE entry has one character per byte, a SentencePiece entry one per
    character, so a text of ``c`` characters needs at least ``c / max_token_chars`` tokens: a prompt
    longer than ``max_model_len * max_token_chars`` characters can be refused before it is tokenized.
    Computed once per tokenizer."""
    try:
        return _MAX_TOKEN_CHARS[tokenizer]
    except (KeyError, TypeError):
        pass
    n = max((len(t) for t in tokenizer.get_vocab()), default=1)
    n = max([n, 1] + [len(str(t)) for t in getattr(tokenizer, "all_special_tokens", ())])
    try:
        _MAX_TOKEN_CHARS[tokenizer] = n
    except TypeError:  # not weak-referenceable: computed again next time
        pass
    return n
