"""Scheduler: step-by-step slot and block assignments for hand-made request mixes."""

import pytest

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus, SamplingParams
from engine.scheduler import Scheduler


def make(policy="continuous", slots=3, num_blocks=64, block_size=4, budget=256, max_len=1024, prefix=False):
    cfg = EngineConfig(policy=policy, max_num_seqs=slots, num_blocks=num_blocks, block_size=block_size,
                       max_num_batched_tokens=budget, enable_prefix_caching=prefix)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size, prefix), max_len)


def add(s, rid, prompt_len, max_tokens, start=0):
    r = Request(rid, list(range(start + 1, start + 1 + prompt_len)), SamplingParams(max_tokens=max_tokens), max_model_len=s.max_model_len)
    s.add_request(r)
    return r


def step(s):
    """One engine step with a fake model that always samples token 0. ``out.slots`` records each
    scheduled request's slot during the step."""
    out = s.schedule()
    out.slots = {r.request_id: r.batch_slot for r, _ in out.scheduled}
    sampled = {r.request_id: 0 for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens}
    s.apply_stops(*s.update_from_output(out, sampled))  # token-level stops only: no text step here
    return out


def slot_names(s):
    return [r.request_id if r is not None else None for r in s.batch_slots]


def run_abcde(policy):
    """The classic example: three slots; A, B, C need 2, 5 and 3 new tokens; D and E wait."""
    s = make(policy)
    for rid, mt in zip("ABCDE", [2, 5, 3, 4, 4]):
        add(s, rid, 4, mt)
    history = []
    while s.has_unfinished_requests():
        out = step(s)
        history.append((out.slots, [r.request_id for r in out.admitted]))
    return history


def test_continuous_fills_freed_slots_in_the_next_step():
    h = run_abcde("continuous")
    assert h[0] == ({"A": 0, "B": 1, "C": 2}, ["A", "B", "C"])
    assert h[1] == ({"A": 0, "B": 1, "C": 2}, [])  # A's 2nd token: A finishes
    assert h[2] == ({"B": 1, "C": 2, "D": 0}, ["D"])  # step 3: D takes A's slot; C finishes
    assert h[3] == ({"B": 1, "D": 0, "E": 2}, ["E"])  # step 4: E takes C's slot
    assert len(h) == 7  # D (admitted step 3, 4 tokens) ends at step 6, E at step 7


def test_static_waits_for_the_whole_batch():
    h = run_abcde("static")
    for i in range(5):
        assert set(h[i][0]) <= {"A", "B", "C"}
    assert set(h[2][0]) == {"B", "C"} and set(h[3][0]) == {"B"}  # finished rows stay empty
    assert h[5] == ({"D": 0, "E": 1}, ["D", "E"])  # D and E start only after B's fifth token
    assert len(h) == 9


def test_static_reserves_prompt_plus_max_tokens_blocks():
    s = make("static", block_size=4)
    a = add(s, "A", 4, 9)  # 13 tokens -> 4 blocks up front
    step(s)
    assert len(a.block_ids) == 4


def test_static_slots_stay_held_by_finished_rows_until_batch_ends():
    s = make("static")
    add(s, "A", 4, 1)
    add(s, "B", 4, 3)
    step(s)  # A finishes at once
    assert slot_names(s) == ["A", "B", None]
    step(s)
    step(s)
    assert slot_names(s) == [None, None, None]


def test_chunked_prefill_splits_long_prompts_by_budget():
    s = make(budget=8)
    a = add(s, "A", 20, 2)
    assert [n for _, n in step(s).scheduled] == [8]
    assert a.num_computed_tokens == 8 and a.output_token_ids == []
    assert [n for _, n in step(s).scheduled] == [8]
    assert [n for _, n in step(s).scheduled] == [4]
    assert a.output_token_ids == [0]  # the last chunk samples
    assert [n for _, n in step(s).scheduled] == [1]


def test_budget_is_shared_running_first_then_waiting():
    s = make(budget=10)
    add(s, "A", 6, 5)
    add(s, "B", 9, 5)
    out = step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("A", 6), ("B", 4)]
    out = step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("A", 1), ("B", 5)]


def test_preemption_evicts_most_recent_and_requeues_it_first():
    # 4 blocks of 4 tokens; A and B each hold 2 blocks after an 8-token prompt
    s = make(num_blocks=4, block_size=4)
    a = add(s, "A", 8, 6)
    b = add(s, "B", 8, 6)
    step(s)  # both prefill 8 tokens (2 blocks each) and sample their first token
    assert a.block_ids == [0, 1] and b.block_ids == [2, 3]
    out = step(s)  # A needs a 3rd block: B (admitted last) is preempted
    assert [r.request_id for r in out.preempted] == ["B"]
    assert b.status == RequestStatus.WAITING and b.block_ids == [] and b.num_computed_tokens == 0
    assert s.waiting[0] is b and b.batch_slot is None and b.num_preemptions == 1
    assert a.block_ids == [0, 1, 3]
    while s.has_unfinished_requests():
        step(s)
    assert len(a.output_token_ids) == 6 and len(b.output_token_ids) == 6
    assert s.kv.pool.num_free_blocks == 4


def test_max_tokens_is_clamped_to_the_context_length_and_a_lone_request_runs_to_it():
    """A lone request asking for more than the context length holds is clamped (3 prompt + 5 = 8 tokens) and
    runs to the end in a pool that just fits it, without preempting itself."""
    s = make(num_blocks=2, block_size=4, max_len=8)
    a = add(s, "A", 3, 100)  # clamped to the context length
    assert a.max_tokens == 5
    while s.has_unfinished_requests():
        step(s)
    assert a.status == RequestStatus.FINISHED_LENGTH and len(a.output_token_ids) == 5


