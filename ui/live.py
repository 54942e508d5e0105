"""The page's live channel: panels, counters, pace line and the tab's streaming reply over short polls.

Why not Gradio events: a browser opens at most 6 HTTP/1.1 connections to one host, for all its tabs
together. Gradio holds one of them per tab for as long as any event of that tab runs (its event stream)
and, on a page with session state or unload events, one more for the tab's heartbeat. A streaming chat
reply and a panel timer therefore kept 1-2 connections per tab busy for good, and from the fourth to sixth
tab of one browser on, new events waited for a free connection: chats did not start and panels froze.

Here every tab asks ``GET <root>/cbp/live`` a few times a second (``ui/live.js``). Each answer is one short
request: a few hundred bytes when the engine made no step since the tab's last answer, else the figures
(built once per engine step for all tabs by :class:`ui.panels.Panels`, the tab's own request outlined on a
copy; Plotly's template is sent once per page, not with every figure), the counters, the pace and
load-generator lines, and the state and text of the reply the tab is streaming. No connection is held between
polls, so any number of tabs share the browser's six.

Every step drawn: while the engine is paused or in slow motion (at least :data:`EVERY_STEP_S` per step), a
tab that says which step it drew last (``after``) gets the figures of the next step (the window ending there,
built from the telemetry ring) and how many steps it is still behind; the page asks again at once and plays
the frames in order, so no step goes undrawn however slowly the browser draws. At full speed it gets the
newest step only. After Step (and Resume, run-to) the page's poll may ask the server to hold it (``wait``, at
most :data:`MAX_WAIT_S`) until the engine has made a step after ``after``, so the new step is sent the moment
it exists. A poll without a session (the page before its load event has named the tab) gets the default
view, so the first panel does not wait for Gradio's load event.

Gradio events remain for what a person does (send, stop, pause, step, sliders): each is short. A reply's
tokens reach the tab through the poll (:meth:`ui.chat.ChatHandlers.live_reply`); when it ends, the page
clicks a hidden button whose event writes the finished turn into the tab's ``gr.Chatbot``.

Closed tabs: the page sends ``POST <root>/cbp/bye`` (``navigator.sendBeacon``) when it is closed; a tab that
stops polling for :attr:`LiveChannel.lease_s` seconds without saying goodbye (a crashed browser) has its
reply aborted too. Per-tab view settings (steps shown, timeline pin, live on/off, host rights) live here,
keyed by Gradio's session hash, instead of in ``gr.State`` (which would open the heartbeat connection).
"""

from __future__ import annotations

import asyncio
import html
import json
import re
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, Response

from ui import figures as figures_module
from ui import talk
from ui.chat import ChatHandlers
from ui.i18n import EN, KO, PACE_TEXTS, state_text
from ui.loadgen import LoadGenerator
from ui.panel_table import FOLDED
from ui.panels import COUNTER_KEYS, PanelKey, Panels

if TYPE_CHECKING:
    from engine import AsyncEngine

LIVE_JS = Path(__file__).with_name("live.js")
_BOLD = re.compile(r"\*\*(.+?)\*\*")
_REF = re.compile("\x00(\\d+)\x00")
EVERY_STEP_S = 0.2  # slow motion of at least this many seconds per step: the page draws every step
MAX_BEHIND = 16  # a tab further behind than this many steps jumps to the newest one
MAX_WAIT_S = 1.0  # the longest a poll is held for a new step (one tab's poll, after a pacing click)


def pacing_line(engine: AsyncEngine, end: int | None, lang: str, name: Callable[[str], str] = str) -> str:
    """One Markdown line: the engine's pace (running / paused at step n / slow motion), what a run-to found
    (requests named by ``name``, default their ids) and, when the tab's panels are pinned on the timeline at
    step ``end``, which step they show."""
    L = PACE_TEXTS.get(lang, PACE_TEXTS["en"])
    step = engine.step_count
    line = L["paused" if engine.paused else "running"].format(step=step)
    line += talk.seek_text(engine, lang, name)
    slow = float(engine.min_step_time)
    if slow > 0:
        line += L["slow"].format(s=slow)
    if end is not None:
        line += L["pinned"].format(end=end, newest=step)
    return line


