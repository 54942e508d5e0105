"""What the panel figures share (:mod:`ui.figures`, :mod:`ui.block_map`, :mod:`ui.block_tiles`): the English
labels, plain figure specs and their JSON, the fixed layout (legend inside a fixed margin, Plotly's margin
auto-expansion off), the request letters drawn in cells, and the "your request" outline trace.

Fixed layout: Plotly grows a margin to fit a legend that does not fit in it (``margin.autoexpand``), which
moves the plot area whenever a legend gains a line (and, with a vertical legend measured against the whole
figure, left a 190 px white band in the Compare slide). Every panel here turns that off and keeps its legend
entries the same from step to step, so a panel's plot area keeps its size whatever its legend says.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
import plotly.io as pio
from plotly.io.json import to_json_plotly

from ui.palette import MINE_COLOR

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
    "took_slot": "took its slot",
}

# Plotly's default fonts, then Korean ones: a laptop without a Korean system font otherwise shows boxes
# ("NanumGothic" is Debian's fonts-nanum; Malgun Gothic ships with Windows, Apple SD Gothic Neo with macOS)
FONT_FAMILY = ('"Open Sans", verdana, arial, "Noto Sans KR", "NanumGothic", "Malgun Gothic", '
               '"Apple SD Gothic Neo", sans-serif')
LEGEND_LINE_PX = 22  # height of one line of a horizontal legend (12 px font)
PLOT_WIDTH_1366 = 700  # px: the plot area of a live panel at 1366x768 (cells are sized from it)


def origin_text(take, labels: Mapping[str, str] | None = None, name=str) -> str:
    """Hover text of a held block's provenance, e.g. ``"taken at step 12 · was red A's, freed at step 11"``.

    Args:
        take: an ``engine.kv_cache.BlockTake`` (``step``, ``kind``, ``previous_owner``, ``freed_step``), or None.
        labels: translated texts (keys of :data:`LABELS_EN`).
        name: request id -> the text naming it (default: the id).

    Returns:
        the text; "" for None.
    """
    if take is None:
        return ""
    L = {**LABELS_EN, **(labels or {})}
    key = "origin_" + take.kind if ("origin_" + take.kind) in L else "origin_new"
    if take.previous_owner is None and key != "origin_shared":
        key = "origin_new"
    owner = name(take.previous_owner) if take.previous_owner is not None else None
    how = L[key].format(owner=owner, freed="?" if take.freed_step is None else take.freed_step)
    return f"{L['taken_at'].format(step=take.step)} · {how}"


def _spec(traces: list[dict], layout: dict) -> dict:
    return {"data": traces, "layout": layout}


def _figure(spec: dict) -> go.Figure:
    """A ``go.Figure`` from a plain ``{"data": [...], "layout": {...}}`` spec in one call, without plotly's
    per-property validation (known-good properties; validating took about 80% of a panel refresh,
    docs/performance.md). The live panels serialise the spec instead (:func:`spec_json`)."""
    return go.Figure(spec, _validate=False)


def spec_json(spec: dict, template: bool = True) -> str:
    """A figure spec (a ``*_spec`` builder's result) as Plotly JSON text, the default template included
    (unless ``template`` is False: the live page receives it once, :func:`template_json`): what
    ``go.Figure(spec).to_json()`` writes, without the figure object's two deep copies of the data (two
    thirds of a panel build's time)."""
    layout = spec.get("layout") or {}
    if template and "template" not in layout:
        layout = {**layout, "template": _template()}
    return to_json_plotly({"data": spec.get("data") or [], "layout": layout})


@functools.cache
def _template() -> dict:
    return pio.templates[pio.templates.default].to_plotly_json()


@functools.cache
def template_json() -> str:
    """Plotly's default layout template as JSON text (about 7 KB), what :func:`spec_json` leaves out with
    ``template=False``."""
    return to_json_plotly(_template())


def _rect_path(rects: Sequence[tuple[float, float, float, float]]) -> tuple[list, list]:
    """x and y of closed rectangles ``(x0, x1, y0, y1)`` in one line trace, separated by None."""
    x = [v for x0, x1, _, _ in rects for v in (x0, x1, x1, x0, x0, None)]
    y = [v for _, _, y0, y1 in rects for v in (y0, y0, y1, y1, y0, None)]
    return x, y


def _mine_trace(x: list, y: list, name: str) -> go.Scatter:
    """The outline of "your request": no legend entry of its own (every panel has a fixed one,
    :func:`mine_legend`), so the legend does not change when the outline comes and goes."""
    return go.Scatter(x=x, y=y, mode="lines", name=name, hoverinfo="skip", showlegend=False,
                      line={"color": MINE_COLOR, "width": 3}, connectgaps=False)


def legend_entry(name: str, marker: dict) -> dict:
    """A legend entry alone (a trace with no points): Plotly leaves a trace with no points out of the legend,
    so marker traces take no legend entry and each has one of these, always there."""
    return dict(type="scatter", x=[None], y=[None], mode="markers", name=name, marker=marker, hoverinfo="skip")


def mine_legend(name: str) -> dict:
    """The fixed legend entry of the "your request" outline (a trace with no points)."""
    return dict(type="scatter", x=[None], y=[None], mode="lines", name=name, hoverinfo="skip",
                line={"color": MINE_COLOR, "width": 3})


def fixed_legend(margin_bottom: int, lines: int = 1) -> tuple[dict, dict]:
    """``(legend, margin)`` layout parts: a horizontal legend of ``lines`` lines in the bottom margin, under
    everything else there, and no margin auto-expansion (the plot area never moves)."""
    legend = {"orientation": "h", "yref": "container", "y": 0, "yanchor": "bottom", "x": 0,
              "font": {"size": 12}, "itemclick": False, "itemdoubleclick": False}
    return legend, {"b": margin_bottom + lines * LEGEND_LINE_PX, "autoexpand": False}


def ink(color: str) -> str:
    """Black or white, whichever reads better on ``color`` (``"#RRGGBB"`` or ``"rgb(r, g, b)"``): WCAG
    relative luminance above 0.18 gets black."""
    if color.startswith("#"):
        rgb = [int(color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    else:
        rgb = [float(v) / 255 for v in color[color.index("(") + 1:-1].split(",")]
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
    lum = 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]
    return "#000000" if lum > 0.18 else "#FFFFFF"


def cell_px(span_px: float, cells: int) -> float:
    """Pixels per cell when ``cells`` share ``span_px`` pixels."""
    return span_px / max(1, cells)


def letters_trace(x: list, y: list, text: list, colors: list, size: float) -> dict:
    """The letters of requests drawn in their cells (no hover: the cell under it keeps its own)."""
    return dict(type="scatter", x=x, y=y, mode="text", text=text, hoverinfo="skip", showlegend=False,
                cliponaxis=False, textfont={"size": round(size), "color": colors, "family": FONT_FAMILY})
