"""Tests of engine.detokenizer.IncrementalDetokenizer with the real SmolLM2 tokenizer (offline)."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.detokenizer import MAX_HELD_TOKENS, IncrementalDetokenizer
from tests._tokenizer import load_tokenizer

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# letters, digits, punctuation, whitespace, accented Latin, Greek, Cyrillic, CJK, kana, Hangul, emoji
# (incl. skin tones and ZWJ sequences), combining marks
_ALPHABET = st.one_of(
    st.characters(min_codepoint=0x20, max_codepoint=0x7E),
    st.sampled_from(list("\n\t  éèçüßñøÅ")),
    st.characters(min_codepoint=0x0391, max_codepoint=0x03C9),
    st.characters(min_codepoint=0x0410, max_codepoint=0x044F),
    st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),
    st.characters(min_codepoint=0x3040, max_codepoint=0x30FF),
    st.characters(min_codepoint=0xAC00, max_codepoint=0xD7A3),
    st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF),
    st.sampled_from(["\u200d", "\U0001f3fd", "\u0301", "\ufe0f"]),
)
_PIECES = st.one_of(_ALPHABET, st.sampled_from(["👨‍👩‍👧", "🇫🇷", " the", " end", "\n\n", "😀😀"]))
TEXTS = st.lists(_PIECES, max_size=50).map("".join)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def decode(tok, ids, skip=True):
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


def stream(tok, ids, prompt=(), stop=(), skip=True):
    """Feed ``ids`` one by one; return (deltas, stop that matched, flushed text, detokenizer)."""
    d = IncrementalDetokenizer(tok, list(prompt), stop=stop, skip_special_tokens=skip)
    deltas, matched = [], None
    for t in ids:
        delta, s = d.update(t)
        deltas.append(delta)
        if s is not None:
            assert matched is None
            matched = s
    rest = d.flush()
    return deltas, matched, rest, d


def chat_prompt(tok):
    # transformers 5: apply_chat_template(tokenize=True) returns a BatchEncoding, not a list of ids
    text = tok.apply_chat_template([{"role": "user", "content": "Say something."}], add_generation_prompt=True, tokenize=False)
    return encode(tok, text)


# ---------------------------------------------------------------------------------------- round trips
@SETTINGS
@given(text=TEXTS, with_prompt=st.booleans())
def test_joined_deltas_equal_decode(tok, text, with_prompt):
    ids = encode(tok, text)
    prompt = chat_prompt(tok) if with_prompt else []
    deltas, matched, rest, d = stream(tok, ids, prompt)
    assert matched is None
    assert "".join(deltas) + rest == decode(tok, ids) == text
    assert d.text == text
    assert all("\ufffd" not in x for x in deltas + [rest])


@SETTINGS
@given(ids=st.lists(st.integers(0, 49151), max_size=40), skip=st.booleans())
def test_arbitrary_token_ids_equal_decode(tok, ids, skip):
    """Any id sequence, special tokens and stray byte tokens included, decodes as a whole would."""
    deltas, _, rest, d = stream(tok, ids, skip=skip)
    assert "".join(deltas) + rest == decode(tok, ids, skip)
    assert d.text == decode(tok, ids, skip)


@pytest.fixture(scope="module")
def partial_byte_ids(tok):
    """Ids (among the first 2,000) whose own text is or ends in an incomplete UTF-8 character."""
    ids = [i for i in range(2000) if "\ufffd" in decode(tok, [i])]
    assert len(ids) > 100
    return ids


@SETTINGS
@given(data=st.data(), skip=st.booleans())
def test_byte_tokens_never_split_characters(tok, partial_byte_ids, data, skip):
    """Sequences rich in lone UTF-8 bytes (most of them invalid): the joined deltas equal the full
    decode, and a delta holds U+FFFD only where the full decode does too."""
    ids = data.draw(
        st.lists(st.one_of(st.sampled_from(partial_byte_ids), st.integers(0, 49151)), max_size=50), label="ids"
    )
    deltas, _, rest, _ = stream(tok, ids, skip=skip)
    full = decode(tok, ids, skip)
    assert "".join(deltas) + rest == full
    if "\ufffd" not in full:
        assert all("\ufffd" not in x for x in deltas)


def test_long_run_of_invalid_bytes_keeps_the_window_bounded(tok, partial_byte_ids):
    # a UTF-8 continuation byte alone: invalid however many follow, each is one U+FFFD
    cont = next(i for i in partial_byte_ids if decode(tok, [i] * 3) == "\ufffd" * 3)
    ids = [cont] * 300 + encode(tok, " fine")
    d = IncrementalDetokenizer(tok, [])
    out = ""
    for t in ids:
        out += d.update(t)[0]
        assert len(d._window) <= 2 * MAX_HELD_TOKENS + 1
    out += d.flush()
    assert out == decode(tok, ids) == "\ufffd" * 300 + " fine"


def test_emoji_split_over_tokens_is_held_until_complete(tok):
    ids = encode(tok, " 😀 ok")
    pieces = [decode(tok, [i]) for i in ids]
    assert any("\ufffd" in p for p in pieces), "the emoji should be split over byte tokens"
    deltas, _, rest, _ = stream(tok, ids)
    assert "".join(deltas) + rest == " 😀 ok"
    assert "😀" in deltas[1] or "😀" in deltas[2]
    assert all("\ufffd" not in x for x in deltas)


def test_genuine_replacement_character_is_emitted(tok):
    text = "a\ufffd"
    deltas, _, rest, _ = stream(tok, encode(tok, text))
    assert "".join(deltas) + rest == text


def test_special_tokens(tok):
    ids = encode(tok, "Hi there") + [tok.eos_token_id]
    deltas, _, rest, _ = stream(tok, ids)
    assert "".join(deltas) + rest == "Hi there"
    deltas, _, rest, _ = stream(tok, ids, skip=False)
    assert "".join(deltas) + rest == "Hi there<|im_end|>"


def test_window_stays_small_and_update_is_cheap(tok):
    ids = encode(tok, "The quick brown fox jumps over the lazy dog. 敏捷的棕色狐狸 🦊🦊. " * 60)
    d = IncrementalDetokenizer(tok, chat_prompt(tok), stop=["never appears"])
    t0 = time.perf_counter()
    longest = 0
    for t in ids:
        d.update(t)
        longest = max(longest, len(d._window))
    per_token = (time.perf_counter() - t0) / len(ids)
    d.flush()
    assert d.text == decode(tok, ids)
    assert longest <= 6
    assert per_token < 2e-3, f"{per_token * 1e6:.0f} us per token"


# ---------------------------------------------------------------------------------------- stop strings
def _expected_stop(tok, ids, stops):
    """Oracle: the stop string that completes first while the tokens arrive (if several complete at
    the same token: the one that starts first, then the first listed) and where it starts."""
    avail = ""
    for k in range(1, len(ids) + 1):
        t = decode(tok, ids[:k])
        if not t.endswith("\ufffd"):
            avail = t
        hits = [(avail.find(s), i, s) for i, s in enumerate(stops) if s in avail]
        if hits:
            pos, _, s = min(hits)
            return pos, s
    return None


def _check_stop(tok, text, stops, prompt=()):
    ids = encode(tok, text)
    deltas, matched, rest, d = stream(tok, ids, prompt, stop=stops)
    hit = _expected_stop(tok, ids, stops)
    running = ""
    for x in deltas + [rest]:
        running += x
        assert not any(s in running for s in stops), "a stop string was emitted"
    if hit:
        pos, s = hit
        assert matched == s == d.stop_reason
        assert running == text[:pos] == d.text
        assert rest == ""
    else:
        assert matched is None and d.stop_reason is None
        assert running == text == d.text
    return deltas, matched, rest, d


def test_stop_string_across_token_boundaries(tok):
    text = "Hello world, this is the end of it. More text after."
    stop = "the end of"
    ids = encode(tok, text)
    boundaries = set()
    pos = 0
    for i in ids:
        pos += len(decode(tok, [i]))
        boundaries.add(pos)
    start = text.index(stop)
    assert any(start < b < start + len(stop) for b in boundaries), "the stop string must span tokens"
    deltas, matched, rest, d = _check_stop(tok, text, [stop])
    assert matched == stop
    assert d.text == "Hello world, this is "
    # nothing after the stop: further tokens give nothing
    assert d.update(ids[0]) == ("", None)
    assert d.flush() == ""


def test_stop_string_held_back_then_released(tok):
    text = "We went to the endless sea."
    stop = "the end."
    ids = encode(tok, text)
    d = IncrementalDetokenizer(tok, [], stop=[stop])
    emitted = ""
    held_at_some_point = False
    for k, t in enumerate(ids):
        delta, s = d.update(t)
        assert s is None
        emitted += delta
        full = decode(tok, ids[: k + 1])
        # whatever of the text so far could still begin the stop string is not out yet
        for n in range(1, len(stop)):
            if full.endswith(stop[:n]):
                assert len(emitted) <= len(full) - n
                held_at_some_point = True
                break
        assert full.startswith(emitted)
    assert held_at_some_point
    assert emitted + d.flush() == text
    assert d.stop_reason is None


def test_held_prefix_released_by_flush(tok):
    text = "The answer is 42. Obs"
    deltas, matched, rest, _ = _check_stop(tok, text, ["Observation:"])
    assert matched is None
    assert rest.endswith("Obs") and "Obs" not in "".join(deltas)


def test_stop_string_on_the_first_token(tok):
    ids = encode(tok, "Hello there")
    first = decode(tok, ids[:1])
    d = IncrementalDetokenizer(tok, chat_prompt(tok), stop=[first])
    assert d.update(ids[0]) == ("", first)
    assert d.text == ""
    assert d.update(ids[1]) == ("", None)
    assert d.flush() == ""


def test_first_completed_stop_wins_and_multibyte_stop(tok):
    assert _check_stop(tok, "abc STOP def END", ["END", "STOP"])[1] == "STOP"
    _check_stop(tok, "风和日丽 😀 的一天", ["😀", "丽 😀"])
    _check_stop(tok, "no match here", ["zzz", "here!"])
    # "\n" completes before "b\n " does: the text is cut at "\n", not at the earlier-starting "b\n "
    assert _check_stop(tok, "db\n end", ["b\n ", "\n"])[3].text == "db"
    # both complete with the same token: the earlier start wins
    ids = encode(tok, "xx STOPPED")
    assert "PED" not in decode(tok, ids[:-1]) and decode(tok, ids).endswith("PED")
    assert _check_stop(tok, "xx STOPPED", ["PED", " STOPPED"])[1] == " STOPPED"


def test_empty_stop_string_rejected(tok):
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tok, [], stop=[""])


@SETTINGS
@given(text=TEXTS, data=st.data())
def test_stop_strings_property(tok, text, data):
    if text:
        a = data.draw(st.integers(0, len(text) - 1))
        b = data.draw(st.integers(a + 1, min(len(text), a + 6)))
        stops = [text[a:b]]
    else:
        stops = []
    stops += data.draw(st.lists(st.text(alphabet=_ALPHABET, min_size=1, max_size=4), max_size=2))
    _check_stop(tok, text, stops)