def markdown_line_html(text: str, refs: list[str] | None = None) -> str:
    """A one-line Markdown text (only ``**bold**``) as escaped HTML; with ``refs``, each ``"\x00i\x00"`` in the
    text becomes ``refs[i]`` as it is (HTML made by the caller, e.g. :meth:`ui.panels.Panels.request_html`)."""
    out = _BOLD.sub(r"<b>\1</b>", html.escape(text, quote=False))
    return _REF.sub(lambda m: refs[int(m.group(1))], out) if refs else out


@dataclass
class TabView:
    """One tab's view of the panels (what ``gr.State`` used to hold).

    Attributes:
        last_seen: ``time.monotonic()`` of the tab's latest poll (seconds).
        is_host: whether the tab may pace the engine and run the load generator.
        window: engine steps shown in the occupancy and rates panels.
        pin: the step the panels end at (None: follow the newest step).
        live: False while the tab's "live" box is unticked (figures are not sent).
    """

    last_seen: float
    is_host: bool
    window: int
    pin: int | None = None
    live: bool = True


class LiveChannel:
    """Serves ``/cbp/live`` (one JSON frame per poll), ``/cbp/bye`` and ``/cbp/live.js`` for one page.

    Args:
        engine: the process's ``AsyncEngine`` (``telemetry``, ``step_count``, ``paused``, ``min_step_time``).
        panels: the shared figure builder and cache.
        chat: the page's :class:`ui.chat.ChatHandlers` (streaming replies, aborts).
        loadgen: the page's :class:`ui.loadgen.LoadGenerator` (its status line).
        window: default steps shown.
        refresh_s: seconds between two polls of a visible tab (``--refresh``).
        lease_s: a tab silent for this long (seconds) is taken as closed: its reply is aborted.
    """

    def __init__(self, engine: AsyncEngine, panels: Panels, chat: ChatHandlers, loadgen: LoadGenerator,
                 window: int = 96, refresh_s: float = 0.2, lease_s: float = 90.0) -> None:
        self.engine = engine
        self.panels = panels
        self.chat = chat
        self.loadgen = loadgen
        self.window = int(window)
        self.refresh_s = float(refresh_s)
        self.lease_s = float(lease_s)
        self.tabs: dict[str, TabView] = {}
        self.polls = 0  # frames served (for tests and benchmarks)
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's event loop, once polled (benchmarks)

    # ------------------------------------------------------------------ per-tab view
    def open(self, session: str, is_host: bool) -> TabView:
        """Register (or refresh) the tab ``session`` at page load."""
        view = self.tabs.get(session)
        if view is None:
            view = self.tabs[session] = TabView(time.monotonic(), bool(is_host), self.window)
        view.is_host, view.last_seen = bool(is_host), time.monotonic()
        return view

    def view(self, session: str) -> TabView:
        """The tab's view (a default one, without host rights, for a session never opened)."""
        return self.tabs.get(session) or self.open(session, False)

    def is_host(self, session: str) -> bool:
        """Whether the tab may pace the engine (decided at page load from the host key)."""
        view = self.tabs.get(session)
        return bool(view and view.is_host)

    def bye(self, session: str) -> None:
        """The tab closed: abort what it streams (its KV blocks return to the pool) and forget it."""
        self.chat.forget(session)
        self.tabs.pop(session, None)

    def reap(self, now: float | None = None) -> list[str]:
        """Abort the replies of tabs silent for longer than :attr:`lease_s`; returns their sessions."""
        now = time.monotonic() if now is None else now
        gone = [s for s, v in self.tabs.items() if now - v.last_seen > self.lease_s]
        for session in gone:
            self.bye(session)
        return gone

    # ------------------------------------------------------------------ frames
    def _counters(self, lang: str) -> list[dict[str, str]]:
        labels = KO if lang == "ko" else EN
        return [{"key": k, "label": labels[k], "value": v}
                for k, v in zip(COUNTER_KEYS, self.panels.counters(lang))]

    def _newest_step(self) -> int:
        latest = self.engine.telemetry.latest()
        return latest.step if latest is not None else 0

    async def _wait_for_step(self, after: int, seconds: float) -> None:
        """Return once the telemetry holds a step after ``after``, or after ``seconds`` (at most MAX_WAIT_S)."""
        deadline = time.monotonic() + min(max(0.0, seconds), MAX_WAIT_S)
        while self._newest_step() <= after and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def _frame_end(self, view: TabView, after: int | None) -> tuple[int | None, bool]:
        """``(end, every)``: the step the figures end at (None: the newest) and whether the page plays every
        step (paused or slow motion while following live); then a tab that drew ``after`` gets the next step."""
        every = view.pin is None and (self.engine.paused or float(self.engine.min_step_time) >= EVERY_STEP_S)
        if not every or after is None:
            return view.pin, every
        snaps = self.engine.telemetry.snapshots()
        newest = snaps[-1].step if snaps else 0
        if after + 1 < newest and newest - after <= MAX_BEHIND and snaps[0].step <= after + 1:
            return after + 1, True
        return None, True

    def _names(self, lang: str) -> tuple[list[str], Callable[[str], str]]:
        """``(refs, name)``: ``name(request id)`` puts a placeholder in a Markdown line and the request's HTML
        (colour swatch, "teal D", the id on hover) in ``refs``, for :func:`markdown_line_html`."""
        refs: list[str] = []

        def name(rid: str) -> str:
            refs.append(self.panels.request_html(rid, lang))
            return f"\x00{len(refs) - 1}\x00"

        return refs, name

    async def frame(self, session: str, since: str | None, lang: str = "en", shown: Collection[str] = (),
                    figures: bool = True, after: int | None = None, wait: float = 0.0,
                    template: bool = False) -> str:
        """One poll's answer, as JSON text.

        Fields: ``key`` (what the figures show; the tab sends it back as ``since``), ``step`` (the engine's),
        ``drawn`` (the step the figures end at), ``behind`` (steps after ``drawn`` the tab has not been sent),
        ``every`` (the page plays every step: paused or slow motion), ``pace`` and ``mine`` (HTML lines; requests
        named by colour and letter, ids on hover), ``load`` (load-generator line), ``counters`` (``[{key,
        label, value}]``), ``chat`` (the tab's streaming reply: ``{rid, title, text, final}``, or null),
        ``refresh`` (seconds until the next poll), ``template`` (Plotly's layout template, when asked for:
        the figures are sent without it) and ``figs``: ``{panel name: Plotly figure}``, one per row of
        :data:`ui.panel_table.PANELS`, present only when ``key`` differs from ``since`` (a folded panel's
        figure only when its name is in ``shown``, the folded panels the tab shows; else null). ``figures=False`` (a hidden
        tab) sends and builds no figures. ``after`` is the last step the tab was sent; ``wait`` (seconds)
        holds the answer until the engine has made a step after it. An empty ``session`` is a tab not named
        yet: the default view, nothing of its own.
        """
        self.polls += 1
        view = self.view(session) if session else TabView(time.monotonic(), False, self.window)
        view.last_seen = time.monotonic()
        if wait and after is not None:
            await self._wait_for_step(after, wait)
        mine = self.chat.latest_request(session) if session else None
        refs, name = self._names(lang)
        out: dict[str, Any] = {
            "step": self.engine.step_count,
            "pace": markdown_line_html(pacing_line(self.engine, view.pin, lang, name), refs),
            "load": self.loadgen.status(lang),
            "counters": self._counters(lang),
            "chat": self.chat.live_reply(session, lang) if session else None,
            "refresh": self.refresh_s,
        }
        refs, name = self._names(lang)
        out["mine"] = (markdown_line_html(state_text(lang, "mine_panel", rid=mine, color=name(mine)), refs)
                       if mine and self.panels.color_name(mine, lang) else "")
        figs = None
        if view.live and figures:
            end, every = self._frame_end(view, after)
            key, plots = await self.panels.frame_plots(view.window, lang, mine=mine, end=end)
            drawn = PanelKey.step_of(key)
            out.update(key=key, drawn=drawn, every=every, behind=max(0, self._newest_step() - drawn) if every else 0)
            if key != since:
                figs = {name: plot if name not in FOLDED or name in shown else None for name, plot in plots.items()}
        else:
            out["key"] = since
        text = json.dumps(out, ensure_ascii=False)
        # the figures and the template are already JSON text, shared by every tab: spliced in, not parsed and
        # dumped again
        if template:
            text = text[:-1] + ',"template":' + figures_module.template_json() + "}"
        if figs is None:
            return text
        parts = ",".join(f'"{name}":{"null" if fig is None else fig}' for name, fig in figs.items())
        return text[:-1] + ',"figs":{' + parts + "}}"

    # ------------------------------------------------------------------ routes
    def router(self, lang_of: Callable[[Request], str]) -> APIRouter:
        """The routes, to include in the FastAPI app that serves the page. ``lang_of(request)`` gives the
        language ("en"/"ko") of a request."""
        router = APIRouter()
        reaper: list[asyncio.Task] = []

        async def reap_forever() -> None:
            while True:
                await asyncio.sleep(max(1.0, self.lease_s / 4))
                self.reap()

        @router.get("/cbp/live", include_in_schema=False)
        async def live(request: Request, session: str = "", since: str = "", shown: str = "",
                       figs: int = 1, after: int | None = None, wait: float = 0.0, template: int = 0) -> Response:
            if not reaper:  # started from the server's own loop, on the first poll
                self.loop = asyncio.get_running_loop()
                reaper.append(self.loop.create_task(reap_forever()))
            text = await self.frame(session, since or None, lang_of(request), set(shown.split(",")), bool(figs), after,
                                    wait, bool(template))
            return Response(text, media_type="application/json", headers={"Cache-Control": "no-store"})

        @router.post("/cbp/bye", include_in_schema=False)
        async def bye(session: str = "") -> Response:
            if session:
                self.bye(session)
            return Response(status_code=204)

        @router.get("/cbp/live.js", include_in_schema=False)
        async def script() -> Response:
            return FileResponse(LIVE_JS, media_type="text/javascript", headers={"Cache-Control": "no-cache"})

        @router.get("/cbp/plotly.min.js", include_in_schema=False)
        async def plotly_js() -> Response:
            return FileResponse(_plotly_js_path(), media_type="text/javascript",
                                headers={"Cache-Control": "public, max-age=86400"})

        return router


PLOTLY_CARTESIAN = Path(__file__).with_name("static") / "plotly-cartesian.min.js"


def _plotly_js_path() -> Path:
    """plotly.js for the live panels, served by this app so the page draws with no network: plotly.js's
    cartesian partial bundle (``ui/static``, the version of the ``plotly`` package's own bundle; ready about a
    second sooner on a busy laptop), else the full bundle the ``plotly`` package ships."""
    if PLOTLY_CARTESIAN.exists():
        return PLOTLY_CARTESIAN
    import plotly

    return Path(plotly.__file__).with_name("package_data") / "plotly.min.js"


def head_html(refresh_s: float) -> str:
    """The ``<head>`` additions of the page: plotly.js and the live channel's script, both ``async``: they load
    and run while Gradio's own scripts load (not before them), and the script asks for its first frame at once."""
    return (f'<script src="cbp/plotly.min.js" async></script>'
            f'<script src="cbp/live.js" data-refresh="{float(refresh_s):g}" async></script>')
