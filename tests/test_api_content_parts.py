"""Issue kind 6: a message whose ``content`` is a list of text parts is rendered with the parts joined by a
newline (vLLM's convention), so it equals the single string; a part of any other type (image, audio,
file) is a 400 naming it.
"""

from __future__ import annotations

import pytest

from tests._api_helpers import MODEL, normal_request_works, serve_tiny_api

PARTS = [{"type": "text", "text": "Translate"}, {"type": "text", "text": "bonjour"}]


@pytest.fixture(scope="module")
def api(tiny_model, tokenizer):
    yield from serve_tiny_api(tiny_model, tokenizer)


def _chat(api, messages, **kw) -> dict:
    r = api.http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 6,
                                                    "temperature": 0, "return_token_ids": True} | kw)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("role", ["user", "system", "assistant"])
def test_text_parts_joined_with_newline(api, role):
    msgs = [{"role": role, "content": PARTS}] + ([{"role": "user", "content": "go"}] if role != "user" else [])
    joined = [{"role": role, "content": "Translate\nbonjour"}] + msgs[1:]
    glued = [{"role": role, "content": "Translatebonjour"}] + msgs[1:]
    a, b, c = _chat(api, msgs), _chat(api, joined), _chat(api, glued)
    assert a["prompt_token_ids"] == b["prompt_token_ids"] != c["prompt_token_ids"]
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]


def test_parts_streamed_with_the_openai_client(api):
    kw = dict(model=MODEL, max_tokens=6, temperature=0)
    full = api.client.chat.completions.create(messages=[{"role": "user", "content": PARTS}], **kw)
    single = api.client.chat.completions.create(messages=[{"role": "user", "content": "Translate\nbonjour"}], **kw)
    assert full.usage.prompt_tokens == single.usage.prompt_tokens
    chunks = list(api.client.chat.completions.create(messages=[{"role": "user", "content": PARTS}], stream=True,
                                                     stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == single.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == single.usage.prompt_tokens


@pytest.mark.parametrize("part,words", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "'image_url'"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "'input_audio'"),
    ({"type": "file", "file": {"file_id": "f"}}, "'file'"),
    ({"text": "no type"}, "part"),
    ({"type": "text", "text": 5}, "text must be a string"),
    ("plain string", "part"),
])
def test_other_parts_are_400_naming_them(api, part, words):
    msgs = [{"role": "user", "content": [PARTS[0], part]}]
    r = api.http.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages[0].content" and "messages[0].content[1]" in err["message"], err
    assert words in err["message"], err
    normal_request_works(api)
