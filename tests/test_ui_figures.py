"""The panels' figure builders on a hand-made telemetry sequence: exact cells, no engine, no server."""

from __future__ import annotations

import asyncio
import json

import pytest

from engine.telemetry import PHASE_DECODE, PHASE_IDLE, PHASE_PREFILL, BatchSlotSnapshot, StepSnapshot, Telemetry
from ui import figures as F

NUM_BLOCKS = 8
BS = 4


def snap(step, slots, tables, *, reuses=None, cached=(), admitted=(), finished=(), waiting=0, tokens=None):
    """A StepSnapshot from ``slots`` = [(request id, phase, scheduled, computed) or None] and block tables."""
    ref = [0] * NUM_BLOCKS
    for blocks in tables.values():
        for b in blocks:
            ref[b] += 1
    return StepSnapshot(
        step=step, time=float(step), duration=0.1, forward_time=0.08,
        batch_slots=tuple(BatchSlotSnapshot(i, None, PHASE_IDLE) if s is None else BatchSlotSnapshot(i, *s) for i, s in enumerate(slots)),
        block_tables={k: tuple(v) for k, v in tables.items()}, block_refcount=tuple(ref),
        block_tokens=tuple(tokens or [0] * NUM_BLOCKS), block_reuses=tuple(reuses or [0] * NUM_BLOCKS),
        cached_blocks=frozenset(cached), num_running=len(tables), num_waiting=waiting,
        num_scheduled_tokens=sum(s[2] for s in slots if s), num_generated_tokens=sum(1 for s in slots if s),
        num_preemptions=0, finished=tuple(finished), admitted=tuple(admitted),
    )


# Two slots, eight blocks of four tokens. A (6-token prompt) and B (3-token prompt) start at step 1; B
# finishes at step 2 and its slot and block 2 go to C at step 3 (block 2 reused); block 5 stays cached.
SEQ = [
    snap(1, [("A", PHASE_PREFILL, 6, 6), ("B", PHASE_PREFILL, 3, 3)], {"A": [0, 1], "B": [2]},
         admitted=("A", "B"), waiting=1, tokens=[4, 2, 3, 0, 0, 0, 0, 0]),
    snap(2, [("A", PHASE_DECODE, 1, 7), ("B", PHASE_DECODE, 1, 4)], {"A": [0, 1]}, finished=("B",),
         waiting=1, cached=(2,), tokens=[4, 3, 4, 0, 0, 0, 0, 0]),
    snap(3, [("A", PHASE_DECODE, 1, 8), ("C", PHASE_PREFILL, 5, 5)], {"A": [0, 1], "C": [2, 3]},
         reuses=[0, 0, 1, 0, 0, 0, 0, 0], cached=(5,), admitted=("C",), tokens=[4, 4, 4, 1, 0, 4, 0, 0]),
]


def test_default_colors_follow_first_appearance():
    assert F.default_colors(SEQ) == {"A": 0, "B": 1, "C": 2}


def test_occupancy_cells_are_slot_request_and_phase():
    fig = F.occupancy_figure(SEQ)
    heat, adm = fig.data[0], fig.data[1]
    assert list(heat.x) == [1, 2, 3]
    ids = [[c[0] for c in row] for row in heat.customdata]
    assert ids == [["A", "A", "A"], ["B", "B", "C"]]
    K = F.K
    assert [list(r) for r in heat.z] == [[K + 0, 0, 0], [K + 1, 1, K + 2]]  # light = prefill, full = decode
    phases = [[c[1] for c in row] for row in heat.customdata]
    took = "prefill, took its slot"  # the cell where a request took its slot says so (the ▷ takes no hover)
    assert phases == [[took, "decode", "decode"], [took, "decode", took]]
    assert list(heat.customdata[1][2][2:5]) == [5, 5, 0]  # tokens this step, tokens in cache, prefix-cache hit
    # admissions are marked in the left part of the cell where they happened, including C taking B's slot
    assert sorted(zip(adm.x, adm.y)) == [(0.7, 0), (0.7, 1), (2.7, 1)]
    assert adm.hoverinfo == "skip" and "%{customdata[5]}" in heat.hovertemplate


def test_occupancy_empty_and_idle_slots():
    seq = [snap(1, [("A", PHASE_IDLE, 0, 9), None], {"A": [0]})]
    heat = F.occupancy_figure(seq).data[0]
    assert list(heat.z[0]) == [F.IDLE_CODE] and list(heat.z[1]) == [None]
    assert heat.customdata[1][0] is None  # an empty cell has no hover (hoverongaps off) and no data


