"""Remote mode's panels, drawn from what a client can see (pure functions, no network or Gradio access):

- :func:`counters_html`: the per-engine counters read from each server's ``/metrics``;
- :func:`timeline_figure`: this page's requests as the client saw them (queued = sent until the first token, then
  decoding until the end), one row each, grouped by replica when a response header named it;
- :func:`kv_map_figure`: the KV blocks the servers' KV events told of, one row per block hash, grouped by prefix
  chain, from stored to removed.

Colours come from :mod:`ui.palette`: a request's colour (its light shade while queued), grey for removed blocks.
"""

from __future__ import annotations

import html
import textwrap
import time
import zlib
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

from ui.palette import IDLE_COLOR, PALETTE, light_shade
from ui.remote.client import RequestRecord
from ui.remote.kv import BlockRecord
from ui.remote.metrics import EngineCounters, Histogram, ScrapeResult

LAG_NOTE = ("Read from each server's /metrics about once a second. Running/waiting gauges lag by seconds (the "
            "server samples them); latencies are the server's histograms: p50 over the last 30 s of scrapes, and "
            "the mean since the server started.")
TIMELINE_NOTE = ("This page's requests as the client sees them (client clock): queued = sent until the first token "
                 "(network, the server's queue and prefill together), then decoding until the stream ended. The "
                 "replica is the one a response header named, else unknown. Other clients' requests are not shown.")
LIVE_COLOR, AGAIN_COLOR = PALETTE[0], PALETTE[1]
MARGIN = {"l": 110, "r": 20, "t": 30, "b": 40}


def _figure(traces: list[dict], layout: dict) -> go.Figure:
    return go.Figure({"data": traces, "layout": layout}, _validate=False)


def _fmt(value: float | None, fmt: str = "{:,.0f}", scale: float = 1.0) -> str:
    return "-" if value is None else fmt.format(value * scale)


def _ms(h: Histogram | None, q: float | None = 0.5) -> str:
    if h is None:
        return "-"
    v = h.mean if q is None else h.quantile(q)
    return "-" if v is None else (f"{v * 1000:.0f} ms" if v < 10 else f"{v:.1f} s")


def _latency(recent: Histogram | None, lifetime: Histogram | None) -> str:
    """p50 over the recent scrapes (else since start) · mean since start."""
    p50 = _ms(recent) if recent is not None and recent.count > 0 else _ms(lifetime)
    return f"{p50} · {_ms(lifetime, None)}"


COUNTER_ROWS = ("running", "waiting", "KV used", "prefix hit", "preempt.", "gen tok/s", "gen tokens", "prompt tokens",
                "TTFT p50 · mean", "ITL p50 · mean", "KV blocks")


def _column(e: EngineCounters) -> list[str]:
    """One engine's values, in :data:`COUNTER_ROWS` order."""
    blocks = "-" if e.num_gpu_blocks is None else (
        f"{e.num_gpu_blocks:,} x {e.block_size}" if e.block_size else f"{e.num_gpu_blocks:,}")
    return [_fmt(e.running), _fmt(e.waiting), _fmt(e.kv_usage, "{:.1f}%", 100), _fmt(e.hit_rate, "{:.1f}%", 100),
            _fmt(e.preemptions), _fmt(e.gen_throughput, "{:,.1f}"), _fmt(e.generation_tokens),
            _fmt(e.prompt_tokens), _latency(e.ttft_recent, e.ttft), _latency(e.itl_recent, e.itl), blocks]


