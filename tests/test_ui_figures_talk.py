"""The panels' figures for a talk: block provenance on the block map, a projector at 1366x768 (cell width,
legend under the axis title), the Korean counters and header, colours named before a request is drawn."""

from __future__ import annotations

import dataclasses

from engine.telemetry import PHASE_DECODE, PHASE_PREFILL, Telemetry
from tests.test_ui_figures import SEQ, snap
from ui import figures as F


# --------------------------------------------------------------------------- block provenance
def test_block_map_marks_blocks_taken_this_step_and_hover_says_whose_they_were():
    from engine.kv_events import BlockTake
    from ui.i18n import figure_labels

    d_takes = (BlockTake(2, "C", 3, "reused", "B", 2), BlockTake(3, "C", 3, "new"))
    a_origin = BlockTake(0, "A", 1, "new")
    s = dataclasses.replace(SEQ[-1], block_takes=d_takes, block_origins={0: a_origin, 2: d_takes[0], 3: d_takes[1]})
    fig = F.block_map_figure(s, F.default_colors(SEQ), columns=4)
    taken = fig.data[6]
    assert taken.name == "taken this step" and taken.marker.symbol == "triangle-right"
    assert list(zip(taken.x, taken.y)) == [(2 - 0.3, 0), (3 - 0.3, 0)]  # in the cell's left part
    assert list(zip(fig.data[1].x, fig.data[1].y)) == [(2.3, -0.25)]  # the recycled dot stays, top right
    hover = [c[5] for row in fig.data[0].customdata for c in row]
    assert hover[2] == "taken at step 3 · was B's, freed at step 2"
    assert hover[3] == "taken at step 3 · never used before" and hover[0] == "taken at step 1 · never used before"
    assert hover[1] == "" and hover[4] == ""  # no origin known / a free block
    assert "%{customdata[5]}" in fig.data[0].hovertemplate
    assert F.origin_text(BlockTake(5, "E", 9, "cached", "A", 4)) == "taken at step 9 · cached prefix of A, freed at step 4"
    assert F.origin_text(BlockTake(5, "E", 9, "shared", "A")) == "taken at step 9 · shared with A"
    ko = F.block_map_figure(s, F.default_colors(SEQ), labels=figure_labels("ko"), columns=4)
    assert ko.data[6].name == "이번 스텝에 받은 블록"
    assert [c[5] for row in ko.data[0].customdata for c in row][2] == "스텝 3에 받음 · B의 블록이었음, 스텝 2에 해제"
    assert len(F.block_map_figure(SEQ[0], columns=4).data[6].x) == 0  # no takes recorded: no marks


# --------------------------------------------------------------------------- a projector at 1366x768
# The occupancy figure at 1366x768 (Chromium, fill_width page): the panel column is 3/5 of the row, about
# 780 px, the plot inside it about 770 px wide; the margins leave the plot area.
OCCUPANCY_FIGURE_WIDTH_1366 = 770


def test_default_window_gives_cells_a_projector_shows_and_the_last_marker_is_not_clipped():
    import inspect

    from ui.layout import build_app

    assert inspect.signature(build_app).parameters["window"].default == F.DEFAULT_WINDOW
    fig = F.occupancy_figure(SEQ, window=F.DEFAULT_WINDOW)
    area = OCCUPANCY_FIGURE_WIDTH_1366 - fig.layout.margin.l - fig.layout.margin.r
    lo, hi = fig.layout.xaxis.range
    assert area / (hi - lo) >= 14  # pixels per step
    admitted = fig.data[1]
    assert admitted.cliponaxis is False and admitted.marker.size + 2 * admitted.marker.line.width <= 14


def test_the_axis_title_never_covers_the_legend():
    from ui.i18n import figure_labels

    for lang in ("en", "ko"):
        fig = F.occupancy_figure(SEQ, labels=figure_labels(lang), window=48)
        legend, xaxis, margin = fig.layout.legend, fig.layout.xaxis, fig.layout.margin
        assert (legend.yref, legend.y, legend.yanchor, legend.orientation) == ("container", 0, "bottom", "h")
        # below the plot area: tick labels (about 18 px), the title's standoff and its line, then the legend
        title_bottom = 18 + xaxis.title.standoff + 1.4 * xaxis.title.font.size
        assert margin.b - F.LEGEND_LINE_PX >= title_bottom + 4, lang
        assert xaxis.title.text == figure_labels(lang)["step"]


# --------------------------------------------------------------------------- the Korean page
def test_counters_header_and_latencies_in_korean_and_seconds_past_10_s():
    from types import SimpleNamespace

    from engine.config import EngineConfig
    from ui.i18n import figure_labels
    from ui.layout import engine_summary

    stats = {"generated_tokens": 6458, "steps": 2039, "preemptions": 0, "prefix_hit_rate_window": 0.81,
             "prefill_tokens_saved_window": 96, "prefix_window_steps": 64, "ttft_p50": 0.2504, "ttft_p90": 367.708,
             "tpot_p50": 9.99, "tpot_p90": 10.0}
    en, ko = F.counter_values(stats), F.counter_values(stats, figure_labels("ko"))
    assert en["totals"] == "6458 tok · 2039 steps · 0 preempt."
    assert ko["totals"] == "6458 토큰 · 2039 스텝 · 선점 0회"
    assert ko["prefix_cache"] == "적중 81% · 96 토큰 절약 (최근 64 스텝)"
    assert en["ttft"] == "250 ms / 367.7 s" and en["tpot"] == "9990 ms / 10.0 s"
    eng = SimpleNamespace(config=EngineConfig(num_blocks=96, max_num_seqs=4, max_model_len=1536))
    assert engine_summary(eng) == ("`SmolLM2-135M-Instruct (embedded)` · **4** slots · **96** KV blocks × **16** tokens"
                                   " · policy `continuous` · free blocks `lru` · context 1536 tokens")
    ko_line = engine_summary(eng, lang="ko")
    assert "슬롯 **4**개" in ko_line and "KV 블록 **96**개" in ko_line and "정책 `continuous`" in ko_line
    assert "컨텍스트 1536 토큰" in ko_line and "slots" not in ko_line


def test_a_request_gets_its_colour_before_it_is_drawn_and_keeps_it():
    """A chat's status line names its colour while the request still waits (queued), and the same colour
    when it is drawn and when it has finished; other requests never take a reserved colour meanwhile."""
    ca = F.ColorAssigner()
    on_screen = ca.update(SEQ[:1])  # A and B
    queued = ca.reserve("Q")
    assert queued not in on_screen.values() and ca.reserve("Q") == queued and ca.index_of("Q") == queued
    many = [snap(2, [(f"r{i}", PHASE_DECODE, 1, 1) for i in range(F.K - 1)], {})]
    assert queued not in ca.update(many).values()  # 15 new requests: none takes Q's colour
    drawn = [snap(3, [("Q", PHASE_PREFILL, 4, 4)], {"Q": [0]})]
    assert ca.update(drawn)["Q"] == queued
    ca.update([snap(4, [None], {})])  # Q finished: no longer drawn, still named
    assert ca.index_of("Q") == queued


def test_panels_name_a_queued_requests_colour_when_asked_to_reserve_it():
    from ui.panels import Panels

    panels = Panels(Telemetry())
    assert panels.color_name("chat-1", "en") is None
    name = panels.color_name("chat-1", "ko", reserve=True)
    assert name in F.PALETTE_NAMES["ko"] and panels.color_name("chat-1", "ko") == name
