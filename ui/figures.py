"""Plotly figures drawn from telemetry snapshots only (pure functions, no engine or Gradio access).

Colour code shared by both panels: each request gets one palette colour (:class:`ColorAssigner`) and a
letter, written in its cells, so the room can name it ("teal D"); in the slot heatmap a prefill cell is a
light shade of its colour, a decode cell the full colour, a slot held without computing (static policy) is
grey; an empty slot is blank. In the block map a block has its owner's colour, a free block is blank
(white), a free block that still holds a findable prefix is pale blue-grey, and the cells after the last
block of the pool (the end of the last grid row) are marked "x".

The palette and the colour codes live in :mod:`ui.palette`, the block map in :mod:`ui.block_map`, what the
figures share (labels, JSON, the fixed legend) in :mod:`ui.figure_base`; all re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

from engine import PHASE_DECODE, PHASE_IDLE, PHASE_PREFILL, StepSnapshot
from ui.block_map import (  # noqa: F401  (re-exported)
    BLOCK_CELL_LIMIT,
    _block_grid,
    _mark,
    block_grid_columns,
    block_map_figure,
    block_map_highlight,
    block_map_spec,
    outline_cells,
)
from ui.figure_base import (  # noqa: F401  (re-exported)
    FONT_FAMILY,
    LABELS_EN,
    LEGEND_LINE_PX,
    PLOT_WIDTH_1366,
    _figure,
    _mine_trace,
    _rect_path,
    _spec,
    _template,
    cell_px,
    fixed_legend,
    ink,
    legend_entry,
    letters_trace,
    mine_legend,
    origin_text,
    spec_json,
    template_json,
)
from ui.palette import (  # noqa: F401  (re-exported: the figures' colour code)
    _NAMED_COLORS,
    CACHED_CODE,
    CACHED_COLOR,
    COLORSCALE,
    FREE_CODE,
    FREE_COLOR,
    GRID_COLOR,
    IDLE_CODE,
    IDLE_COLOR,
    LETTERS,
    MINE_COLOR,
    OUTSIDE_MARK_COLOR,
    PALETTE,
    PALETTE_NAMES,
    ZRANGE,
    ColorAssigner,
    K,
    color_name,
    default_colors,
    light_shade,
    request_label,
    request_order,
)

DEFAULT_WINDOW = 48  # steps on the occupancy x axis: at 1366x768 the panel's plot area is about 700 px wide,
# so a cell is about 14.5 px, wide enough for the ▷ of a hand-over to read on a projector (96 gave 7 px)
OCCUPANCY_MARGIN = {"l": 50, "r": 12, "t": 10, "b": 42}  # pixels; "b" holds tick labels and axis title (the
# legend's line comes on top of it, :func:`ui.figure_base.fixed_legend`)


ADMITTED_MARKER = {"symbol": "triangle-right", "color": "white", "line": {"color": "black", "width": 1}}


def phase_code(color_index: int, phase: str) -> int:
    """Heatmap value of a held slot: decode -> colour index, prefill -> its light shade, idle -> grey."""
    if phase == PHASE_PREFILL:
        return K + color_index % K
    if phase == PHASE_DECODE:
        return color_index % K
    return IDLE_CODE


def _cell_ink(color_index: int, phase: str) -> str:
    """The letter colour on a cell of ``phase`` in palette colour ``color_index``."""
    if phase == PHASE_PREFILL:
        return ink(light_shade(PALETTE[color_index % K]))
    if phase == PHASE_DECODE:
        return ink(PALETTE[color_index % K])
    return ink(IDLE_COLOR)


def occupancy_spec(
    snapshots: Sequence[StepSnapshot],
    colors: Mapping[str, int] | None = None,
    labels: Mapping[str, str] | None = None,
    height: int = 330,
    num_slots: int | None = None,
    window: int | None = None,
    letters: Mapping[str, str] | None = None,
    lang: str = "en",
) -> dict:
    """Slot-occupancy heatmap as a plain figure spec (``{"data": traces, "layout": layout}``; see
    :func:`occupancy_figure` for the ``go.Figure``): x = engine step, y = batch slot, colour = request and phase.

    Trace 0 is the heatmap: ``z[slot][i]`` is :func:`phase_code` (None for an empty slot) and
    ``customdata[slot][i]`` is ``(request id, phase label (", took its slot" at its admission), tokens this
    step, tokens in cache, prefix-cache hit tokens, name)`` at step ``x[i]`` (None for an empty slot), the
    name being the request's colour and letter ("teal D") when ``letters`` has it, else its id. Trace 1
    marks with ▷ in the left part of the cells where a request took its slot (admission), so a finished
    request's slot being taken by a waiting one is visible; it takes no hover (the cell under it keeps its
    own) and no legend entry. Traces 2-4 are legend entries (prefill, decode, idle), trace 5 the fixed "your
    request" entry, trace 6 the ▷ entry, trace 7 (with ``letters``) each request's letter in the first cell of
    each of its runs in a slot.
    Marker and letter sizes follow the cell size at 1366x768 (:data:`ui.figure_base.PLOT_WIDTH_1366`). The
    legend's entries are the same at every step and its line has a fixed place (fixed layout).

    Args:
        snapshots: the steps to draw, oldest first (may be empty).
        colors: request id -> palette index (default: :func:`default_colors`).
        labels: translated texts (keys of :data:`LABELS_EN`).
        height: figure height (pixels).
        num_slots: batch slots (``max_num_seqs``): that many rows are drawn even before the first step.
        window: steps the x axis spans (the panel's window): with it, the axis is ``window`` steps wide
            from the first step drawn (or ends at the last step once more are drawn), so cells keep their
            width while the window fills; with no snapshots it is ``[0.5, window + 0.5]`` (default 48).
            Without it and with snapshots, the axis spans exactly the steps drawn.
        letters: request id -> letter (``ColorAssigner.letters``): drawn in the cells and named in the hover.
        lang: language of the colour names.
    """
    L = {**LABELS_EN, **(labels or {})}
    colors = dict(colors) if colors is not None else default_colors(snapshots)
    steps = [s.step for s in snapshots]
    n_slots = max([len(s.batch_slots) for s in snapshots] + [num_slots or 0])
    z: list[list[int | None]] = [[None] * len(steps) for _ in range(n_slots)]
    cd: list[list[tuple | None]] = [[None] * len(steps) for _ in range(n_slots)]
    phase_name = {PHASE_PREFILL: L["prefill"], PHASE_DECODE: L["decode"], PHASE_IDLE: L["idle"]}
    letters = letters or {}
    names = {rid: request_label(colors.get(rid, 0), letter, lang) for rid, letter in letters.items()}
    adm_x: list[float] = []
    adm_y: list[int] = []
    text_at: tuple[list, list, list, list] = ([], [], [], [])  # x, y, letter, ink
    prev: list[str | None] = [None] * n_slots  # the request in each slot at the step before
    lettered: list[bool] = [False] * n_slots  # its run has its letter already
    legend, margin_b = fixed_legend(OCCUPANCY_MARGIN["b"])
    plot_h = height - OCCUPANCY_MARGIN["t"] - margin_b["b"]
    cell = min(cell_px(PLOT_WIDTH_1366, window or len(steps) or DEFAULT_WINDOW), cell_px(plot_h, n_slots or 1))
    for i, snap in enumerate(snapshots):
        admitted = set(snap.admitted)
        held: list[str | None] = [None] * n_slots
        for s in snap.batch_slots:
            rid = s.request_id
            if rid is None:
                continue
            held[s.batch_slot] = rid
            idx = colors.get(rid, 0)
            z[s.batch_slot][i] = phase_code(idx, s.phase)
            phase = phase_name.get(s.phase, s.phase)
            if rid in admitted:
                adm_x.append(snap.step - 0.3)
                adm_y.append(s.batch_slot)
                phase = f"{phase}, {L['took_slot']}"
            cd[s.batch_slot][i] = (rid, phase, s.num_scheduled_tokens, s.num_computed_tokens, s.num_cached_tokens,
                                   names.get(rid, rid))
            if prev[s.batch_slot] != rid:
                lettered[s.batch_slot] = False
            # the request's letter in the first cell of its run, or in the second one when a small first
            # cell holds its ▷
            crowded = rid in admitted and cell < 20 and i + 1 < len(snapshots)
            if rid in names and not lettered[s.batch_slot] and not crowded:
                lettered[s.batch_slot] = True
                for lst, v in zip(text_at, (snap.step, s.batch_slot, letters[rid], _cell_ink(idx, s.phase))):
                    lst.append(v)
        prev = held
    hover = (f"<b>%{{customdata[5]}}</b> · {L['request']} %{{customdata[0]}} (%{{customdata[1]}})<br>{L['step']}: "
             f"%{{x}} · {L['slot']}: %{{y}}<br>{L['tokens_step']}: %{{customdata[2]}}<br>"
             f"{L['tokens_cache']}: %{{customdata[3]}}<br>{L['cache_hit_tokens']}: %{{customdata[4]}}<extra></extra>")
    traces: list[dict] = [
        dict(type="heatmap", x=steps, y=list(range(n_slots)), z=z, customdata=cd, hovertemplate=hover,
             colorscale=COLORSCALE, showscale=False, xgap=1, ygap=1, hoverongaps=False, name="slots", **ZRANGE),
        dict(type="scatter", x=adm_x, y=adm_y, mode="markers", name=L["admitted"], hoverinfo="skip",
             cliponaxis=False, showlegend=False, marker={**ADMITTED_MARKER, "size": max(7.0, min(14.0, 0.4 * cell))}),
    ]
    for name, col in ((L["prefill"], light_shade(PALETTE[0])), (L["decode"], PALETTE[0]), (L["idle"], IDLE_COLOR)):
        traces.append(legend_entry(name, {"symbol": "square", "size": 10, "color": col}))
    traces.append(mine_legend(L["mine"]))
    traces.append(legend_entry(L["admitted"], {**ADMITTED_MARKER, "size": 10}))
    if letters:
        traces.append(letters_trace(*text_at, size=max(8.0, min(16.0, 0.6 * cell))))
    if n_slots:
        yaxis = {"range": [n_slots - 0.5, -0.5], "dtick": 1 if n_slots <= 16 else None}
    else:  # nothing known about the batch: an empty box, no invented slot numbers
        yaxis = {"range": [0.5, -0.5], "tickvals": []}
    layout = dict(
        height=height, margin={**OCCUPANCY_MARGIN, **margin_b}, plot_bgcolor="white", uirevision="occupancy",
        legend=legend, font={"family": FONT_FAMILY},  # the legend: one fixed line under the axis title
        xaxis={"title": {"text": L["step"], "standoff": 2, "font": {"size": 12}}, "showgrid": False,
               "zeroline": False, "range": _step_range(steps, window)},
        yaxis={**yaxis, "title": {"text": L["slot"]}, "showgrid": False, "zeroline": False},
    )
    return _spec(traces, layout)


def occupancy_figure(*args, **kwargs) -> go.Figure:
    """:func:`occupancy_spec` (same arguments) as a ``go.Figure``."""
    return _figure(occupancy_spec(*args, **kwargs))


def _step_range(steps: Sequence[int], window: int | None) -> list[float] | None:
    """The x range of the occupancy heatmap (see :func:`occupancy_figure`)."""
    if not steps:
        return [0.5, (window or DEFAULT_WINDOW) + 0.5]
    if window is None:
        return [steps[0] - 0.5, steps[-1] + 0.5]
    hi = max(steps[-1], steps[0] + window - 1)
    return [hi - window + 0.5, hi + 0.5]


def occupancy_highlight(
    snapshots: Sequence[StepSnapshot], request_id: str, labels: Mapping[str, str] | None = None,
) -> go.Scatter | None:
    """An outline around the cells of one request in :func:`occupancy_figure` (the "your request" mark).

    One ``go.Scatter`` of lines in the heatmap's data coordinates (x = step, y = slot): a closed
    rectangle around each run of consecutive steps the request held the same slot, runs separated by
    None. It refers to no other trace, so it can be appended to the figure (``fig.add_trace``) or to its
    JSON.

    Args:
        snapshots: the steps drawn by :func:`occupancy_figure`.
        request_id: the request to outline.
        labels: translated texts; the trace's name is ``labels["mine"]``.

    Returns:
        The trace, or None when the request holds no slot in ``snapshots``.
    """
    L = {**LABELS_EN, **(labels or {})}
    cells = sorted((s.batch_slot, snap.step) for snap in snapshots for s in snap.batch_slots
                   if s.request_id == request_id)
    if not cells:
        return None
    rects: list[list[int]] = []  # [x0, x1, y0, y1, slot] around each run of consecutive steps in one slot
    for slot, step in cells:
        if rects and rects[-1][4] == slot and rects[-1][1] == step - 1:
            rects[-1][1] = step
        else:
            rects.append([step, step, slot, slot, slot])
    x, y = _rect_path([(x0 - 0.5, x1 + 0.5, y0 - 0.5, y1 + 0.5) for x0, x1, y0, y1, _ in rects])
    return _mine_trace(x, y, L["mine"])


def rates_spec(snapshots: Sequence[StepSnapshot], labels: Mapping[str, str] | None = None,
               height: int = 220) -> dict:
    """Running and waiting requests (left axis) and KV usage % (right axis) per step, as a plain figure spec."""
    L = {**LABELS_EN, **(labels or {})}
    x = [s.step for s in snapshots]
    traces: list[dict] = [
        dict(type="scatter", x=x, y=[s.num_running for s in snapshots], name=L["running"], mode="lines"),
        dict(type="scatter", x=x, y=[s.num_waiting for s in snapshots], name=L["waiting"], mode="lines"),
        dict(type="scatter", x=x, y=[round(100 * s.kv_usage, 1) for s in snapshots], name=L["kv"],
             mode="lines", yaxis="y2", line={"dash": "dot"}),
    ]
    layout = dict(
        height=height, margin={"l": 40, "r": 45, "t": 30, "b": 30}, plot_bgcolor="white",
        legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0}, uirevision="rates",
        yaxis={"rangemode": "tozero", "gridcolor": "#eee"},
        yaxis2={"overlaying": "y", "side": "right", "range": [0, 100], "dtick": 25, "showgrid": False,
                "tickmode": "linear", "ticksuffix": "%"},
        xaxis={"title": {"text": L["step"]}},
    )
    return _spec(traces, layout)


def rates_figure(*args, **kwargs) -> go.Figure:
    """:func:`rates_spec` (same arguments) as a ``go.Figure``."""
    return _figure(rates_spec(*args, **kwargs))

def latency_text(seconds: float | None) -> str:
    """A latency for the counters: ``"123 ms"`` below 10 s, ``"12.3 s"`` from 10 s on, ``"-"`` for None."""
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


_ms = latency_text


def counter_values(stats: Mapping[str, Any], labels: Mapping[str, str] | None = None) -> dict[str, str]:
    """Formatted counters from :meth:`Telemetry.stats`, totals and prefix-cache line in the language of ``labels``."""
    L = {**LABELS_EN, **(labels or {})}
    return {
        "running": str(stats.get("running", 0)),
        "waiting": str(stats.get("waiting", 0)),
        "kv_usage": f"{100 * float(stats.get('kv_usage', 0.0)):.1f} %",
        "tokens_per_s": f"{float(stats.get('tokens_per_s', 0.0)):.1f} tok/s",
        "ttft": f"{_ms(stats.get('ttft_p50'))} / {_ms(stats.get('ttft_p90'))}",
        "tpot": f"{_ms(stats.get('tpot_p50'))} / {_ms(stats.get('tpot_p90'))}",
        "totals": L["totals_fmt"].format(tok=stats.get("generated_tokens", 0), steps=stats.get("steps", 0),
                                         preempt=stats.get("preemptions", 0)),
        "prefix_cache": _hit_rate(stats, L),
    }


def _hit_rate(stats: Mapping[str, Any], L: Mapping[str, str] = LABELS_EN) -> str:
    """The prefix-cache counter: over the last steps (``prefix_hit_rate_window``) when the stats have it,
    else since the start; "-" when no prompt was looked up."""
    if "prefix_hit_rate_window" in stats:
        rate = stats["prefix_hit_rate_window"]
        if rate is None:
            return "-"
        return (L["prefix_fmt"].format(rate=f"{100 * float(rate):.0f}", saved=stats.get("prefill_tokens_saved_window", 0))
                + L["prefix_window_fmt"].format(steps=stats.get("prefix_window_steps", "?")))
    rate = stats.get("prefix_hit_rate")
    if rate is None:
        return "-"
    return L["prefix_fmt"].format(rate=f"{100 * float(rate):.0f}", saved=stats.get("prefill_tokens_saved", 0))
