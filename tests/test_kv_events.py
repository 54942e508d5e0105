"""KV cache events: replaying a step's events gives exactly the pool a full snapshot shows (any step in
the ring, after the ring wrapped, across aborts, preemption, prefix hits, copy-on-write and a prefix-cache
reset), a remote reader that starts from a frame follows the cache, and the events map onto vLLM's."""

import dataclasses
import random

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv_cache import BlockPool
from engine.kv_events import (
    TAKE_SHARED,
    BlockEvicted,
    BlockFreed,
    BlockState,
    BlockStored,
    BlockTake,
    KVFrame,
    PrefixCacheCleared,
    block_arrays,
    to_vllm_events,
)
from engine.kv_provenance import Provenance
from engine.request import SamplingParams
from engine.telemetry import Telemetry

PER_BLOCK = ("block_refcount", "block_tokens", "block_reuses", "cached_blocks", "cache_hit_blocks", "block_origins")


def truth(core: EngineCore) -> dict:
    """The per-block fields now, counted from the pool and the running requests' block tables (refcounts, fill,
    cached, prefix hits) and from the telemetry's provenance (reuses, origins: no engine structure keeps them)."""
    pool, bs, running = core.kv.pool, core.kv.block_size, core.scheduler.running
    tokens, hit = [0] * pool.num_blocks, set()
    for r in running:
        hit.update(r.block_ids[: r.num_hit_blocks])
        for j, b in enumerate(r.block_ids):
            tokens[b] = max(tokens[b], min(bs, max(0, r.num_computed_tokens - j * bs)))
    cached = pool.cached_free_blocks()
    for b in cached:
        tokens[b] = bs
    state = core.telemetry._provenance.state
    return {"block_refcount": tuple(pool.ref_cnt), "block_tokens": tuple(tokens), "block_reuses": tuple(state.reuses),
            "cached_blocks": frozenset(cached), "cache_hit_blocks": frozenset(hit), "block_origins": dict(state.origins),
            "block_tables": {r.request_id: tuple(r.block_ids) for r in running}}


def lazy_core(tiny_model, tokenizer, **kw) -> EngineCore:
    """An engine whose snapshots, like every engine's, store no per-block tuples: read, they are replayed."""
    return EngineCore(EngineConfig(**kw), model=tiny_model, tokenizer=tokenizer)


def busy_run(core: EngineCore, steps: int, seed: int = 0, prefix: str = "r") -> dict[int, dict]:
    """Arrivals with shared prefixes, parallel samples, aborts and a prefix-cache reset; the full snapshot
    of every recorded step."""
    rng = random.Random(seed)
    system = list(range(5, 5 + 3 * core.config.block_size))  # a shared system prompt: prefix hits
    seen: dict[int, dict] = {}
    live: list[str] = []
    for i in range(steps):
        if rng.random() < 0.5:
            rid = f"{prefix}{i}"
            prompt = (system if rng.random() < 0.6 else []) + [rng.randrange(5, 200) for _ in range(rng.randrange(1, 24))]
            n = 2 if rng.random() < 0.2 else 1
            core.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 24), n=n,
                                                          ignore_eos=True))
            live.append(rid)
        if live and rng.random() < 0.1:
            core.abort_request(live.pop(rng.randrange(len(live))))
        if rng.random() < 0.02:
            core.kv.pool.reset_prefix_cache()
        before = core.step_count
        core.step()
        if core.step_count != before:
            seen[core.step_count] = truth(core)
    return seen


def assert_same(snap, want: dict) -> None:
    for f in PER_BLOCK:
        assert getattr(snap, f) == want[f], (snap.step, f)
    assert snap.block_tables == want["block_tables"]


def test_events_replay_to_the_full_snapshot_at_every_kept_step(tiny_model, tokenizer):
    core = lazy_core(tiny_model, tokenizer, num_blocks=24, block_size=4, max_num_seqs=4, telemetry_capacity=16)
    seen = busy_run(core, 160)
    snaps = core.telemetry.snapshots()
    assert len(snaps) == 16 and snaps[0].step > 16  # the ring wrapped: the base state moved on
    kinds = {type(e) for s in core.telemetry.snapshots() for e in s.kv_events}
    assert {BlockTake, BlockFreed, BlockStored} <= kinds
    assert core.scheduler.num_preemptions > 0 and core.kv.num_cow_copies > 0
    for snap in reversed(snaps):  # newest first, then older ones: replayed from the base
        assert snap.__dict__["_block_refcount"] is None  # nothing per block stored in the ring
        assert_same(snap, seen[snap.step])
        assert snap.num_blocks == 24 and snap.num_used_blocks == sum(1 for r in snap.block_refcount if r)


