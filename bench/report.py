"""The benchmark's HTML report: Plotly figures built from the JSON-ready dict of ``python -m bench``.

Only the bench imports plotly for it: :mod:`bench.cli` imports this module only when ``--html`` is given.
``python -m bench.report results.json report.html`` rebuilds a report from a saved JSON.
"""

from __future__ import annotations

import html
import json
import sys
from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

COLORS = {"ours-continuous": "#1F77B4", "ours-static": "#9EC3E6", "hf-static": "#D62728", "hf-cb": "#FF7F0E"}
BASELINE = "hf-static"


def _color(system: str) -> str:
    return COLORS.get(system, "#7F7F7F")


def throughput_figure(results: Sequence[Mapping], title: str) -> go.Figure:
    """Bars of generated tokens/s per system (tokens/s), labelled with the multiple of ``hf-static``'s."""
    base = next((r["tokens_per_s"] for r in results if r["system"] == BASELINE), None)
    names = [r["system"] for r in results]
    vals = [r["tokens_per_s"] for r in results]
    text = [f"{v:.1f}" + (f"  (x{v / base:.2f})" if base else "") for v in vals]
    fig = go.Figure(go.Bar(x=names, y=vals, text=text, textposition="outside", marker_color=[_color(n) for n in names]))
    fig.update_layout(title=title, yaxis_title="generated tokens/s", height=360, margin={"t": 50, "b": 40})
    return fig


def kv_figure(results: Sequence[Mapping], title: str) -> go.Figure:
    """Left: KV reserved and holding real tokens per step (tokens) for each system that reports it;
    right: the share of reserved KV that holds real tokens (mean over token-steps, and at peak), %."""
    fig = make_subplots(rows=1, cols=2, column_widths=[0.65, 0.35],
                        subplot_titles=("KV per step: reserved (solid) vs real tokens (dotted)",
                                        "real tokens / reserved (%)"))
    with_kv = [r for r in results if r.get("kv_real_pct_mean") is not None]
    for r in with_kv:
        s = r.get("series") or {}
        res, real = s.get("kv_reserved") or [], s.get("kv_real") or []
        x = list(range(1, len(res) + 1))
        c = _color(r["system"])
        fig.add_trace(go.Scatter(x=x, y=res, name=f"{r['system']} reserved", line={"color": c}), 1, 1)
        fig.add_trace(go.Scatter(x=x, y=real, name=f"{r['system']} real", line={"color": c, "dash": "dot"}), 1, 1)
    names = [r["system"] for r in with_kv]
    fig.add_trace(go.Bar(x=names, y=[r["kv_real_pct_mean"] for r in with_kv], name="mean",
                         marker_color="#4C78A8", text=[f"{r['kv_real_pct_mean']:.1f}" for r in with_kv],
                         textposition="outside"), 1, 2)
    fig.add_trace(go.Bar(x=names, y=[r["kv_real_pct_at_peak"] for r in with_kv], name="at peak reservation",
                         marker_color="#A0CBE8", text=[f"{r['kv_real_pct_at_peak']:.1f}" for r in with_kv],
                         textposition="outside"), 1, 2)
    fig.update_xaxes(title_text="step", row=1, col=1)
    fig.update_yaxes(title_text="KV tokens", row=1, col=1)
    fig.update_yaxes(range=[0, 110], row=1, col=2)
    fig.update_layout(title=title, height=420, barmode="group", margin={"t": 70, "b": 40})
    return fig


def occupancy_figure(results: Sequence[Mapping], title: str) -> go.Figure:
    """Requests computed in each step (the batch actually used), per system that reports it."""
    fig = go.Figure()
    for r in results:
        y = (r.get("series") or {}).get("num_scheduled") or []
        if not any(y):
            continue
        fig.add_trace(go.Scatter(x=list(range(1, len(y) + 1)), y=y, name=r["system"],
                                 line={"color": _color(r["system"])}))
    fig.update_layout(title=title, xaxis_title="step", yaxis_title="requests computed", height=340,
                      margin={"t": 50, "b": 40})
    return fig


def latency_figure(results: Sequence[Mapping], title: str) -> go.Figure:
    """TTFT, TPOT and end-to-end latency percentiles (ms) per system, one panel each."""
    fig = make_subplots(rows=1, cols=3, subplot_titles=("TTFT (ms)", "TPOT (ms)", "end-to-end (ms)"))
    for j, name in enumerate(("ttft", "tpot", "e2e"), start=1):
        for q, shade in ((50, 1.0), (90, 0.7), (99, 0.45)):
            fig.add_trace(go.Bar(x=[r["system"] for r in results], y=[r.get(f"{name}_p{q}_ms") for r in results],
                                 name=f"p{q}", legendgroup=f"p{q}", showlegend=j == 1, opacity=shade,
                                 marker_color="#4C78A8"), 1, j)
    fig.update_layout(title=title, barmode="group", height=380, margin={"t": 70, "b": 40})
    return fig


