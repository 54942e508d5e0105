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
    assert phases == [["prefill", "decode", "decode"], ["prefill", "decode", "prefill"]]
    assert list(heat.customdata[1][2][2:]) == [5, 5, 0]  # tokens this step, tokens in cache, prefix-cache hit
    # admissions are marked where they happened, including C taking B's slot
    assert sorted(zip(adm.x, adm.y)) == [(1, 0), (1, 1), (3, 1)]


def test_occupancy_empty_and_idle_slots():
    seq = [snap(1, [("A", PHASE_IDLE, 0, 9), None], {"A": [0]})]
    heat = F.occupancy_figure(seq).data[0]
    assert list(heat.z[0]) == [F.IDLE_CODE] and list(heat.z[1]) == [None]
    assert heat.customdata[1][0][0] == ""


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
    # block 2 (row 0, column 2) was handed from B to C: it is the only reused mark
    assert list(zip(reused.x, reused.y)) == [(2, 0)]
    assert len(shared.x) == 0


def test_block_map_shared_block_and_grid_shape():
    s = snap(1, [("A", PHASE_DECODE, 1, 5), ("D", PHASE_PREFILL, 5, 5)], {"A": [0, 1], "D": [0, 4]})
    fig = F.block_map_figure(s, {"A": 3, "D": 4}, columns=3)
    heat, shared = fig.data[0], fig.data[2]
    assert len(heat.z) == 3 and all(len(r) == 3 for r in heat.z)  # 8 blocks in 3 columns: 3 rows
    assert heat.z[2][2] is None  # past the last block
    assert heat.customdata[0][0][1] == "A, D" and heat.customdata[0][0][3] == 2
    assert list(zip(shared.x, shared.y)) == [(0, 0)]
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
    assert first[0].startswith("(2, 96, 'en'") and json.loads(first[1][0])["data"]  # key: (step, window, lang, ...)
    assert again == first  # same key and the same cached JSON: nothing is rebuilt for a tab that polls again
    assert newer[0].startswith("(3, 96, 'en'") and newer[1][0] != first[1][0]
    assert panels.builds == 2


# --------------------------------------------------------------------------- palette: distances in CIELAB
# Threshold: CIEDE2000 >= 15 between any two colours a viewer must tell apart. (CIEDE2000 ~ 1 is a
# just-noticeable difference side by side; ~10 is "clearly different", and small heatmap cells need more.)
MIN_DE2000 = 16.5  # every distance the panels rely on (palette_distances)
MIN_PAIR_DE2000 = 17.0  # two full request colours (was 16.9: purple and plum looked alike on a projector)


def _rgb(color: str) -> tuple[float, float, float]:
    """(r, g, b) in 0..255 from "#RRGGBB" or plotly's "rgb(r, g, b)"."""
    if color.startswith("#"):
        return tuple(int(color[i:i + 2], 16) for i in (1, 3, 5))
    return tuple(float(v) for v in color[color.index("(") + 1:-1].split(","))


def _lab(color: str) -> tuple[float, float, float]:
    """CIELAB (D65) of an sRGB colour."""
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in (v / 255 for v in _rgb(color))]
    r, g, b = lin
    xyz = ((0.4124564 * r + 0.3575761 * g + 0.1804375 * b) / 0.95047,
           0.2126729 * r + 0.7151522 * g + 0.0721750 * b,
           (0.0193339 * r + 0.1191920 * g + 0.9503041 * b) / 1.08883)
    fx, fy, fz = (t ** (1 / 3) if t > 216 / 24389 else (24389 / 27 * t + 16) / 116 for t in xyz)
    return 116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)


def _de2000_lab(lab1, lab2) -> float:
    """CIEDE2000 colour difference of two CIELAB colours (Sharma, Wu, Dalal 2005)."""
    from math import atan2, cos, degrees, exp, hypot, radians, sin, sqrt

    (L1, a1, b1), (L2, a2, b2) = lab1, lab2
    cbar7 = ((hypot(a1, b1) + hypot(a2, b2)) / 2) ** 7
    g = 0.5 * (1 - sqrt(cbar7 / (cbar7 + 25 ** 7)))
    a1, a2 = (1 + g) * a1, (1 + g) * a2
    c1, c2 = hypot(a1, b1), hypot(a2, b2)
    h1, h2 = degrees(atan2(b1, a1)) % 360, degrees(atan2(b2, a2)) % 360
    dh = 0.0 if c1 * c2 == 0 else (h2 - h1 + 180) % 360 - 180
    d_l, d_c, d_h = L2 - L1, c2 - c1, 2 * sqrt(c1 * c2) * sin(radians(dh / 2))
    lbar, cbar = (L1 + L2) / 2, (c1 + c2) / 2
    if c1 * c2 == 0:
        hbar = h1 + h2
    elif abs(h1 - h2) <= 180:
        hbar = (h1 + h2) / 2
    else:
        hbar = (h1 + h2 + 360) / 2 if h1 + h2 < 360 else (h1 + h2 - 360) / 2
    t = (1 - 0.17 * cos(radians(hbar - 30)) + 0.24 * cos(radians(2 * hbar)) + 0.32 * cos(radians(3 * hbar + 6))
         - 0.20 * cos(radians(4 * hbar - 63)))
    s_l = 1 + 0.015 * (lbar - 50) ** 2 / sqrt(20 + (lbar - 50) ** 2)
    s_c, s_h = 1 + 0.045 * cbar, 1 + 0.015 * cbar * t
    r_t = -2 * sqrt(cbar ** 7 / (cbar ** 7 + 25 ** 7)) * sin(radians(60 * exp(-(((hbar - 275) / 25) ** 2))))
    return sqrt((d_l / s_l) ** 2 + (d_c / s_c) ** 2 + (d_h / s_h) ** 2 + r_t * (d_c / s_c) * (d_h / s_h))


