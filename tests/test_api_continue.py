"""Issue kind 3: continuing the assistant's last message (``continue_final_message`` with
``add_generation_prompt: false``), as transformers' ``apply_chat_template(..., continue_final_message=True)``
renders it: the last message left open, no new turn. Both flags true is a 400; ``echo`` puts the
continued message in front of the answer (vLLM's).
"""

from __future__ import annotations

import json

import pytest

from tests._api_helpers import MODEL, normal_request_works, serve_tiny_api

FRANCE = [{"role": "user", "content": "What is the capital of France?"},
          {"role": "assistant", "content": "The capital of France is"}]


@pytest.fixture(scope="module")
def api(tiny_model, tokenizer):
    yield from serve_tiny_api(tiny_model, tokenizer)


def _render(tok, messages, **kw) -> list[int]:
    return tok(tok.apply_chat_template(messages, tokenize=False, **kw), add_special_tokens=False)["input_ids"]


def _prompt_ids(api, **body) -> list[int]:
    r = api.http.post("/v1/chat/completions", json={"model": MODEL, "messages": FRANCE, "max_tokens": 1,
                                                    "return_token_ids": True} | body)
    assert r.status_code == 200, r.text
    return r.json()["prompt_token_ids"]


def test_prompt_is_rendered_open(api, tokenizer):
    cont = _prompt_ids(api, continue_final_message=True, add_generation_prompt=False)
    assert cont == _render(tokenizer, FRANCE, continue_final_message=True, add_generation_prompt=False)
    assert tokenizer.decode(cont).endswith("<|im_start|>assistant\nThe capital of France is")
    # the default: a new assistant turn after the (closed) last message
    new_turn = _prompt_ids(api)
    assert new_turn == _render(tokenizer, FRANCE, add_generation_prompt=True)
    assert tokenizer.decode(new_turn).endswith("The capital of France is<|im_end|>\n<|im_start|>assistant\n")
    # add_generation_prompt false alone: the chat closed, no header
    closed = _prompt_ids(api, add_generation_prompt=False)
    assert tokenizer.decode(closed).endswith("The capital of France is<|im_end|>\n")
    # continue_final_message without add_generation_prompt: taken as false (not a new turn)
    assert _prompt_ids(api, continue_final_message=True) == cont


@pytest.mark.parametrize("body,param", [
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"chat_template_kwargs": {"continue_final_message": True}}, "chat_template_kwargs"),
    ({"continue_final_message": "yes please"}, "continue_final_message"),
])
def test_conflicting_flags_are_400(api, body, param):
    r = api.http.post("/v1/chat/completions", json={"model": MODEL, "messages": FRANCE, "max_tokens": 2} | body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    normal_request_works(api)


def test_real_model_continues_the_message(real_model):
    """The embedded model continues "The capital of France is" with " Paris", streamed and not; the
    default request starts a new turn instead; ``echo`` returns the whole message."""
    gen = serve_tiny_api(*real_model)
    api = next(gen)
    try:
        body = {"model": MODEL, "messages": FRANCE, "max_tokens": 8, "temperature": 0,
                "continue_final_message": True, "add_generation_prompt": False}
        r = api.http.post("/v1/chat/completions", json=body).json()
        text = r["choices"][0]["message"]["content"]
        assert text.startswith(" Paris"), text
        assert r["choices"][0]["message"]["role"] == "assistant"
        with api.http.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as resp:
            events = [json.loads(x[6:]) for x in resp.iter_lines() if x.startswith("data: {")]
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == text
        new_turn = api.http.post("/v1/chat/completions", json={"model": MODEL, "messages": FRANCE, "max_tokens": 8,
                                                                "temperature": 0}).json()
        assert not new_turn["choices"][0]["message"]["content"].startswith(" Paris")
        echoed = api.http.post("/v1/chat/completions", json=body | {"echo": True}).json()
        assert echoed["choices"][0]["message"]["content"] == "The capital of France is" + text
        with api.http.stream("POST", "/v1/chat/completions", json=body | {"echo": True, "stream": True}) as resp:
            events = [json.loads(x[6:]) for x in resp.iter_lines() if x.startswith("data: {")]
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == \
            echoed["choices"][0]["message"]["content"]
    finally:
        gen.close()