def test_block_map_cells_owner_free_cached_and_reused():
    fig = F.block_map_figure(SEQ[-1], F.default_colors(SEQ), columns=4)
    heat, reused, shared = fig.data[0], fig.data[1], fig.data[2]
    z = [v for row in heat.z for v in row]
    owners = [c[1] for row in heat.customdata for c in row]
    assert z == [0, 0, 2, 2, F.FREE_CODE, F.CACHED_CODE, F.FREE_CODE, F.FREE_CODE]
    assert owners[:4] == ["A", "A", "C", "C"]
    assert owners[4:] == ["free", "free, cached prefix", "free", "free"]
    ids = [c[0] for row in heat.customdata for c in row]
    assert ids == list(range(NUM_BLOCKS))
    assert [list(c[2:5]) for row in heat.customdata for c in row][:4] == [[4, 1, 0], [4, 1, 0], [4, 1, 1], [1, 1, 0]]
    # block 2 (row 0, column 2) was handed from B to C: it is the only reused mark (top right of its cell)
    assert list(zip(reused.x, reused.y)) == [(2.3, -0.25)]
    assert len(shared.x) == 0


def test_block_map_shared_block_and_grid_shape():
    s = snap(1, [("A", PHASE_DECODE, 1, 5), ("D", PHASE_PREFILL, 5, 5)], {"A": [0, 1], "D": [0, 4]})
    fig = F.block_map_figure(s, {"A": 3, "D": 4}, columns=3)
    heat, shared = fig.data[0], fig.data[2]
    assert len(heat.z) == 3 and all(len(r) == 3 for r in heat.z)  # 8 blocks in 3 columns: 3 rows
    assert heat.z[2][2] is None  # past the last block
    assert heat.customdata[0][0][1] == "A, D" and heat.customdata[0][0][3] == 2
    assert list(zip(shared.x, shared.y)) == [(-0.3, 0.25)]  # bottom left of block 0's cell
    assert heat.z[1][1] == 4  # block 4 belongs to D


def test_block_map_without_snapshot_is_empty():
    assert len(F.block_map_figure(None).data) == 0


def test_grid_columns():
    assert F.block_grid_columns(8) == 8
    assert F.block_grid_columns(728) == 48
    assert F.block_grid_columns(100_000) == 64


def test_color_assigner_keeps_live_colours_distinct_and_stable():
    ca = F.ColorAssigner()
    first = ca.update(SEQ[:1])
    assert first["A"] != first["B"]
    later = ca.update(SEQ)
    assert later["A"] == first["A"] and later["B"] == first["B"] and later["C"] not in (first["A"], first["B"])
    # many requests alive at once: all distinct up to the palette size
    many = [snap(1, [(f"r{i}", PHASE_DECODE, 1, 1) for i in range(F.K)], {})]
    assert len(set(F.ColorAssigner().update(many).values())) == F.K


def test_rates_and_counters():
    fig = F.rates_figure(SEQ)
    assert list(fig.data[0].y) == [2, 1, 2] and list(fig.data[1].y) == [1, 1, 0]
    assert list(fig.data[2].y) == [37.5, 25.0, 50.0]
    c = F.counter_values({"running": 3, "waiting": 1, "kv_usage": 0.25, "tokens_per_s": 12.34,
                          "ttft_p50": 0.1, "ttft_p90": None, "tpot_p50": 0.02, "tpot_p90": 0.03})
    assert c["kv_usage"] == "25.0 %" and c["tokens_per_s"] == "12.3 tok/s"
    assert c["ttft"] == "100 ms / -" and c["tpot"] == "20 ms / 30 ms"


def test_figures_accept_translated_labels():
    from ui.i18n import EN, FIGURE_LABELS, KO, figure_labels, language

    assert set(EN) == set(KO) and set(FIGURE_LABELS["ko"]) == set(F.LABELS_EN)

    assert language("ko-KR,ko;q=0.9,en;q=0.8") == "ko" and language("en-US,ko;q=0.5") == "en"
    assert language(None) == "en" and language("fr-FR") == "en"
    fig = F.occupancy_figure(SEQ, labels=figure_labels("ko"))
    assert fig.layout.xaxis.title.text == "엔진 스텝"


def test_spec_json_writes_what_the_figure_object_writes():
    """The live panels serialise the plain specs (no go.Figure, no deep copies): the same JSON as plotly's
    own ``to_json``, default template included."""
    for spec, fig in ((F.occupancy_spec(SEQ, window=8), F.occupancy_figure(SEQ, window=8)),
                      (F.block_map_spec(SEQ[-1], num_blocks=NUM_BLOCKS), F.block_map_figure(SEQ[-1], num_blocks=NUM_BLOCKS)),
                      (F.block_map_spec(None), F.block_map_figure(None)),
                      (F.rates_spec(SEQ), F.rates_figure(SEQ))):
        out = json.loads(F.spec_json(spec))
        assert out == json.loads(fig.to_json())
        assert out["layout"]["template"]["layout"]  # plotly's default look, as the Gradio plots have it