def de2000(c1: str, c2: str) -> float:
    return _de2000_lab(_lab(c1), _lab(c2))


def test_de2000_matches_published_pairs():
    # Sharma, Wu, Dalal (2005), Table 1: pairs 1, 3, 7 and 17
    for lab1, lab2, want in [((50, 2.6772, -79.7751), (50, 0, -82.7485), 2.0425),
                             ((50, 2.5, 0), (50, 0, -2.5), 4.3065),
                             ((50, 0, 0), (50, -1, 2), 2.3669),
                             ((50, 2.5, 0), (73, 25, -18), 27.1492)]:
        assert _de2000_lab(lab1, lab2) == pytest.approx(want, abs=1e-4)
    assert de2000("#FFFFFF", "#000000") == pytest.approx(100, abs=0.01)


def palette_distances(colors: list[str]) -> list[tuple[float, str, str]]:
    """Every distance the panels rely on among ``colors`` (palette entries) and the fixed colours."""
    out = []
    for i, a in enumerate(colors):
        la = F.light_shade(a)
        for fixed in (F.IDLE_COLOR, F.CACHED_COLOR, F.FREE_COLOR):
            out.append((de2000(a, fixed), a, fixed))
        out.append((de2000(la, F.FREE_COLOR), f"light {a}", "white"))  # a prefill cell is not blank
        out.append((de2000(la, F.IDLE_COLOR), f"light {a}", "idle"))  # nor grey
        for j, b in enumerate(colors):
            if i < j:
                out.append((de2000(a, b), a, b))
            out.append((de2000(a, F.light_shade(b)), a, f"light {b}"))  # decode of one vs prefill of any
    return out


def test_palette_has_16_named_colours_far_apart():
    assert len(F.PALETTE) >= 16 and len(F.PALETTE) == F.K and len(set(F.PALETTE)) == F.K
    for lang in ("en", "ko"):
        names = F.PALETTE_NAMES[lang]
        assert len(names) == F.K and len(set(names)) == F.K and all(names)
    worst = min(palette_distances(list(F.PALETTE)))
    assert worst[0] >= MIN_DE2000, worst
    pairs = [(de2000(a, b), a, b) for i, a in enumerate(F.PALETTE) for b in F.PALETTE[i + 1:]]
    assert min(pairs)[0] >= MIN_PAIR_DE2000, min(pairs)


def test_color_names():
    teal = F.PALETTE_NAMES["en"].index("teal")
    assert F.color_name(teal) == "teal" and F.color_name(teal, "ko") == "청록"
    assert F.color_name(teal + F.K) == "teal" and F.color_name(0, "fr") == F.PALETTE_NAMES["en"][0]


def test_sixteen_live_requests_get_sixteen_distinguishable_colours():
    live = [snap(1, [(f"r{i}", PHASE_DECODE, 1, 1) for i in range(16)], {})]
    ca = F.ColorAssigner()
    idx = ca.update(live)
    assert len(set(idx.values())) == 16 and ca.index_of("r3") == idx["r3"] and ca.index_of("nope") is None
    worst = min(palette_distances([F.PALETTE[i] for i in idx.values()]))
    assert worst[0] >= MIN_DE2000, worst


def test_cached_and_outside_cells_stand_apart_from_free_and_grid():
    # the grid colour shows between cells and in the cells past the last block ("not in the pool")
    assert de2000(F.CACHED_COLOR, F.GRID_COLOR) >= 10
    assert de2000(F.CACHED_COLOR, F.FREE_COLOR) >= 15
    assert de2000(F.FREE_COLOR, F.GRID_COLOR) >= 4  # free cells are told apart by the grid lines


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
    outside = F.block_map_figure(s, {"A": 0}, columns=3).data[5]
    assert list(zip(outside.x, outside.y)) == [(2, 2)] and outside.name == "not in the pool"
    assert outside.showlegend and outside.marker.symbol == "x-thin"
    full = F.block_map_figure(s, {"A": 0}, columns=4).data[5]  # 8 blocks fill two rows of 4
    assert len(full.x) == 0 and not full.showlegend
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
    assert heat.customdata[0][0][4] == 16 and heat.customdata[1][0][4] == 0
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