def test_requests_that_can_never_fit_are_rejected():
    s = make(num_blocks=4, block_size=4, max_len=64)
    with pytest.raises(ValueError, match="context length"):
        add(s, "long", 64, 1)
    with pytest.raises(ValueError, match="KV blocks"):
        add(s, "big", 20, 1)
    with pytest.raises(ValueError, match="empty"):
        s.add_request(Request("e", [], SamplingParams()))
    st = make("static", num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="KV blocks"):
        add(st, "x", 8, 20)


def test_abort_frees_blocks_and_slot_at_once():
    s = make()
    a = add(s, "A", 6, 10)
    add(s, "B", 6, 10)
    step(s)
    s.abort("A")
    assert a.status == RequestStatus.FINISHED_ABORTED and a.block_ids == [] and slot_names(s) == [None, "B", None]
    s.abort("nope")  # unknown ids are ignored
    add(s, "C", 4, 2)
    step(s)
    assert slot_names(s) == ["C", "B", None]


def test_long_prompt_is_chunked_around_running_decodes():
    """Latency policy: while requests decode, every step computes each decode token and at most
    ``prefill_chunk_tokens`` prompt tokens per prompt that can progress, in arrival order; once nothing
    decodes, a prompt uses the whole budget."""
    cfg = EngineConfig(max_num_seqs=6, num_blocks=256, block_size=4, max_num_batched_tokens=100,
                       prefill_chunk_tokens=16, enable_prefix_caching=False)
    s = Scheduler(cfg, KVCacheManager(256, 4, False), 1024)
    add(s, "A", 4, 30)
    add(s, "B", 4, 30)
    step(s)  # both prompts, nothing decodes yet
    add(s, "L", 200, 2, start=100)
    chunks = []
    while not s.requests["L"].output_token_ids:
        out = step(s)
        sched = {r.request_id: n for r, n in out.scheduled}
        assert sched["A"] == 1 and sched["B"] == 1, sched  # the streams never stall
        chunks.append(sched.get("L", 0))
    assert chunks == [16] * 12 + [8]  # 200 prompt tokens in chunks of at most 16
    # two prompts arriving together: the step computes a chunk for each (2 x 16 prompt tokens), but in
    # arrival order, the first taking all it still needs, so M reaches its first token a step earlier
    add(s, "M", 40, 1, start=400)
    add(s, "N", 40, 1, start=500)
    sched = {r.request_id: n for r, n in step(s).scheduled}
    assert sched["M"] == 32 and "N" not in sched and sched["A"] == 1 and sched["B"] == 1, sched
    sched = {r.request_id: n for r, n in step(s).scheduled}
    assert sched["M"] == 8 and sched["N"] == 24, sched  # 8 left of M; N gets the rest of 2 x 16
    sched = {r.request_id: n for r, n in step(s).scheduled}
    assert sched["N"] == 16 and sched["A"] == 1, sched  # only N still prefills: one chunk
    # nothing decoding: a new prompt takes the whole budget at once
    s2 = Scheduler(cfg, KVCacheManager(256, 4, False), 1024)
    add(s2, "P", 90, 1)
    assert [(r.request_id, n) for r, n in step(s2).scheduled] == [("P", 90)]



def test_prompt_budget_keeps_short_prompts_and_the_step_target_unhindered():
    """The per-step prompt budget (one chunk per prompt that can progress, admitted prompts in arrival
    order) must not delay a short prompt behind a long one mid-prefill, must not count waiting requests the
    static policy cannot admit, and must not cap a chunk sized by ``prefill_step_target``."""
    def mk(**kw):
        cfg = EngineConfig(num_blocks=4096, block_size=4, enable_prefix_caching=False, **kw)
        return Scheduler(cfg, KVCacheManager(cfg.num_blocks, cfg.block_size, False), 100_000)

    # a long prompt part way through its prefill keeps its own chunk; short prompts behind it go at once
    s = mk(max_num_seqs=8, max_num_batched_tokens=2048, prefill_chunk_tokens=16)
    add(s, "A", 4, 1000)
    step(s)
    add(s, "L", 3000, 1, start=100)
    step(s)
    for i in range(5):
        add(s, f"S{i}", 16, 1, start=5000 + 100 * i)
    sched = {r.request_id: n for r, n in step(s).scheduled}
    assert sched == {"A": 1, "L": 16, **{f"S{i}": 16 for i in range(5)}}, sched
    # static: waiting requests are not admitted while a batch runs, so they add nothing to the budget
    s = mk(policy="static", max_num_seqs=8, max_num_batched_tokens=104, prefill_chunk_tokens=16)
    add(s, "A", 4, 50)
    add(s, "B", 400, 5, start=100)
    for i in range(5):
        add(s, f"W{i}", 10, 5, start=1000 + 100 * i)
    step(s)
    assert {r.request_id: n for r, n in step(s).scheduled} == {"A": 1, "B": 16}
    # a chunk sized by the step-time target is not capped by prefill_chunk_tokens
    s = mk(max_num_seqs=4, max_num_batched_tokens=2048, prefill_chunk_tokens=80, prefill_step_target=3.0)
    add(s, "A", 4, 100)
    step(s)
    add(s, "L", 4000, 1, start=100)
    s.step_cost.fixed, s.step_cost.per_token, s.step_cost.per_pair = 0.01, 1e-5, 0.0
    sched = {r.request_id: n for r, n in step(s).scheduled}
    assert sched["A"] == 1 and sched["L"] > 80, sched
