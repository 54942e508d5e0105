"""Engine-level behaviour on a tiny random-weight Llama: continuous vs static, bad input, aborts,
telemetry, and block invariants under random request mixes (hypothesis)."""

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.llm import LLM
from engine.request import SamplingParams


def core(tiny_model, tokenizer, **kw):
    kw.setdefault("num_blocks", 64)
    kw.setdefault("block_size", 4)
    kw.setdefault("max_num_seqs", 4)
    return EngineCore(EngineConfig(**kw), model=tiny_model, tokenizer=tokenizer)


def run_to_end(eng, max_steps=10_000):
    outs = {}
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            return outs
        for o in eng.step():
            outs[o.request_id] = o
    raise AssertionError("engine did not finish")


def check_invariants(eng):
    """free + used = total; no block both free and in a live block table; refcount = number of
    block tables holding it."""
    pool = eng.kv.pool
    holders = [0] * pool.num_blocks
    for r in eng.scheduler.running:
        for b in r.block_ids:
            holders[b] += 1
    for r in eng.scheduler.waiting:
        assert r.block_ids == [], "a waiting request holds blocks"
    free = set(pool.free_queue)
    assert len(free) + sum(1 for c in pool.ref_cnt if c > 0) == pool.num_blocks
    for b in range(pool.num_blocks):
        assert pool.ref_cnt[b] == holders[b], f"block {b}: refcount {pool.ref_cnt[b]} != holders {holders[b]}"
        assert (b in free) == (holders[b] == 0)
    for h, b in pool.hash_to_block.items():
        assert pool.block_hash[b] == h


