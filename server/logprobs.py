"""OpenAI's ``logprobs`` objects from the engine's per-token logprobs.

The engine gives, for every generated token of a request that asked, ``(token_id, logprob, top)`` with
``top`` the best ``(token_id, logprob)`` pairs, most likely first (:class:`engine.request.CompletionOutput`).
They are the logprobs of the raw model output: log-softmax of the logits before repetition / presence /
frequency penalties, logit bias, temperature, top-k / top-p / min-p (vLLM's default, ``raw_logprobs``).

- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``
  (``top_logprobs``: the ``top_logprobs`` most likely tokens, as OpenAI);
- completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` (``top_logprobs``: one
  ``{token: logprob}`` per position with the sampled token and the ``logprobs`` most likely ones, as vLLM
  and OpenAI's legacy endpoint; ``text_offset``: where each token's text begins in the returned text, in
  characters, from the engine's detokenizer, whatever the ``tokens`` entries look like).

A token's text is its own decoded text; a token that is only part of a UTF-8 character (byte-level BPE
splits CJK and emoji over several tokens) is written ``"bytes:\\xe4\\xbd"`` as OpenAI does, and ``bytes``
are always the token's real bytes, so concatenating them gives the exact UTF-8 of the text. With
``return_tokens_as_token_ids`` (vLLM's) the token is written ``"token_id:123"``. A logprob of ``-inf``
(JSON cannot carry it) is written -9999.0, as vLLM and OpenAI do.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

MIN_LOGPROB = -9999.0

_RENDERERS: weakref.WeakKeyDictionary[Any, TokenText] = weakref.WeakKeyDictionary()


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the character standing for each byte -> the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenText:
    """Text and bytes of single tokens for one tokenizer (cached per token id)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        try:
            decoder = tokenizer.backend_tokenizer.decoder
            self._byte_level = type(decoder).__name__ == "ByteLevel" or str(decoder).startswith("ByteLevel")
        except AttributeError:
            self._byte_level = False
        try:
            self._added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        except AttributeError:
            self._added = {}

    @classmethod
    def of(cls, tokenizer) -> TokenText:
        """The (shared) renderer of ``tokenizer``."""
        try:
            return _RENDERERS[tokenizer]
        except KeyError:
            r = _RENDERERS[tokenizer] = cls(tokenizer)
            return r
        except TypeError:  # not weak-referenceable
            return cls(tokenizer)

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        if self._byte_level:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            dec = _byte_decoder()
            if isinstance(piece, str) and all(ch in dec for ch in piece):
                return bytes(dec[ch] for ch in piece)
        return self.tokenizer.decode([token_id], skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False).encode("utf-8")

    def get(self, token_id: int) -> tuple[str, list[int]]:
        """``(text, bytes)`` of one token; text is ``"bytes:\\x.."`` when its bytes are not whole UTF-8."""
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self._bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            hit = self._cache[token_id] = (text, list(raw))
        return hit

    def text(self, token_id: int, as_id: bool = False) -> str:
        return f"token_id:{token_id}" if as_id else self.get(token_id)[0]


def _lp(x: float) -> float:
    return x if x > MIN_LOGPROB else MIN_LOGPROB  # also maps NaN / -inf to the floor


def chat_logprobs(entries, tt: TokenText, top: int, as_ids: bool = False) -> dict:
    """The chat ``logprobs`` object of ``entries`` (``(token_id, logprob, top pairs)``)."""
    content = []
    for tid, lp, alts in entries:
        text, raw = tt.get(tid)
        content.append({
            "token": tt.text(tid, as_ids), "logprob": _lp(lp), "bytes": raw,
            "top_logprobs": [{"token": tt.text(a, as_ids), "logprob": _lp(alp), "bytes": tt.get(a)[1]}
                             for a, alp in alts[:top]],
        })
    return {"content": content}


def completion_logprobs(entries, tt: TokenText, top: int, offsets: list[int], as_ids: bool = False,
                        start: int = 0, end: int | None = None) -> dict:
    """The completions ``logprobs`` object of ``entries``.

    Args:
        entries: ``(token_id, logprob, top pairs)`` per token.
        offsets: per token, where its text begins in the completion's text (characters; the engine's
            ``CompletionOutput.text_offsets``).
        start: characters in front of the completion's text in the returned text (an echoed prompt).
        end: the returned text's length once known (the last chunk, or a whole response): offsets are clamped to
            it (the tokens of a stop string that was cut off point at its end).
    """
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    offsets = list(offsets) + [offsets[-1] if offsets else 0] * (len(entries) - len(offsets))  # never short
    for (tid, lp, alts), offset in zip(entries, offsets):
        text = tt.text(tid, as_ids)
        tokens.append(text)
        token_logprobs.append(_lp(lp))
        d = {text: _lp(lp)}
        for a, alp in alts[:top]:
            d.setdefault(tt.text(a, as_ids), _lp(alp))
        top_logprobs.append(d)
        text_offset.append(start + offset if end is None else min(start + offset, end))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}
