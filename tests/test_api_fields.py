"""Issue kind 1: every request field of OpenAI's chat / completions endpoints and vLLM's extra sampling
fields is honoured or refused with a 400 naming it, never accepted and ignored.

- ``min_tokens`` (the embedded model): EOS and stop strings are suppressed until ``min_tokens`` tokens
  exist; ``min_tokens > max_tokens`` is a 400 naming ``min_tokens``.
- ``stream_options`` with ``stream: false`` is a 400.
- every field the server does not implement (the tables of :mod:`server.protocol`) is a 400 naming it
  when set to anything but its no-op value; fields with no effect on the output are accepted.
- the implemented ones do what they say: ``logit_bias``, ``allowed_token_ids``, presence / frequency
  penalties, ``truncate_prompt_tokens``, ``echo``, ``request_id``, ``return_token_ids``,
  ``stream_options.continuous_usage_stats``, ``best_of == n``.
"""

from __future__ import annotations

import json

import pytest
import torch

from engine.request import Request, SamplingParams
from engine.sampler import Sampler
from server.protocol import REFUSED_CHAT, REFUSED_COMMON, REFUSED_COMPLETIONS
from tests._api_helpers import CHAT, MODEL, normal_request_works, serve_tiny_api, wait_idle
from tests._api_helpers import endpoint as api_endpoint

FRUIT = [{"role": "user", "content": "Name a fruit."}]


@pytest.fixture(scope="module")
def api(tiny_model, tokenizer):
    yield from serve_tiny_api(tiny_model, tokenizer)


@pytest.fixture(scope="module")
def real_api(real_model):
    """The same API over the embedded SmolLM2 (float32, CPU)."""
    yield from serve_tiny_api(*real_model)


def _sse(resp) -> list[dict]:
    """The JSON events of a streamed httpx response (without ``[DONE]``)."""
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line.removeprefix("data: ")))
    return out


def _streamed_chat(api, **kw) -> tuple[str, list]:
    chunks = list(api.client.chat.completions.create(model=MODEL, stream=True, **kw))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


# ---------------------------------------------------------------------------------------------- min_tokens
def test_min_tokens_suppresses_eos_on_the_embedded_model(real_api):
    kw = dict(messages=FRUIT, temperature=0, max_tokens=48)
    plain = real_api.client.chat.completions.create(model=MODEL, **kw)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < 24  # EOS came early
    r = real_api.client.chat.completions.create(model=MODEL, **kw, extra_body={"min_tokens": 24})
    assert r.usage.completion_tokens >= 24, r.choices[0].message.content
    assert r.choices[0].message.content.startswith(plain.choices[0].message.content)  # greedy: same start
    text, chunks = _streamed_chat(real_api, **kw, extra_body={"min_tokens": 24},
                                  stream_options={"include_usage": True})
    assert text == r.choices[0].message.content and chunks[-1].usage.completion_tokens >= 24


def test_min_tokens_suppresses_stop_strings(real_api):
    """A stop string completed before ``min_tokens`` tokens is not a stop; the next one after is."""
    kw = dict(messages=FRUIT, temperature=0, max_tokens=48)
    long = real_api.client.chat.completions.create(model=MODEL, **kw, extra_body={"min_tokens": 24})
    text = long.choices[0].message.content
    first = text.find("Banana")
    second = text.find("Banana", first + 1)
    assert 0 <= first < second, text  # the greedy answer names the fruit early, then again after 24 tokens
    for stream in (False, True):
        body = {"model": MODEL, **kw, "stop": ["Banana"], "min_tokens": 24, "stream": stream}
        if stream:
            with real_api.http.stream("POST", "/v1/chat/completions", json=body) as resp:
                events = _sse(resp)
            got = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
            last = events[-1]["choices"][0]
        else:
            last = real_api.http.post("/v1/chat/completions", json=body).json()["choices"][0]
            got = last["message"]["content"]
        assert got == text[:second] and last["finish_reason"] == "stop" and last["stop_reason"] == "Banana"
    # without min_tokens the first one stops it
    r = real_api.client.chat.completions.create(model=MODEL, **kw, stop=["Banana"])
    assert r.choices[0].message.content == text[:first]


