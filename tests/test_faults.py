"""Fault injection (issue 22): a fault in one request fails that request alone.

Each fault is injected by patching a component at run time (never through an option a user could set):
NaN logits for one request, a detokenizer that raises for one request (through ``EngineCore``,
``AsyncEngine`` and ``LLM``), a forward that raises once, and a forward that raises for every batch that
holds one poisoned request. For each: which requests fail, that the others equal their solo runs (tiny
random-weight Llama, float32, greedy), that no block leaks, and that the next request is served.
"""

from __future__ import annotations

import asyncio

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.llm import LLM
from engine.request import SamplingParams

PROMPTS = [list(range(10 + 7 * i, 10 + 7 * i + 5 + 3 * i)) for i in range(8)]  # 8 prompts, 5..26 tokens
POISONED = 3  # the index of the request the faults hit
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENGINE_ARGS = dict(num_blocks=128, block_size=4, max_num_seqs=8, max_num_batched_tokens=512)


def new_core(tiny_model, tokenizer) -> EngineCore:
    return EngineCore(EngineConfig(**ENGINE_ARGS), model=tiny_model, tokenizer=tokenizer)


def run_all(eng: EngineCore, max_steps: int = 2_000) -> dict:
    """Step until nothing is left; the final output of each request by id."""
    final = {}
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            return final
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    raise AssertionError("the engine did not finish")


def assert_no_leak(eng: EngineCore) -> None:
    """Nothing running or waiting, no block held: free + used = total and used = 0."""
    pool = eng.kv.pool
    assert not eng.scheduler.running and not eng.scheduler.waiting and not eng.scheduler.requests
    assert pool.num_used_blocks == 0, f"{pool.num_used_blocks} blocks leaked"
    assert len(set(pool.free_queue)) == pool.num_blocks


@pytest.fixture(scope="module")
def solo(tiny_model, tokenizer) -> list[list[int]]:
    """Each prompt's greedy tokens when it runs alone (the reference for the unaffected requests)."""
    eng = new_core(tiny_model, tokenizer)
    out = []
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"solo{i}", p, GREEDY)
        out.append(run_all(eng)[f"solo{i}"].token_ids)
    return out


def run_batch(eng: EngineCore) -> dict:
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, GREEDY)
    return run_all(eng)


def check_only_poisoned_failed(final: dict, solo: list[list[int]], match: str) -> None:
    bad = final[f"r{POISONED}"]
    assert bad.finish_reason == "error" and match in bad.error, bad.error
    for i in range(len(PROMPTS)):
        if i != POISONED:
            out = final[f"r{i}"]
            assert out.error is None and out.finish_reason == "length"
            assert out.token_ids == solo[i], f"request {i} changed by another request's fault"


def check_next_request_served(eng: EngineCore, solo: list[list[int]]) -> None:
    eng.add_request("next", PROMPTS[0], GREEDY)
    assert run_all(eng)["next"].token_ids == solo[0]
    assert_no_leak(eng)


# ---------------------------------------------------------------------------------------------- injectors
def nan_logits_at(runner, request_id: str, num_output_tokens: int, monkeypatch) -> None:
    """From the step where ``request_id`` has ``num_output_tokens`` tokens, its logits row is all NaN."""
    real = runner.execute_model

    def patched(scheduled, blocks_to_copy=()):
        logits, sampling = real(scheduled, blocks_to_copy)
        for row, req in enumerate(sampling):
            if req.request_id == request_id and len(req.output_token_ids) >= num_output_tokens:
                logits = logits.clone()
                logits[row] = float("nan")
        return logits, sampling

    monkeypatch.setattr(runner, "execute_model", patched)


def failing_detokenizer(output_processor, prompt_ids: list[int], at_update: int, monkeypatch) -> None:
    """Detokenizers built for ``prompt_ids`` raise ``RuntimeError`` on their ``at_update``-th token."""
    real = output_processor.new_detokenizer

    def patched(ids, params):
        detok = real(ids, params)
        if list(ids) == list(prompt_ids):
            update, calls = detok.update, {"n": 0}

            def poisoned_update(*a, **kw):
                calls["n"] += 1
                if calls["n"] == at_update:
                    raise RuntimeError("injected detokenizer fault")
                return update(*a, **kw)

            detok.update = poisoned_update
        return detok

    monkeypatch.setattr(output_processor, "new_detokenizer", patched)


