"""Request colours of the live panels: a palette of named colours, the heatmap's colour codes, and the
assignment of colours and letters to requests that keeps the requests on screen at once apart.

Every colour has a name a presenter can say aloud ("the teal request"): :data:`PALETTE_NAMES`,
:func:`color_name`; with its letter a request is "teal D" (:func:`request_label`). tests/test_ui_palette.py
checks that all its colours, their light (prefill) shades, grey, white and the cached colour are far apart in
CIELAB (CIEDE2000), also as a washed-out projector shows them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import plotly.colors as pc

from engine import StepSnapshot

# (hex, English name, Korean name); the first ones are the most distinct, since requests take them first.
# Chosen by a search over sRGB for the largest smallest CIEDE2000 distance between any two colours, on a white
# screen and on a washed-out projector (25% ambient light added in linear RGB), and between each colour and the
# light (prefill) shades, grey, white and the grid (tests/test_ui_palette.py): olive, ochre, brown and gold, and
# purple and violet, of an earlier hand-picked palette were 7-10 apart on a projector, these at least 11.
_NAMED_COLORS: tuple[tuple[str, str, str], ...] = (
    ("#3C87FF", "blue", "파랑"),
    ("#FF870F", "orange", "주황"),
    ("#00B44B", "green", "초록"),
    ("#FF4B2D", "red", "빨강"),
    ("#965AFF", "violet", "보라"),
    ("#B48700", "gold", "금색"),
    ("#FF4BE1", "pink", "분홍"),
    ("#0FA596", "teal", "청록"),
    ("#3C3CA5", "indigo", "남색"),
    ("#A55A00", "brown", "갈색"),
    ("#96A51E", "olive", "올리브"),
    ("#871E3C", "maroon", "밤색"),
    ("#963C96", "plum", "자주"),
    ("#0087A5", "sea blue", "바다색"),
    ("#3C691E", "dark green", "진초록"),
    ("#E12D78", "rose", "장미색"),
)
PALETTE: tuple[str, ...] = tuple(c for c, _, _ in _NAMED_COLORS)  # request colours (hex), 16
PALETTE_NAMES: dict[str, tuple[str, ...]] = {
    "en": tuple(en for _, en, _ in _NAMED_COLORS),
    "ko": tuple(ko for _, _, ko in _NAMED_COLORS),
}
K = len(PALETTE)
IDLE_CODE = 2 * K  # slot held by a request but not computed in this step
CACHED_CODE = 2 * K + 1  # free block still holding a cached prefix
FREE_CODE = 2 * K + 2  # free block (drawn blank)
IDLE_COLOR = "#9E9E9E"
CACHED_COLOR = "#B0BCCC"  # pale blue-grey: clearly darker than the grid lines and than white
FREE_COLOR = "#FFFFFF"
GRID_COLOR = "#E6E6E6"  # plot background seen through the gaps between cells (and in cells past the pool)
OUTSIDE_MARK_COLOR = "#A6A6A6"  # the faint "x" of a grid cell past the last block
MINE_COLOR = "#111111"  # outline of "your request"

def color_name(index: int, lang: str = "en") -> str:
    """The spoken name of palette colour ``index`` (taken modulo ``len(PALETTE)``), e.g. ``"teal"``.

    Args:
        index: a palette index, as given by :class:`ColorAssigner` or :func:`default_colors`.
        lang: ``"en"`` or ``"ko"``; any other language gets the English name.
    """
    return PALETTE_NAMES.get(lang, PALETTE_NAMES["en"])[index % K]


def light_shade(hex_color: str, amount: float = 0.55) -> str:
    """The colour moved ``amount`` of the way to white (used for prefill cells)."""
    rgb = pc.hex_to_rgb(hex_color)
    return pc.label_rgb(pc.find_intermediate_color(rgb, (255, 255, 255), amount))


def _code_colorscale() -> list[list]:
    """A stepwise colorscale: code v (0..FREE_CODE) gets one band of width 1 centred on v."""
    colors = list(PALETTE) + [light_shade(c) for c in PALETTE] + [IDLE_COLOR, CACHED_COLOR, FREE_COLOR]
    n = len(colors)
    scale = []
    for v, col in enumerate(colors):
        scale.append([v / n, col])
        scale.append([(v + 1) / n, col])
    return scale


COLORSCALE = _code_colorscale()
ZRANGE = {"zmin": -0.5, "zmax": FREE_CODE + 0.5}


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


LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def request_label(index: int, letter: str, lang: str = "en") -> str:
    """How the page names a request aloud: its colour's name and its letter, e.g. ``"teal D"``."""
    return f"{color_name(index, lang)} {letter}"


