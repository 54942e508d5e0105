"""Public bug kinds of other servers that a hostile trial found this server already withstood, kept as tests
(tiny random model, loopback port): each must stay a clear 4xx for that request alone, leave no block
behind, and keep the server serving.

- out-of-vocabulary token ids (vLLM and SGLang crashed their engine on an id past the embedding table);
- non-finite numbers: Python's JSON reads ``NaN`` and ``Infinity`` (llama.cpp and vLLM sampled with a NaN
  temperature or penalty);
- oversized generation requests: ``n``, ``max_tokens``, ``seed`` and ``top_k`` past any sane range (integer
  overflows and unbounded allocations in vLLM, TGI and Ollama);
- a client that leaves mid-stream (TGI and vLLM kept generating, and their KV blocks, for a closed connection).
"""

from __future__ import annotations

import json

import pytest

from tests._api_helpers import CHAT, MODEL, normal_request_works, serve_tiny_api, wait_idle


@pytest.fixture(scope="module")
def api(tiny_model, tokenizer):
    yield from serve_tiny_api(tiny_model, tokenizer)


def _post(api, path: str, raw: str):
    return api.http.post(path, content=raw.encode(), headers={"content-type": "application/json"})


def _refused(r, param: str | None = None) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize("body,param", [
    ({"prompt": [10**9, 5], "max_tokens": 2}, "prompt"),
    ({"prompt": [-1], "max_tokens": 2}, "prompt"),
    ({"prompt": "hi", "stop_token_ids": [49152], "max_tokens": 2}, "stop_token_ids"),
    ({"prompt": "hi", "allowed_token_ids": [2**40], "max_tokens": 2}, "allowed_token_ids"),
    ({"prompt": "hi", "logit_bias": {"999999999": 5}, "max_tokens": 2}, "logit_bias"),
], ids=["prompt-huge", "prompt-negative", "stop-token", "allowed", "logit-bias"])
def test_out_of_vocabulary_token_ids(api, body, param):
    _refused(_post(api, "/v1/completions", json.dumps(body)), param)
    normal_request_works(api)


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty"])
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers(api, field, literal):
    raw = json.dumps({"messages": CHAT, "max_tokens": 2, field: "LITERAL"}).replace('"LITERAL"', literal)
    _refused(_post(api, "/v1/chat/completions", raw), field)
    bias = json.dumps({"prompt": "hi", "max_tokens": 2, "logit_bias": {"5": "LITERAL"}}).replace('"LITERAL"', literal)
    _refused(_post(api, "/v1/completions", bias), "logit_bias")


@pytest.mark.parametrize("extra,param", [
    ({"n": 10**6}, "n"), ({"n": 2**64}, "n"), ({"max_tokens": 2**63}, None), ({"max_tokens": -5}, "max_tokens"),
    ({"seed": 2**64}, "seed"), ({"top_k": -2**63}, "top_k"), ({"best_of": 10**9}, "best_of"),
    ({"top_logprobs": 10**6, "logprobs": True}, "top_logprobs"), ({"min_tokens": 10**12, "max_tokens": 4}, "min_tokens"),
], ids=["n", "n-overflow", "max-tokens-huge", "max-tokens-negative", "seed", "top-k", "best-of", "top-logprobs",
        "min-tokens"])
def test_oversized_generation_requests(api, extra, param):
    r = _post(api, "/v1/chat/completions", json.dumps({"model": MODEL, "messages": CHAT, **extra}))
    if param is None:  # max_tokens past the context: clamped to the context, as vLLM does, and finished
        assert r.status_code in (200, 400), r.text
    else:
        _refused(r, param)
    assert wait_idle(api.engine)
    normal_request_works(api)


def test_client_leaving_mid_stream_frees_its_blocks(api):
    engine = api.engine
    for _ in range(3):
        with api.http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "Count:", "max_tokens": 400,
                                                              "stream": True, "ignore_eos": True}) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
        # the context closed the connection after one event
    assert wait_idle(engine), "a request of a departed client kept running or kept its blocks"
    assert engine.core.kv.pool.num_used_blocks == 0
    normal_request_works(api)