# ---------------------------------------------------------------------------------------------- EngineCore
def test_nan_logits_fail_that_request_alone(tiny_model, tokenizer, solo, monkeypatch):
    eng = new_core(tiny_model, tokenizer)
    nan_logits_at(eng.runner, f"r{POISONED}", 3, monkeypatch)  # its 3rd decode step
    final = run_batch(eng)
    check_only_poisoned_failed(final, solo, "non-finite logits")
    assert final[f"r{POISONED}"].token_ids == solo[POISONED][:3]  # nothing sampled from the NaN row
    assert_no_leak(eng)
    monkeypatch.undo()
    check_next_request_served(eng, solo)


def test_detokenizer_fault_fails_that_request_alone(tiny_model, tokenizer, solo, monkeypatch):
    eng = new_core(tiny_model, tokenizer)
    failing_detokenizer(eng.output_processor, PROMPTS[POISONED], 3, monkeypatch)
    final = run_batch(eng)
    check_only_poisoned_failed(final, solo, "injected detokenizer fault")
    assert_no_leak(eng)
    check_next_request_served(eng, solo)


def test_forward_failing_once_is_retried(tiny_model, tokenizer, solo, monkeypatch):
    """The forward raises once, in the last decoder layer (after the first layer wrote its K/V): the
    step is run again and every request completes as if nothing happened. The fault is patched into the
    Python layer, so the test forces the Python layer loop: where every linear is on an own GEMM (float32 on
    AVX2-only CPUs, bfloat16 on AVX512-BF16) the layers otherwise run in one C++ call that never calls it."""
    monkeypatch.setenv("CBP_CPU_FUSED_LAYERS", "0")
    eng = new_core(tiny_model, tokenizer)
    own = eng.runner.own_forward  # the engine's own forward runs the tiny Llama; else transformers' layers
    layer = own.layers[-1] if own is not None else tiny_model.model.layers[-1]
    real, calls = layer.forward, {"n": 0}

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("injected transient fault")
        return real(*a, **kw)

    monkeypatch.setattr(layer, "forward", flaky)
    final = run_batch(eng)
    assert calls["n"] > 5
    for i in range(len(PROMPTS)):
        assert final[f"r{i}"].error is None and final[f"r{i}"].token_ids == solo[i]
    assert_no_leak(eng)
    check_next_request_served(eng, solo)


def test_forward_failing_for_a_poisoned_request_is_narrowed(tiny_model, tokenizer, solo, monkeypatch):
    """Every forward holding the poisoned request raises: the batch is split until only that request
    fails; the others complete, equal to their solo runs."""
    eng = new_core(tiny_model, tokenizer)
    real = eng.runner.execute_model
    forwards = {"n": 0}

    def poisoned(scheduled, blocks_to_copy=()):
        forwards["n"] += 1
        if any(r.request_id == f"r{POISONED}" for r, _ in scheduled):
            raise RuntimeError("injected persistent fault")
        return real(scheduled, blocks_to_copy)

    monkeypatch.setattr(eng.runner, "execute_model", poisoned)
    final = run_batch(eng)
    check_only_poisoned_failed(final, solo, "injected persistent fault")
    assert final[f"r{POISONED}"].token_ids == []
    assert_no_leak(eng)
    check_next_request_served(eng, solo)


def test_nan_logits_of_one_parallel_sample_fail_that_sample_alone(tiny_model, tokenizer, monkeypatch):
    """n=2: a NaN row of the forked sibling fails that child alone, nothing leaks."""
    eng = new_core(tiny_model, tokenizer)
    nan_logits_at(eng.runner, "grp#1", 2, monkeypatch)
    eng.add_request("grp", PROMPTS[0], SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=8, ignore_eos=True))
    eng.add_request("other", PROMPTS[1], GREEDY)
    final = run_all(eng)  # the core reports each child of the n=2 request under its own id
    assert final["grp#1"].finish_reason == "error" and "non-finite" in final["grp#1"].error
    assert final["grp#0"].finish_reason == "length" and final["grp#0"].error is None
    assert final["other"].error is None
    assert_no_leak(eng)