def test_continuous_takes_fewer_steps_and_idle_slot_steps_than_static(tiny_model, tokenizer):
    lengths = [2, 40, 3, 35, 4, 30, 5, 25]
    results = {}
    for policy in ("continuous", "static"):
        eng = core(tiny_model, tokenizer, policy=policy, num_blocks=128)
        for i, n in enumerate(lengths):
            eng.add_request(f"r{i}", list(range(10, 18)), SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        outs = run_to_end(eng)
        assert [len(outs[f"r{i}"].token_ids) for i in range(len(lengths))] == lengths
        results[policy] = (eng.step_count, eng.telemetry.total_idle_slot_steps)
    assert results["continuous"][0] < results["static"][0]
    assert results["continuous"][1] < results["static"][1]


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ("", SamplingParams(), "empty"),
        ([], SamplingParams(), "empty"),
        ("hi " * 600, SamplingParams(), "context length"),
        ("hello", SamplingParams(max_tokens=0), "max_tokens"),
        ("hello", SamplingParams(temperature=-1.0), "temperature"),
        ("hello", SamplingParams(top_p=0.0), "top_p"),
        ("hello", SamplingParams(top_p=1.5), "top_p"),
        ([{"role": "user"}], SamplingParams(), "content"),
        (12, SamplingParams(), "prompt"),
        ("hello", SamplingParams(n=5), "batch slots"),
        ("hello", SamplingParams(n=99), "at most"),
    ],
)
def test_bad_input_fails_alone_and_the_engine_keeps_serving(tiny_model, tokenizer, prompt, params, match):
    eng = core(tiny_model, tokenizer, max_model_len=512, num_blocks=256)
    eng.add_request("good", "hello there", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    eng.step()
    with pytest.raises(ValueError, match=match):
        eng.add_request("bad", prompt, params)
    outs = run_to_end(eng)
    assert outs["good"].finished and len(outs["good"].token_ids) == 5
    assert eng.kv.pool.num_used_blocks == 0


def test_abort_frees_blocks_within_one_step(tiny_model, tokenizer):
    eng = core(tiny_model, tokenizer)
    eng.add_request("a", "one two three four five", SamplingParams(max_tokens=50, ignore_eos=True))
    eng.add_request("b", "six seven eight", SamplingParams(max_tokens=5, ignore_eos=True))
    eng.step()
    eng.step()
    held = len(eng.scheduler.requests["a"].block_ids)
    assert held > 0
    eng.abort_request("a")
    outs = eng.step()
    aborted = [o for o in outs if o.request_id == "a"]
    assert aborted and aborted[0].finish_reason == "abort" and aborted[0].finished
    assert "a" not in eng.telemetry.latest().block_tables
    run_to_end(eng)
    assert eng.kv.pool.num_used_blocks == 0


def test_telemetry_records_slots_blocks_and_phases(tiny_model, tokenizer):
    eng = core(tiny_model, tokenizer, max_num_seqs=2, num_blocks=5)
    eng.add_request("a", list(range(20, 29)), SamplingParams(max_tokens=3, ignore_eos=True))
    eng.add_request("b", list(range(30, 35)), SamplingParams(max_tokens=2, ignore_eos=True))
    eng.add_request("c", list(range(40, 45)), SamplingParams(max_tokens=2, ignore_eos=True))
    run_to_end(eng)
    snaps = eng.telemetry.snapshots()
    first = snaps[0]
    assert [(s.batch_slot, s.request_id, s.phase, s.num_scheduled_tokens) for s in first.batch_slots] == [
        (0, "a", "prefill", 9), (1, "b", "prefill", 5)]
    assert set(first.block_tables) == {"a", "b"} and len(first.block_tables["a"]) == 3
    assert first.admitted == ("a", "b")
    assert snaps[1].batch_slots[0].phase == "decode"
    assert snaps[1].finished == ("b",)
    # c takes b's slot in the next step, and (the pool being full) the blocks b freed
    assert snaps[2].batch_slots[1].request_id == "c" and snaps[2].admitted == ("c",)
    assert sorted(snaps[2].block_tables["c"]) == sorted(snaps[0].block_tables["b"])
    assert all(snaps[2].block_reuses[b] == 1 for b in snaps[2].block_tables["c"])
    stats = eng.telemetry.stats()
    assert stats["generated_tokens"] == 7 and stats["ttft_p50"] is not None
    # a request waiting for its first token can tell where it is
    assert first.waiting == ("c",) and first.request_state("c") == {"state": "queued", "position": 1}
    assert first.request_state("a") == {"state": "decoding"} and first.request_state("zz") is None


def test_telemetry_shows_a_long_prompt_prefilling_n_of_m(tiny_model, tokenizer):
    eng = core(tiny_model, tokenizer, max_num_batched_tokens=16, prefill_chunk_tokens=8)
    eng.add_request("chat", list(range(20, 25)), SamplingParams(max_tokens=20, ignore_eos=True))
    eng.step()
    eng.add_request("long", list(range(100, 140)), SamplingParams(max_tokens=1, ignore_eos=True))
    states = []
    for _ in range(5):
        eng.step()
        snap = eng.telemetry.latest()
        states.append(snap.request_state("long"))
        assert snap.request_state("chat") == {"state": "decoding"}
    assert states[:4] == [{"state": "prefilling", "computed": n, "prompt": 40} for n in (8, 16, 24, 32)]
    stats = eng.stats()
    assert states[4] == {"state": "finished"}  # the 5th chunk completed the prompt; its one token ended it
    assert stats.step_count == 6 and stats.num_running == 1 and stats.num_preemptions == 0


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    reqs=st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 30), st.integers(0, 6), st.booleans(), st.integers(0, 3),
                  st.sampled_from([1, 1, 1, 2, 3])),
        min_size=1, max_size=10,
    ),
    num_blocks=st.integers(12, 40),
    budget=st.sampled_from([8, 16, 64]),
    policy=st.sampled_from(["continuous", "continuous", "static"]),
)
def test_block_invariants_hold_after_every_step(tiny_model, tokenizer, reqs, num_blocks, budget, policy):
    """Random arrivals, lengths, shared prefixes, parallel samples (n) and aborts: invariants after every
    step; all free at the end."""
    eng = core(tiny_model, tokenizer, num_blocks=num_blocks, max_num_batched_tokens=budget, policy=policy,
               max_model_len=num_blocks * 4)
    arrivals = {}
    for i, (plen, mt, arrive, abort, prefix, n) in enumerate(reqs):
        arrivals.setdefault(arrive, []).append((i, plen, mt, abort, prefix, n))
    step = 0
    aborts = {}
    while step < 400:
        for i, plen, mt, abort, prefix, n in arrivals.pop(step, []):
            ids = [7] * (prefix * 4) + list(range(100 + i * 50, 100 + i * 50 + plen))
            try:
                eng.add_request(f"r{i}", ids, SamplingParams(temperature=1.0, seed=i, n=n, max_tokens=mt,
                                                             ignore_eos=True))
            except ValueError:
                continue  # could never fit: rejected at admission
            if abort:
                aborts[step + 1 + i % 3] = f"r{i}"
        if step in aborts:
            eng.abort_request(aborts[step])
        eng.step()
        check_invariants(eng)
        step += 1
        if not arrivals and not eng.has_unfinished_requests():
            break
    assert not eng.has_unfinished_requests()
    assert eng.kv.pool.num_used_blocks == 0
    assert set(eng.kv.pool.free_queue) == set(range(num_blocks))