def counters_html(results: Sequence[ScrapeResult]) -> str:
    """The counters table: one column per engine of each server (its URL, dialect and engine label on top),
    one row per counter, so that the table stays narrow for the usual one to four engines; a server that
    failed gets a line under the table with its error (what probably happened first).

    Args:
        results: the latest :meth:`ui.remote.metrics.MetricsScraper.scrape` results.
    """
    engines = [e for res in results for e in res.engines]
    errors = [f'<div class="cbp-error">{html.escape(res.url)}: not read: {html.escape(res.error)}</div>'
              for res in results if res.error and not res.engines]
    if engines:
        head = "<th></th>" + "".join(
            f'<th>{html.escape(e.url)} ({html.escape(e.dialect)})'
            f'{"<br>engine " + html.escape(e.engine) if e.engine else ""}</th>' for e in engines)
        columns = [_column(e) for e in engines]
        rows = "".join(f"<tr><th>{html.escape(name)}</th>" + "".join(f"<td>{html.escape(c[i])}</td>" for c in columns)
                       + "</tr>" for i, name in enumerate(COUNTER_ROWS))
        table = (f'<table id="remote-counters" class="cbp-remote-table"><thead><tr>{head}</tr></thead>'
                 f"<tbody>{rows}</tbody></table>")
    else:
        table = '<table id="remote-counters" class="cbp-remote-table"><tbody><tr><td>' + (
            "no server read" if errors else "not scraped yet") + "</td></tr></tbody></table>"
    return (f'<div class="cbp-counters-box">{table}</div>{"".join(errors)}'
            f'<div class="cbp-note">{html.escape(LAG_NOTE)}</div>')


def request_color(request_id: str) -> str:
    """A request's palette colour, the same for the same id on every refresh."""
    return PALETTE[zlib.crc32(request_id.encode()) % len(PALETTE)]


def timeline_figure(records: Sequence[RequestRecord], now: float, window_s: float = 120.0, max_rows: int = 48,
                    height: int | None = None) -> go.Figure:
    """This page's requests over the last ``window_s`` seconds (x: seconds before ``now``, client clock).

    Args:
        records: the request log (:meth:`ui.remote.client.RequestLog.records`).
        now: the figure's right edge (seconds since the epoch).
        window_s: seconds shown.
        max_rows: most requests drawn (the newest).
        height: figure height in pixels (default: 14 px a row, 260 to 760).
    """
    shown = [r for r in records if r.ended is None or r.ended >= now - window_s][-max_rows:]
    shown.sort(key=lambda r: (r.replica or "~", r.submitted))
    span = -min(window_s, max((now - min(r.submitted for r in shown) + 2) if shown else 10.0, 10.0))
    ys, labels = list(range(len(shown))), [f"{r.source} · {r.replica + ' · ' if r.replica else ''}{r.request_id[-8:]}"
                                          for r in shown]
    q_base, q_len, q_col, d_base, d_len, d_col, hover = [], [], [], [], [], [], []
    ends: dict[str, tuple[list, list]] = {"aborted": ([], []), "error": ([], [])}
    for y, r in zip(ys, shown):
        end = r.ended if r.ended is not None else now
        first = r.first_token if r.first_token is not None else end
        col = request_color(r.request_id)
        q_base.append(r.submitted - now)
        q_len.append(max(first - r.submitted, 0.0))
        q_col.append(light_shade(col))
        d_base.append(first - now)
        d_len.append(max(end - first, 0.0) if r.first_token is not None else 0.0)
        d_col.append(col)
        ttft = "-" if r.ttft is None else f"{r.ttft * 1000:.0f} ms"
        hover.append(f"{html.escape(r.request_id)} ({r.source})<br>replica: {html.escape(r.replica or 'unknown')}"
                     f"<br>status: {r.status}{' (' + r.finish_reason + ')' if r.finish_reason else ''}<br>"
                     f"first token after {ttft}<br>{end - r.submitted:.1f} s, {r.chunks} chunks"
                     + (f"<br>{html.escape(r.error)}" if r.error else ""))
        if r.status in ends and r.ended is not None:
            ends[r.status][0].append(r.ended - now)
            ends[r.status][1].append(y)
    traces: list[dict] = [
        dict(type="bar", orientation="h", y=ys, x=q_len, base=q_base, marker={"color": q_col}, name="queued",
             hovertext=hover, hoverinfo="text", width=0.8, showlegend=False),
        dict(type="bar", orientation="h", y=ys, x=d_len, base=d_base, marker={"color": d_col}, name="decoding",
             hovertext=hover, hoverinfo="text", width=0.8, showlegend=False),
    ]
    for name, color in (("queued (light shade)", light_shade(IDLE_COLOR)), ("decoding (full colour)", IDLE_COLOR)):
        traces.append(dict(type="scatter", mode="markers", x=[None], y=[None], name=name, hoverinfo="skip",
                           marker={"symbol": "square", "size": 10, "color": color}))
    for status, symbol, color in (("aborted", "x", "#111111"), ("error", "x", "#FA1531")):
        xs, yy = ends[status]
        traces.append(dict(type="scatter", mode="markers", x=xs, y=yy, name=status, hoverinfo="skip",
                           marker={"symbol": symbol, "size": 9, "color": color}, showlegend=bool(xs)))
    height = height or min(760, max(260, 90 + 14 * len(shown)))
    layout: dict[str, Any] = dict(
        height=height, margin=dict(MARGIN), plot_bgcolor="white", barmode="overlay", uirevision="remote-timeline",
        legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0},
        xaxis={"title": {"text": "seconds before now (client clock)"}, "range": [span, 0.5],
               "gridcolor": "#eee", "zeroline": False},
        yaxis={"tickvals": ys, "ticktext": labels, "range": [len(ys) - 0.5, -0.5] if ys else [0.5, -0.5],
               "showgrid": False, "automargin": True, "tickfont": {"size": 10}},
    )
    if not ys:
        layout["annotations"] = [{"text": "no request from this page yet", "showarrow": False, "x": span / 2,
                                  "y": 0, "font": {"color": IDLE_COLOR}}]
    return _figure(traces, layout)


