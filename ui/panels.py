"""The live panels' data: figures built from telemetry at most a few times a second, shared by all tabs.

Every tab's ``gr.Timer`` asks for the panels a few times a second. Figures are built only when the engine
has made a new step, at most ``max_builds_per_s`` times a second (``asyncio-throttle``), in a worker
thread so the event loop keeps streaming chats, and serialised once (Gradio's ``PlotData``) for all tabs.
A tab that already has the newest figures gets ``gr.skip()`` and nothing is sent.
"""

from __future__ import annotations

import asyncio
from typing import Any

import gradio as gr
from asyncio_throttle import Throttler
from gradio.components.plot import PlotData

from ui import figures
from ui.i18n import figure_labels

COUNTER_KEYS = ("running", "waiting", "kv_usage", "tokens_per_s", "ttft", "tpot", "totals", "prefix_cache")


def _plot_data(fig) -> PlotData:
    return PlotData(type="plotly", plot=fig.to_json())


class Panels:
    """Builds and caches the panel figures of one engine's telemetry.

    Args:
        telemetry: the engine's :class:`engine.telemetry.Telemetry` (read only).
        max_builds_per_s: most figure builds per second, whatever the number of tabs.
    """

    def __init__(self, telemetry: Any, max_builds_per_s: float = 2.0) -> None:
        self.telemetry = telemetry
        self.colors = figures.ColorAssigner()
        # one build per 1/max_builds_per_s seconds: evenly spaced, no bursts
        self.throttler = Throttler(rate_limit=1, period=1.0 / max_builds_per_s)
        self._lock: asyncio.Lock | None = None
        # (window, lang) -> (key, serialised plots); a few variants, so tabs in two languages don't thrash
        self._cache: dict[tuple, tuple[tuple, tuple[PlotData, PlotData, PlotData]]] = {}
        self.builds = 0

    def build(self, window: int, lang: str) -> tuple[tuple, tuple[Any, Any, Any]]:
        """Build the three figures now (any thread): returns ``(key, (occupancy, blocks, rates))``.

        ``key`` is ``(last step, window, lang)``; the figures are ``go.Figure`` objects.
        """
        snaps = self.telemetry.snapshots(window)
        labels = figure_labels(lang)
        colors = self.colors.update(snaps)
        last = snaps[-1] if snaps else None
        key = (last.step if last else 0, window, lang)
        figs = (
            figures.occupancy_figure(snaps, colors, labels),
            figures.block_map_figure(last, colors, labels),
            figures.rates_figure(snaps, labels),
        )
        return key, figs

    def _build_serialised(self, window: int, lang: str) -> tuple[tuple, tuple[PlotData, PlotData, PlotData]]:
        key, figs = self.build(window, lang)
        return key, tuple(_plot_data(f) for f in figs)  # type: ignore[return-value]

    async def plots(self, window: int, lang: str) -> tuple[tuple, tuple[PlotData, PlotData, PlotData]]:
        """The newest figures for ``window`` steps in ``lang``, rebuilt only if the engine moved on."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            latest = self.telemetry.latest()
            step = latest.step if latest else 0
            cached = self._cache.get((window, lang))
            if cached is None or cached[0][0] != step:
                async with self.throttler:
                    cached = await asyncio.to_thread(self._build_serialised, window, lang)
                    self.builds += 1
                self._cache.pop((window, lang), None)
                self._cache[(window, lang)] = cached
                while len(self._cache) > 8:
                    self._cache.pop(next(iter(self._cache)))
            return cached

    def counters(self) -> tuple[str, ...]:
        """Counter strings in :data:`COUNTER_KEYS` order, from ``telemetry.stats()``."""
        values = figures.counter_values(self.telemetry.stats())
        return tuple(values[k] for k in COUNTER_KEYS)

    async def refresh(self, window: float, seen: tuple | None, lang: str) -> tuple:
        """Outputs of one timer tick: three plots (or ``gr.skip()``), the counters, and the new ``seen``."""
        key, plots = await self.plots(int(window), lang)
        out_plots = (gr.skip(),) * 3 if seen is not None and tuple(seen) == key else plots
        return (*out_plots, *self.counters(), key)