@pytest.mark.parametrize("endpoint,body,param", [
    ("chat", {"max_tokens": 4, "min_tokens": 10}, "min_tokens"),
    ("chat", {"max_completion_tokens": 4, "min_tokens": 10}, "min_tokens"),
    ("completions", {"max_tokens": 4, "min_tokens": 10}, "min_tokens"),
    ("chat", {"min_tokens": -1}, "min_tokens"),
])
def test_min_tokens_over_max_tokens_is_400(api, endpoint, body, param):
    path, base = api_endpoint(endpoint)
    r = api.http.post(path, json={"model": MODEL} | base | body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    normal_request_works(api)


def test_stream_options_without_stream_is_400(api):
    for path, base in (("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "hi"})):
        for stream in ({}, {"stream": False}):
            r = api.http.post(path, json={"model": MODEL, **base, **stream, "stream_options": {"include_usage": True}})
            assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text
    normal_request_works(api)


# ---------------------------------------------------------------------------------------------- refused fields
# a value that uses each refused field (the test below fails when a field is added without one)
USED = {
    "use_beam_search": True, "length_penalty": 0.5, "early_stopping": True, "prompt_logprobs": 1,
    "logprob_token_ids": [1], "bad_words": ["hello"], "structured_outputs": {"json": {"type": "object"}},
    "guided_json": {"type": "object"}, "guided_regex": "a+", "guided_choice": ["a", "b"],
    "guided_grammar": "root ::= 'a'", "structural_tag": "{}", "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": " ", "logits_processors": ["my.Processor"], "priority": 1,
    "truncation_side": "right", "kv_transfer_params": {"do_remote_decode": True}, "ec_transfer_params": {"a": 1},
    "vllm_xargs": {"a": 1}, "mm_processor_kwargs": {"num_crops": 4}, "media_io_kwargs": {"image": {}},
    "thinking_token_budget": 16, "repetition_detection": {"max_pattern_size": 4}, "watermarking": True,
    "lora_request": {"name": "x"},
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tool_choice": "auto",
    "functions": [{"name": "f"}], "function_call": "auto", "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"], "reasoning_effort": "low", "verbosity": "low", "web_search_options": {},
    "documents": [{"title": "t", "text": "x"}], "chat_template": "{{ messages[0]['content'] }}",
    "suffix": "the end", "prompt_embeds": "AAAA",
}
REFUSED = ([("chat", f) for f in REFUSED_COMMON] + [("completions", f) for f in REFUSED_COMMON]
           + [("chat", f) for f in REFUSED_CHAT] + [("completions", f) for f in REFUSED_COMPLETIONS]
           + [("chat", "tools_empty"), ("chat", "response_format"), ("completions", "response_format"),
              ("completions", "best_of"), ("completions", "echo_logprobs"), ("chat", "logit_bias_range"),
              ("chat", "logit_bias_key"), ("chat", "logit_bias_vocab"), ("completions", "allowed_token_ids_vocab"),
              ("chat", "allowed_token_ids_empty"), ("chat", "allowed_token_ids_min_tokens"),
              ("chat", "truncate_prompt_tokens"),
              ("chat", "chat_template_kwargs"), ("chat", "tool_calls_message"), ("chat", "presence_penalty")])
SPECIAL = {  # name -> (body fields, param)
    "tools_empty": ({"tools": []}, "tools"),
    "response_format": ({"response_format": {"type": "json_object"}}, "response_format"),
    "best_of": ({"best_of": 3}, "best_of"),
    "echo_logprobs": ({"echo": True, "logprobs": 2}, "echo"),
    "logit_bias_range": ({"logit_bias": {"5": 150}}, "logit_bias"),
    "logit_bias_key": ({"logit_bias": {"five": 1}}, "logit_bias"),
    "logit_bias_vocab": ({"logit_bias": {"999999": 1}}, "logit_bias"),
    "allowed_token_ids_vocab": ({"allowed_token_ids": [1, 999999]}, "allowed_token_ids"),
    "allowed_token_ids_empty": ({"allowed_token_ids": []}, "allowed_token_ids"),
    # only EOS (id 2) allowed, but EOS is masked until min_tokens: nothing left to sample
    "allowed_token_ids_min_tokens": ({"allowed_token_ids": [2], "min_tokens": 1}, "allowed_token_ids"),
    "truncate_prompt_tokens": ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    "chat_template_kwargs": ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    "tool_calls_message": ({"messages": CHAT + [{"role": "assistant", "content": "",
                                                 "tool_calls": [{"id": "1", "type": "function"}]}]},
                           "messages[1].tool_calls"),
    "presence_penalty": ({"presence_penalty": -3}, "presence_penalty"),
}


def test_every_refused_field_has_an_example():
    assert set(REFUSED_COMMON) | set(REFUSED_CHAT) | set(REFUSED_COMPLETIONS) <= set(USED)


@pytest.mark.parametrize("endpoint,name", REFUSED, ids=[f"{e}-{n}" for e, n in REFUSED])
def test_unimplemented_field_is_400_naming_it(api, endpoint, name):
    body, param = SPECIAL[name] if name in SPECIAL else ({name: USED[name]}, name)
    path, base = api_endpoint(endpoint)
    r = api.http.post(path, json={"model": MODEL, "max_tokens": 2} | base | body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert api.engine.num_pending == 0
    # the no-op value of a refused field is accepted
    if name in USED:
        noop = {**REFUSED_COMMON, **REFUSED_CHAT, **REFUSED_COMPLETIONS}[name][0]
        r = api.http.post(path, json={"model": MODEL, "max_tokens": 2} | base | {name: noop[-1]})
        assert r.status_code == 200, r.text


def test_fields_without_effect_are_accepted(api):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=6, temperature=0)
    plain = api.client.chat.completions.create(**kw).choices[0].message.content
    r = api.client.chat.completions.create(
        **kw, user="u1", metadata={"k": "v"}, store=False, service_tier="auto", parallel_tool_calls=True,
        tool_choice="none", extra_body={"prompt_cache_key": "k", "safety_identifier": "s", "include_reasoning": True,
                                        "spaces_between_special_tokens": True, "best_of": 1, "add_special_tokens": False,
                                        "response_format": {"type": "text"}, "modalities": ["text"]})
    assert r.choices[0].message.content == plain
    assert wait_idle(api.engine)


# ---------------------------------------------------------------------------------------------- implemented fields
def _ids(api, **kw) -> list[int]:
    r = api.http.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6,
                                               "ignore_eos": True, "return_token_ids": True} | kw)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_logit_bias_and_allowed_token_ids(api):
    target = api.engine.tokenizer(" lighthouse", add_special_tokens=False)["input_ids"][0]
    assert _ids(api, temperature=0, logit_bias={str(target): 100}) == [target] * 6
    assert _ids(api, temperature=1.0, seed=1, logit_bias={str(target): 100}) == [target] * 6
    allowed = [target, 28, 30]
    assert set(_ids(api, temperature=1.0, seed=2, allowed_token_ids=allowed, max_tokens=12)) <= set(allowed)
    assert set(_ids(api, temperature=0, allowed_token_ids=allowed)) <= set(allowed)