def chain_order(records: Sequence[BlockRecord]) -> list[BlockRecord]:
    """``records`` grouped by prefix chain: each chain (the blocks reached from one first block by parent
    links) in the order of its first store, parents before children; blocks whose parent is unknown start their
    own chain."""
    by_key = {(r.source, r.medium, r.block_hash): r for r in records}
    children: dict[tuple, list[BlockRecord]] = {}
    roots = []
    for r in records:
        pk = (r.source, r.medium, r.parent)
        if r.parent is not None and pk in by_key and by_key[pk] is not r:
            children.setdefault(pk, []).append(r)
        else:
            roots.append(r)
    out, seen = [], set()
    for root in sorted(roots, key=lambda r: r.first_stored):
        stack = [root]
        while stack:
            r = stack.pop()
            k = (r.source, r.medium, r.block_hash)
            if k in seen:
                continue
            seen.add(k)
            out.append(r)
            stack.extend(sorted(children.get(k, []), key=lambda c: c.first_stored, reverse=True))
    out.extend(r for r in records if (r.source, r.medium, r.block_hash) not in seen)  # cycles, if any
    return out


def _annotation_text(text: str, width: int = 64) -> str:
    """``text`` for a Plotly annotation: wrapped into lines of about ``width`` characters (``<br>``), with no
    HTML escaping (Plotly shows entities such as ``&quot;`` as they are) and angle brackets replaced."""
    text = text.replace("<", "‹").replace(">", "›")
    return "<br>".join(textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False)) or text