def test_panels_rebuild_only_on_new_steps_and_skip_unchanged():
    pytest.importorskip("gradio")
    from ui.panels import Panels

    tel = Telemetry(capacity=16)
    for s in SEQ[:2]:
        tel.record(s)
    panels = Panels(tel, max_builds_per_s=50)

    async def run():
        first = await panels.frame_plots(96, "en")
        again = await panels.frame_plots(96, "en")
        tel.record(SEQ[2])
        newer = await panels.frame_plots(96, "en")
        return first, again, newer

    first, again, newer = asyncio.run(run())
    assert first[0].startswith("(2, 96, 'en'") and json.loads(first[1]["occupancy"])["data"]  # key: (step, window, lang, ...)
    assert again == first  # same key and the same cached JSON: nothing is rebuilt for a tab that polls again
    assert newer[0].startswith("(3, 96, 'en'") and newer[1]["occupancy"] != first[1]["occupancy"]
    assert panels.builds == 2


# --------------------------------------------------------------------------- first screen
def test_occupancy_before_the_first_step_shows_the_empty_slots():
    fig = F.occupancy_figure([], {}, num_slots=16)
    heat = fig.data[0]
    assert list(heat.y) == list(range(16)) and all(v is None for row in heat.z for v in row)
    assert list(fig.layout.yaxis.range) == [15.5, -0.5] and fig.layout.yaxis.dtick == 1
    assert list(fig.layout.xaxis.range) == [0.5, 48.5]
    assert list(F.occupancy_figure([], num_slots=4, window=32).layout.xaxis.range) == [0.5, 32.5]
    bare = F.occupancy_figure([])  # nothing known: an empty box, never slot -1
    assert list(bare.layout.yaxis.range) == [0.5, -0.5] and list(bare.layout.yaxis.tickvals) == []
    assert list(bare.layout.xaxis.range) == [0.5, 48.5]


def test_occupancy_window_keeps_the_step_axis_width():
    assert list(F.occupancy_figure(SEQ).layout.xaxis.range) == [0.5, 3.5]  # old calls: the steps drawn
    assert list(F.occupancy_figure(SEQ, window=96).layout.xaxis.range) == [0.5, 96.5]
    assert list(F.occupancy_figure(SEQ, window=2).layout.xaxis.range) == [1.5, 3.5]
    assert len(F.occupancy_figure(SEQ, num_slots=4).data[0].y) == 4  # more rows than the snapshots have


def test_block_map_before_the_first_step_shows_the_free_pool():
    fig = F.block_map_figure(None, {}, num_blocks=NUM_BLOCKS, columns=3)
    with_snap = F.block_map_figure(SEQ[0], F.default_colors(SEQ), columns=3)
    heat = fig.data[0]
    assert len(fig.data) == len(with_snap.data) and len(heat.z) == len(with_snap.data[0].z) == 3
    assert [v for row in heat.z for v in row] == [F.FREE_CODE] * NUM_BLOCKS + [None]
    assert [tuple(c[:2]) for row in heat.customdata for c in row][:NUM_BLOCKS] == [(b, "free") for b in range(NUM_BLOCKS)]
    assert fig.layout.xaxis.range == with_snap.layout.xaxis.range
    assert fig.layout.yaxis.range == with_snap.layout.yaxis.range
    default_grid = F.block_map_figure(None, num_blocks=728)
    assert len(default_grid.data[0].z) == 16 and len(default_grid.data[0].z[0]) == 48


def test_block_map_marks_cells_past_the_pool():
    s = snap(1, [("A", PHASE_DECODE, 1, 5), None], {"A": [0, 1]})
    fig = F.block_map_figure(s, {"A": 0}, columns=3)
    outside = fig.data[5]
    assert list(zip(outside.x, outside.y)) == [(2, 2)] and outside.name == "not in the pool"
    assert outside.marker.symbol == "x-thin" and outside.hoverinfo == "skip"
    assert "not in the pool" in [tr.name for tr in fig.data if tr.showlegend is not False]
    full = F.block_map_figure(s, {"A": 0}, columns=4)  # 8 blocks fill two rows of 4: no such cells, no entry
    assert len(full.data[5].x) == 0 and "not in the pool" not in [tr.name for tr in full.data if tr.showlegend is not False]
    from ui.i18n import figure_labels

    assert F.block_map_figure(s, labels=figure_labels("ko"), columns=3).data[5].name == "풀 밖"


