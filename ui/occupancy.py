"""The slot-occupancy panel: which request holds which batch slot at each engine step, in which phase (pure
functions of telemetry snapshots; re-exported by :mod:`ui.figures`). A prefill cell is a light shade of its
request's colour, a decode cell the full colour, a slot held without computing (static policy) grey, an empty
slot blank; each request's letter is written in the first cell of each of its runs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go

from engine import PHASE_DECODE, PHASE_IDLE, PHASE_PREFILL, StepSnapshot
from ui.figure_base import (
    FONT_FAMILY,
    LABELS_EN,
    PLOT_WIDTH_1366,
    _figure,
    _mine_trace,
    _rect_path,
    _spec,
    cell_px,
    fixed_legend,
    ink,
    legend_entry,
    letters_trace,
    mine_legend,
)
from ui.palette import (
    COLORSCALE,
    IDLE_CODE,
    IDLE_COLOR,
    PALETTE,
    ZRANGE,
    K,
    default_colors,
    light_shade,
    request_label,
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
    letters = letters or {}
    names = {rid: request_label(colors.get(rid, 0), letter, lang) for rid, letter in letters.items()}
    legend, margin_b = fixed_legend(OCCUPANCY_MARGIN["b"])
    plot_h = height - OCCUPANCY_MARGIN["t"] - margin_b["b"]
    cell = min(cell_px(PLOT_WIDTH_1366, window or len(steps) or DEFAULT_WINDOW), cell_px(plot_h, n_slots or 1))
    z, cd, admitted, text_at = _slot_cells(snapshots, n_slots, colors, L, names, letters, cell)
    hover = (f"<b>%{{customdata[5]}}</b> · {L['request']} %{{customdata[0]}} (%{{customdata[1]}})<br>{L['step']}: "
             f"%{{x}} · {L['slot']}: %{{y}}<br>{L['tokens_step']}: %{{customdata[2]}}<br>"
             f"{L['tokens_cache']}: %{{customdata[3]}}<br>{L['cache_hit_tokens']}: %{{customdata[4]}}<extra></extra>")
    traces: list[dict] = [
        dict(type="heatmap", x=steps, y=list(range(n_slots)), z=z, customdata=cd, hovertemplate=hover,
             colorscale=COLORSCALE, showscale=False, xgap=1, ygap=1, hoverongaps=False, name="slots", **ZRANGE),
        dict(type="scatter", x=admitted[0], y=admitted[1], mode="markers", name=L["admitted"], hoverinfo="skip",
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


def _slot_cells(snapshots: Sequence[StepSnapshot], n_slots: int, colors: Mapping[str, int], L: Mapping[str, str],
                names: Mapping[str, str], letters: Mapping[str, str],
                cell: float) -> tuple[list, list, tuple[list[float], list[int]], tuple[list, list, list, list]]:
    """The occupancy heatmap's cells: ``(z, customdata, admissions, letters_at)`` of :func:`occupancy_spec`
    (admissions: x and y of the ▷ marks; letters_at: x, y, letter and ink of each run's letter)."""
    z: list[list[int | None]] = [[None] * len(snapshots) for _ in range(n_slots)]
    cd: list[list[tuple | None]] = [[None] * len(snapshots) for _ in range(n_slots)]
    phase_name = {PHASE_PREFILL: L["prefill"], PHASE_DECODE: L["decode"], PHASE_IDLE: L["idle"]}
    adm_x: list[float] = []
    adm_y: list[int] = []
    text_at: tuple[list, list, list, list] = ([], [], [], [])  # x, y, letter, ink
    prev: list[str | None] = [None] * n_slots  # the request in each slot at the step before
    lettered: list[bool] = [False] * n_slots  # its run has its letter already
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
    return z, cd, (adm_x, adm_y), text_at


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