def test_presence_and_frequency_penalties_in_the_sampler():
    logits = torch.zeros(1, 10)
    logits[0, 3] = 1.0
    logits[0, 4] = 0.5

    def pick(out, **kw):
        r = Request("r", [1], SamplingParams(temperature=0, **kw))
        r.output_token_ids = list(out)
        return Sampler().sample(logits, [r])[0]

    assert pick([3]) == 3
    assert pick([3], presence_penalty=0.6) == 4  # 1.0 - 0.6 < 0.5
    assert pick([3], presence_penalty=0.4) == 3
    assert pick([3, 3], frequency_penalty=0.2) == 3  # 1.0 - 0.4 > 0.5
    assert pick([3, 3, 3], frequency_penalty=0.2) == 4  # 1.0 - 0.6 < 0.5
    assert pick([3], presence_penalty=-0.5, frequency_penalty=0.0) == 3
    assert pick([], presence_penalty=2.0) == 3  # only output tokens count


def test_penalties_through_the_api(api):
    base = _ids(api, temperature=0, max_tokens=12)
    pen = _ids(api, temperature=0, max_tokens=12, frequency_penalty=2.0, presence_penalty=2.0)
    assert len(pen) == 12 and (pen != base or len(set(base)) == len(base))


def test_truncate_prompt_tokens(api):
    prompt = "one two three four five six seven eight nine ten"
    ids = api.engine.tokenizer(prompt)["input_ids"]
    r = api.client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                      extra_body={"truncate_prompt_tokens": 4})
    assert r.usage.prompt_tokens == 4
    raw = api.http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3,
                                                 "truncate_prompt_tokens": 4, "return_token_ids": True}).json()
    assert raw["choices"][0]["prompt_token_ids"] == ids[-4:]
    same = api.client.completions.create(model=MODEL, prompt=ids[-4:], max_tokens=3, temperature=0)
    assert same.choices[0].text == r.choices[0].text


