"""The block map of a large KV pool: one cell per tile of consecutive blocks, an image-like heat map.

Up to :data:`CELL_LIMIT` blocks the map has one cell per block (:func:`ui.block_map.block_map_spec`, the
pools of talks). Above, the pool is cut into at most :data:`MAX_TILES` tiles of ``g`` consecutive blocks
(``g = ceil(num_blocks / MAX_TILES)``, 176 at 360,000 blocks), laid out 64 per row, so the figure's size is
bounded whatever the pool. A tile keeps what the per-block map shows, aggregated with numpy:

- colour: the request holding most of its blocks (full colour when it holds at least half the tile's
  blocks, its light shade when fewer), else pale blue-grey when a free block still holds a cached
  prefix, else white;
- markers, the same traces in the same order as the per-block map: a dot when a held block in it was
  reused, a diamond when one is shared, a star for prefix-cache hits, ▷ for blocks taken in the step;
- hover: the block range, its two largest holders with their block counts (and how many others), blocks
  held, cached-free, reused, shared, prefix hits and taken this step.

The tab's own request is outlined around the tiles that hold its blocks (:func:`block_tiles_highlight`). The
frame around the cells (marks, legend, axes) is the per-block map's, :func:`ui.block_grid.block_grid_spec`.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from engine import StepSnapshot
from ui.block_grid import BLOCK_CELL_LIMIT, Points, _mark, block_grid_spec, outline_cells
from ui.figure_base import LABELS_EN
from ui.palette import CACHED_CODE, FREE_CODE, K, default_colors

CELL_LIMIT = BLOCK_CELL_LIMIT  # blocks: up to this many, one cell per block
MAX_TILES = 2048  # cells of a tiled map (64 columns x 32 rows)
TILE_COLUMNS = 64
NAME_CHARS = 20  # a request id in a tile's hover is cut to this many characters

TILE_LABELS_KO = {  # the English ones are in ui.figure_base.LABELS_EN
    "tile_fmt": "1칸 = 블록 {g}개", "held": "사용 중", "cached_short": "캐시된 빈 블록", "others_fmt": " 외 {n}개",
    "reused_short": "재사용",
}


def tile_size(num_blocks: int) -> int:
    """Blocks per cell of the map of a pool of ``num_blocks`` blocks (1 up to :data:`CELL_LIMIT`)."""
    return 1 if num_blocks <= CELL_LIMIT else -(-num_blocks // MAX_TILES)


def _per_tile(mask: np.ndarray, tiles: int, g: int) -> np.ndarray:
    """Per tile, how many of its blocks ``mask`` holds (``mask``: bool per block)."""
    padded = np.zeros(tiles * g, bool)
    padded[: len(mask)] = mask
    return padded.reshape(tiles, g).sum(axis=1)


def _top_owners(owner: np.ndarray, g: int, tiles: int) -> tuple[np.ndarray, ...]:
    """Per tile: the owner index holding most blocks and its count, the second and its count (-1 / 0 when
    none), and the number of distinct owners."""
    held = np.flatnonzero(owner >= 0)
    top1, top2 = np.full(tiles, -1), np.full(tiles, -1)
    n1, n2, distinct = np.zeros(tiles, int), np.zeros(tiles, int), np.zeros(tiles, int)
    if len(held):
        r = int(owner.max()) + 1
        pairs, counts = np.unique((held // g) * r + owner[held], return_counts=True)
        tile, who = pairs // r, pairs % r
        order = np.lexsort((-counts, tile))  # by tile, then most blocks first
        tile, who, counts = tile[order], who[order], counts[order]
        starts = np.flatnonzero(np.r_[True, tile[1:] != tile[:-1]])
        ends = np.r_[starts[1:], len(tile)]
        t = tile[starts]
        top1[t], n1[t], distinct[t] = who[starts], counts[starts], ends - starts
        second = starts[(ends - starts) > 1] + 1
        top2[tile[second]], n2[tile[second]] = who[second], counts[second]
    return top1, n1, top2, n2, distinct


def block_tiles_spec(snap: StepSnapshot | None, colors: Mapping[str, int] | None = None,
                     labels: Mapping[str, str] | None = None, height: int = 330, num_blocks: int | None = None) -> dict:
    """The tiled block map as a plain figure spec (traces as :func:`ui.block_map.block_map_spec`'s: 0 the heat
    map, 1 reused, 2 shared, 3 the cached legend entry, 4 prefix hits, 5 cells past the pool, 6 taken ▷).

    Tile ``i`` holds blocks ``[i * g, (i + 1) * g)`` and sits at row ``i // 64``, column ``i % 64``;
    ``customdata`` per cell: ``(first block, last block, holders text, held, cached-free, reused, shared,
    prefix hits, taken this step)``.

    Args:
        snap: the step to draw, or None before the first step (then ``num_blocks`` free blocks).
        colors: request id -> palette index (default: :func:`ui.palette.default_colors`).
        labels: translated texts (keys of :data:`ui.figure_base.LABELS_EN`).
        height: figure height (pixels).
        num_blocks: pool size when ``snap`` is None.
    """
    L = {**LABELS_EN, **(labels or {})}
    n = snap.num_blocks if snap is not None else (num_blocks or 0)
    g = tile_size(n)
    tiles = -(-n // g)
    cols = TILE_COLUMNS
    rows = -(-tiles // cols)
    colors = dict(colors) if colors is not None else default_colors([snap] if snap is not None else [])
    if snap is not None:
        a = snap.block_arrays()
        held, owner, ids = a.refcount > 0, a.owner, a.owner_ids
        taken = np.zeros(n, bool)
        taken[[t.block_id for t in snap.block_takes if 0 <= t.block_id < n]] = True
        counts = [_per_tile(m, tiles, g) for m in (held, a.cached, held & (a.reuses > 0), a.refcount > 1, a.hit, taken)]
    else:
        owner, ids = np.full(n, -1), []
        counts = [np.zeros(tiles, int)] * 6
    used, cached, reused, shared, hits, took = counts
    top1, n1, top2, n2, distinct = _top_owners(owner, g, tiles)
    size = np.minimum(g, n - np.arange(tiles) * g)
    z: list[list[int | None]] = [[None] * cols for _ in range(rows)]
    cd: list[list] = [[(-1, -1, "", 0, 0, 0, 0, 0, 0)] * cols for _ in range(rows)]
    marks: list[Points] = [([], []) for _ in range(4)]
    for i in range(tiles):
        r, c = divmod(i, cols)
        if used[i]:
            rid = ids[top1[i]]
            z[r][c] = colors.get(rid, 0) % K + (0 if 2 * used[i] >= size[i] else K)
            text = f"{rid[:NAME_CHARS]} {n1[i]}"
            if top2[i] >= 0:
                text += f", {ids[top2[i]][:NAME_CHARS]} {n2[i]}"
            if distinct[i] > 2:
                text += L["others_fmt"].format(n=distinct[i] - 2)
        elif cached[i]:
            z[r][c], text = CACHED_CODE, L["cached"]
        else:
            z[r][c], text = FREE_CODE, L["free"]
        first = i * g
        cd[r][c] = (first, first + int(size[i]) - 1, text, int(used[i]), int(cached[i]), int(reused[i]),
                    int(shared[i]), int(hits[i]), int(took[i]))
        for k, count in enumerate((reused[i], shared[i], hits[i], took[i])):
            if count:
                _mark(marks[k], c - 0.3 if k == 3 else c, r)
    hover = (f"{L['block']} <b>%{{customdata[0]}}–%{{customdata[1]}}</b><br>{L['owner']}: <b>%{{customdata[2]}}</b><br>"
             f"{L['held']}: %{{customdata[3]}} · {L['cached_short']}: %{{customdata[4]}}<br>{L['reused_short']}: "
             f"%{{customdata[5]}} · {L['shared']}: %{{customdata[6]}} · {L['cache_hit']}: %{{customdata[7]}}<br>"
             f"{L['taken_marker']}: %{{customdata[8]}}<extra></extra>")
    spec = block_grid_spec(tiles, cols, z, cd, hover, marks, L, height, lambda r: f"{r * cols * g:,}")
    layout = spec["layout"]
    layout["title"] = {"text": L["tile_fmt"].format(g=g), "font": {"size": 12}, "x": 0.01, "y": 0.98}
    layout["margin"] = {**layout["margin"], "t": 30}  # room for that title
    return spec


def block_tiles_highlight(snap: StepSnapshot | None, request_id: str, labels: Mapping[str, str] | None = None,
                          num_blocks: int | None = None):
    """An outline around the tiles holding blocks of ``request_id`` in :func:`block_tiles_spec` (a
    ``go.Scatter``; None when the request holds no block)."""
    if snap is None or not snap.block_tables.get(request_id):
        return None
    L = {**LABELS_EN, **(labels or {})}
    n = snap.num_blocks
    g = tile_size(n)
    return outline_cells({b // g for b in snap.block_tables[request_id] if 0 <= b < n}, TILE_COLUMNS, L["mine"])
