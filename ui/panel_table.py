"""The live panels, one row each: what a panel draws and where the page shows it.

Everything downstream reads this table: :class:`ui.panels.Panels` builds one figure per row from the same
telemetry window, :mod:`ui.live` sends them by name in each poll's frame, ``ui/live.js`` draws each figure
into the element of the same id, and the page (:func:`ui.page_markup.live_html`, :func:`ui.layout.panels_column`)
makes one element per row. A new panel is a figure builder (``ui/figures.py`` or a module of its own), a row
here and, if it is folded, its accordion title in ``ui/i18n.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine import StepSnapshot
from ui import figures

PLOT_HEIGHT = 280  # pixels: the pacing row and both panels fit one 1366x768 screen


@dataclass(frozen=True)
class FigureInputs:
    """What one build of every panel draws from.

    Attributes:
        snaps: the telemetry snapshots in the window, oldest first (empty before the first step).
        colors: request id -> palette index; letters: request id -> its letter.
        labels: the figure texts in the tab's language (:func:`ui.i18n.figure_labels`); lang: ``"en"``/``"ko"``.
        window: engine steps shown; num_slots, num_blocks: batch slots and KV blocks (None: from the snapshots).
    """

    snaps: Sequence[StepSnapshot]
    colors: Mapping[str, int]
    letters: Mapping[str, str]
    labels: Mapping[str, str]
    lang: str
    window: int
    num_slots: int | None
    num_blocks: int | None

    @property
    def last(self) -> StepSnapshot | None:
        """The newest snapshot drawn (None before the first step)."""
        return self.snaps[-1] if self.snaps else None


@dataclass(frozen=True)
class Panel:
    """One live panel.

    Attributes:
        name: the figure's name in a poll's frame (``figs[name]``) and the id of the element it is drawn in.
        build: the figure as a plain Plotly spec (``dict``) from the window's :class:`FigureInputs`.
        outline: a trace (or None) that outlines one request in the figure: a tab's own request is outlined
            while it is on screen; None: the panel outlines nothing.
        folded: the ``ui.i18n`` key of the closed accordion the panel sits in (its figure is sent to a tab only
            while the tab shows it); None: always on screen, in the live area.
    """

    name: str
    build: Callable[[FigureInputs], dict]
    outline: Callable[[FigureInputs, str], Any] | None = None
    folded: str | None = None


PANELS: tuple[Panel, ...] = (
    Panel("occupancy",
          lambda f: figures.occupancy_spec(f.snaps, f.colors, f.labels, num_slots=f.num_slots, window=f.window,
                                           height=PLOT_HEIGHT, letters=f.letters, lang=f.lang),
          outline=lambda f, mine: figures.occupancy_highlight(f.snaps, mine, f.labels)),
    Panel("blockmap",
          lambda f: figures.block_map_spec(f.last, f.colors, f.labels, num_blocks=f.num_blocks, height=PLOT_HEIGHT,
                                           letters=f.letters, lang=f.lang),
          outline=lambda f, mine: (figures.block_map_highlight(f.last, mine, f.labels, num_blocks=f.num_blocks)
                                   if f.last else None)),
    Panel("rates", lambda f: figures.rates_spec(f.snaps, f.labels), folded="rates"),
)
SHOWN = tuple(p.name for p in PANELS if p.folded is None)  # the panels of the live area, in its order
FOLDED = tuple(p.name for p in PANELS if p.folded is not None)  # sent only to a tab that shows them