def test_completions_echo_streamed_and_not(api):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0, echo=True)
    full = api.client.completions.create(**kw)
    plain = api.client.completions.create(**(kw | {"echo": False}))
    assert full.choices[0].text == "Once upon a time" + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in api.client.completions.create(**kw, stream=True) if c.choices)
    assert streamed == full.choices[0].text
    ids = api.engine.tokenizer("Once upon a time")["input_ids"]
    by_ids = api.client.completions.create(**(kw | {"prompt": ids}))
    assert by_ids.choices[0].text == full.choices[0].text


def test_request_id_and_header(api):
    r = api.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "request_id": "abc"})
    assert r.json()["id"] == "cmpl-abc"
    r = api.http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 2},
                      headers={"X-Request-Id": "trace-7"})
    assert r.json()["id"] == "chatcmpl-trace-7"
    # the same client id twice at once is fine (the engine's own ids stay unique)
    r = api.http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": 2,
                                               "request_id": "abc#1"})
    assert r.status_code == 200 and r.json()["id"] == "cmpl-abc#1"


def test_return_token_ids_streamed_and_not(api):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    full = api.http.post("/v1/chat/completions", json=body).json()
    tok = api.engine.tokenizer
    text = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert full["prompt_token_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert len(full["choices"][0]["token_ids"]) == full["usage"]["completion_tokens"]
    with api.http.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as resp:
        events = _sse(resp)
    assert events[0]["prompt_token_ids"] == full["prompt_token_ids"]
    streamed = [t for e in events for ch in e["choices"] for t in ch.get("token_ids") or []]
    assert streamed == full["choices"][0]["token_ids"]


def test_continuous_usage_stats(api):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with api.http.stream("POST", "/v1/completions", json=body) as resp:
        events = _sse(resp)
    counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert counts == sorted(counts) and counts[-1] == 5 and all(e["usage"]["prompt_tokens"] > 0 for e in events)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5


def test_best_of_equal_to_n_is_accepted(api):
    r = api.client.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=2, best_of=2, seed=1)
    assert len(r.choices) == 2
    assert wait_idle(api.engine)


@pytest.mark.parametrize("body,param", [({"stop": 5}, "stop"), ({"stop": [5]}, "stop"), ({"stop_token_ids": "x"}, "stop_token_ids")])
def test_a_wrong_type_in_a_union_field_names_the_field(api, body, param):
    """pydantic reports ``("body", "stop", "str")`` for ``"stop": 5``: the param is the field, not the union tag."""
    path, base = api_endpoint("chat")
    r = api.http.post(path, json={"model": MODEL} | base | body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
