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

from engine import StepSnapshot
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
from ui.occupancy import (  # noqa: F401  (re-exported)
    ADMITTED_MARKER,
    DEFAULT_WINDOW,
    OCCUPANCY_MARGIN,
    _cell_ink,
    _step_range,
    occupancy_figure,
    occupancy_highlight,
    occupancy_spec,
    phase_code,
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
