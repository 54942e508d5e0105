"""The block map of any pool: one cell per block up to 2,048 blocks (talks: as before), tiles of blocks
above, with ownership, reuse, sharing, prefix hits and takes kept per tile and the figure bounded in size."""

import json

from engine.kv_events import BlockTake
from engine.telemetry import StepSnapshot
from ui import block_tiles as T
from ui import figures as F


def snapshot(num_blocks, tables, *, reuses=(), cached=(), hits=(), takes=()):
    ref = [0] * num_blocks
    for blocks in tables.values():
        for b in blocks:
            ref[b] += 1
    reuse = [0] * num_blocks
    for b in reuses:
        reuse[b] = 1
    return StepSnapshot(step=7, time=0.0, duration=0.0, forward_time=0.0, batch_slots=(),
                        block_tables={k: tuple(v) for k, v in tables.items()}, block_refcount=tuple(ref),
                        block_tokens=(4,) * num_blocks, block_reuses=tuple(reuse), cached_blocks=frozenset(cached),
                        num_running=len(tables), num_waiting=0, num_scheduled_tokens=0, num_generated_tokens=0,
                        num_preemptions=0, cache_hit_blocks=frozenset(hits),
                        block_takes=tuple(BlockTake(b, "x", 7, "new") for b in takes))


def test_pools_up_to_the_cell_limit_keep_one_cell_per_block():
    for n in (32, 384, F.BLOCK_CELL_LIMIT):
        spec = F.block_map_spec(snapshot(n, {"A": [0, 1]}))
        cells = [c for row in spec["data"][0]["customdata"] for c in row if c[0] >= 0]
        assert [c[0] for c in cells] == list(range(n)) and "title" not in spec["layout"]
    assert T.tile_size(F.BLOCK_CELL_LIMIT) == 1 and T.tile_size(F.BLOCK_CELL_LIMIT + 1) == 2


def test_tiles_keep_ownership_reuse_sharing_hits_and_takes():
    n = 3 * 2048 + 6  # g = 4 blocks per tile, 1,538 tiles: the last one holds 2 blocks
    tables = {"A": [0, 1, 2, 3, 4], "B": [3, 8], "C": [4, 5]}
    snap = snapshot(n, tables, reuses=[1, 8], cached=[12, 13], hits=[0], takes=[5, n - 1])
    colors = {"A": 0, "B": 1, "C": 2}
    spec = F.block_map_spec(snap, colors)
    heat, reused, shared, _, hits, outside, taken = spec["data"][:7]
    assert T.tile_size(n) == 4 and spec["layout"]["title"]["text"] == "1 cell = 4 blocks"
    z, cd = heat["z"], heat["customdata"]
    # A holds all 4 blocks of tile 0; A and C 2 of 4 (full colour: half); B 1 of 4 (light); 2 cached-free
    assert z[0][:5] == [0, 0, 1 + F.K, F.CACHED_CODE, F.FREE_CODE]
    assert cd[0][0] == (0, 3, "A 4", 4, 0, 1, 1, 1, 0)  # held, cached-free, reused, shared (3: A and B), hits, taken
    assert cd[0][1] == (4, 7, "A 1, C 1", 2, 0, 0, 1, 0, 1)
    assert cd[0][3][2:5] == ("free, cached prefix", 0, 2)
    tiles = -(-n // 4)
    assert cd[tiles // 64][tiles % 64 - 1][:2] == (n - 2, n - 1)  # the last tile is short
    assert list(zip(reused["x"], reused["y"])) == [(0, 0), (2, 0)]
    assert list(zip(shared["x"], shared["y"])) == [(0, 0), (1, 0)]  # 3 (A, B) and 4 (A, C)
    assert list(zip(hits["x"], hits["y"])) == [(0, 0)]
    assert len(taken["x"]) == 2 and len(outside["x"]) == 64 - tiles % 64
    mine = F.block_map_highlight(snap, "B")  # tiles 0 and 2: two rectangles
    assert [v for v in mine.x if v is not None][:5] == [-0.5, 0.5, 0.5, -0.5, -0.5] and list(mine.x).count(None) == 2


def test_a_huge_busy_pool_draws_a_bounded_map():
    n, requests = 360_000, 2_000
    per = n // requests
    tables = {f"load-{i:05d}-{'x' * 30}": list(range(i * per, (i + 1) * per)) for i in range(requests)}
    snap = snapshot(n, tables, reuses=range(0, n, 3), hits=range(0, n, 5), takes=range(0, n, 11))
    text = F.spec_json(F.block_map_spec(snap, height=280))
    assert len(text) < 300_000
    fig = json.loads(text)
    heat = fig["data"][0]
    cells = [c for row in heat["customdata"] for c in row if c[0] >= 0]
    assert len(cells) <= T.MAX_TILES and cells[-1][1] == n - 1
    assert all(c[3] == c[1] - c[0] + 1 for c in cells)  # every block held
    assert all(len(name) <= T.NAME_CHARS for c in cells for name in [c[2].split(" ")[0]])
    assert F.block_map_highlight(snap, next(iter(tables))) is not None


def test_before_the_first_step_a_huge_pool_is_free():
    spec = F.block_map_spec(None, num_blocks=360_000)
    z = [v for row in spec["data"][0]["z"] for v in row if v is not None]
    assert set(z) == {F.FREE_CODE} and len(z) == -(-360_000 // T.tile_size(360_000))


def test_look_back_at_the_oldest_step_survives_a_step_recorded_while_drawing(monkeypatch):
    """A pool over 512 blocks rebuilds a step's blocks from the ring: when the engine records a step while
    the panels draw the oldest kept one, that step leaves the ring; the build draws the next one instead
    of failing the poll."""
    from engine.kv_events import BlockTake, KVFrame
    from engine.telemetry import BatchSlotSnapshot, StepSnapshot, Telemetry
    from ui import figures
    from ui.panels import Panels

    nb = 600
    tel = Telemetry(capacity=8)

    def record(s):
        ev = ((KVFrame(0, nb, 16),) if s == 1 else ()) + (BlockTake(s, f"r{s}", s, "new"),)
        tel.record(StepSnapshot(step=s, time=float(s), duration=0.01, forward_time=0.01,
                                batch_slots=(BatchSlotSnapshot(0, f"r{s}", "prefill", 1, 1, 1),),
                                block_tables={f"r{t}": (t,) for t in range(1, s + 1)}, block_refcount=None,
                                block_tokens=None, block_reuses=None, cached_blocks=None, num_running=s,
                                num_waiting=0, num_scheduled_tokens=1, num_generated_tokens=1, num_preemptions=0,
                                cache_hit_blocks=None, block_origins=None, kv_events=ev,
                                request_fill={f"r{t}": (1, 0) for t in range(1, s + 1)}, used_blocks=s,
                                pool_blocks=nb, kv_history=tel.kv_history))

    for s in range(1, 21):
        record(s)
    panels = Panels(tel, num_blocks=nb)
    oldest = tel.snapshots()[0].step
    real = figures.occupancy_spec

    def engine_steps_meanwhile(*a, **k):
        record(tel.latest().step + 1)
        return real(*a, **k)

    monkeypatch.setattr(figures, "occupancy_spec", engine_steps_meanwhile)
    key, inputs, _ = panels._build(48, "en", oldest)
    assert inputs.snaps[-1].step > oldest
