"""Plotly figures drawn from telemetry snapshots only (pure functions, no engine or Gradio access).

Colour code shared by both panels: each request gets one palette colour (:class:`ColorAssigner`);
in the slot heatmap a prefill cell is a light shade of it, a decode cell the full colour, a slot held
without computing (static policy) is grey; an empty slot is blank. In the block map a block has its
owner's colour, a free block is blank (white), a free block that still holds a findable prefix is pale grey.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import plotly.colors as pc
import plotly.graph_objects as go

from engine.telemetry import PHASE_DECODE, PHASE_IDLE, PHASE_PREFILL, StepSnapshot

PALETTE: tuple[str, ...] = tuple(c for c in pc.qualitative.Dark24 if c != "#222A2A")
K = len(PALETTE)
IDLE_CODE = 2 * K  # slot held by a request but not computed in this step
CACHED_CODE = 2 * K + 1  # free block still holding a cached prefix
FREE_CODE = 2 * K + 2  # free block (drawn blank)
IDLE_COLOR = "#9E9E9E"
CACHED_COLOR = "#D5DBE3"
FREE_COLOR = "#FFFFFF"
GRID_COLOR = "#E6E6E6"  # plot background seen through the gaps between cells

LABELS_EN = {
    "step": "engine step", "slot": "batch slot", "request": "request",
    "tokens_step": "tokens this step", "tokens_cache": "tokens in cache", "admitted": "admitted",
    "block": "block", "owner": "owner", "free": "free", "cached": "free, cached prefix",
    "filled": "tokens filled", "refcount": "refcount", "reused": "times reused", "shared": "shared", "cache_hit": "prefix-cache hit",
    "reused_marker": "reused block", "running": "running", "waiting": "waiting", "kv": "KV usage %",
    "prefill": "prefill", "decode": "decode", "idle": "idle (held)",
}


def _light(hex_color: str, amount: float = 0.55) -> str:
    """The colour moved ``amount`` of the way to white (used for prefill cells)."""
    rgb = pc.hex_to_rgb(hex_color)
    return pc.label_rgb(pc.find_intermediate_color(rgb, (255, 255, 255), amount))


def _code_colorscale() -> list[list]:
    """A stepwise colorscale: code v (0..FREE_CODE) gets one band of width 1 centred on v."""
    colors = list(PALETTE) + [_light(c) for c in PALETTE] + [IDLE_COLOR, CACHED_COLOR, FREE_COLOR]
    n = len(colors)
    scale = []
    for v, col in enumerate(colors):
        scale.append([v / n, col])
        scale.append([(v + 1) / n, col])
    return scale


COLORSCALE = _code_colorscale()
_ZRANGE = {"zmin": -0.5, "zmax": FREE_CODE + 0.5}


def phase_code(color_index: int, phase: str) -> int:
    """Heatmap value of a held slot: decode -> colour index, prefill -> its light shade, idle -> grey."""
    if phase == PHASE_PREFILL:
        return K + color_index % K
    if phase == PHASE_DECODE:
        return color_index % K
    return IDLE_CODE


def request_order(snapshots: Sequence[StepSnapshot]) -> list[str]:
    """Request ids in order of first appearance (slots, then block tables), oldest step first."""
    seen: dict[str, None] = {}
    for snap in snapshots:
        for s in snap.batch_slots:
            if s.request_id is not None:
                seen.setdefault(s.request_id)
        for rid in snap.block_tables:
            seen.setdefault(rid)
    return list(seen)


def default_colors(snapshots: Sequence[StepSnapshot]) -> dict[str, int]:
    """Palette index per request: order of first appearance, modulo the palette size."""
    return {rid: i % K for i, rid in enumerate(request_order(snapshots))}


class ColorAssigner:
    """Stable request -> palette index across refreshes, never reusing a colour held by a live request.

    A new request gets the palette index unused for the longest time among those not held by a
    request seen in the latest update, so the requests on screen at once have distinct colours
    (as long as there are fewer than ``len(PALETTE)`` of them).
    """

    def __init__(self, memory: int = 4096) -> None:
        self._index: dict[str, int] = {}
        self._last_used = [0] * K
        self._tick = itertools.count(1)
        self._memory = memory

    def update(self, snapshots: Sequence[StepSnapshot]) -> dict[str, int]:
        """Assign colours to the requests in ``snapshots``; return the mapping for all of them."""
        order = request_order(snapshots)
        live = {self._index[r] for r in order if r in self._index}
        for rid in order:
            if rid not in self._index:
                free = [i for i in range(K) if i not in live] or list(range(K))
                idx = min(free, key=lambda i: self._last_used[i])
                self._index[rid] = idx
                live.add(idx)
            self._last_used[self._index[rid]] = next(self._tick)
        if len(self._index) > self._memory:  # forget the oldest entries (dicts keep insertion order)
            for rid in list(self._index)[: len(self._index) - self._memory // 2]:
                if rid not in order:
                    del self._index[rid]
        return {rid: self._index[rid] for rid in order}


def occupancy_figure(
    snapshots: Sequence[StepSnapshot],
    colors: Mapping[str, int] | None = None,
    labels: Mapping[str, str] | None = None,
    height: int = 330,
) -> go.Figure:
    """Slot-occupancy heatmap: x = engine step, y = batch slot, colour = request and phase.

    Trace 0 is the heatmap: ``z[slot][i]`` is :func:`phase_code` (None for an empty slot) and
    ``customdata[slot][i]`` is ``(request id, phase label, tokens this step, tokens in cache)`` at step
    ``x[i]`` (request id "" when empty). Trace 1 marks the cells where a request took its slot
    (admission), so a finished request's slot being taken by a waiting one is visible.
    """
    L = {**LABELS_EN, **(labels or {})}
    colors = dict(colors) if colors is not None else default_colors(snapshots)
    steps = [s.step for s in snapshots]
    n_slots = max((len(s.batch_slots) for s in snapshots), default=0)
    z = [[None] * len(steps) for _ in range(n_slots)]
    cd = [[("", "", 0, 0)] * len(steps) for _ in range(n_slots)]
    phase_name = {PHASE_PREFILL: L["prefill"], PHASE_DECODE: L["decode"], PHASE_IDLE: L["idle"]}
    adm_x, adm_y, adm_text = [], [], []
    for i, snap in enumerate(snapshots):
        admitted = set(snap.admitted)
        for s in snap.batch_slots:
            if s.request_id is None:
                continue
            z[s.batch_slot][i] = phase_code(colors.get(s.request_id, 0), s.phase)
            cd[s.batch_slot][i] = (s.request_id, phase_name.get(s.phase, s.phase), s.num_scheduled_tokens,
                             s.num_computed_tokens)
            if s.request_id in admitted:
                adm_x.append(snap.step)
                adm_y.append(s.batch_slot)
                adm_text.append(f"{L['admitted']}: {s.request_id}")
    hover = (f"{L['request']}: <b>%{{customdata[0]}}</b> (%{{customdata[1]}})<br>{L['step']}: %{{x}} · "
             f"{L['slot']}: %{{y}}<br>{L['tokens_step']}: %{{customdata[2]}}<br>"
             f"{L['tokens_cache']}: %{{customdata[3]}}<extra></extra>")
    fig = go.Figure()
    fig.add_trace(go.Heatmap(
        x=steps, y=list(range(n_slots)), z=z, customdata=cd, hovertemplate=hover, colorscale=COLORSCALE,
        showscale=False, xgap=1, ygap=1, hoverongaps=False, name="slots", **_ZRANGE,
    ))
    fig.add_trace(go.Scatter(
        x=adm_x, y=adm_y, mode="markers", name=L["admitted"], text=adm_text, hovertemplate="%{text}<extra></extra>",
        marker={"symbol": "triangle-right", "size": 7, "color": "white", "line": {"color": "black", "width": 1}},
    ))
    for name, col in ((L["prefill"], _light(PALETTE[0])), (L["decode"], PALETTE[0]), (L["idle"], IDLE_COLOR)):
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name,
                                 marker={"symbol": "square", "size": 10, "color": col}, hoverinfo="skip"))
    fig.update_layout(
        height=height, margin={"l": 50, "r": 10, "t": 34, "b": 40}, plot_bgcolor="white",
        legend={"orientation": "h", "y": -0.18, "x": 0}, uirevision="occupancy",
    )
    x_range = [steps[0] - 0.5, steps[-1] + 0.5] if steps else None
    fig.update_xaxes(title_text=L["step"], showgrid=False, zeroline=False, range=x_range)
    fig.update_yaxes(title_text=L["slot"], showgrid=False, zeroline=False, range=[n_slots - 0.5, -0.5],
                     dtick=1 if n_slots <= 16 else None)
    return fig


def block_grid_columns(num_blocks: int) -> int:
    """Columns of the block map: a wide rectangle, about 3 columns per row, 8 to 64 columns."""
    cols = 8
    while cols < 64 and cols * cols < 3 * num_blocks:
        cols += 8
    return cols


def block_map_figure(
    snap: StepSnapshot | None,
    colors: Mapping[str, int] | None = None,
    labels: Mapping[str, str] | None = None,
    columns: int | None = None,
    height: int = 330,
) -> go.Figure:
    """Physical KV block map: one cell per block, colour = owning request, blank = free.

    Block ``b`` sits at row ``b // columns``, column ``b % columns``. Trace 0 is the heatmap (``z`` is
    the owner's palette index, :data:`CACHED_CODE` for a free cached block, :data:`FREE_CODE` for a
    free one, None past the last block; ``customdata`` holds ``(block id, owner ids joined by ", " or
    the free state, tokens filled, refcount, times reused)``, (-1, ...) past the last block); trace 1
    marks owned blocks that were reused (handed over from another request before); trace 2 marks
    shared blocks (refcount > 1); trace 3 is the legend entry of cached-free blocks; trace 4 marks held
    blocks that their request found in the prefix cache instead of computing them.
    """
    L = {**LABELS_EN, **(labels or {})}
    fig = go.Figure()
    if snap is None:
        fig.update_layout(height=height, margin={"l": 10, "r": 10, "t": 10, "b": 10})
        return fig
    colors = dict(colors) if colors is not None else default_colors([snap])
    n = snap.num_blocks
    cols = columns or block_grid_columns(n)
    rows = (n + cols - 1) // cols
    owners = snap.block_owners()
    z = [[None] * cols for _ in range(rows)]
    cd = [[(-1, "", 0, 0, 0)] * cols for _ in range(rows)]
    reused, shared, hits = ([], []), ([], []), ([], [])
    for b in range(n):
        r, c = divmod(b, cols)
        own = owners[b]
        if own:
            z[r][c] = colors.get(own[0], 0) % K
            state = ", ".join(own)
            if snap.block_reuses[b] > 0:
                reused[0].append(c), reused[1].append(r)
            if snap.block_refcount[b] > 1:
                shared[0].append(c), shared[1].append(r)
            if b in snap.cache_hit_blocks:
                hits[0].append(c), hits[1].append(r)
        elif b in snap.cached_blocks:
            z[r][c] = CACHED_CODE
            state = L["cached"]
        else:
            z[r][c] = FREE_CODE
            state = L["free"]
        cd[r][c] = (b, state, snap.block_tokens[b], snap.block_refcount[b], snap.block_reuses[b])
    hover = (f"{L['block']} <b>%{{customdata[0]}}</b><br>{L['owner']}: <b>%{{customdata[1]}}</b><br>"
             f"{L['filled']}: %{{customdata[2]}}<br>{L['refcount']}: %{{customdata[3]}}<br>"
             f"{L['reused']}: %{{customdata[4]}}<extra></extra>")
    fig.add_trace(go.Heatmap(
        z=z, customdata=cd, hovertemplate=hover, colorscale=COLORSCALE, showscale=False, xgap=1, ygap=1,
        hoverongaps=True, name="blocks", **_ZRANGE,
    ))
    fig.add_trace(go.Scatter(
        x=reused[0], y=reused[1], mode="markers", name=L["reused_marker"], hoverinfo="skip",
        marker={"symbol": "circle", "size": 4, "color": "white", "line": {"color": "black", "width": 0.5}},
    ))
    fig.add_trace(go.Scatter(
        x=shared[0], y=shared[1], mode="markers", name=L["shared"], hoverinfo="skip",
        marker={"symbol": "diamond-open", "size": 8, "color": "black"},
    ))
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=L["cached"], hoverinfo="skip",
                             marker={"symbol": "square", "size": 10, "color": CACHED_COLOR}))
    fig.add_trace(go.Scatter(
        x=hits[0], y=hits[1], mode="markers", name=L["cache_hit"], hoverinfo="skip",
        marker={"symbol": "star", "size": 7, "color": "gold", "line": {"color": "black", "width": 0.5}},
    ))
    fig.update_layout(
        height=height, margin={"l": 40, "r": 10, "t": 34, "b": 30}, plot_bgcolor=GRID_COLOR,
        legend={"orientation": "h", "y": -0.08, "x": 0}, uirevision="blocks",
    )
    fig.update_xaxes(showgrid=False, zeroline=False, showticklabels=False, range=[-0.5, cols - 0.5])
    every = max(1, rows // 8)
    fig.update_yaxes(title_text=L["block"], range=[rows - 0.5, -0.5], showgrid=False, zeroline=False,
                     tickvals=list(range(0, rows, every)), ticktext=[str(r * cols) for r in range(0, rows, every)])
    return fig


def rates_figure(snapshots: Sequence[StepSnapshot], labels: Mapping[str, str] | None = None,
                 height: int = 220) -> go.Figure:
    """Running and waiting requests (left axis) and KV usage % (right axis) per engine step."""
    L = {**LABELS_EN, **(labels or {})}
    x = [s.step for s in snapshots]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=x, y=[s.num_running for s in snapshots], name=L["running"], mode="lines"))
    fig.add_trace(go.Scatter(x=x, y=[s.num_waiting for s in snapshots], name=L["waiting"], mode="lines"))
    fig.add_trace(go.Scatter(x=x, y=[round(100 * s.kv_usage, 1) for s in snapshots], name=L["kv"],
                             mode="lines", yaxis="y2", line={"dash": "dot"}))
    fig.update_layout(
        height=height, margin={"l": 40, "r": 45, "t": 30, "b": 30}, plot_bgcolor="white",
        legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0}, uirevision="rates",
        yaxis={"rangemode": "tozero", "gridcolor": "#eee"},
        yaxis2={"overlaying": "y", "side": "right", "range": [0, 100], "dtick": 25, "showgrid": False,
                "tickmode": "linear", "ticksuffix": "%"},
        xaxis={"title": {"text": L["step"]}},
    )
    return fig


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def counter_values(stats: Mapping[str, object]) -> dict[str, str]:
    """Formatted counters from :meth:`Telemetry.stats` (units are universal, so no translation)."""
    return {
        "running": str(stats.get("running", 0)),
        "waiting": str(stats.get("waiting", 0)),
        "kv_usage": f"{100 * float(stats.get('kv_usage', 0.0)):.1f} %",
        "tokens_per_s": f"{float(stats.get('tokens_per_s', 0.0)):.1f} tok/s",
        "ttft": f"{_ms(stats.get('ttft_p50'))} / {_ms(stats.get('ttft_p90'))}",
        "tpot": f"{_ms(stats.get('tpot_p50'))} / {_ms(stats.get('tpot_p90'))}",
        "totals": f"{stats.get('generated_tokens', 0)} tok · {stats.get('steps', 0)} steps · "
                  f"{stats.get('preemptions', 0)} preempt.",
        "prefix_cache": _hit_rate(stats),
    }


def _hit_rate(stats: Mapping[str, object]) -> str:
    rate = stats.get("prefix_hit_rate")
    if rate is None:
        return "-"
    return f"{100 * float(rate):.0f} % hit · {stats.get('prefill_tokens_saved', 0)} tok saved"