def test_a_step_that_left_the_ring_says_so(tiny_model, tokenizer):
    core = lazy_core(tiny_model, tokenizer, num_blocks=24, block_size=4, max_num_seqs=4, telemetry_capacity=4)
    core.add_request("a", list(range(5, 30)), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    core.step()
    first = core.telemetry.latest()
    for _ in range(6):
        core.step()
    with pytest.raises(LookupError):
        first.block_arrays()


def test_amended_step_and_a_lost_record_stay_exact(tiny_model, tokenizer, monkeypatch):
    core = lazy_core(tiny_model, tokenizer, num_blocks=24, block_size=4, max_num_seqs=4)
    for rid in "ab":
        core.add_request(rid, list(range(5, 20)), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    for _ in range(3):
        core.step()
    core.abort_request("a")
    core.process_inbox()  # a paused engine: the newest step is amended
    assert_same(core.telemetry.latest(), truth(core))
    real = core.telemetry.record
    monkeypatch.setattr(core.telemetry, "record", lambda snap: (_ for _ in ()).throw(RuntimeError("boom")))
    core.step()  # its events are lost with the record ...
    monkeypatch.setattr(core.telemetry, "record", real)
    core.step()  # ... and the next step starts from a frame
    assert any(type(e) is KVFrame for e in core.telemetry.latest().kv_events)
    assert_same(core.telemetry.latest(), truth(core))


def test_a_remote_reader_follows_the_cache_from_a_frame(tiny_model, tokenizer):
    core = lazy_core(tiny_model, tokenizer, num_blocks=24, block_size=4, max_num_seqs=4, telemetry_capacity=8)
    busy_run(core, 20, seed=2)
    feed = core.telemetry.kv_feed()
    assert feed.frame is not None and not feed.steps
    state = BlockState()
    state.apply([feed.frame])
    cursor = feed.cursor
    for i in range(40):
        busy_run(core, 1, seed=10 + i, prefix=f"p{i}-")
        if i % 3 == 0:  # polls now and then
            feed = core.telemetry.kv_feed(cursor)
            assert feed.frame is None
            for step in feed.steps:
                state.apply(step.events)
            cursor = feed.cursor
            last = core.telemetry.latest()
            got = block_arrays(state, feed.steps[-1].block_tables, feed.steps[-1].request_fill) if feed.steps else None
            if got is not None:
                assert got.as_fields == last.block_arrays().as_fields
    assert core.telemetry.kv_feed((0, 0)).frame is not None  # fell behind the ring: a frame again


def test_pool_events_in_order_and_their_vllm_shape():
    pool, prov = BlockPool(3, "lru", block_size=2), Provenance()
    first = pool.pop_events()
    assert first == (KVFrame(0, 3, 2),)
    prov.stamp(first, 0)
    a = pool.allocate(2, "a")
    pool.cache(a[0], b"h0", None, (1, 2))
    pool.cache(a[1], b"h1", b"h0", (3, 4))
    pool.touch([a[0]], "b")
    pool.free([a[1], a[0], a[0]])
    events = prov.stamp(pool.pop_events(), 1)
    pool.allocate(3, "c")  # takes block 2 (new), then evicts 1 and 0 (LRU)
    events += prov.stamp(pool.pop_events(), 2)
    kinds = [type(e).__name__ + (f":{e.kind}" if type(e) is BlockTake else "") for e in events]
    assert kinds == ["BlockTake:new", "BlockTake:new", "BlockStored", "BlockStored", "BlockTake:shared", "BlockFreed",
                     "BlockFreed", "BlockTake:new", "BlockEvicted", "BlockTake:reused", "BlockEvicted",
                     "BlockTake:reused"]
    assert [(e.block_id, e.request_id, e.step) for e in events if type(e) is BlockFreed] == [(1, "a", 1), (0, "a", 1)]
    state = BlockState()
    state.apply((KVFrame(0, 3, 2),) + events)
    assert list(state.reuses) == [1, 1, 0] and not any(state.hashed) and set(state.origins) == {0, 1, 2}
    assert all(state.origins[b].kind != TAKE_SHARED for b in state.origins)
    assert (list(state.reuses), state.origins) == (list(prov.state.reuses), prov.state.origins)
    vllm = to_vllm_events((KVFrame(0, 3, 2),) + events, block_size=2)
    assert vllm == [
        {"type": "AllBlocksCleared"},
        {"type": "BlockStored", "block_hashes": [b"h0", b"h1"], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
         "block_size": 2},
        {"type": "BlockRemoved", "block_hashes": [b"h1", b"h0"]},  # takes between them have no vLLM event
    ]
    pool.free([0, 1, 2])
    pool.cache(0, b"x")
    pool.reset_prefix_cache()
    cleared = [e for e in prov.stamp(pool.pop_events(), 3) if type(e) is PrefixCacheCleared]
    assert cleared == [PrefixCacheCleared((0,), (b"x",))]
    assert to_vllm_events(cleared, 2) == [{"type": "BlockRemoved", "block_hashes": [b"x"]}]
    assert dataclasses.is_dataclass(BlockEvicted)


def test_reading_the_kept_steps_forward_replays_each_step_once(monkeypatch):
    """Reading every kept step in order (a bench's read-back) continues from the last step replayed
    instead of replaying the ring from its start each time."""
    from engine.kv_events import BlockState, BlockTake, KVFrame
    from engine.telemetry import BatchSlotSnapshot, StepSnapshot

    nb, tel = 600, Telemetry(capacity=64)
    for s in range(1, 61):
        ev = ((KVFrame(0, nb, 16),) if s == 1 else ()) + (BlockTake(s, f"r{s}", s, "new"),)
        tel.record(StepSnapshot(step=s, time=float(s), duration=0.01, forward_time=0.01,
                                batch_slots=(BatchSlotSnapshot(0, f"r{s}", "prefill", 1, 1, 1),),
                                block_tables={f"r{s}": (s,)}, block_refcount=None, block_tokens=None,
                                block_reuses=None, cached_blocks=None, num_running=1, num_waiting=0,
                                num_scheduled_tokens=1, num_generated_tokens=1, num_preemptions=0,
                                cache_hit_blocks=None, block_origins=None, kv_events=ev,
                                request_fill={f"r{s}": (1, 0)}, used_blocks=1, pool_blocks=nb,
                                kv_history=tel.kv_history))
    applied = []
    real = BlockState.apply

    def counted(self, events):
        applied.append(len(events))
        return real(self, events)

    monkeypatch.setattr(BlockState, "apply", counted)
    snaps = tel.snapshots()
    for snap in snaps[:-1]:
        assert snap.block_refcount[snap.step] == 1
    assert len(applied) <= len(snaps) + 1, len(applied)  # not quadratic: about one replay per step
