"""Block pool and KV cache manager: exact block ids, eviction order, refcounts, prefix caching."""

import pytest

from engine.kv_cache import BlockPool, KVCacheManager, hash_block
from engine.kv_provenance import Provenance
from engine.request import Request, SamplingParams


def req(rid, n_tokens, start=0):
    return Request(rid, list(range(start, start + n_tokens)), SamplingParams(max_tokens=8))


def test_pool_allocates_lowest_ids_first_and_frees_to_tail():
    pool = BlockPool(8)
    assert pool.allocate(3, "a") == [0, 1, 2]
    assert pool.num_free_blocks == 5
    pool.free([2, 1, 0])
    assert list(pool.free_queue) == [3, 4, 5, 6, 7, 2, 1, 0]
    assert pool.allocate(6, "b") == [3, 4, 5, 6, 7, 2]
    with pytest.raises(RuntimeError):
        pool.allocate(3)


def test_reuse_counter_counts_new_owners_only():
    """Reuses are counted from the pool's events (the telemetry's provenance), not by the pool."""
    pool, prov = BlockPool(2), Provenance()
    a = pool.allocate(2, "a")
    pool.free(a)
    pool.allocate(1, "a")  # same owner again: not a reuse
    prov.stamp(pool.pop_events(), 1)
    assert list(prov.state.reuses) == [0, 0]
    pool.allocate(1, "b")  # block 1 goes from a to b
    prov.stamp(pool.pop_events(), 2)
    assert list(prov.state.reuses) == [0, 1]


def test_allocate_on_demand_one_block_at_a_time():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    r = req("r", 5)
    assert kv.allocate_slots(r, 5) == [0, 1]
    r.num_computed_tokens = 5
    r.output_token_ids.append(99)
    assert kv.allocate_slots(r, 1) == []  # position 5 fits in block 1
    r.num_computed_tokens = 8
    r.output_token_ids += [1, 2, 3]
    assert kv.allocate_slots(r, 1) == [2]  # position 8 opens block 2
    assert r.block_ids == [0, 1, 2]
    kv.free(r)
    assert r.block_ids == [] and kv.pool.num_free_blocks == 10


def test_allocate_returns_none_and_changes_nothing_when_full():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    a, b = req("a", 8), req("b", 8)
    assert kv.allocate_slots(a, 8) == [0, 1]
    assert kv.allocate_slots(b, 8) is None
    assert b.block_ids == [] and kv.pool.num_free_blocks == 1


def test_prefix_hit_reuses_full_blocks_and_recomputes_last_token():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = req("a", 10)
    kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    kv.cache_blocks(a)  # blocks 0 and 1 are full
    assert kv.pool.block_hash[0] is not None and kv.pool.block_hash[1] is not None and kv.pool.block_hash[2] is None
    b = req("b", 10)
    hits, n = kv.get_computed_blocks(b)
    assert hits == [0, 1] and n == 8
    kv.allocate_slots(b, 2, hits)
    assert b.block_ids[:2] == [0, 1] and kv.pool.ref_cnt[0] == 2 and kv.pool.ref_cnt[1] == 2
    # a prompt of exactly two blocks: only the first can hit, the last token must be computed
    c = req("c", 8)
    hits, n = kv.get_computed_blocks(c)
    assert hits == [0] and n == 4


def test_cached_free_blocks_are_found_until_evicted_lru_first():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = req("a", 8)
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.cache_blocks(a)
    kv.free(a)  # tail first: block 1 then block 0 join the free queue
    assert list(kv.pool.free_queue) == [2, 3, 1, 0]
    assert sorted(kv.pool.cached_free_blocks()) == [0, 1]
    b = req("b", 9)
    hits, n = kv.get_computed_blocks(b)
    assert hits == [0, 1] and n == 8
    # new data takes the least recently freed blocks; 2 and 3 are uncached, then 1 is evicted
    other = req("x", 12, start=1000)
    assert kv.allocate_slots(other, 12) == [2, 3, 1]
    assert kv.pool.block_hash[1] is None and kv.pool.lookup(hash_block(None, list(range(4)))) == 0
    hits, n = kv.get_computed_blocks(req("b2", 9))
    assert hits == [0] and n == 4


def test_touching_cached_free_blocks_counts_against_free_space():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = req("a", 8)
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.cache_blocks(a)
    kv.free(a)
    b = req("b", 13)  # needs 4 blocks: 2 hits + 2 new, only 1 other block exists
    hits, _ = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 5, hits) is None
    assert kv.pool.num_free_blocks == 3 and b.block_ids == []


def test_cache_salt_separates_entries():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", 8)
    a.cache_salt = "alice"
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.cache_blocks(a)
    b = req("b", 8)
    b.cache_salt = "bob"
    assert kv.get_computed_blocks(b) == ([], 0)
    c = req("c", 8)
    c.cache_salt = "alice"
    assert kv.get_computed_blocks(c)[0] == [0]