class ColorAssigner:
    """Stable request -> palette index and letter across refreshes, never reusing a colour held by a live request.

    A new request gets the palette index unused for the longest time among those not held by a request
    seen in the latest update (the window drawn), so the requests on screen at once have distinct colours
    as long as there are at most ``len(PALETTE)`` of them. With more, it takes a colour not held by a
    request of the newest step drawn (that step holds at most ``max_num_seqs`` requests with slots or
    blocks), so two requests that run at the same step never share a colour while ``max_num_seqs <=
    len(PALETTE)``. Letters go A, B, ... Z, A, ... in the order requests get their colour, so the panels and
    every line can name a request "teal D". :meth:`reserve` gives a request its colour before it is drawn
    (a chat's status line names it while the request still waits); a reserved colour counts as held until
    the request shows up in an update.
    """

    def __init__(self, memory: int = 4096) -> None:
        self._index: dict[str, int] = {}
        self._letter: dict[str, str] = {}
        self._count = 0  # requests given a colour so far (the next letter)
        self._last_used = [0] * K
        self._tick = itertools.count(1)
        self._memory = memory
        self._reserved: dict[str, None] = {}  # given a colour before being drawn, oldest first
        self._on_screen: set[int] = set()  # colours of the requests in the latest update
        self._current: set[int] = set()  # colours of the requests in the newest step of the latest update

    def _pick(self, live: set[int], current: set[int] | None = None) -> int:
        free = ([i for i in range(K) if i not in live] or [i for i in range(K) if i not in (current or set())]
                or list(range(K)))
        return min(free, key=lambda i: self._last_used[i])

    def _give(self, request_id: str, index: int) -> None:
        self._index[request_id] = index
        self._letter[request_id] = LETTERS[self._count % len(LETTERS)]
        self._count += 1

    def reserve(self, request_id: str) -> int:
        """The palette index of ``request_id``, given now if it has none (its colour is then kept for it: it
        counts as held by a live request until the request is drawn; at most 64 reservations are kept)."""
        if request_id in self._index:
            return self._index[request_id]
        idx = self._pick(self._on_screen | {self._index[r] for r in self._reserved},
                         self._current | {self._index[r] for r in self._reserved})
        self._give(request_id, idx)
        self._last_used[idx] = next(self._tick)
        self._reserved[request_id] = None
        while len(self._reserved) > 64:
            self._reserved.pop(next(iter(self._reserved)))
        return idx

    def update(self, snapshots: Sequence[StepSnapshot]) -> dict[str, int]:
        """Assign colours to the requests in ``snapshots``; return the mapping for all of them."""
        order = request_order(snapshots)
        newest = set(request_order(snapshots[-1:]))
        for rid in order:
            self._reserved.pop(rid, None)  # drawn now: an ordinary live request
        reserved = {self._index[r] for r in self._reserved}
        live = {self._index[r] for r in order if r in self._index} | reserved
        current = {self._index[r] for r in newest if r in self._index} | reserved
        for rid in order:
            if rid not in self._index:
                idx = self._pick(live, current)
                self._give(rid, idx)
                live.add(idx)
                if rid in newest:
                    current.add(idx)
            self._last_used[self._index[rid]] = next(self._tick)
        self._on_screen = {self._index[r] for r in order}
        self._current = {self._index[r] for r in newest}
        if len(self._index) > self._memory:  # forget the oldest entries (dicts keep insertion order)
            for rid in list(self._index)[: len(self._index) - self._memory // 2]:
                if rid not in order and rid not in self._reserved:
                    del self._index[rid]
                    self._letter.pop(rid, None)
        return {rid: self._index[rid] for rid in order}

    def index_of(self, request_id: str) -> int | None:
        """The palette index given to ``request_id`` by :meth:`update`, or None if it has none (yet)."""
        return self._index.get(request_id)

    def letter_of(self, request_id: str) -> str | None:
        """The letter given to ``request_id`` with its colour (A, B, ... Z, A, ...), or None if it has none."""
        return self._letter.get(request_id)

    def letters(self, request_ids) -> dict[str, str]:
        """Request id -> letter, for the ids that have one."""
        return {r: self._letter[r] for r in request_ids if r in self._letter}