def multiturn_figure(results: Sequence[Mapping], title: str) -> go.Figure:
    """Prefix caching on vs off: prefill tokens computed (tokens), TTFT p50/p99 (ms), tokens/s."""
    labels = ["on" if r.get("prefix_caching") else "off" for r in results]
    fig = make_subplots(rows=1, cols=3, subplot_titles=("prefill tokens computed", "TTFT p50 / p99 (ms)",
                                                        "generated tokens/s"))
    fig.add_trace(go.Bar(x=labels, y=[r.get("prefill_tokens") for r in results], marker_color="#59A14F",
                         showlegend=False), 1, 1)
    fig.add_trace(go.Bar(x=labels, y=[r.get("ttft_p50_ms") for r in results], name="p50", marker_color="#4C78A8"), 1, 2)
    fig.add_trace(go.Bar(x=labels, y=[r.get("ttft_p99_ms") for r in results], name="p99", marker_color="#A0CBE8"), 1, 2)
    fig.add_trace(go.Bar(x=labels, y=[r.get("tokens_per_s") for r in results], marker_color="#F28E2B",
                         showlegend=False), 1, 3)
    fig.update_xaxes(title_text="prefix caching")
    fig.update_layout(title=title, barmode="group", height=360, margin={"t": 70, "b": 50})
    return fig


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.1f}"
    return html.escape(str(v))


TABLE_KEYS = [
    ("system", "system"), ("tokens_per_s", "tok/s"), ("requests_per_s", "req/s"), ("steps", "steps"),
    ("idle_slot_steps", "idle slot-steps"), ("kv_real_pct_mean", "KV real % (mean)"),
    ("kv_real_pct_at_peak", "KV real % (at peak)"), ("kv_reserved_peak", "KV peak (tokens)"),
    ("preemptions", "preemptions"), ("outside_forward_pct", "outside forward %"),
    ("outside_forward_pct_full", "outside forward % (full batch)"), ("ttft_p50_ms", "TTFT p50 ms"),
    ("ttft_p99_ms", "TTFT p99 ms"), ("tpot_p50_ms", "TPOT p50 ms"), ("tpot_p99_ms", "TPOT p99 ms"),
    ("e2e_p50_ms", "e2e p50 ms"), ("e2e_p99_ms", "e2e p99 ms"), ("same_tokens_as_ours", "same tokens as ours"),
]


def metrics_table(results: Sequence[Mapping]) -> str:
    """An HTML table of the main metrics, one row per system."""
    head = "".join(f"<th>{html.escape(label)}</th>" for _, label in TABLE_KEYS)
    rows = "".join("<tr>" + "".join(f"<td>{_cell(r.get(k))}</td>" for k, _ in TABLE_KEYS) + "</tr>" for r in results)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"


def build_report(report: Mapping) -> str:
    """The whole report as one self-contained HTML page (plotly.js embedded once, works offline)."""
    env = report.get("environment", {})
    ls, le = report.get("load_start"), report.get("load_end")
    parts: list[str] = []
    figs: list[tuple[str, go.Figure]] = []
    for key, name in (("offline", "Offline"), ("online", "Online (Poisson arrivals)")):
        res = report.get(key)
        if not res:
            continue
        wl = res[0].get("workload", key)
        parts.append(f"<h2>{html.escape(name)}: {html.escape(str(wl))}</h2>{metrics_table(res)}")
        figs.append((key, throughput_figure(res, f"{name}: generated tokens/s")))
        if key == "offline":
            figs.append((key, kv_figure(res, "KV memory: reserved vs holding real tokens")))
            figs.append((key, occupancy_figure(res, "Requests computed per step")))
        else:
            figs.append((key, latency_figure(res, "Online latency percentiles")))
    if report.get("multiturn"):
        res = report["multiturn"]
        parts.append(f"<h2>Multi-turn: {html.escape(str(res[0].get('workload', '')))}</h2>{metrics_table(res)}")
        figs.append(("multiturn", multiturn_figure(res, "Multi-turn: prefix caching on vs off")))
    prof = report.get("profile")
    if prof:
        rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{v:.2f}</td></tr>"
                       for k, v in sorted(prof["parts_ms"].items(), key=lambda kv: -kv[1]))
        parts.append(f"<h2>One decode step at {prof['num_running']} requests: {prof['step_ms']:.1f} ms</h2>"
                     f"<table><tr><th>part</th><th>ms</th></tr>{rows}</table>")
    body = []
    first = True
    for _key, fig in figs:
        body.append(fig.to_html(full_html=False, include_plotlyjs="inline" if first else False))
        first = False
    env_line = ", ".join(f"{k}={v}" for k, v in env.items())
    load = ""
    if ls and le:
        load = (f"load average (1/5/15 min) at start {ls[0]:.2f}/{ls[1]:.2f}/{ls[2]:.2f}, "
                f"at end {le[0]:.2f}/{le[1]:.2f}/{le[2]:.2f}")
    style = ("body{font-family:system-ui,sans-serif;margin:24px;max-width:1400px} table{border-collapse:collapse;"
             "font-size:13px;margin:8px 0 16px} td,th{border:1px solid #ddd;padding:3px 6px;text-align:right}"
             "td:first-child,th:first-child{text-align:left}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>Continuous Batching Playground: bench</title>"
            f"<style>{style}</style></head><body><h1>Benchmark report</h1><p>{html.escape(env_line)}</p>"
            f"<p>{html.escape(load)}</p>{''.join(parts)}{''.join(body)}</body></html>")


def write_report(report: Mapping, path: str) -> None:
    """Write :func:`build_report` of ``report`` (the bench's JSON dict) to ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(build_report(report))


if __name__ == "__main__":  # python -m bench.report results.json report.html
    with open(sys.argv[1]) as f:
        write_report(json.load(f), sys.argv[2])
