"""Issue kind 2: logprobs, chat (``logprobs`` + ``top_logprobs`` 0..20) and completions (``logprobs``
0..20), streamed and not, parsed by the ``openai`` client.

They are the raw model's (log-softmax of the logits before penalties, temperature and truncation, as
vLLM's default): checked against a transformers forward over the prompt and the generated tokens.
Greedy: the chosen token's logprob is the top-1 entry's. Tokens come with their real bytes (their
concatenation is the text's UTF-8).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests._api_helpers import CHAT, MODEL, normal_request_works, serve_tiny_api, wait_idle
from tests._api_helpers import endpoint as api_endpoint
from tests.conftest import make_tiny_model


@pytest.fixture(scope="module")
def api(tiny_model, tokenizer):
    yield from serve_tiny_api(tiny_model, tokenizer)


@pytest.fixture(scope="module")
def oracle(tokenizer):
    """A second instance of the tiny model (same weights), run by transformers alone."""
    model = make_tiny_model(len(tokenizer))
    model.set_attn_implementation("sdpa")
    return model


def _raw_logprobs(model, prompt_ids: list[int], out_ids: list[int]) -> torch.Tensor:
    """``[len(out_ids), vocab]`` log-softmax of the raw logits at each generated position."""
    ids = torch.tensor([prompt_ids + out_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    n = len(prompt_ids)
    return torch.log_softmax(logits[n - 1: n - 1 + len(out_ids)], dim=-1)


def _sse(resp) -> list[dict]:
    return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


def test_chat_logprobs_greedy(api):
    r = api.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0, logprobs=True,
                                           top_logprobs=5, extra_body={"ignore_eos": True})
    choice = r.choices[0]
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens == 10
    for e in content:
        assert len(e.top_logprobs) == 5
        lps = [t.logprob for t in e.top_logprobs]
        assert lps == sorted(lps, reverse=True) and all(x <= 0 for x in lps)
        assert e.logprob == e.top_logprobs[0].logprob and e.token == e.top_logprobs[0].token  # greedy
        assert e.bytes == e.top_logprobs[0].bytes
    assert bytes(b for e in content for b in e.bytes).decode("utf-8", errors="replace") == choice.message.content


def test_logprobs_are_the_raw_models(api, oracle, tokenizer):
    """Sampled with temperature, top-k and a repetition penalty: the logprobs are still those of the raw
    model output at each position (not of the processed distribution)."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.7, "top_k": 20,
            "repetition_penalty": 1.3, "seed": 5, "logprobs": 4, "ignore_eos": True, "return_token_ids": True}
    r = api.http.post("/v1/completions", json=body).json()
    ch = r["choices"][0]
    ref = _raw_logprobs(oracle, ch["prompt_token_ids"], ch["token_ids"])
    lp = ch["logprobs"]
    for i, tid in enumerate(ch["token_ids"]):
        assert math.isclose(lp["token_logprobs"][i], ref[i, tid].item(), abs_tol=2e-3)
        best = ref[i].topk(4).values.tolist()
        got = sorted(lp["top_logprobs"][i].values(), reverse=True)
        assert all(math.isclose(a, b, abs_tol=2e-3) for a, b in zip(got, best))
    # and the chat form of the same numbers
    chat = api.http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": CHAT, "max_tokens": 6, "temperature": 1.2, "seed": 9, "logprobs": True,
        "top_logprobs": 3, "ignore_eos": True, "return_token_ids": True}).json()
    ids = chat["choices"][0]["token_ids"]
    ref = _raw_logprobs(oracle, chat["prompt_token_ids"], ids)
    for i, e in enumerate(chat["choices"][0]["logprobs"]["content"]):
        assert math.isclose(e["logprob"], ref[i, ids[i]].item(), abs_tol=2e-3)
        assert [t["logprob"] for t in e["top_logprobs"]] == pytest.approx(ref[i].topk(3).values.tolist(), abs=2e-3)


@pytest.mark.parametrize("n", [1, 2])
def test_chat_logprobs_streamed_equal_non_streamed(api, n):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=8, temperature=1.0, seed=4, n=n, logprobs=True, top_logprobs=2)
    full = api.client.chat.completions.create(**kw)
    got = {i: [] for i in range(n)}
    for c in api.client.chat.completions.create(**kw, stream=True):
        for ch in c.choices:
            if ch.logprobs is not None:
                got[ch.index] += [e.model_dump() for e in ch.logprobs.content]
    for c in full.choices:
        assert got[c.index] == [e.model_dump() for e in c.logprobs.content]
        assert len(got[c.index]) == len(c.logprobs.content) > 0
    assert full.usage.completion_tokens == sum(len(c.logprobs.content) for c in full.choices)
    assert wait_idle(api.engine)


