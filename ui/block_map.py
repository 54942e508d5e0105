"""The physical KV block map: one cell per block of the pool, in its owner's colour (pure functions of a
telemetry snapshot; re-exported by :mod:`ui.figures`). Pools over :data:`BLOCK_CELL_LIMIT` blocks are drawn
in tiles (:mod:`ui.block_tiles`)."""

from __future__ import annotations

from collections.abc import Mapping

import plotly.graph_objects as go

from engine import StepSnapshot
from ui.block_grid import (
    BLOCK_CELL_LIMIT,
    LETTER_MIN_PX,
    Points,
    _mark,
    block_grid_columns,
    block_grid_spec,
    grid_cell_px,
    outline_cells,
)
from ui.block_tiles import block_tiles_highlight, block_tiles_spec
from ui.figure_base import LABELS_EN, _figure, _spec, ink, origin_text
from ui.palette import CACHED_CODE, FREE_CODE, PALETTE, K, default_colors, request_label


def _block_grid(snap: StepSnapshot | None, columns: int | None, num_blocks: int | None) -> tuple[int, int, int]:
    """``(blocks, columns, rows)`` of the block map: the snapshot's pool size, else ``num_blocks``."""
    n = snap.num_blocks if snap is not None and snap.num_blocks else (num_blocks or 0)
    cols = columns or block_grid_columns(n)
    return n, cols, (n + cols - 1) // cols


def _namer(letters: Mapping[str, str] | None, colors: Mapping[str, int], lang: str):
    """request id -> ``"teal D (chat-1a2b)"`` when the request has a letter, else the id."""

    def name(rid: str) -> str:
        if letters and rid in letters and rid in colors:
            return f"{request_label(colors[rid], letters[rid], lang)} ({rid})"
        return rid

    return name


def block_map_spec(
    snap: StepSnapshot | None,
    colors: Mapping[str, int] | None = None,
    labels: Mapping[str, str] | None = None,
    columns: int | None = None,
    height: int = 330,
    num_blocks: int | None = None,
    letters: Mapping[str, str] | None = None,
    lang: str = "en",
) -> dict:
    """Physical KV block map as a plain figure spec (see :func:`block_map_figure` for the ``go.Figure``):
    one cell per block, colour = owning request, blank = free (over :data:`BLOCK_CELL_LIMIT`: ui/block_tiles.py).

    Block ``b`` sits at row ``b // columns``, column ``b % columns`` (x = column, y = row). Trace 0 is
    the heatmap (``z`` is the owner's palette index, :data:`CACHED_CODE` for a free cached block,
    :data:`FREE_CODE` for a free one, None past the last block; ``customdata`` holds ``(block id, owners
    (each "teal D (id)" when it has a letter, joined by ", ") or the free state, tokens filled, refcount,
    times reused, provenance)``, (-1, ...) past the last block); trace 1 marks owned blocks that were reused
    (handed over from another request before); trace 2 marks shared blocks (refcount > 1); trace 3 is the
    legend entry of cached-free blocks; trace 4 marks held blocks that their request found in the prefix
    cache instead of computing them; trace 5 marks with a faint "x" the grid cells past the last block ("not
    in the pool"), which show the grid colour; trace 6 marks with ▷ (in the left part of the cell) the blocks
    taken in this step (``snap.block_takes``), so a hand-over of blocks shows at the step it happens; trace 7
    is the fixed legend entry of "your request"; traces 8-11 (and 12 when cells lie past the pool) are the
    legend entries of the marks (the marker traces take none: a trace with no points drops out of the legend);
    the last trace (when ``letters`` is given and the cells are at least :data:`LETTER_MIN_PX` pixels) writes
    each owned block's request letter in it. ``customdata[5]`` is the
    held block's provenance (:func:`origin_text`: taken at step N, whose it was, the step it was freed).
    Markers and letters take no hover: the cell under them keeps its own. The legend's entries are the same
    at every step (fixed layout: :func:`ui.figure_base.fixed_legend`). The frame around the cells (marks,
    legend, axes) is :func:`ui.block_grid.block_grid_spec`.

    Args:
        snap: the step to draw, or None before the first step.
        colors: request id -> palette index (default: :func:`default_colors`).
        labels: translated texts (keys of :data:`LABELS_EN`).
        columns: grid columns (default: :func:`block_grid_columns`).
        height: figure height (pixels).
        num_blocks: pool size (blocks), used when ``snap`` is None: the whole pool is drawn free. With
            neither, the figure is blank (no traces).
        letters: request id -> letter drawn in its blocks and named in the hover (``ColorAssigner``).
        lang: language of the colour names in the hover.
    """
    L = {**LABELS_EN, **(labels or {})}
    n, cols, rows = _block_grid(snap, columns, num_blocks)
    if n > BLOCK_CELL_LIMIT:  # a large pool: one cell per tile of blocks (ui/block_tiles.py)
        return block_tiles_spec(snap, colors, labels, height, num_blocks)
    if n == 0:
        return _spec([], {"height": height, "margin": {"l": 10, "r": 10, "t": 10, "b": 10}})
    colors = dict(colors) if colors is not None else default_colors([snap] if snap is not None else [])
    lettered = bool(letters) and grid_cell_px(height, cols, rows) >= LETTER_MIN_PX
    z, cd, marks, text_at = _block_cells(snap, n, cols, colors, L, _namer(letters, colors, lang),
                                         letters if lettered else None)
    hover = (f"{L['block']} <b>%{{customdata[0]}}</b><br>{L['owner']}: <b>%{{customdata[1]}}</b><br>"
             f"{L['filled']}: %{{customdata[2]}}<br>{L['refcount']}: %{{customdata[3]}}<br>"
             f"{L['reused']}: %{{customdata[4]}}<br>%{{customdata[5]}}<extra></extra>")
    return block_grid_spec(n, cols, z, cd, hover, marks, L, height, lambda r: str(r * cols),
                           text_at if lettered else None)