def kv_map_figure(records: Sequence[BlockRecord], now: float | None = None, max_rows: int = 1500,
                  height: int = 420, off_reason: str | None = None, stale: Collection[str] = ()) -> go.Figure:
    """The KV map: one row per block hash (grouped by prefix chain), a line from its latest store to its removal
    (or to now), a faint line back to its first store when it was stored again; removed blocks grey, blocks
    stored again after a removal orange, blocks of a publisher whose server does not answer grey and dotted
    (as last seen). x: seconds before now, as the request timeline (the events' times are the publisher's clock).

    Args:
        records: :meth:`ui.remote.kv.KVMap.records`.
        now: the right edge (seconds since the epoch; default: ``time.time()``).
        max_rows: most blocks drawn (the most recently stored).
        height: figure height in pixels.
        off_reason: when given, an empty figure saying the map is off and why (wrapped over several lines).
        stale: sources (subscriber labels) whose server's ``/metrics`` fails: their blocks are drawn greyed.
    """
    layout: dict[str, Any] = dict(height=height, margin=dict(MARGIN, l=60), plot_bgcolor="white", uirevision="remote-kv",
                  legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0},
                  xaxis={"title": {"text": "seconds before now (event times: the publisher's clock)"},
                         "gridcolor": "#eee", "zeroline": False},
                  yaxis={"title": {"text": "block hashes, by prefix chain"}, "showticklabels": False,
                         "showgrid": False, "zeroline": False})
    if off_reason is not None or not records:
        layout["annotations"] = [{"text": _annotation_text(off_reason or "no KV event received yet"),
                                  "showarrow": False, "xref": "paper", "yref": "paper", "x": 0.5, "y": 0.5,
                                  "align": "left", "font": {"color": "#555"}}]
        layout["xaxis"] = {**layout["xaxis"], "visible": off_reason is None}
        layout["yaxis"] = {**layout["yaxis"], "visible": off_reason is None}
        return _figure([], layout)
    recent = sorted(records, key=lambda r: r.stored)[-max_rows:]
    rows = chain_order(recent)
    edge = time.time() if now is None else now
    lines: dict[str, tuple[list, list]] = {k: ([], []) for k in ("live", "removed", "again", "before", "stale")}
    pts_x, pts_y, pts_col, hover = [], [], [], []
    for y, r in enumerate(rows):
        kind = "removed" if r.removed is not None else ("again" if r.stored_again else "live")
        if r.source in stale and r.removed is None:
            kind = "stale"
        end = (r.removed if r.removed is not None else edge) - edge
        xs, ys = lines[kind]
        xs += [r.stored - edge, end, None]
        ys += [y, y, None]
        if r.store_count > 1 and r.first_stored < r.stored:
            bx, by = lines["before"]
            bx += [r.first_stored - edge, r.stored - edge, None]
            by += [y, y, None]
        pts_x.append(r.stored - edge)
        pts_y.append(y)
        pts_col.append({"live": LIVE_COLOR, "again": AGAIN_COLOR}.get(kind, IDLE_COLOR))
        parent = "none (first block)" if r.parent is None else f"{r.parent & 0xFFFFFFFFFFFFFFFF:016x}"
        hover.append(f"hash {r.block_hash & 0xFFFFFFFFFFFFFFFF:016x}<br>parent {parent}<br>chain position "
                     f"{r.depth}{'' if r.rooted else ' (the chain began before the events seen)'}<br>stored {r.store_count}x"
                     f"{f', again after removal {r.stored_again}x' if r.stored_again else ''}<br>"
                     f"{'removed' if r.removed is not None else 'stored'} · {html.escape(r.source)}"
                     f"{' · ' + r.medium if r.medium else ''}"
                     f"{' · its server does not answer: as last seen' if kind == 'stale' else ''}")
    traces: list[dict] = []
    for kind, name, color, width, dash in (
            ("before", "earlier store (stored again)", light_shade(AGAIN_COLOR), 1, "solid"),
            ("live", "stored", LIVE_COLOR, 2, "solid"), ("again", "stored again after removal", AGAIN_COLOR, 2, "solid"),
            ("removed", "removed", IDLE_COLOR, 2, "solid"),
            ("stale", "server not answering (as last seen)", light_shade(IDLE_COLOR), 2, "dot")):
        xs, ys = lines[kind]
        traces.append(dict(type="scatter", mode="lines", x=xs, y=ys, name=name, hoverinfo="skip",
                           line={"color": color, "width": width, "dash": dash}, showlegend=bool(xs)))
    traces.append(dict(type="scatter", mode="markers", x=pts_x, y=pts_y, name="stored at", showlegend=False,
                       marker={"size": 4, "color": pts_col}, hovertext=hover, hoverinfo="text"))
    layout["yaxis"] = {**layout["yaxis"], "range": [len(rows) - 0.5, -0.5]}
    return _figure(traces, layout)


