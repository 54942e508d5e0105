"""Block provenance (whose a block was, the step it was freed: derived from the pool's events) and the
free-block order (LRU / MRU): exact block ids in the pool, and the hand-over "A finishes, D takes A's blocks" on a tiny engine."""

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv_cache import BlockPool
from engine.kv_events import TAKE_CACHED, TAKE_NEW, TAKE_OWN, TAKE_REUSED, TAKE_SHARED, BlockFreed, BlockTake
from engine.kv_provenance import Provenance
from engine.request import SamplingParams


def takes(pool: BlockPool, prov: Provenance, step: int) -> list[BlockTake]:
    """The takes among the pool's events since the last call, as the telemetry stamps them in ``step``."""
    return [e for e in prov.stamp(pool.pop_events(), step) if type(e) is BlockTake]


def test_the_pool_says_what_it_did_and_the_provenance_whose_each_block_was():
    pool, prov = BlockPool(3, "mru"), Provenance()
    pool.allocate(2, "a")
    raw = pool.pop_events()
    assert [type(e).__name__ for e in raw] == ["KVFrame", "BlockAllocated", "BlockAllocated"]  # no step, no owner
    first = [e for e in prov.stamp(raw, 1) if type(e) is BlockTake]
    assert [(t.block_id, t.request_id, t.step, t.kind, t.previous_owner, t.freed_step) for t in first] == [
        (0, "a", 1, TAKE_NEW, None, None), (1, "a", 1, TAKE_NEW, None, None)]
    assert takes(pool, prov, 1) == []  # handed over once
    pool.free([1, 0])
    freed = prov.stamp(pool.pop_events(), 5)
    assert [(type(e), e.block_id, e.request_id, e.step) for e in freed] == [(BlockFreed, 1, "a", 5), (BlockFreed, 0, "a", 5)]
    assert prov.freed_step[:2] == [5, 5] and prov.state.origins == {}
    pool.allocate(1, "d")  # MRU: block 0, freed last, by a at step 5
    pool.allocate(1, "a")  # block 1 again for a: its own
    got = takes(pool, prov, 6)
    assert [(t.block_id, t.kind, t.previous_owner, t.freed_step) for t in got] == [
        (0, TAKE_REUSED, "a", 5), (1, TAKE_OWN, "a", 5)]
    assert prov.state.origins[0].request_id == "d" and prov.state.origins[0].previous_owner == "a"
    assert list(prov.state.reuses) == [1, 0, 0]  # block 1 went back to its own holder: no reuse


def test_prefix_hits_record_cached_and_shared_takes():
    pool, prov = BlockPool(4), Provenance()
    pool.allocate(1, "a")
    takes(pool, prov, 1)
    pool.touch([0], "b")  # b hits a's block while a holds it
    (shared,) = takes(pool, prov, 2)
    assert (shared.kind, shared.previous_owner, shared.freed_step) == (TAKE_SHARED, "a", None)
    assert prov.state.origins[0].request_id == "a"  # a shared block keeps its first holder's origin
    pool.free([0, 0])
    prov.stamp(pool.pop_events(), 3)
    pool.touch([0], "c")  # a cached-free block brought back by a prefix hit
    (cached,) = takes(pool, prov, 4)
    assert (cached.kind, cached.previous_owner, cached.freed_step) == (TAKE_CACHED, "a", 3)  # its first holder
    assert prov.state.origins[0].request_id == "c"
    pool.touch([0], None)  # a fork's siblings take no block of their own
    assert takes(pool, prov, 5) == [] and prov.state.origins[0].request_id == "c"


def test_lru_takes_the_least_recently_freed_and_mru_the_most_recently_freed():
    for order, expected in (("lru", [4, 5]), ("mru", [0, 1])):
        pool = BlockPool(6, order)
        a = pool.allocate(2, "a")
        pool.allocate(2, "b")
        pool.free(list(reversed(a)))  # a request frees its blocks tail first
        assert pool.allocate(2, "d") == expected, order
    with pytest.raises(ValueError):
        BlockPool(4, "fifo")


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
    from engine.config import FREE_BLOCK_ORDERS
    from engine.options import ENGINE_OPTIONS

    opt = next(o for o in ENGINE_OPTIONS if o.name == "free_block_order")
    assert {"lru", "mru"} <= set(FREE_BLOCK_ORDERS)
    assert opt.default == "lru" and opt.choices == FREE_BLOCK_ORDERS and opt.env_var == "CBP_FREE_BLOCK_ORDER"
    assert "prefix" in opt.help
    with pytest.raises(ValueError):
        EngineConfig(free_block_order="newest")
