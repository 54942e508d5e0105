"""Adversarial tests: bad input must fail alone, with a clear error, and leave nothing behind.

Each test is a minimal reproduction of a problem found by attacking the engine and the API with odd
input (tiny random model, CPU). See the docstring of each test for the symptom.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import torch

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.errors import RequestError
from engine.request import SamplingParams
from server import ServerThread, create_api
from tests.conftest import make_tiny_model

torch.set_num_threads(1)

LONE_SURROGATE = "\ud800"  # a valid Python str (and valid JSON "\ud800"), but not encodable as UTF-8


def core(model, tok, **kw) -> EngineCore:
    cfg = dict(num_blocks=64, block_size=4, max_num_seqs=4)
    cfg.update(kw)
    return EngineCore(EngineConfig(**cfg), model=model, tokenizer=tok)


def run_to_end(eng: EngineCore, max_steps: int = 1000) -> dict:
    outs = {}
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            break
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    assert not eng.has_unfinished_requests(), "livelock: requests still unfinished"
    return outs


# ---------------------------------------------------------------------------------------------- engine
def test_lone_surrogate_cache_salt_fails_alone(tiny_model, tokenizer):
    """A ``cache_salt`` that is not UTF-8 encodable is accepted by ``make_request``; later, on the
    stepping thread, ``hash_block`` calls ``salt.encode("utf-8")`` and raises ``UnicodeEncodeError``
    out of ``EngineCore.step``; ``AsyncEngine._fail_all`` then fails *every* running and waiting
    request: another user's request is lost."""
    eng = AsyncEngine(core(tiny_model, tokenizer, num_blocks=64, block_size=4))
    try:
        async def good():
            return await eng.generate_text("one two three four five six",
                                           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))

        async def bad():
            try:
                return await eng.generate_text("hello there my friend",
                                               SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                               cache_salt=LONE_SURROGATE)
            except ValueError:
                return None  # rejected up front with a clear error: fine

        async def main():
            return await asyncio.wait_for(asyncio.gather(good(), bad()), 60)

        good_out, bad_out = asyncio.run(main())
        assert good_out.error is None, f"the good request was failed by another's bad input: {good_out.error}"
        assert good_out.finish_reason == "length" and len(good_out.token_ids) == 12
        assert bad_out is None or bad_out.finish_reason == "error"
        assert eng.is_running
    finally:
        eng.shutdown()


def test_lone_surrogate_prompt_is_a_clear_value_error(tiny_model, tokenizer):
    """A prompt (or chat content) holding a lone surrogate makes the Rust tokenizer raise a
    ``TypeError`` ("TextEncodeInput must be Union[...]"), which ``make_request`` lets through: callers
    that catch ``ValueError`` for bad input (the API) answer 500."""
    eng = core(tiny_model, tokenizer)
    with pytest.raises(ValueError):
        eng.add_request("a", "hi " + LONE_SURROGATE, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError):
        eng.add_request("b", [{"role": "user", "content": LONE_SURROGATE}], SamplingParams(max_tokens=2))