SILENT_AFTER_S = 30.0  # a publisher that sent nothing for this long since the subscriber started is suspect


def publisher_lines(subscribers: Sequence[Any], server_errors: Mapping[str, str | None], now: float | None = None,
                    silent_after_s: float = SILENT_AFTER_S) -> tuple[list[str], set[str]]:
    """Each KV publisher's liveness, one markdown line each, and the labels of those greyed.

    A line says when its latest event came ("last event 12 s ago"), that none has come yet, or, after
    ``silent_after_s`` seconds without any, "nothing received: check --kv-events-url"; a subscriber's error is
    shown after a sentence. A publisher whose server's ``/metrics`` fails (``server_errors[label]``) is greyed
    (HTML class ``cbp-stale``) with that reason: what the map shows of it is as last seen.

    Args:
        subscribers: :class:`ui.remote.kv.KVSubscriber` (``endpoint``, ``label``, ``error``, ``started_at``,
            ``last_message_at``).
        server_errors: subscriber label -> the error of its server's latest scrape (None: it answered or unknown).
        now: ``time.time()`` (default: now).
        silent_after_s: seconds without any event after which the endpoint is questioned.
    """
    now = time.time() if now is None else now
    lines, stale = [], set()
    for sub in subscribers:
        name = f"`{sub.endpoint}`"
        if sub.error:
            line = (f"⚠️ {name}: the KV event subscriber stopped or a message failed: check --kv-events-url "
                    f"({sub.error})")
        elif sub.last_message_at is not None:
            line = f"{name}: last event {max(0.0, now - sub.last_message_at):,.0f} s ago"
        else:
            waited = max(0.0, now - (sub.started_at or now))
            line = (f"{name}: nothing received in {waited:,.0f} s: check --kv-events-url (the server's "
                    "--kv-events-config endpoint; vLLM publishes only with prefix caching on)"
                    if waited >= silent_after_s else f"{name}: no event yet ({waited:,.0f} s)")
        reason = server_errors.get(sub.label)
        if reason:
            stale.add(sub.label)
            line = (f'<span class="cbp-stale">{line} · its server\'s /metrics fails, so what the map shows of it '
                    f"is as last seen: {html.escape(reason)}</span>")
        lines.append(line)
    return lines, stale


def kv_summary(summary: dict[str, int], publishers: Sequence[str], block_size: int | None, not_exposed: str,
               as_last_seen: bool = False) -> str:
    """The KV map's caption (markdown): blocks now ("as last seen" when no publisher's server answers), totals,
    replay and gap counts, one liveness line per publisher (:func:`publisher_lines`), and what the events do not
    expose (``not_exposed``)."""
    s = summary
    lines = [f"**{s['live']:,}** blocks stored {'as last seen' if as_last_seen else 'now'} · {s['removed']:,} "
             f"removed (remembered) · {s['stored_again']:,} stored again after removal · {s['chains']:,} prefix "
             f"chains · block size {block_size or '?'} tokens",
             f"since start: {s['total_batches']:,} batches, {s['total_stored']:,} stores, {s['total_removed']:,} "
             f"removals, {s['total_cleared']} cache clears · {s['total_gaps']} sequence gaps, "
             f"{s['total_replayed']} messages replayed, {s['total_lost']} lost · {s['total_dropped']:,} old hashes "
             f"forgotten"]
    lines += list(publishers)
    lines.append(f"_{not_exposed}._")
    return "\n\n".join(lines)
