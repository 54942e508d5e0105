"""Issue kind 4: the text of the token or string that stopped a completion is not in ``text`` or the
stream (vLLM's default), for stop token ids, EOS and stop strings alike; ``include_stop_str_in_output``
keeps it. ``finish_reason`` is ``"stop"``, ``stop_reason`` names the id / string (None for EOS), and
``completion_tokens`` counts the stop token.
"""

from __future__ import annotations

import json

import pytest

from engine.detokenizer import IncrementalDetokenizer
from tests._api_helpers import MODEL, serve_tiny_api

FRUIT = [{"role": "user", "content": "Name a fruit."}]


@pytest.fixture(scope="module")
def real_api(real_model):
    yield from serve_tiny_api(*real_model)


def _both(api, path: str, body: dict) -> tuple[dict, str, dict]:
    """(non-streamed choice, joined streamed text, last streamed choice) of one request."""
    full = api.http.post(path, json=body)
    assert full.status_code == 200, full.text
    with api.http.stream("POST", path, json=body | {"stream": True,
                                                    "stream_options": {"include_usage": True}}) as resp:
        events = [json.loads(x[6:]) for x in resp.iter_lines() if x.startswith("data: {")]
    key = "text" if path.endswith("/completions") and "chat" not in path else None
    texts = [(ch["text"] if key else ch["delta"].get("content") or "") for e in events for ch in e["choices"]]
    last = [ch for e in events for ch in e["choices"]][-1]
    assert events[-1]["usage"] == full.json()["usage"]
    return full.json(), "".join(texts), last


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_id_text(real_api, include):
    comma = real_api.engine.tokenizer(",", add_special_tokens=False)["input_ids"]
    assert len(comma) == 1
    body = {"model": MODEL, "prompt": "Red, green, blue, yellow", "max_tokens": 16, "temperature": 0,
            "stop_token_ids": comma}
    if include:
        body["include_stop_str_in_output"] = True
    full, streamed, last = _both(real_api, "/v1/completions", body)
    ch = full["choices"][0]
    assert ch["text"] == ("," if include else "") and streamed == ch["text"]
    assert ch["finish_reason"] == last["finish_reason"] == "stop"
    assert ch["stop_reason"] == last["stop_reason"] == comma[0]
    assert full["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("include", [False, True])
def test_eos_text(real_api, include):
    body = {"model": MODEL, "messages": FRUIT, "max_tokens": 48, "temperature": 0, "skip_special_tokens": False}
    if include:
        body["include_stop_str_in_output"] = True
    full, streamed, last = _both(real_api, "/v1/chat/completions", body)
    ch = full["choices"][0]
    text = ch["message"]["content"]
    assert ch["finish_reason"] == "stop" and ch["stop_reason"] is None and last["finish_reason"] == "stop"
    assert text.endswith("<|im_end|>") == include, text
    assert "Banana" in text and streamed == text


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_text(real_api, include):
    body = {"model": MODEL, "messages": FRUIT, "max_tokens": 48, "temperature": 0, "stop": ["Banana", "nothing"]}
    if include:
        body["include_stop_str_in_output"] = True
    full, streamed, last = _both(real_api, "/v1/chat/completions", body)
    ch = full["choices"][0]
    assert ch["message"]["content"] == "The fruit I mentioned is the " + ("Banana" if include else "")
    assert streamed == ch["message"]["content"]
    assert ch["finish_reason"] == last["finish_reason"] == "stop" and ch["stop_reason"] == "Banana"


def test_included_stop_string_across_emitted_text(tokenizer):
    """With include_stop_str_in_output nothing is held back: a stop string that began in text already
    emitted still stops, and the text ends right after it (nothing after it is ever emitted)."""
    ids = tokenizer(" hello world, again", add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tokenizer, [], stop=["lo wor"], include_stop_str_in_output=True)
    deltas = []
    for t in ids:
        delta, stop = d.update(t)
        deltas.append(delta)
        if stop:
            break
    assert "".join(deltas) == " hello wor" and d.stop_reason == "lo wor"
    assert deltas[0] == " hello"  # emitted at once, not held back
    # the default: held back and cut before the stop string
    d = IncrementalDetokenizer(tokenizer, [], stop=["lo wor"])
    out = "".join(d.update(t)[0] for t in ids)
    assert out == " hel" and d.stop_reason == "lo wor"