def test_underflowing_repetition_penalty_does_not_kill_neighbours(tokenizer):
    """``repetition_penalty=1e-300`` passes ``validate`` (> 0) but is 0.0 in float32: the penalty turns
    positive logits into +inf, the softmax into NaN, and ``_draw_full`` then returns a token id in the
    padding past ``vocab_size`` (the model's vocabulary is padded above the tokenizer's, as many real
    models are). The next forward's embedding lookup raises ``IndexError`` and every request of that
    step fails, including the innocent greedy one."""
    model = make_tiny_model(len(tokenizer) + 100)  # vocab not a multiple of the sampler's 256-block
    eng = core(model, tokenizer)
    eng.add_request("good", "hello world", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    try:
        eng.add_request("bad", "hello there", SamplingParams(temperature=1.0, repetition_penalty=1e-300, seed=1,
                                                             max_tokens=8, ignore_eos=True))
    except ValueError:
        pass  # rejected up front: fine
    outs = run_to_end(eng)
    assert outs["good"].error is None, outs["good"].error
    assert len(outs["good"].token_ids) == 8
    vocab = model.config.vocab_size
    if "bad" in outs:
        assert all(0 <= t < vocab for t in outs["bad"].token_ids), outs["bad"].token_ids
    assert eng.kv.pool.num_used_blocks == 0


def test_request_id_n1_and_an_n2_request_of_the_same_id_stay_apart_in_the_core(tiny_model, tokenizer):
    """The core knows sequences only: ``x`` (n=1) and the children ``x#0``/``x#1`` of a second ``x`` (n=2) are
    three sequences, each reported under its own id and finished normally (it once reported the n=1
    request's progress as the n=2 group's). A caller-level duplicate (the same id while the first streams)
    is the front's to refuse (``AsyncEngine.generate``); a caller's id may not name a child."""
    eng = core(tiny_model, tokenizer)
    eng.add_request("x", "hello world", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    eng.add_request("x", "good morning", SamplingParams(temperature=0, max_tokens=5, n=2, ignore_eos=True))
    with pytest.raises(RequestError):
        eng.add_request("x#1", "again", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    finished = {}
    for _ in range(200):
        if not eng.has_unfinished_requests():
            break
        finished.update({o.request_id: o for o in eng.step() if o.finished})
    assert sorted(finished) == ["x", "x#0", "x#1"]
    assert all(o.error is None and len(o.outputs) == 1 and len(o.token_ids) == 5 for o in finished.values())
    assert eng.kv.pool.num_used_blocks == 0


def test_aborting_a_sibling_before_admission_leaks_no_slot(tiny_model, tokenizer):
    """Aborting one sequence of an n>1 request (id ``A#1``) before the request is admitted finishes it,
    but it stays in ``A#0.pending_forks``; ``Scheduler._admit`` then gives that finished sequence a batch
    slot, and since a finished sibling never forks, nothing ever releases it: the slot is lost for good
    (``scheduler.batch_slots`` holds a FINISHED_ABORTED request after everything is done)."""
    eng = core(tiny_model, tokenizer, max_num_seqs=4)
    eng.add_request("A", "hello world", SamplingParams(temperature=0, max_tokens=3, n=2, ignore_eos=True))
    eng.abort_request("A#1")
    run_to_end(eng)
    assert all(s is None for s in eng.scheduler.batch_slots), eng.scheduler.batch_slots
    assert eng.kv.pool.num_used_blocks == 0


# ---------------------------------------------------------------------------------------------- API
@pytest.fixture(scope="module")
def api(tiny_model, tokenizer):
    engine = AsyncEngine(EngineCore(EngineConfig(num_blocks=64, block_size=4, max_num_seqs=4,
                                                 max_num_batched_tokens=64), model=tiny_model, tokenizer=tokenizer))
    server = ServerThread(create_api(engine, "tiny")).start()
    yield server.url, engine
    server.stop()
    engine.shutdown()


def _post(url: str, path: str, raw: str) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=30) as h:  # a fresh connection each time
        return h.post(path, content=raw, headers={"content-type": "application/json"})


@pytest.mark.parametrize(
    "path,raw",
    [
        # the 404 message repeats the model name; JSONResponse (ensure_ascii=False) cannot encode it
        ("/v1/chat/completions", '{"model":"\\ud800","messages":[{"role":"user","content":"hi"}]}'),
        # the tokenizer's TypeError is not caught by OpenAIServer.start (only ValueError)
        ("/v1/chat/completions", '{"messages":[{"role":"user","content":"\\ud800"}],"max_tokens":2}'),
        ("/v1/completions", '{"prompt":"\\ud800","max_tokens":2}'),
        # accepted, then crashes the engine step (see test_lone_surrogate_cache_salt_fails_alone)
        ("/v1/completions", '{"prompt":"hello there you all","max_tokens":6,"temperature":0,"cache_salt":"\\ud800"}'),
        # a field name: pydantic refuses it before any field is read (no location): not "not a JSON object"
        ("/v1/chat/completions", '{"messages":[{"role":"user","content":"x"}],"\\ud800":1,"max_tokens":4}'),
    ],
    ids=["model", "chat-content", "prompt", "cache-salt", "field-name"],
)
def test_api_lone_surrogates_get_a_4xx_json_error(api, path, raw):
    url, engine = api
    r = _post(url, path, raw)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:200])
    assert "error" in r.json()
    assert "Unicode" in r.json()["error"]["message"] or r.status_code == 404, r.text[:200]
    end = time.monotonic() + 30
    while time.monotonic() < end and (engine.num_pending or engine.core.kv.pool.num_used_blocks):
        time.sleep(0.01)
    assert engine.core.kv.pool.num_used_blocks == 0
    ok = _post(url, "/v1/completions", '{"prompt":"hello","max_tokens":2,"temperature":0}')
    assert ok.status_code == 200
