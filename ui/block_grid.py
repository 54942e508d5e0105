"""The block map's frame, shared by the map of one cell per block (:mod:`ui.block_map`) and the tiled map of a
large pool (:mod:`ui.block_tiles`): the grid's shape, the marks and their legend entries, the axes, and the
outline of "your request" around cells (pure functions; both maps fill the cells, this draws what is around).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import plotly.graph_objects as go

from ui.figure_base import (
    FONT_FAMILY,
    _mine_trace,
    _rect_path,
    _spec,
    cell_px,
    fixed_legend,
    legend_entry,
    letters_trace,
    mine_legend,
)
from ui.palette import CACHED_COLOR, COLORSCALE, GRID_COLOR, OUTSIDE_MARK_COLOR, ZRANGE

BLOCK_CELL_LIMIT = 2048  # blocks: a larger pool is drawn in tiles of blocks (ui/block_tiles.py)
BLOCK_MARGIN = {"l": 40, "r": 10, "t": 10}  # pixels; the bottom margin holds the two-line legend
LETTER_MIN_PX = 12  # cells smaller than this (either side) carry no letter
PLOT_WIDTH_PX = 720  # pixels of the map's plot area its cells are sized from


MARKERS = {  # the block map's marks (``marker`` of their traces and legend entries)
    "reused": {"symbol": "circle", "size": 5, "color": "white", "line": {"color": "black", "width": 0.7}},
    "shared": {"symbol": "diamond-open", "size": 8, "color": "black"},
    "hit": {"symbol": "star", "size": 8, "color": "gold", "line": {"color": "black", "width": 0.5}},
    "outside": {"symbol": "x-thin", "size": 7, "color": OUTSIDE_MARK_COLOR, "line": {"color": OUTSIDE_MARK_COLOR, "width": 1}},
    "taken": {"symbol": "triangle-right", "size": 10, "color": "white", "line": {"color": "black", "width": 1}},
}

Points = tuple[list[float], list[float]]  # x and y of one marker trace


def _markers(points: tuple[list, list], name: str, marker: dict) -> dict:
    """A marker trace with no legend entry of its own and no hover (the cell under it keeps its own)."""
    return dict(type="scatter", x=points[0], y=points[1], mode="markers", name=name, hoverinfo="skip",
                showlegend=False, marker=marker)


def block_grid_columns(num_blocks: int) -> int:
    """Columns of the block map: a wide rectangle, about 3 columns per row, 8 to 64 columns."""
    cols = 8
    while cols < 64 and cols * cols < 3 * num_blocks:
        cols += 8
    return cols


def _mark(points: Points, x: float, y: float) -> None:
    """Add the point ``(x, y)`` to a marker trace's x and y lists."""
    points[0].append(x)
    points[1].append(y)


def grid_cell_px(height: int, cols: int, rows: int) -> float:
    """Pixels per side of a cell of a ``rows`` x ``cols`` map drawn ``height`` pixels high (square cells)."""
    _legend, margin_b = fixed_legend(8, lines=2)
    plot_h = height - BLOCK_MARGIN["t"] - margin_b["b"]
    return min(cell_px(PLOT_WIDTH_PX, cols), cell_px(plot_h, rows))


def block_grid_spec(cells: int, cols: int, z: list, customdata: list, hovertemplate: str, marks: Sequence[Points],
                    L: Mapping[str, str], height: int, row_label: Callable[[int], str],
                    letters_at: tuple[list, list, list, list] | None = None) -> dict:
    """The block map's figure spec around filled cells (trace order in :func:`ui.block_map.block_map_spec`).

    Args:
        cells: cells of the map (blocks, or tiles of blocks); the grid cells past them are marked "x".
        cols: grid columns; cell ``i`` sits at row ``i // cols``, column ``i % cols``.
        z, customdata, hovertemplate: the heat map's cells (rows x cols) and their hover.
        marks: points of the reused, shared, prefix-hit and taken marks, in that order.
        L: the labels (all keys of :data:`ui.figure_base.LABELS_EN`).
        height: figure height (pixels).
        row_label: row -> the y tick text of that row (its first block).
        letters_at: x, y, letter and ink of the letters written in cells (None: no letters).
    """
    rows = (cells + cols - 1) // cols
    reused, shared, hits, taken = marks
    legend, margin_b = fixed_legend(8, lines=2)
    cell = grid_cell_px(height, cols, rows)
    outside = [(c, rows - 1) for c in range(cells - (rows - 1) * cols, cols)]
    traces: list[dict] = [
        dict(type="heatmap", z=z, customdata=customdata, hovertemplate=hovertemplate, colorscale=COLORSCALE,
             showscale=False, xgap=1, ygap=1, hoverongaps=False, name="blocks", **ZRANGE),
        _markers(reused, L["reused_marker"], MARKERS["reused"]),
        _markers(shared, L["shared"], MARKERS["shared"]),
        legend_entry(L["cached"], {"symbol": "square", "size": 10, "color": CACHED_COLOR}),
        _markers(hits, L["cache_hit"], MARKERS["hit"]),
        _markers(([c for c, _ in outside], [r for _, r in outside]), L["outside"], MARKERS["outside"]),
        {**_markers(taken, L["taken_marker"], {**MARKERS["taken"], "size": max(7.0, min(14.0, 0.4 * cell))}),
         "cliponaxis": False},
        mine_legend(L["mine"]),
    ]
    # the legend: the same entries at every step (a trace with no points would drop out of it)
    traces += [legend_entry(L[k], MARKERS[m]) for k, m in (("reused_marker", "reused"), ("shared", "shared"),
                                                           ("cache_hit", "hit"), ("taken_marker", "taken"))]
    if outside:  # the same for every step of one pool
        traces.append(legend_entry(L["outside"], MARKERS["outside"]))
    if letters_at is not None:
        traces.append(letters_trace(*letters_at, size=min(16.0, 0.55 * cell)))
    every = max(1, rows // 8)
    layout = dict(
        height=height, margin={**BLOCK_MARGIN, **margin_b}, plot_bgcolor=GRID_COLOR, legend=legend,
        uirevision="blocks", font={"family": FONT_FAMILY},
        xaxis={"showgrid": False, "zeroline": False, "showticklabels": False, "range": [-0.5, cols - 0.5]},
        yaxis={"title": {"text": L["block"]}, "range": [rows - 0.5, -0.5], "showgrid": False, "zeroline": False,
               "tickvals": list(range(0, rows, every)), "ticktext": [row_label(r) for r in range(0, rows, every)]},
    )
    return _spec(traces, layout)


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