# ---------------------------------------------------------------------------------------------- AsyncEngine
def test_detokenizer_fault_through_async_engine(tiny_model, tokenizer, solo, monkeypatch):
    eng = AsyncEngine(new_core(tiny_model, tokenizer))
    try:
        failing_detokenizer(eng.core.output_processor, PROMPTS[POISONED], 3, monkeypatch)

        async def main():
            outs = [eng.generate_text(p, GREEDY, request_id=f"r{i}") for i, p in enumerate(PROMPTS)]
            return await asyncio.wait_for(asyncio.gather(*outs), 120)

        final = {o.request_id: o for o in asyncio.run(main())}
        check_only_poisoned_failed(final, solo, "injected detokenizer fault")
        assert eng.is_running
        nxt = asyncio.run(asyncio.wait_for(eng.generate_text(PROMPTS[0], GREEDY), 60))
        assert nxt.token_ids == solo[0]
    finally:
        eng.shutdown()
    assert_no_leak(eng.core)


# ---------------------------------------------------------------------------------------------- LLM
def test_detokenizer_fault_through_llm(tiny_model, tokenizer, solo, monkeypatch):
    llm = LLM(tiny_model, tokenizer=tokenizer, **ENGINE_ARGS)
    failing_detokenizer(llm.engine.output_processor, PROMPTS[POISONED], 3, monkeypatch)
    outs = llm.generate(PROMPTS, GREEDY)
    assert outs[POISONED].finish_reason == "error" and "injected detokenizer fault" in outs[POISONED].error
    assert [o.token_ids for i, o in enumerate(outs) if i != POISONED] == [s for i, s in enumerate(solo)
                                                                        if i != POISONED]
    assert_no_leak(llm.engine)
    assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids == solo[0]


def test_llm_survives_a_failed_call(tiny_model, tokenizer, solo, monkeypatch):
    """A step that raises (an engine-level fault: here the scheduler) makes ``generate`` raise; every
    request of that call is aborted and freed, and the next call works."""
    llm = LLM(tiny_model, tokenizer=tokenizer, **ENGINE_ARGS)
    real, calls = llm.engine.scheduler.schedule, {"n": 0}

    def broken():
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected scheduler fault")
        return real()

    monkeypatch.setattr(llm.engine.scheduler, "schedule", broken)
    with pytest.raises(RuntimeError, match="injected scheduler fault"):
        llm.generate(PROMPTS, GREEDY)
    assert_no_leak(llm.engine)
    outs = llm.generate(PROMPTS[:2], GREEDY)
    assert [o.token_ids for o in outs] == solo[:2]
    assert_no_leak(llm.engine)


def test_sampler_fault_fails_that_request_alone(tiny_model, tokenizer, solo, monkeypatch):
    """The vectorised sampler raises; each row is then sampled alone and only the bad row fails."""
    eng = new_core(tiny_model, tokenizer)
    real = eng.sampler.sample

    def sample(logits, requests):
        if any(r.request_id == f"r{POISONED}" and len(r.output_token_ids) == 2 for r in requests):
            raise RuntimeError("injected sampler fault")
        return real(logits, requests)

    monkeypatch.setattr(eng.sampler, "sample", sample)
    final = run_batch(eng)
    check_only_poisoned_failed(final, solo, "injected sampler fault")
    assert_no_leak(eng)


def test_output_building_fault_fails_that_request_alone(tiny_model, tokenizer, solo, monkeypatch):
    eng = new_core(tiny_model, tokenizer)
    real = eng.output_processor.make_output

    def make_output(req):
        if req.request_id == f"r{POISONED}" and len(req.output_token_ids) == 4:
            raise RuntimeError("injected output fault")
        return real(req)

    monkeypatch.setattr(eng.output_processor, "make_output", make_output)
    final = run_batch(eng)
    check_only_poisoned_failed(final, solo, "injected output fault")
    assert_no_leak(eng)