def test_llm_generate_keeps_prompt_order_and_accepts_per_prompt_params(tiny_model, tokenizer):
    llm = LLM(tiny_model, tokenizer=tokenizer, num_blocks=64, block_size=4)
    outs = llm.generate(["a b c", [{"role": "user", "content": "hi"}], [5, 6, 7]],
                        [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in (3, 1, 2)])
    assert [len(o.token_ids) for o in outs] == [3, 1, 2]
    assert all(o.finish_reason == "length" for o in outs)
    with pytest.raises(ValueError):
        llm.generate(["ok", ""], SamplingParams())


def test_async_engine_streams_concurrently_and_aborts_on_break(tiny_model, tokenizer):
    eng = AsyncEngine(EngineCore(EngineConfig(num_blocks=64, block_size=4, max_num_seqs=4), model=tiny_model,
                                 tokenizer=tokenizer))

    async def full(rid, n):
        deltas = []
        async for out in eng.generate("count with me", SamplingParams(max_tokens=n, ignore_eos=True), request_id=rid):
            deltas.append(out.delta)
        return out, "".join(deltas)

    async def early(rid):
        async for out in eng.generate("stop early", SamplingParams(max_tokens=500, ignore_eos=True), request_id=rid):
            if len(out.token_ids) >= 3:
                break

    async def main():
        return await asyncio.gather(full("x", 12), full("y", 7), early("z"))

    try:
        (ox, tx), (oy, ty), _ = asyncio.run(main())
        assert len(ox.token_ids) == 12 and ox.text == tx and len(oy.token_ids) == 7 and oy.text == ty
        with pytest.raises(ValueError):
            asyncio.run(full("bad", 0))
        for _ in range(1500):  # (30 s at most)
            if eng.core.kv.pool.num_used_blocks == 0 and not eng.core.has_unfinished_requests():
                break
            asyncio.run(asyncio.sleep(0.02))
        assert eng.core.kv.pool.num_used_blocks == 0
        steps = eng.telemetry.snapshots()
        assert any(sum(1 for s in snap.batch_slots if s.request_id) >= 3 for snap in steps)
    finally:
        eng.shutdown()


def test_async_engine_rejects_past_max_pending(tiny_model, tokenizer):
    from engine.async_engine import EngineOverloadedError

    eng = AsyncEngine(EngineCore(EngineConfig(num_blocks=64, block_size=4, max_num_seqs=2), model=tiny_model,
                                 tokenizer=tokenizer), max_pending=1)

    async def main():
        gen = eng.generate("long one", SamplingParams(max_tokens=200, ignore_eos=True), request_id="p1")
        first = await gen.__anext__()
        with pytest.raises(EngineOverloadedError):
            async for _ in eng.generate("second", SamplingParams(max_tokens=2), request_id="p2"):
                pass
        await gen.aclose()  # leaving the stream aborts the request
        return first

    try:
        assert asyncio.run(main()).request_id == "p1"
    finally:
        eng.shutdown()
