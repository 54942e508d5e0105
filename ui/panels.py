"""The live panels' data: figures built from telemetry at most a few times a second, shared by all tabs.

Every tab polls for the panels a few times a second (:mod:`ui.live`). Figures are built only when the
engine has made a new step (or the tab looks at another part of the timeline), at most ``max_builds_per_s``
times a second (``asyncio-throttle``), in a worker thread so the event loop keeps serving, and serialised
to JSON once for all tabs. A tab that already has the newest figures gets none. A tab whose own request is
on screen gets a copy with one extra trace that outlines that request (the shared JSON plus the outline;
nothing else is rebuilt).

The timeline: a tab may pin the panels at an earlier step still in the telemetry ring buffer (``end``);
the window then ends at that step and the block map shows the pool as it was after it. The same way, a tab
that plays every step (slow motion) is sent the window ending at each step in turn (:mod:`ui.live`).

The figures are serialised without Plotly's layout template: the page receives it once (``ui.live``).
Requests are named by colour and letter ("teal D", :meth:`Panels.label`), as the panels draw them.
"""

from __future__ import annotations

import asyncio
import html
import json
from typing import NamedTuple

from asyncio_throttle import Throttler
from gradio.components.plot import PlotData
from plotly.io.json import to_json_plotly

from engine import StepSnapshot, Telemetry
from ui import figures
from ui.i18n import figure_labels
from ui.panel_table import PANELS, PLOT_HEIGHT, FigureInputs

__all__ = ["COUNTER_KEYS", "PLOT_HEIGHT", "PanelKey", "Panels", "Plots"]
COUNTER_KEYS = ("running", "waiting", "kv_usage", "tokens_per_s", "ttft", "tpot", "totals", "prefix_cache")


class PanelKey(NamedTuple):
    """What a set of panel figures shows; equal keys mean equal figures.

    Attributes:
        step: the last engine step drawn (0 before the first step).
        window: engine steps shown.
        lang: figure language (``"en"`` or ``"ko"``).
        end: the step the tab pinned the window at (None: following the newest step).
        version: ``Telemetry.version`` when drawn (it changes whenever the newest snapshot does).
        mine: the request outlined in the figures (None: none).
    """

    step: int
    window: int
    lang: str
    end: int | None
    version: int
    mine: str | None = None

    def text(self) -> str:
        """The key as the page receives it (and sends back as ``since``): the fields as a tuple's repr,
        ``mine`` only when set, e.g. ``"(2, 96, 'en', None, 5)"`` or ``"(2, 96, 'en', None, 5, 'chat-1')"``."""
        return repr(tuple(self) if self.mine is not None else tuple(self)[:-1])

    @staticmethod
    def step_of(text: str) -> int:
        """The last step drawn, from a key's :meth:`text`."""
        return int(text.lstrip("(").split(",", 1)[0])


Plots = dict[str, PlotData]  # panel name (ui.panel_table.PANELS) -> its serialised figure


def _plot_data(spec: dict) -> PlotData:
    return PlotData(type="plotly", plot=figures.spec_json(spec, template=False))


def _with_trace(plot: PlotData, trace) -> PlotData:
    """A copy of a serialised figure with ``trace`` (a plotly trace) appended. Spliced into the JSON text
    (``{"data":[...],"layout":...}`` as plotly writes it: ``],"layout":`` cannot occur inside a JSON
    string) rather than parsed and written again, since every tab with a request on screen needs one."""
    text = plot.plot
    extra = to_json_plotly(trace.to_plotly_json())
    head, cut = '{"data":[', text.find('],"layout":')
    if not text.startswith(head) or cut < 0:  # another writer's layout: the slow, general way
        data = json.loads(text)
        data.setdefault("data", []).append(trace.to_plotly_json())
        return PlotData(type="plotly", plot=json.dumps(data, default=str))
    return PlotData(type="plotly", plot=text[:cut] + ("," if cut > len(head) else "") + extra + text[cut:])