def _legend_width(fig) -> float:
    """Rough width of a horizontal legend (pixels): 40 px of symbol and gap per entry, 7 px per Latin
    character and 13 px per Hangul one (12 px font)."""
    total = 0.0
    for tr in fig.data:
        if tr.showlegend is False or not tr.name or tr.type == "heatmap":
            continue
        total += 40 + sum(13 if ord(ch) > 0x1100 else 7 for ch in tr.name)
    return total


def test_legends_fit_in_two_lines_at_700_px():
    from ui.i18n import figure_labels

    s = snap(1, [("A", PHASE_DECODE, 1, 5), None], {"A": [0, 1]})
    for lang in ("en", "ko"):
        labels = figure_labels(lang)
        occ = F.occupancy_figure(SEQ, labels=labels)
        occ.add_trace(F.occupancy_highlight(SEQ, "A", labels))
        blocks = F.block_map_figure(s, labels=labels, columns=3)
        blocks.add_trace(F.block_map_highlight(s, "A", labels, columns=3))
        assert _legend_width(occ) <= 700, lang
        assert _legend_width(blocks) <= 2 * 700, lang


# --------------------------------------------------------------------------- "your request"
def _rects(trace) -> list[tuple[float, float, float, float]]:
    """(x0, x1, y0, y1) of the closed rectangles of an outline trace."""
    out, xs, ys = [], list(trace.x), list(trace.y)
    for i in range(0, len(xs), 6):
        x, y = xs[i:i + 5], ys[i:i + 5]
        assert xs[i + 5] is None and x[0] == x[4] and y[0] == y[4]
        out.append((min(x), max(x), min(y), max(y)))
    return out


def test_occupancy_highlight_outlines_the_cells_of_one_request():
    a = F.occupancy_highlight(SEQ, "A")
    assert a.name == "your request" and a.mode == "lines" and a.line.width >= 2
    assert _rects(a) == [(0.5, 3.5, -0.5, 0.5)]  # steps 1-3, slot 0
    assert _rects(F.occupancy_highlight(SEQ, "B")) == [(0.5, 2.5, 0.5, 1.5)]
    assert _rects(F.occupancy_highlight(SEQ, "C")) == [(2.5, 3.5, 0.5, 1.5)]
    assert F.occupancy_highlight(SEQ, "nope") is None and F.occupancy_highlight([], "A") is None
    # preempted and readmitted in another slot: one rectangle per run
    moved = [snap(1, [("A", PHASE_DECODE, 1, 5), None], {}), snap(2, [None, None], {}),
             snap(3, [None, ("A", PHASE_PREFILL, 5, 5)], {})]
    assert _rects(F.occupancy_highlight(moved, "A")) == [(0.5, 1.5, -0.5, 0.5), (2.5, 3.5, 0.5, 1.5)]
    from ui.i18n import figure_labels

    assert F.occupancy_highlight(SEQ, "A", figure_labels("ko")).name == "내 요청"


def test_block_map_highlight_outlines_its_blocks_on_the_same_grid():
    last = SEQ[-1]  # A holds blocks 0 and 1, C holds 2 and 3
    assert _rects(F.block_map_highlight(last, "C", columns=4)) == [(1.5, 3.5, -0.5, 0.5)]
    # in 3 columns block 3 starts the second row: two rectangles
    assert _rects(F.block_map_highlight(last, "C", columns=3)) == [(1.5, 2.5, -0.5, 0.5), (-0.5, 0.5, 0.5, 1.5)]
    default = F.block_map_highlight(last, "A", num_blocks=NUM_BLOCKS)  # 8 blocks: one row of 8 columns
    assert _rects(default) == [(-0.5, 1.5, -0.5, 0.5)]
    assert F.block_map_highlight(last, "B") is None and F.block_map_highlight(None, "A") is None


def test_highlights_append_to_the_figure_json():
    import json

    fig = F.block_map_figure(SEQ[-1], F.default_colors(SEQ), columns=4)
    data = json.loads(fig.to_json())
    data["data"].append(F.block_map_highlight(SEQ[-1], "C", columns=4).to_plotly_json())
    again = F.go.Figure(data)
    assert len(again.data) == len(fig.data) + 1 and again.data[-1].name == "your request"
    occ = F.occupancy_figure(SEQ)
    occ.add_trace(F.occupancy_highlight(SEQ, "C"))
    assert occ.data[-1].xaxis in (None, "x") and occ.data[-1].yaxis in (None, "y")


