"""Block provenance (whose a block was, the step it was freed) and the free-block order (LRU / MRU):
exact block ids in the pool, and the hand-over "A finishes, D takes A's blocks" on a tiny engine."""

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv_cache import TAKE_CACHED, TAKE_NEW, TAKE_OWN, TAKE_REUSED, TAKE_SHARED, BlockPool
from engine.request import SamplingParams


def test_lru_takes_the_least_recently_freed_and_mru_the_most_recently_freed():
    for order, expected in (("lru", [4, 5]), ("mru", [0, 1])):
        pool = BlockPool(6, order)
        a = pool.allocate(2, "a")
        pool.allocate(2, "b")
        pool.free(list(reversed(a)))  # a request frees its blocks tail first
        assert pool.allocate(2, "d") == expected, order
    with pytest.raises(ValueError):
        BlockPool(4, "fifo")


def test_each_take_records_the_previous_owner_and_the_step_it_was_freed():
    pool = BlockPool(3, "mru")
    pool.step = 1
    pool.allocate(2, "a")
    first = pool.take_events()
    assert [(t.block_id, t.request_id, t.step, t.kind, t.previous_owner, t.freed_step) for t in first] == [
        (0, "a", 1, TAKE_NEW, None, None), (1, "a", 1, TAKE_NEW, None, None)]
    assert pool.take_events() == ()  # handed over once
    pool.step = 5
    pool.free([1, 0])
    assert pool.freed_step[:2] == [5, 5] and pool.origins == {}
    pool.step = 6
    pool.allocate(1, "d")  # MRU: block 0, freed last, by a at step 5
    pool.allocate(1, "a")  # block 1 again for a: its own
    takes = pool.take_events()
    assert [(t.block_id, t.kind, t.previous_owner, t.freed_step) for t in takes] == [
        (0, TAKE_REUSED, "a", 5), (1, TAKE_OWN, "a", 5)]
    assert pool.origins[0].request_id == "d" and pool.origins[0].previous_owner == "a"


def test_prefix_hits_record_cached_and_shared_takes_and_the_origins_copy_is_stable():
    pool = BlockPool(4)
    pool.step = 1
    pool.allocate(1, "a")
    pool.take_events()
    before = pool.origins_snapshot()
    assert pool.origins_snapshot() is before  # nothing changed: no copy
    pool.touch([0], "b")  # b hits a's block while a holds it
    (shared,) = pool.take_events()
    assert (shared.kind, shared.previous_owner, shared.freed_step) == (TAKE_SHARED, "a", None)
    assert pool.origins[0].request_id == "a"  # a shared block keeps its first holder's origin
    pool.step = 3
    pool.free([0, 0])
    pool.step = 4
    pool.touch([0], "c")  # a cached-free block brought back by a prefix hit
    (cached,) = pool.take_events()
    assert (cached.kind, cached.previous_owner, cached.freed_step) == (TAKE_CACHED, "a", 3)  # its first holder
    assert pool.origins_snapshot()[0].request_id == "c"
    assert before[0].request_id == "a"  # an earlier copy is never changed


def _engine(tiny_model, tokenizer, order):
    return EngineCore(EngineConfig(num_blocks=16, block_size=4, max_num_seqs=1, enable_prefix_caching=False,
                                   free_block_order=order), model=tiny_model, tokenizer=tokenizer)


@pytest.mark.parametrize("order", ["lru", "mru"])
def test_d_takes_a_slot_and_with_mru_exactly_the_blocks_a_freed_a_step_before(tiny_model, tokenizer, order):
    eng = _engine(tiny_model, tokenizer, order)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    eng.add_request("A", list(range(10, 19)), params)  # 9 prompt tokens + 3: 3 blocks of 4
    eng.add_request("D", list(range(30, 39)), params)
    a_blocks, a_freed, d_snap = None, None, None
    for _ in range(20):
        eng.step()
        snap = eng.telemetry.latest()
        if "A" in snap.block_tables:
            a_blocks = snap.block_tables["A"]
        if "A" in snap.finished:
            a_freed = snap.step
        if "D" in snap.admitted:
            d_snap = snap
            break
    assert a_freed is not None and d_snap is not None and d_snap.step == a_freed + 1
    d_takes = [t for t in d_snap.block_takes if t.request_id == "D"]
    assert [t.block_id for t in d_takes] == list(d_snap.block_tables["D"])
    if order == "mru":  # D takes exactly the blocks A freed one step before, in A's order
        assert d_snap.block_tables["D"] == a_blocks[: len(d_takes)]
        assert all(t.kind == TAKE_REUSED and t.previous_owner == "A" and t.freed_step == a_freed for t in d_takes)
    else:  # LRU: never-used blocks first
        assert not set(d_snap.block_tables["D"]) & set(a_blocks)
        assert all(t.kind == TAKE_NEW and t.previous_owner is None for t in d_takes)
    assert {b: o.request_id for b, o in d_snap.block_origins.items()} == {b: "D" for b in d_snap.block_tables["D"]}


def test_free_block_order_is_an_engine_option():
    from engine.options import ENGINE_OPTIONS

    opt = next(o for o in ENGINE_OPTIONS if o.name == "free_block_order")
    assert opt.default == "lru" and opt.choices == ("lru", "mru") and opt.env_var == "CBP_FREE_BLOCK_ORDER"
    assert "prefix" in opt.help
    with pytest.raises(ValueError):
        EngineConfig(free_block_order="newest")