class Panels:
    """Builds and caches the panel figures of one engine's telemetry.

    Args:
        telemetry: the engine's :class:`engine.telemetry.Telemetry` (read only).
        max_builds_per_s: most figure builds per second, whatever the number of tabs.
        num_slots: batch slots (``max_num_seqs``), to draw the empty slots before the first step.
        num_blocks: KV blocks in the pool, to draw the free pool before the first step.
    """

    def __init__(self, telemetry: Telemetry, max_builds_per_s: float = 4.0, num_slots: int | None = None,
                 num_blocks: int | None = None) -> None:
        self.telemetry = telemetry
        self.num_slots = num_slots
        self.num_blocks = num_blocks
        self.colors = figures.ColorAssigner()
        # one build per 1/max_builds_per_s seconds: evenly spaced, no bursts
        self.throttler = Throttler(rate_limit=1, period=1.0 / max_builds_per_s)
        self._lock: asyncio.Lock | None = None
        # (window, lang, end) -> (key, what was drawn from, serialised plots); a few variants, so tabs in two
        # languages or at two points of the timeline don't thrash
        self._cache: dict[tuple[int, str, int | None], tuple[PanelKey, FigureInputs, Plots]] = {}
        self._mine: dict[PanelKey, Plots] = {}  # key with ``mine`` -> the plots with that request outlined
        self.builds = 0

    def rebind(self, telemetry: Telemetry, num_slots: int | None = None, num_blocks: int | None = None) -> None:
        """Draw another telemetry from now on (an engine restarted with new settings,
        ``AsyncEngine.reconfigure``): cached figures are dropped, colours and letters start afresh."""
        self.telemetry, self.num_slots, self.num_blocks = telemetry, num_slots, num_blocks
        self.colors = figures.ColorAssigner()
        self._cache.clear()
        self._mine.clear()

    def _window(self, window: int, end: int | None, margin: bool = False) -> list[StepSnapshot]:
        """The steps drawn; with ``margin``, a pinned last step is at least the second oldest kept, so that
        one step recorded while drawing cannot push it out of the ring (large pools rebuild its blocks)."""
        snaps = self.telemetry.snapshots()
        if end is not None:
            if margin and len(snaps) > 1:
                end = max(end, snaps[1].step)
            snaps = [s for s in snaps if s.step <= end] or snaps[:1]
        return snaps[-window:]

    def _build(self, window: int, lang: str, end: int | None) -> tuple[PanelKey, FigureInputs, dict[str, dict]]:
        for attempt in range(3):
            try:
                return self._build_once(window, lang, end, margin=attempt > 0)
            except LookupError:  # the drawn step left the telemetry ring while drawing (large pools): again
                continue
        return self._build_once(window, lang, end, margin=True)

    def _build_once(self, window: int, lang: str, end: int | None,
                    margin: bool = False) -> tuple[PanelKey, FigureInputs, dict[str, dict]]:
        version = self.telemetry.version
        snaps = self._window(window, end, margin)
        colors = self.colors.update(snaps)
        inputs = FigureInputs(snaps, colors, self.colors.letters(colors), figure_labels(lang), lang, window,
                              self.num_slots, self.num_blocks)
        key = PanelKey(snaps[-1].step if snaps else 0, window, lang, end, version)
        return key, inputs, {p.name: p.build(inputs) for p in PANELS}

    def _build_serialised(self, window: int, lang: str, end: int | None) -> tuple[PanelKey, FigureInputs, Plots]:
        key, inputs, specs = self._build(window, lang, end)
        return key, inputs, {name: _plot_data(spec) for name, spec in specs.items()}

    async def plots(self, window: int, lang: str, end: int | None = None) -> tuple[PanelKey, FigureInputs, Plots]:
        """``(key, what was drawn from, {panel name: figure})`` (one figure per row of
        :data:`ui.panel_table.PANELS`), rebuilt only if the picture changed.

        Args:
            window: steps shown.
            lang: figure language.
            end: pin the window's last step (None: follow the newest step).
        """
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            cached = self._cache.get((window, lang, end))
            if cached is None or (end is None and cached[0].version != self.telemetry.version):
                async with self.throttler:
                    cached = await asyncio.to_thread(self._build_serialised, window, lang, end)
                    self.builds += 1
                self._cache.pop((window, lang, end), None)
                self._cache[(window, lang, end)] = cached
                while len(self._cache) > 8:
                    self._cache.pop(next(iter(self._cache)))
            return cached

    def color_name(self, request_id: str, lang: str = "en", reserve: bool = False) -> str | None:
        """The name of ``request_id``'s colour in the panels (None until it has been drawn, unless ``reserve``:
        then a request not drawn yet, e.g. queued, is given its colour now)."""
        index = self.colors.reserve(request_id) if reserve else self.colors.index_of(request_id)
        return None if index is None else figures.color_name(index, lang)

    def label(self, request_id: str, lang: str = "en") -> str:
        """How the panels name ``request_id``: colour and letter, e.g. ``"teal D"`` (given now if it has none
        yet, as :meth:`color_name` with ``reserve``)."""
        index = self.colors.reserve(request_id)
        return figures.request_label(index, self.colors.letter_of(request_id) or "?", lang)

    def request_html(self, request_id: str, lang: str = "en") -> str:
        """``request_id`` named for a line the room reads: a swatch of its colour and :meth:`label`, the id
        only on hover (``title``)."""
        index = self.colors.reserve(request_id)
        return (f'<span class="cbp-req" title="{html.escape(request_id)}"><i style="background:'
                f'{figures.PALETTE[index % figures.K]}"></i>{html.escape(self.label(request_id, lang))}</span>')

    async def _outlined(self, key: PanelKey, inputs: FigureInputs, plots: Plots, mine: str) -> Plots | None:
        """The plots of ``key`` with ``mine`` outlined in each panel that outlines (None when it is in none);
        ``key`` is the figures' key without ``mine``."""
        mine_key = key._replace(mine=mine)
        cached = self._mine.get(mine_key)
        if cached is None:
            traces = {p.name: p.outline(inputs, mine) for p in PANELS if p.outline is not None}
            traces = {name: trace for name, trace in traces.items() if trace is not None}
            if not traces:
                return None
            outlined: Plots = await asyncio.to_thread(
                lambda: {name: _with_trace(plot, traces[name]) if name in traces else plot
                         for name, plot in plots.items()})
            cached = self._mine[mine_key] = outlined
            while len(self._mine) > 64:
                self._mine.pop(next(iter(self._mine)))
        return cached

    def counters(self, lang: str = "en") -> tuple[str, ...]:
        """Counter strings in :data:`COUNTER_KEYS` order, from ``telemetry.stats()``, in ``lang``."""
        values = figures.counter_values(self.telemetry.stats(), figure_labels(lang))
        return tuple(values[k] for k in COUNTER_KEYS)

    async def frame_plots(self, window: int, lang: str, mine: str | None = None,
                          end: int | None = None) -> tuple[str, dict[str, str]]:
        """The figures a tab's poll shows: ``(key, {panel name: Plotly JSON text})``, one per row of
        :data:`ui.panel_table.PANELS`.

        ``key`` names what is drawn (:meth:`PanelKey.text` of the last step, window, language, pin, telemetry
        version, and the outlined request); equal keys mean equal figures, so a tab that already has them gets
        none. Figures are rebuilt only when the engine made a step (or ``window`` / ``end`` change), then shared
        by every tab.

        Args:
            window: steps shown.
            lang: figure language.
            mine: the tab's own request id, outlined in the panels that outline while it is on screen.
            end: pin the window's last step (None: follow the newest step).
        """
        key, inputs, plots = await self.plots(int(window), lang, end)
        if mine:
            outlined = await self._outlined(key, inputs, plots, mine)
            if outlined is not None:
                plots = outlined
                key = key._replace(mine=mine)
        return key.text(), {name: plot.plot for name, plot in plots.items()}