# --------------------------------------------------------------------------- prefix cache, per window and per request
def _with_prefix(s, queries, hits):
    from dataclasses import replace

    return replace(s, prefix_cache_queries=queries, prefix_cache_hits=hits)


def test_prefix_hit_rate_over_the_last_steps():
    tel = Telemetry(capacity=16)
    # cumulative (queries, hits) after each step: 100/0 at step 1, then 40 more looked up, 32 found
    cum = [(100, 0), (100, 0), (140, 32), (140, 32), (140, 32)]
    for i, (q, h) in enumerate(cum):
        tel.record(_with_prefix(snap(i + 1, [None], {}), q, h))
    st = tel.stats(prefix_window_steps=3)  # steps 3-5: 40 looked up, 32 found
    assert st["prefix_hit_rate_window"] == pytest.approx(0.8) and st["prefill_tokens_saved_window"] == 32
    assert st["prefix_window_steps"] == 3
    assert st["prefix_hit_rate"] == pytest.approx(32 / 140) and st["prefill_tokens_saved"] == 32
    quiet = tel.stats(prefix_window_steps=2)  # steps 4-5: no lookup
    assert quiet["prefix_hit_rate_window"] is None and quiet["prefill_tokens_saved_window"] == 0
    everything = tel.stats(prefix_window_steps=64)  # the window reaches back to step 1: since the start
    assert everything["prefix_hit_rate_window"] == pytest.approx(32 / 140) and everything["prefix_window_steps"] == 5
    assert Telemetry().stats()["prefix_hit_rate_window"] is None
    # a ring buffer shorter than the window: measured from its oldest step
    small = Telemetry(capacity=3)
    for i, (q, h) in enumerate(cum):
        small.record(_with_prefix(snap(i + 1, [None], {}), q, h))
    st = small.stats(prefix_window_steps=64)
    assert st["prefix_window_steps"] == 2 and st["prefix_hit_rate_window"] is None


def test_prefix_cache_counter_is_per_window():
    c = F.counter_values({"prefix_hit_rate_window": 0.81, "prefill_tokens_saved_window": 96, "prefix_window_steps": 64,
                          "prefix_hit_rate": 0.2, "prefill_tokens_saved": 500})
    assert c["prefix_cache"] == "81% hit · 96 tok saved (last 64 steps)"
    assert F.counter_values({"prefix_hit_rate_window": None, "prefix_hit_rate": 0.5})["prefix_cache"] == "-"
    assert F.counter_values({"prefix_hit_rate": 0.5, "prefill_tokens_saved": 8})["prefix_cache"] == "50% hit · 8 tok saved"
    assert F.counter_values({})["prefix_cache"] == "-"


def test_occupancy_hover_shows_prefix_cache_hit_tokens():
    s = snap(1, [("A", PHASE_PREFILL, 4, 20), None], {"A": [0]})
    from dataclasses import replace

    s = replace(s, batch_slots=(BatchSlotSnapshot(0, "A", PHASE_PREFILL, 4, 20, 20, num_cached_tokens=16),
                                BatchSlotSnapshot(1, None, PHASE_IDLE)))
    heat = F.occupancy_figure([s]).data[0]
    assert heat.customdata[0][0][4] == 16 and heat.customdata[1][0] is None
    assert "prefix-cache hit tokens: %{customdata[4]}" in heat.hovertemplate
    from ui.i18n import figure_labels

    assert "프리픽스 캐시 적중 토큰" in F.occupancy_figure([s], labels=figure_labels("ko")).data[0].hovertemplate


def test_scheduler_snapshot_reports_the_prompt_tokens_found_in_the_prefix_cache():
    from engine.config import EngineConfig
    from engine.kv_cache import KVCacheManager
    from engine.request import Request, SamplingParams
    from engine.scheduler import Scheduler
    from engine.step_snapshot import batch_slots_of

    cfg = EngineConfig(max_num_seqs=2, num_blocks=32, block_size=4, max_num_batched_tokens=64,
                       enable_prefix_caching=True)
    sched = Scheduler(cfg, KVCacheManager(32, 4, True), 256)

    def run(rid):
        sched.add_request(Request(rid, list(range(1, 12)), SamplingParams(max_tokens=1)))  # 11 prompt tokens
        out = sched.schedule()
        slots = batch_slots_of(out)
        sched.apply_stops(*sched.update_from_output(out, {r.request_id: 0 for r, _ in out.scheduled}))
        return next(s for s in slots if s.request_id == rid)

    first, second = run("a"), run("b")
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 8  # two full blocks of "a"'s prompt (the last token is always computed)
    assert second.num_scheduled_tokens == 3 and second.num_computed_tokens == 11