def _block_cells(snap: StepSnapshot | None, n: int, cols: int, colors: Mapping[str, int], L: Mapping[str, str],
                 name, letters: Mapping[str, str] | None) -> tuple[list, list, list[Points], tuple[list, list, list, list]]:
    """The per-block map's cells: ``(z, customdata, marks, letters_at)`` of :func:`block_map_spec` (marks:
    reused, shared, prefix hit, taken; letters_at: x, y, letter and ink of the letters, when ``letters``)."""
    rows = (n + cols - 1) // cols
    if snap is not None:
        owners, tokens, refcount, reuses = snap.block_owners(), snap.block_tokens, snap.block_refcount, snap.block_reuses
        cached, hit_blocks = snap.cached_blocks, snap.cache_hit_blocks
        origins, taken_now = snap.block_origins, {t.block_id for t in snap.block_takes}
    else:
        owners, tokens, refcount, reuses = [[]] * n, (0,) * n, (0,) * n, (0,) * n
        cached, hit_blocks, origins, taken_now = frozenset(), frozenset(), {}, set()
    z: list[list[int | None]] = [[None] * cols for _ in range(rows)]
    cd = [[(-1, "", 0, 0, 0, "")] * cols for _ in range(rows)]
    marks: list[Points] = [([], []) for _ in range(4)]  # x and y of each marker trace
    reused, shared, hits, taken = marks
    text_at: tuple[list, list, list, list] = ([], [], [], [])  # x, y, letter, ink
    for b in range(n):
        r, c = divmod(b, cols)
        own = owners[b]
        if own:
            z[r][c] = colors.get(own[0], 0) % K
            state = ", ".join(name(o) for o in own)
            # markers sit in the cell's corners and its left part: its centre holds the request's letter
            if reuses[b] > 0:
                _mark(reused, c + 0.3, r - 0.25)
            if refcount[b] > 1:
                _mark(shared, c - 0.3, r + 0.25)
            if b in hit_blocks:
                _mark(hits, c + 0.3, r + 0.25)
            if b in taken_now:
                _mark(taken, c - 0.3, r)
            if letters and own[0] in letters:
                for lst, v in zip(text_at, (c, r, letters[own[0]], ink(PALETTE[colors.get(own[0], 0) % K]))):
                    lst.append(v)
        elif b in cached:
            z[r][c] = CACHED_CODE
            state = L["cached"]
        else:
            z[r][c] = FREE_CODE
            state = L["free"]
        cd[r][c] = (b, state, tokens[b], refcount[b], reuses[b], origin_text(origins.get(b), L, name) if own else "")
    return z, cd, marks, text_at


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
        return block_tiles_highlight(snap, request_id, labels, num_blocks)
    return outline_cells({b for b in snap.block_tables[request_id] if 0 <= b < n}, cols, L["mine"])

