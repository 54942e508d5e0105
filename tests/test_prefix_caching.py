"""Prefix caching and parallel sampling on the tiny model: identical greedy outputs with caching on
and off, hash-map entries that match their blocks' tokens, and n > 1 with shared prompt blocks."""

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv_cache import hash_block
from engine.parallel_sampling import ParentRequest
from engine.request import SamplingParams

BS = 4


def engine(tiny_model, tokenizer, caching=True, **kw):
    kw.setdefault("num_blocks", 48)
    kw.setdefault("max_num_seqs", 4)
    return EngineCore(EngineConfig(block_size=BS, enable_prefix_caching=caching, **kw), model=tiny_model,
                      tokenizer=tokenizer)


def check_cache_invariants(eng):
    pool = eng.kv.pool
    holders = [0] * pool.num_blocks
    for r in eng.scheduler.running:
        parent = None
        tokens = r.all_token_ids
        for i, b in enumerate(r.block_ids):
            holders[b] += 1
            if (i + 1) * BS <= r.num_computed_tokens:
                h = hash_block(parent, tokens[i * BS : (i + 1) * BS], r.cache_salt)
                # a hashed block holds exactly the tokens it was hashed from
                assert pool.block_hash[b] in (None, h)
                parent = h
    for h, b in pool.hash_to_block.items():
        assert pool.block_hash[b] == h
    assert holders == pool.ref_cnt
    assert all((b in pool.free_queue) == (holders[b] == 0) for b in range(pool.num_blocks))


def run(eng, plan, max_tokens=6):
    """``plan``: list of steps, each a list of (id, token ids) to add before that step."""
    outs = {}
    step = 0
    while step < len(plan) or eng.has_unfinished_requests():
        for rid, ids in plan[step] if step < len(plan) else []:
            eng.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
        check_cache_invariants(eng)
        step += 1
    assert eng.kv.pool.num_used_blocks == 0  # idle: every block is free or cached-free
    return outs


def both(tiny_model, tokenizer, plan, **kw):
    on = engine(tiny_model, tokenizer, True, **kw)
    got_on = run(on, plan)
    got_off = run(engine(tiny_model, tokenizer, False, **kw), plan)
    assert got_on == got_off
    return on


P = list(range(200, 214))  # 14 tokens: 3 full blocks + 2


def test_same_prompt_twice_in_a_row(tiny_model, tokenizer):
    eng = both(tiny_model, tokenizer, [[("a", P)]] + [[]] * 8 + [[("b", P)]])
    assert eng.kv.prefix_hits >= 12  # b reused a's three full blocks


def test_same_prompt_twice_in_the_same_step(tiny_model, tokenizer):
    both(tiny_model, tokenizer, [[("a", P), ("b", P)]])


def test_again_after_traffic_evicted_some_blocks(tiny_model, tokenizer):
    traffic = [[(f"t{i}", list(range(1000 + 40 * i, 1000 + 40 * i + 20)))] for i in range(8)]
    eng = both(tiny_model, tokenizer, [[("a", P)]] + [[]] * 7 + traffic + [[]] * 8 + [[("b", P)]], num_blocks=16)
    assert eng.kv.pool.num_evictions > 0


def test_prompts_sharing_part_of_a_block(tiny_model, tokenizer):
    q = P[:6] + [999, 998, 997, 996, 995]  # shares one full block and half of the next
    eng = both(tiny_model, tokenizer, [[("a", P)]] + [[]] * 7 + [[("b", q)]])
    assert eng.kv.prefix_hits == 4


def test_prompt_of_whole_blocks_recomputes_its_last_token(tiny_model, tokenizer):
    whole = P[:12]
    eng = both(tiny_model, tokenizer, [[("a", whole)]] + [[]] * 7 + [[("b", whole)]])
    assert eng.kv.prefix_hits == 8  # two of three blocks: the last token must be computed


def test_parallel_sampling_shares_prompt_blocks_and_frees_them(tiny_model, tokenizer):
    def sample(seed):
        eng = engine(tiny_model, tokenizer, max_num_seqs=4)
        parent = ParentRequest(eng.add_request("p", P, SamplingParams(n=4, temperature=1.0, seed=seed, max_tokens=8,
                                                                      ignore_eos=True)))  # at submission, as the front does
        shared_seen = False
        final = {}
        while eng.has_unfinished_requests():
            for o in eng.step():  # the core reports each child under its own id; the front merges them
                if o.finished:
                    final[o.request_id] = o
            running = eng.scheduler.running
            if len(running) == 4:
                # the prompt's blocks are held by all four block tables
                assert all(eng.kv.pool.ref_cnt[b] == 4 for b in running[0].block_ids[:3])
                shared_seen = True
            check_cache_invariants(eng)
        assert shared_seen and eng.kv.num_cow_copies >= 3  # the partly filled prompt block was copied
        assert eng.kv.pool.num_used_blocks == 0
        assert sorted(final) == ["p#0", "p#1", "p#2", "p#3"]
        merged = parent.merge([final[f"p#{i}"] for i in range(4)])
        assert merged.finished and merged.request_id == "p" and [c.index for c in merged.outputs] == [0, 1, 2, 3]
        assert all(len(c.token_ids) == 8 for c in merged.outputs)
        return [c.token_ids for c in merged.outputs]

    a = sample(7)
    assert a == sample(7)  # reproducible with a fixed seed
    assert len({tuple(t) for t in a}) > 1  # and the four differ


def test_second_chat_turn_reuses_first_turn_blocks_and_telemetry_shows_it(tiny_model, tokenizer):
    from ui.figures import block_map_figure

    eng = engine(tiny_model, tokenizer, num_blocks=64)
    turn1 = [{"role": "user", "content": "Tell me a story about a cat."}]
    eng.add_request("t1", turn1, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    reply = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            reply = o.text
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
    eng.add_request("t2", turn2, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    eng.step()
    snap = eng.telemetry.latest()
    assert len(snap.cache_hit_blocks) >= 8  # the system prompt and the first turn were found cached
    assert set(snap.cache_hit_blocks) <= set(snap.block_tables["t2"])
    fig = block_map_figure(snap)
    assert len(fig.data[4].x) == len(snap.cache_hit_blocks)
    stats = eng.telemetry.stats()
    assert stats["prefix_hit_rate"] > 0.3 and stats["prefill_tokens_saved"] >= 32


def test_a_request_waiting_for_blocks_is_counted_once_in_the_hit_rate(tiny_model, tokenizer):
    # 8 blocks of 4 tokens: "a" (20 prompt tokens + 8 new) fills most of the pool, so "b" (same 16-token
    # prefix, 12 more) waits several steps for blocks; its lookup counts once, when it is admitted.
    eng = engine(tiny_model, tokenizer, True, num_blocks=8, max_num_seqs=2)
    prefix = list(range(10, 26))
    eng.add_request("a", prefix + [1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    eng.step()
    eng.add_request("b", prefix + list(range(40, 52)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    waited = 0
    while eng.has_unfinished_requests():
        eng.step()
        waited += any(r.request_id == "b" for r in eng.scheduler.waiting)
    assert waited >= 2, "b never had to wait: the test does not test the double count"
    assert eng.kv.prefix_queries == 20 + 28
    assert eng.kv.prefix_hits % BS == 0 and eng.kv.prefix_hits <= 16
