"""Plotly figures drawn from telemetry snapshots only (pure functions, no engine or Gradio access).

Colour code shared by both panels: each request gets one palette colour (:class:`ColorAssigner`);
in the slot heatmap a prefill cell is a light shade of it, a decode cell the full colour, a slot held
without computing (static policy) is grey; an empty slot is blank. In the block map a block has its
owner's colour, a free block is blank (white), a free block that still holds a findable prefix is pale
blue-grey, and the cells after the last block of the pool (the end of the last grid row) are marked "x".

The palette and the colour codes live in :mod:`ui.palette` (re-exported here).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go
import plotly.io as pio
from plotly.io.json import to_json_plotly

from engine import PHASE_DECODE, PHASE_IDLE, PHASE_PREFILL, StepSnapshot
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
    request_order,
)

LABELS_EN = {
    "step": "engine step", "slot": "batch slot", "request": "request", "others_fmt": " +{n} more",
    "tokens_step": "tokens this step", "tokens_cache": "tokens in cache", "admitted": "admitted",
    "block": "block", "owner": "owner", "free": "free", "cached": "free, cached prefix",
    "filled": "tokens filled", "refcount": "refcount", "reused": "times reused", "shared": "shared", "cache_hit": "prefix-cache hit",
    "reused_marker": "reused block", "running": "running", "waiting": "waiting", "kv": "KV usage %",
    "prefill": "prefill", "decode": "decode", "idle": "idle (held)", "tile_fmt": "1 cell = {g} blocks", "held": "held",
    "outside": "not in the pool", "mine": "your request", "cache_hit_tokens": "prefix-cache hit tokens",
    "taken_marker": "taken this step", "taken_at": "taken at step {step}", "origin_new": "never used before",
    "origin_reused": "was {owner}'s, freed at step {freed}", "origin_own": "its own again, freed at step {freed}",
    "origin_cached": "cached prefix of {owner}, freed at step {freed}", "origin_shared": "shared with {owner}",
    "totals_fmt": "{tok} tok · {steps} steps · {preempt} preempt.", "cached_short": "cached-free", "reused_short": "reused",
    "prefix_fmt": "{rate}% hit · {saved} tok saved", "prefix_window_fmt": " (last {steps} steps)",
}


def origin_text(take, labels: Mapping[str, str] | None = None) -> str:
    """Hover text of a held block's provenance, e.g. ``"taken at step 12 · was A's, freed at step 11"``.

    Args:
        take: an ``engine.kv_cache.BlockTake`` (``step``, ``kind``, ``previous_owner``, ``freed_step``), or None.
        labels: translated texts (keys of :data:`LABELS_EN`).

    Returns:
        the text; "" for None.
    """
    if take is None:
        return ""
    L = {**LABELS_EN, **(labels or {})}
    key = "origin_" + take.kind if ("origin_" + take.kind) in L else "origin_new"
    if take.previous_owner is None and key != "origin_shared":
        key = "origin_new"
    how = L[key].format(owner=take.previous_owner, freed="?" if take.freed_step is None else take.freed_step)
    return f"{L['taken_at'].format(step=take.step)} · {how}"


DEFAULT_WINDOW = 48  # steps on the occupancy x axis: at 1366x768 the panel's plot area is about 700 px wide,
# so a cell is about 14.5 px, wide enough for the ▷ of a hand-over to read on a projector (96 gave 7 px)
OCCUPANCY_MARGIN = {"l": 50, "r": 12, "t": 34, "b": 66}  # pixels; "b" holds tick labels, axis title and legend
LEGEND_LINE_PX = 22  # height of one line of a horizontal legend (12 px font)
BLOCK_CELL_LIMIT = 2048  # blocks: a larger pool is drawn in tiles of blocks (ui/block_tiles.py)


def phase_code(color_index: int, phase: str) -> int:
    """Heatmap value of a held slot: decode -> colour index, prefill -> its light shade, idle -> grey."""
    if phase == PHASE_PREFILL:
        return K + color_index % K
    if phase == PHASE_DECODE:
        return color_index % K
    return IDLE_CODE


def _spec(traces: list[dict], layout: dict) -> dict:
    return {"data": traces, "layout": layout}


def _figure(spec: dict) -> go.Figure:
    """A ``go.Figure`` from a plain ``{"data": [...], "layout": {...}}`` spec in one call, without plotly's
    per-property validation (known-good properties; validating took about 80% of a panel refresh,
    docs/performance.md). The live panels serialise the spec instead (:func:`spec_json`)."""
    return go.Figure(spec, _validate=False)


def spec_json(spec: dict) -> str:
    """A figure spec (a ``*_spec`` builder's result) as Plotly JSON text, the default template included:
    what ``go.Figure(spec).to_json()`` writes, without the figure object's two deep copies of the data
    (two thirds of a panel build's time)."""
    layout = spec.get("layout") or {}
    if "template" not in layout:
        layout = {**layout, "template": _template()}
    return to_json_plotly({"data": spec.get("data") or [], "layout": layout})


@functools.cache
def _template() -> dict:
    return pio.templates[pio.templates.default].to_plotly_json()


def occupancy_spec(
    snapshots: Sequence[StepSnapshot],
    colors: Mapping[str, int] | None = None,
    labels: Mapping[str, str] | None = None,
    height: int = 330,
    num_slots: int | None = None,
    window: int | None = None,
) -> dict:
    """Slot-occupancy heatmap as a plain figure spec (``{"data": traces, "layout": layout}``; see
    :func:`occupancy_figure` for the ``go.Figure``): x = engine step, y = batch slot, colour = request and phase.

    Trace 0 is the heatmap: ``z[slot][i]`` is :func:`phase_code` (None for an empty slot) and
    ``customdata[slot][i]`` is ``(request id, phase label, tokens this step, tokens in cache, prefix-cache
    hit tokens)`` at step ``x[i]`` (request id "" when empty). Trace 1 marks the cells where a request
    took its slot (admission), so a finished request's slot being taken by a waiting one is visible.
    Traces 2-4 are legend entries (prefill, decode, idle).

    Args:
        snapshots: the steps to draw, oldest first (may be empty).
        colors: request id -> palette index (default: :func:`default_colors`).
        labels: translated texts (keys of :data:`LABELS_EN`).
        height: figure height (pixels).
        num_slots: batch slots (``max_num_seqs``): that many rows are drawn even before the first step.
        window: steps the x axis spans (the panel's window): with it, the axis is ``window`` steps wide
            from the first step drawn (or ends at the last step once more are drawn), so cells keep their
            width while the window fills; with no snapshots it is ``[0.5, window + 0.5]`` (default 96).
            Without it and with snapshots, the axis spans exactly the steps drawn.
    """
    L = {**LABELS_EN, **(labels or {})}
    colors = dict(colors) if colors is not None else default_colors(snapshots)
    steps = [s.step for s in snapshots]
    n_slots = max([len(s.batch_slots) for s in snapshots] + [num_slots or 0])
    z: list[list[int | None]] = [[None] * len(steps) for _ in range(n_slots)]
    cd = [[("", "", 0, 0, 0)] * len(steps) for _ in range(n_slots)]
    phase_name = {PHASE_PREFILL: L["prefill"], PHASE_DECODE: L["decode"], PHASE_IDLE: L["idle"]}
    adm_x, adm_y, adm_text = [], [], []
    for i, snap in enumerate(snapshots):
        admitted = set(snap.admitted)
        for s in snap.batch_slots:
            if s.request_id is None:
                continue
            z[s.batch_slot][i] = phase_code(colors.get(s.request_id, 0), s.phase)
            cd[s.batch_slot][i] = (s.request_id, phase_name.get(s.phase, s.phase), s.num_scheduled_tokens,
                                   s.num_computed_tokens, s.num_cached_tokens)
            if s.request_id in admitted:
                adm_x.append(snap.step)
                adm_y.append(s.batch_slot)
                adm_text.append(f"{L['admitted']}: {s.request_id}")
    hover = (f"{L['request']}: <b>%{{customdata[0]}}</b> (%{{customdata[1]}})<br>{L['step']}: %{{x}} · "
             f"{L['slot']}: %{{y}}<br>{L['tokens_step']}: %{{customdata[2]}}<br>"
             f"{L['tokens_cache']}: %{{customdata[3]}}<br>{L['cache_hit_tokens']}: %{{customdata[4]}}<extra></extra>")
    traces: list[dict] = [
        dict(type="heatmap", x=steps, y=list(range(n_slots)), z=z, customdata=cd, hovertemplate=hover,
             colorscale=COLORSCALE, showscale=False, xgap=1, ygap=1, hoverongaps=False, name="slots", **ZRANGE),
        dict(type="scatter", x=adm_x, y=adm_y, mode="markers", name=L["admitted"], text=adm_text,
             hovertemplate="%{text}<extra></extra>", cliponaxis=False,
             marker={"symbol": "triangle-right", "size": 7, "color": "white", "line": {"color": "black", "width": 1}}),
    ]
    for name, col in ((L["prefill"], light_shade(PALETTE[0])), (L["decode"], PALETTE[0]), (L["idle"], IDLE_COLOR)):
        traces.append(dict(type="scatter", x=[None], y=[None], mode="markers", name=name,
                           marker={"symbol": "square", "size": 10, "color": col}, hoverinfo="skip"))
    if n_slots:
        yaxis = {"range": [n_slots - 0.5, -0.5], "dtick": 1 if n_slots <= 16 else None}
    else:  # nothing known about the batch: an empty box, no invented slot numbers
        yaxis = {"range": [0.5, -0.5], "tickvals": []}
    layout = dict(
        height=height, margin=dict(OCCUPANCY_MARGIN), plot_bgcolor="white", uirevision="occupancy",
        # the legend sits at the figure's bottom edge, under the axis title (never over it)
        legend={"orientation": "h", "yref": "container", "y": 0, "yanchor": "bottom", "x": 0},
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


def _rect_path(rects: Sequence[tuple[float, float, float, float]]) -> tuple[list, list]:
    """x and y of closed rectangles ``(x0, x1, y0, y1)`` in one line trace, separated by None."""
    x = [v for x0, x1, _, _ in rects for v in (x0, x1, x1, x0, x0, None)]
    y = [v for _, _, y0, y1 in rects for v in (y0, y0, y1, y1, y0, None)]
    return x, y


def _mine_trace(x: list, y: list, name: str) -> go.Scatter:
    return go.Scatter(x=x, y=y, mode="lines", name=name, hoverinfo="skip", showlegend=True,
                      line={"color": MINE_COLOR, "width": 3}, connectgaps=False)


def block_grid_columns(num_blocks: int) -> int:
    """Columns of the block map: a wide rectangle, about 3 columns per row, 8 to 64 columns."""
    cols = 8
    while cols < 64 and cols * cols < 3 * num_blocks:
        cols += 8
    return cols


def _block_grid(snap: StepSnapshot | None, columns: int | None, num_blocks: int | None) -> tuple[int, int, int]:
    """``(blocks, columns, rows)`` of the block map: the snapshot's pool size, else ``num_blocks``."""
    n = snap.num_blocks if snap is not None and snap.num_blocks else (num_blocks or 0)
    cols = columns or block_grid_columns(n)
    return n, cols, (n + cols - 1) // cols


def _mark(points: tuple[list[float], list[int]], x: float, y: int) -> None:
    """Add the point ``(x, y)`` to a marker trace's x and y lists."""
    points[0].append(x)
    points[1].append(y)


def block_map_spec(
    snap: StepSnapshot | None,
    colors: Mapping[str, int] | None = None,
    labels: Mapping[str, str] | None = None,
    columns: int | None = None,
    height: int = 330,
    num_blocks: int | None = None,
) -> dict:
    """Physical KV block map as a plain figure spec (see :func:`block_map_figure` for the ``go.Figure``):
    one cell per block, colour = owning request, blank = free (over :data:`BLOCK_CELL_LIMIT`: ui/block_tiles.py).

    Block ``b`` sits at row ``b // columns``, column ``b % columns`` (x = column, y = row). Trace 0 is
    the heatmap (``z`` is the owner's palette index, :data:`CACHED_CODE` for a free cached block,
    :data:`FREE_CODE` for a free one, None past the last block; ``customdata`` holds ``(block id, owner
    ids joined by ", " or the free state, tokens filled, refcount, times reused)``, (-1, ...) past the
    last block); trace 1 marks owned blocks that were reused (handed over from another request before);
    trace 2 marks shared blocks (refcount > 1); trace 3 is the legend entry of cached-free blocks;
    trace 4 marks held blocks that their request found in the prefix cache instead of computing them;
    trace 5 marks with a faint "x" the grid cells past the last block ("not in the pool"), which show
    the grid colour; trace 6 marks with ▷ (left of the cell's centre) the blocks taken in this step
    (``snap.block_takes``), so a hand-over of blocks shows at the step it happens. ``customdata[5]`` is the
    held block's provenance (:func:`origin_text`: taken at step N, whose it was, the step it was freed).

    Args:
        snap: the step to draw, or None before the first step.
        colors: request id -> palette index (default: :func:`default_colors`).
        labels: translated texts (keys of :data:`LABELS_EN`).
        columns: grid columns (default: :func:`block_grid_columns`).
        height: figure height (pixels).
        num_blocks: pool size (blocks), used when ``snap`` is None: the whole pool is drawn free. With
            neither, the figure is blank (no traces).
    """
    L = {**LABELS_EN, **(labels or {})}
    n, cols, rows = _block_grid(snap, columns, num_blocks)
    if n > BLOCK_CELL_LIMIT:  # a large pool: one cell per tile of blocks (ui/block_tiles.py)
        return importlib.import_module("ui.block_tiles").block_tiles_spec(snap, colors, labels, height, num_blocks)
    if n == 0:
        return _spec([], {"height": height, "margin": {"l": 10, "r": 10, "t": 10, "b": 10}})
    colors = dict(colors) if colors is not None else default_colors([snap] if snap is not None else [])
    if snap is not None:
        owners, tokens, refcount, reuses = snap.block_owners(), snap.block_tokens, snap.block_refcount, snap.block_reuses
        cached, hit_blocks = snap.cached_blocks, snap.cache_hit_blocks
        origins, taken_now = snap.block_origins, {t.block_id for t in snap.block_takes}
    else:
        owners, tokens, refcount, reuses = [[]] * n, (0,) * n, (0,) * n, (0,) * n
        cached, hit_blocks, origins, taken_now = frozenset(), frozenset(), {}, set()
    z: list[list[int | None]] = [[None] * cols for _ in range(rows)]
    cd = [[(-1, "", 0, 0, 0, "")] * cols for _ in range(rows)]
    marks: list[tuple[list[float], list[int]]] = [([], []) for _ in range(4)]  # x and y of each marker trace
    reused, shared, hits, taken = marks
    for b in range(n):
        r, c = divmod(b, cols)
        own = owners[b]
        if own:
            z[r][c] = colors.get(own[0], 0) % K
            state = ", ".join(own)
            if reuses[b] > 0:
                _mark(reused, c, r)
            if refcount[b] > 1:
                _mark(shared, c, r)
            if b in hit_blocks:
                _mark(hits, c, r)
            if b in taken_now:
                _mark(taken, c - 0.3, r)
        elif b in cached:
            z[r][c] = CACHED_CODE
            state = L["cached"]
        else:
            z[r][c] = FREE_CODE
            state = L["free"]
        cd[r][c] = (b, state, tokens[b], refcount[b], reuses[b], origin_text(origins.get(b), L) if own else "")
    outside = [(c, rows - 1) for c in range(n - (rows - 1) * cols, cols)]
    hover = (f"{L['block']} <b>%{{customdata[0]}}</b><br>{L['owner']}: <b>%{{customdata[1]}}</b><br>"
             f"{L['filled']}: %{{customdata[2]}}<br>{L['refcount']}: %{{customdata[3]}}<br>"
             f"{L['reused']}: %{{customdata[4]}}<br>%{{customdata[5]}}<extra></extra>")
    traces: list[dict] = [
        dict(type="heatmap", z=z, customdata=cd, hovertemplate=hover, colorscale=COLORSCALE, showscale=False,
             xgap=1, ygap=1, hoverongaps=False, name="blocks", **ZRANGE),
        dict(type="scatter", x=reused[0], y=reused[1], mode="markers", name=L["reused_marker"], hoverinfo="skip",
             marker={"symbol": "circle", "size": 4, "color": "white", "line": {"color": "black", "width": 0.5}}),
        dict(type="scatter", x=shared[0], y=shared[1], mode="markers", name=L["shared"], hoverinfo="skip",
             marker={"symbol": "diamond-open", "size": 8, "color": "black"}),
        dict(type="scatter", x=[None], y=[None], mode="markers", name=L["cached"], hoverinfo="skip",
             marker={"symbol": "square", "size": 10, "color": CACHED_COLOR}),
        dict(type="scatter", x=hits[0], y=hits[1], mode="markers", name=L["cache_hit"], hoverinfo="skip",
             marker={"symbol": "star", "size": 7, "color": "gold", "line": {"color": "black", "width": 0.5}}),
        dict(type="scatter", x=[c for c, _ in outside], y=[r for _, r in outside], mode="markers",
             name=L["outside"], showlegend=bool(outside), hovertemplate=f"{L['outside']}<extra></extra>",
             marker={"symbol": "x-thin", "size": 7, "color": OUTSIDE_MARK_COLOR,
                     "line": {"color": OUTSIDE_MARK_COLOR, "width": 1}}),
        dict(type="scatter", x=taken[0], y=taken[1], mode="markers", name=L["taken_marker"], hoverinfo="skip",
             cliponaxis=False,
             marker={"symbol": "triangle-right", "size": 7, "color": "white", "line": {"color": "black", "width": 1}}),
    ]
    every = max(1, rows // 8)
    layout = dict(
        height=height, margin={"l": 40, "r": 10, "t": 34, "b": 30}, plot_bgcolor=GRID_COLOR,
        legend={"orientation": "h", "y": -0.08, "x": 0}, uirevision="blocks",
        xaxis={"showgrid": False, "zeroline": False, "showticklabels": False, "range": [-0.5, cols - 0.5]},
        yaxis={"title": {"text": L["block"]}, "range": [rows - 0.5, -0.5], "showgrid": False, "zeroline": False,
               "tickvals": list(range(0, rows, every)), "ticktext": [str(r * cols) for r in range(0, rows, every)]},
    )
    return _spec(traces, layout)


def block_map_figure(*args, **kwargs) -> go.Figure:
    """:func:`block_map_spec` (same arguments) as a ``go.Figure``."""
    return _figure(block_map_spec(*args, **kwargs))

def block_map_highlight(
    snap: StepSnapshot | None,
    request_id: str,
    labels: Mapping[str, str] | None = None,
    columns: int | None = None,
    num_blocks: int | None = None,
) -> go.Scatter | None:
    """An outline around the blocks of one request in :func:`block_map_figure` (the "your request" mark).

    One ``go.Scatter`` of lines at the block map's coordinates (x = column, y = row): a closed rectangle
    around each run of consecutive block ids of its block table in one grid row (a pool over
    :data:`BLOCK_CELL_LIMIT`: around its tiles). It can be appended to the figure or to its JSON.

    Args:
        snap: the step drawn by :func:`block_map_figure`.
        request_id: the request to outline.
        labels: translated texts; the trace's name is ``labels["mine"]``.
        columns, num_blocks: as given to :func:`block_map_figure` (the same grid).

    Returns:
        The trace, or None when ``snap`` is None or the request holds no block in it.
    """
    if snap is None or not snap.block_tables.get(request_id):
        return None
    L = {**LABELS_EN, **(labels or {})}
    n, cols, _rows = _block_grid(snap, columns, num_blocks)
    if n > BLOCK_CELL_LIMIT:
        return importlib.import_module("ui.block_tiles").block_tiles_highlight(snap, request_id, labels, num_blocks)
    return outline_cells({b for b in snap.block_tables[request_id] if 0 <= b < n}, cols, L["mine"])


def outline_cells(cells: set[int], cols: int, name: str) -> go.Scatter | None:
    """A rectangle around each run of consecutive grid ``cells`` in a row (cell c: column c % cols); or None."""
    runs: list[list[int]] = []  # [first cell, last cell] of each run within a row
    for c in sorted(cells):
        if runs and runs[-1][1] == c - 1 and c % cols:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    if not runs:
        return None
    x, y = _rect_path([(a % cols - 0.5, b % cols + 0.5, a // cols - 0.5, a // cols + 0.5) for a, b in runs])
    return _mine_trace(x, y, name)


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
