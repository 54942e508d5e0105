"""The API's small HTTP kinds and its memory bound (issue 22), against uvicorn on a loopback port (tiny
random model): HEAD like GET, 405 with ``Allow`` (also behind the Gradio mount), strict JSON types,
every 400 counted in ``cbp:api_rejected_requests_total``, out-of-vocabulary ``stop_token_ids`` and an
empty ``cache_salt`` refused, 413 for a body over the limit (declared or streamed), a prompt too long
for the context refused by its length in characters before it is tokenized."""

from __future__ import annotations

import os
import re

import pytest

from server import ServerThread, build_server
from tests._api_helpers import MODEL, endpoint, normal_request_works, serve_tiny_api

LIMIT = 128 * 1024  # bytes: the test server's body limit (over 1,024 tokens x 81 characters)


@pytest.fixture(scope="module")
def api(tiny_model, tokenizer):
    yield from serve_tiny_api(tiny_model, tokenizer, max_body_bytes=LIMIT)


def rejected(api, reason: str) -> float:
    """The value of ``cbp:api_rejected_requests_total`` for ``reason`` (0 when not yet counted)."""
    text = api.http.get("/metrics").text
    m = re.search(rf'cbp:api_rejected_requests_total{{model_name="{MODEL}",reason="{reason}"}} ([0-9.e+]+)', text)
    return float(m.group(1)) if m else 0.0


def check_400(r, param: str | None) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


# ---------------------------------------------------------------------------------------------- methods
@pytest.mark.parametrize("path", ["/health", "/v1/models", "/metrics", f"/v1/models/{MODEL}"])
def test_head_answers_like_get(api, path):
    get, head = api.http.get(path), api.http.head(path)
    assert get.status_code == head.status_code == 200
    assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"]


@pytest.mark.parametrize("method,path,allow", [
    ("GET", "/v1/chat/completions", "POST"), ("GET", "/v1/completions", "POST"),
    ("PUT", "/health", "GET, HEAD"), ("POST", "/v1/models", "GET, HEAD"), ("DELETE", "/metrics", "GET, HEAD"),
])
def test_wrong_method_is_405_with_allow(api, method, path, allow):
    before = rejected(api, "method_not_allowed")
    r = api.http.request(method, path)
    assert r.status_code == 405 and r.headers["allow"] == allow
    assert r.json()["error"]["code"] == "method_not_allowed"
    assert rejected(api, "method_not_allowed") == before + 1


def test_head_and_405_behind_the_gradio_mount(api):
    """The real app mounts the page at ``/`` (a catch-all): HEAD and 405 must still be the API's."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    import gradio as gr

    with gr.Blocks() as demo:
        gr.Markdown("playground")
    app = build_server(api.engine, demo, MODEL, mount_kwargs={"css": None, "i18n": None})
    import httpx

    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.head("/health").status_code == 200
        assert http.head("/v1/models").status_code == 200
        r = http.get("/v1/chat/completions")
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        assert http.get("/").status_code == 200  # the page itself is untouched
    demo.close()


# ---------------------------------------------------------------------------------------------- strict types
@pytest.mark.parametrize("field,value", [
    ("n", "2"), ("stream", "yes"), ("max_tokens", "5"), ("max_tokens", 5.5), ("seed", True), ("temperature", "0.5"),
    ("ignore_eos", 1), ("stop_token_ids", ["7"]), ("logprobs", "2"),
])
def test_strict_json_types(api, field, value):
    path, body = endpoint("completions")
    r = api.http.post(path, json={**body, "max_tokens": 2, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"].split(".")[0] == field, r.text


def test_every_400_is_counted(api):
    """Malformed JSON, a body that is not UTF-8, a bad type and a bad value: four 400s, four counts."""
    path, body = endpoint("chat")
    before = rejected(api, "invalid")
    bad = [api.http.post(path, content=b'{"messages": [', headers={"content-type": "application/json"}),
           api.http.post(path, content=b'{"messages": "\xff\xfe"}', headers={"content-type": "application/json"}),
           api.http.post(path, json={**body, "n": "2"}),
           api.http.post(path, json={**body, "temperature": -1})]
    assert [r.status_code for r in bad] == [400] * 4
    assert rejected(api, "invalid") == before + 4
    normal_request_works(api)


@pytest.mark.parametrize("name", ["chat", "completions"])
def test_out_of_vocabulary_stop_token_ids_and_empty_cache_salt(api, name):
    path, body = endpoint(name)
    vocab = api.engine.core.model.config.vocab_size
    r = api.http.post(path, json={**body, "max_tokens": 2, "stop_token_ids": [5, vocab]})
    check_400(r, "stop_token_ids")
    assert "vocabulary" in r.json()["error"]["message"]
    check_400(api.http.post(path, json={**body, "max_tokens": 2, "cache_salt": ""}), "cache_salt")
    assert api.http.post(path, json={**body, "max_tokens": 2, "stop_token_ids": [vocab - 1],
                                     "cache_salt": "s"}).status_code == 200


# ---------------------------------------------------------------------------------------------- memory bound
def test_body_over_the_limit_is_413_by_content_length(api):
    path, body = endpoint("completions")
    before = rejected(api, "too_large")
    big = b'{"prompt": "' + b"a" * (LIMIT + 10) + b'"}'
    r = api.http.post(path, content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert rejected(api, "too_large") == before + 1
    normal_request_works(api)


def test_streamed_body_over_the_limit_is_413(api):
    """No Content-Length (chunked): the body is counted as it arrives and refused once past the limit
    (the server buffers at most the limit; what the client still sends is discarded unparsed)."""
    path, _ = endpoint("completions")
    before = rejected(api, "too_large")

    def chunks():
        yield b'{"prompt": "'
        for _ in range(256):  # 256 x 4 KiB = 1 MiB offered
            yield b"a" * 4096
        yield b'"}'

    r = api.http.post(path, content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "transfer-encoding" not in r.request.headers.get("content-length", "")
    assert rejected(api, "too_large") == before + 1
    normal_request_works(api)


def test_body_under_the_limit_is_read(api):
    path, body = endpoint("completions")
    filler = "x" * (LIMIT - 200)
    r = api.http.post(path, json={**body, "max_tokens": 2, "user": filler})
    assert r.status_code == 200, r.text


def test_prompt_too_long_in_characters_is_refused_before_tokenizing(api, monkeypatch):
    core = api.engine.core
    calls = {"n": 0}
    real = core.tokenizer.__class__.__call__

    def counting(self, *a, **kw):
        calls["n"] += 1
        return real(self, *a, **kw)

    from engine.detokenizer import max_token_chars

    n = core.max_model_len * max_token_chars(core.tokenizer) + 1
    assert n < LIMIT - 100, "the test server's context must be small enough for its body limit"
    monkeypatch.setattr(core.tokenizer.__class__, "__call__", counting)
    path, _ = endpoint("completions")
    r = api.http.post(path, json={"prompt": "a" * n, "max_tokens": 2})
    check_400(r, "prompt")
    assert r.json()["error"]["code"] == "context_length_exceeded" and "characters" in r.json()["error"]["message"]
    assert calls["n"] == 0, "the prompt was tokenized before its length was checked"