def test_completions_logprobs_streamed_and_not(api):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0, logprobs=3,
              extra_body={"ignore_eos": True})
    full = api.client.completions.create(**kw)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[tok] == tlp and 3 <= len(top) <= 4  # the sampled token and the 3 best
        assert tlp == max(top.values())  # greedy
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
    tokens, logprobs, tops, offsets = [], [], [], []
    for c in api.client.completions.create(**kw, stream=True):
        if c.choices and c.choices[0].logprobs:
            x = c.choices[0].logprobs
            tokens += x.tokens
            logprobs += x.token_logprobs
            tops += x.top_logprobs
            offsets += x.text_offset
    assert (tokens, logprobs, tops, offsets) == (lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset)
    # logprobs=0: the sampled token only
    zero = api.client.completions.create(**(kw | {"logprobs": 0})).choices[0].logprobs
    assert all(list(t) == [tok] for t, tok in zip(zero.top_logprobs, zero.tokens))
    assert zero.token_logprobs == lp.token_logprobs


def test_chat_logprobs_top_zero_and_token_ids(api):
    r = api.http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": CHAT, "max_tokens": 4, "temperature": 0, "logprobs": True, "ignore_eos": True,
        "return_tokens_as_token_ids": True, "return_token_ids": True}).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert all(e["top_logprobs"] == [] for e in content)
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in r["choices"][0]["token_ids"]]
    # without logprobs: null, as OpenAI
    r = api.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, logprobs=False)
    assert r.choices[0].logprobs is None


def test_byte_tokens_are_written_as_bytes(tokenizer):
    """A token that is only part of a UTF-8 character: ``bytes:\\x..`` text, its real bytes."""
    from server.logprobs import TokenText

    tt = TokenText(tokenizer)
    ids = tokenizer("你好🚀", add_special_tokens=False)["input_ids"]
    parts = [tt.get(i) for i in ids]
    assert bytes(b for _, raw in parts for b in raw).decode("utf-8") == "你好🚀"
    assert any(text.startswith("bytes:\\x") for text, _ in parts)
    assert tt.get(tokenizer.eos_token_id) == (tokenizer.eos_token, list(tokenizer.eos_token.encode()))
    word = tokenizer(" hello", add_special_tokens=False)["input_ids"][0]
    assert tt.get(word)[0] == tokenizer.decode([word])


@pytest.mark.parametrize("endpoint,body,param", [
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": 3}, "logprobs"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
    ("completions", {"logprobs": "many"}, "logprobs"),
])
def test_logprobs_out_of_range_is_400(api, endpoint, body, param):
    path, base = api_endpoint(endpoint)
    r = api.http.post(path, json={"model": MODEL} | base | body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    normal_request_works(api)


def test_real_model_greedy_logprobs(real_model):
    """The embedded model: greedy chat with logprobs, streamed and not, the chosen token is the top-1."""
    gen = serve_tiny_api(*real_model)
    api = next(gen)
    try:
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
                  max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
        full = api.client.chat.completions.create(**kw)
        content = full.choices[0].logprobs.content
        assert len(content) == full.usage.completion_tokens
        assert all(e.logprob == e.top_logprobs[0].logprob and e.token == e.top_logprobs[0].token for e in content)
        assert "Paris" in "".join(e.token for e in content)
        streamed = [e for c in api.client.chat.completions.create(**kw, stream=True)
                    for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
        # the same tokens and top-3 lists; logprobs equal up to float32 rounding: the second request finds
        # its prompt in the prefix cache and prefills one token instead of 35, and on some CPUs (MKL's
        # kernels differ by row count) that rounds differently in the last bits
        def shape(entries):
            return [(e.token, e.bytes, [(t.token, t.bytes) for t in e.top_logprobs]) for e in entries]

        def numbers(entries):
            return [v for e in entries for v in (e.logprob, *(t.logprob for t in e.top_logprobs))]

        assert shape(streamed) == shape(content)
        assert numbers(streamed) == pytest.approx(numbers(content), abs=1e-4)
    finally:
        gen.close()


# ---------------------------------------------------------------------------------------------- text_offset
SCRIPTED_TEXT = "Hi 😀, 日本語 ok! 🎉 done"


@pytest.fixture(scope="module")
def scripted(tiny_model, tokenizer):
    """An API whose sampler emits the tokens of :data:`SCRIPTED_TEXT` in order, for every request (the real
    draw still runs; its logprob entry is given the scripted token). Emoji and CJK split into byte tokens."""
    ids = tokenizer(SCRIPTED_TEXT, add_special_tokens=False)["input_ids"]
    serving = serve_tiny_api(tiny_model, tokenizer)
    api = next(serving)
    real = api.engine.core.sampler.sample

    def sample(logits, requests):
        drawn = real(logits, requests)
        out = []
        for r, _t in zip(requests, drawn):
            t = ids[min(len(r.output_token_ids), len(ids) - 1)]
            if len(r.output_logprobs) == len(r.output_token_ids) + 1:  # this step's entry
                _, lp, top = r.output_logprobs[-1]
                r.output_logprobs[-1] = (t, lp, top)
            out.append(t)
        return out

    api.engine.core.sampler.sample = sample
    yield api, ids
    next(serving, None)


def _expected_offsets(tokenizer, ids: list[int], text: str) -> list[int]:
    """Where each token's text begins in ``text``: the characters whose UTF-8 bytes all lie in the tokens
    before it (a token that only begins a character starts where that character does)."""
    from server.logprobs import TokenText

    tt, ends, pos = TokenText.of(tokenizer), [], 0
    for ch in text:
        pos += len(ch.encode())
        ends.append(pos)
    out, size = [], 0
    for t in ids:
        out.append(sum(1 for e in ends if e <= size))
        size += len(tt.get(t)[1])
    return out


@pytest.mark.parametrize("as_ids", [False, True], ids=["text", "token-ids"])
def test_text_offset_points_into_the_returned_text(scripted, tokenizer, as_ids):
    """Offsets are character positions in the returned text, whatever the token entries look like
    (``bytes:\\x..`` for a part of a character, ``token_id:N`` in token-id mode): before, the lengths of
    those placeholders were added, and the offsets ran past the text (up to 178 for 8 characters)."""
    api, ids = scripted
    assert any(tokenizer.decode([t]).endswith("\ufffd") for t in ids)  # the text has byte tokens
    n = len(ids)
    body = dict(model=MODEL, prompt="hi", max_tokens=n, temperature=0, logprobs=1,
                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": as_ids})
    full = api.client.completions.create(**body).choices[0]
    assert full.text == SCRIPTED_TEXT
    expected = _expected_offsets(tokenizer, ids, SCRIPTED_TEXT)
    assert full.logprobs.text_offset == expected
    assert all(0 <= o <= len(full.text) for o in full.logprobs.text_offset)
    for tok, off in zip(full.logprobs.tokens, full.logprobs.text_offset):
        if not as_ids and not tok.startswith("bytes:"):
            assert full.text[off:off + len(tok)] == tok  # a whole token's text is found where it says
    streamed, text = [], ""
    for c in api.client.completions.create(**body, stream=True):
        if c.choices:
            text += c.choices[0].text
            if c.choices[0].logprobs:
                streamed += c.choices[0].logprobs.text_offset
    assert (text, streamed) == (full.text, expected)


def test_text_offset_with_a_stop_string_and_echo(scripted, tokenizer):
    """A stop string cuts the text: the tokens after the cut point at its end. ``echo`` with ``logprobs`` stays
    refused (the prompt's logprobs are not computed), so offsets never count an echoed prompt."""
    api, ids = scripted
    body = dict(model=MODEL, prompt="hi", max_tokens=len(ids), temperature=0, logprobs=0,
                extra_body={"ignore_eos": True})
    full = api.client.completions.create(**body, stop=["ok"]).choices[0]
    assert full.text == "Hi 😀, 日本語 " and full.finish_reason == "stop"  # " ok" holds the space
    offsets = full.logprobs.text_offset
    expected = _expected_offsets(tokenizer, ids, SCRIPTED_TEXT)[:len(offsets)]
    assert offsets == [min(o, len(full.text)) for o in expected] and max(offsets) <= len(full.text)
    r = api.http.post("/v1/completions", json={"prompt": "hi", "echo": True, "logprobs": 1, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
