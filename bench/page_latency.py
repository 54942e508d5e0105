"""How closely the page's panels follow the engine, measured in a real browser (Debian's chromium) as a
presenter meets it: ``python -m bench.page_latency [--tabs 8] [--talk] [--busy 2] [--tiny]``.

One process serves the app on loopback; Playwright drives one Chromium profile (all tabs in one context,
as one person's browser) at 1366x768. ``--busy N`` runs N busy-loop processes beside everything (a laptop
whose cores are taken by other work); ``--talk`` serves the talk preset (``python app.py --talk``: few slots,
a small pool, MRU free-block order, a short window) instead of the default configuration. Rounds: 1 tab;
``--tabs`` tabs of which all but the presenter's are in the background and chat at once; with
``--all-visible``, also ``--tabs`` tabs all visible. In every round the load generator keeps the batch full,
and these are measured:

- first panel: seconds from navigation start to both panels drawn (fresh tabs of a browser that has the page's
  scripts in its cache; the round's first tab, the presenter's, is given apart);
- step: seconds from a Step press (engine paused) to the presenter's panels showing that step;
- slow motion: at 0.5 s per step, how many engine steps the presenter's page never drew;
- lag: at full speed, sampled every 0.1 s, how long the engine's step after the drawn one had existed
  (0 when the drawn step is the newest);
- the engine's generated tokens/s alone and with the page, in the same phase of one load run: windows in
  which every tab's script is held (no poll, no drawing) alternate with windows in which they run.

A tab that does not answer in time is a figure (``timeouts``), never an abort of the run. Background tabs:
headless Chromium cannot put a tab in the background, so those tabs are marked hidden with an init script
(``document.hidden`` true); the page's script then polls once a second without figures, as in a real
background tab.

Figures are p50 / p90 over the samples; the last lines are a Markdown table. CPU (flags), dtype, the
preset and the load average (``/proc/loadavg``) are printed with them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]
NOT_SHOWN = math.inf  # a sample whose panel never showed within the bound


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) of ``values`` (nearest rank); nan when empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def fmt(values: list[float], unit: str = "s") -> str:
    """``"p50 0.123 s / p90 0.456 s (n=20)"``, plus how many samples never showed (inf)."""
    missing = sum(1 for v in values if v == NOT_SHOWN)
    tail = f", {missing} not shown" if missing else ""
    return f"p50 {pct(values, 50):.3f} {unit} / p90 {pct(values, 90):.3f} {unit} (n={len(values)}{tail})"


def cpu_flags() -> str:
    """``"<model name> (avx2, avx512f, ...)"`` from /proc/cpuinfo, or "?"."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "?"
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    keep = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{model} ({', '.join(keep)})"


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as ``uptime`` prints them."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def start_busy(n: int) -> list[subprocess.Popen]:
    """``n`` processes that each spin one core at 100% until killed (:func:`stop_busy`)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(max(0, n))]


def stop_busy(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


HIDDEN_TAB_JS = """
Object.defineProperty(Document.prototype, "hidden", {get: () => true, configurable: true});
Object.defineProperty(Document.prototype, "visibilityState", {get: () => "hidden", configurable: true});
"""


def history(page) -> list[tuple[float, int]]:
    """The page's draws: ``[(ms since navigation start, step drawn)]``."""
    return [tuple(x) for x in page.evaluate("() => window.cbpLive.history")]


def open_page(context, url: str, timeout_s: float = 60.0, hidden: bool = False):
    """A new tab on ``url`` whose script has drawn (or, hidden, received) its first frame; raises
    Playwright's TimeoutError after ``timeout_s``."""
    page = context.new_page()
    page.set_default_timeout(timeout_s * 1000)
    if hidden:
        page.add_init_script(HIDDEN_TAB_JS)
    page.goto(url)
    what = "(window.cbpLive.frames || 0) > 0" if hidden else "window.cbpLive.history.length > 0"
    page.wait_for_function(f"() => window.cbpLive && {what}", timeout=timeout_s * 1000)
    return page


def first_panel(context, url: str, loads: int, timeout_s: float = 60.0, marks: list | None = None) -> list[float]:
    """Seconds from navigation start to the first drawn panel, for ``loads`` fresh tabs (inf: none in time);
    ``marks`` collects each load's milestones (ms: the live script ran, plotly.js ready, the panels' place
    rendered by Gradio, first panel drawn)."""
    out = []
    for _ in range(loads):
        page = None
        try:
            page = open_page(context, url, timeout_s)
            out.append(history(page)[0][0] / 1000)
            if marks is not None:
                marks.append(page.evaluate("() => window.cbpLive.marks"))
        except Exception as exc:  # a slow tab is a figure, not a crash
            print(f"  first panel: no panel in {timeout_s:.0f} s ({type(exc).__name__})", flush=True)
            out.append(NOT_SHOWN)
        finally:
            if page is not None:
                page.close()
    return out


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(cond: Callable[[], bool], seconds: float, every: float = 0.005) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(every)
    return cond()


def _one_press(page, engine, bound_s: float) -> float:
    """Press Step once; seconds until the panels show the new step (inf when not within ``bound_s``)."""
    before = engine.step_count
    t_click = page.evaluate("() => { document.querySelector('#step').click(); return performance.now(); }")
    wait_for(lambda: engine.step_count != before, bound_s)
    target = engine.step_count
    shown: list[float] = []

    def drawn() -> bool:
        shown.extend(t for t, s in history(page) if s >= target and t >= t_click)
        return bool(shown)

    wait_for(drawn, bound_s, every=0.01)
    return (shown[0] - t_click) / 1000 if shown else NOT_SHOWN


def step_latency(page, engine, presses: int, bound_s: float = 10.0) -> list[float]:
    """Pause, then press Step ``presses`` times; per press, seconds until the panels show the new step (inf
    when not within ``bound_s``)."""
    engine.pause()
    wait_for(lambda: engine.paused, 5)
    time.sleep(0.5)
    out = []
    for _ in range(presses):
        try:
            out.append(_one_press(page, engine, bound_s))
        except Exception as exc:
            print(f"  step press: {type(exc).__name__}", flush=True)
            out.append(NOT_SHOWN)
        time.sleep(0.2)
    engine.resume()
    return out


def slow_motion_skips(page, engine, seconds: float, per_step: float = 0.5) -> tuple[int, int]:
    """Engine steps made and steps never drawn during ``seconds`` at ``per_step`` seconds per step (the page
    is given 3 s after the phase to draw the last ones)."""
    engine.set_min_step_time(per_step)
    time.sleep(1.0)
    first = engine.step_count + 1
    time.sleep(seconds)
    last = engine.step_count - 1
    engine.set_min_step_time(0.0)
    steps = range(first, last + 1)
    drawn: set[int] = set()
    end = time.monotonic() + 3
    while time.monotonic() < end:
        try:
            drawn = {s for _, s in history(page)}
        except Exception as exc:
            print(f"  slow motion: {type(exc).__name__}", flush=True)
        if all(s in drawn for s in steps):
            break
        time.sleep(0.2)
    return len(steps), sum(1 for s in steps if s not in drawn)


def full_speed_lag(page, engine, seconds: float) -> list[float]:
    """Sampled every 0.1 s: how long the step after the drawn one had existed (0: the newest is drawn)."""
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            drawn = page.evaluate("() => { const h = window.cbpLive.history; return h.length ? h[h.length - 1][1] : 0; }")
        except Exception:
            out.append(NOT_SHOWN)
            continue
        now = time.monotonic()
        after = [s.time for s in engine.telemetry.snapshots() if s.step == drawn + 1]
        out.append(max(0.0, now - after[0]) if after else 0.0)
        time.sleep(0.1)
    return out


def compare_runs(context, url: str, runs: int = 3, timeout_s: float = 60.0) -> list[float]:
    """Seconds from pressing Compare's Run (classic preset) to both grids drawn with the new headline, for
    ``runs`` runs, each in a fresh tab (inf: not in time)."""
    out: list[float] = []
    for _ in range(runs):
        page = context.new_page()
        page.set_default_timeout(timeout_s * 1000)
        try:
            page.goto(url)
            page.click("button[role=tab][data-tab-id=compare]")
            page.wait_for_selector("#compare-run")
            t0 = time.monotonic()
            page.click("#compare-run")
            page.wait_for_function("() => /fewer|same|more/.test(document.querySelector('#compare-summary').innerText)"
                                   " && document.querySelectorAll('#compare-static .heatmaplayer image, "
                                   "#compare-continuous .heatmaplayer image').length === 2")
            out.append(time.monotonic() - t0)
        except Exception as exc:
            print(f"  compare: {type(exc).__name__}", flush=True)
            out.append(NOT_SHOWN)
        finally:
            page.close()
    return out


def hold(pages, on: bool) -> None:
    """Stop (``on``) or restart every page's live script (no polls, no drawing while held)."""
    for p in pages:
        try:
            p.evaluate(f"() => window.cbpLive.hold({'true' if on else 'false'})")
        except Exception as exc:
            print(f"  hold: {type(exc).__name__}", flush=True)


def tokens_in(engine, seconds: float) -> tuple[int, float]:
    """Generated tokens and wall seconds over the next ``seconds``, from the engine's own counters."""
    t0, n0 = time.monotonic(), engine.telemetry.stats().get("generated_tokens", 0)
    time.sleep(seconds)
    return engine.telemetry.stats().get("generated_tokens", 0) - n0, time.monotonic() - t0


def alone_and_with_page(pages, engine, seconds: float, windows: int = 4) -> tuple[float, float]:
    """Engine tokens/s with every tab held and with the tabs running, in alternating windows of
    ``seconds / windows`` each (held first), all in the same decode phase of one load run."""
    sums = {True: [0, 0.0], False: [0, 0.0]}
    for i in range(2 * windows):
        held = i % 2 == 0
        hold(pages, held)
        time.sleep(0.3)  # a draw in flight ends
        n, s = tokens_in(engine, seconds / windows)
        sums[held][0] += n
        sums[held][1] += s
    hold(pages, False)
    return sums[True][0] / sums[True][1], sums[False][0] / sums[False][1]


def start_load(loadgen, loop, n: int = 64, rate: float = 20.0) -> None:
    """A load-generator run on the server's event loop (as the page's Start does)."""
    import asyncio

    async def go() -> None:
        loadgen.start(n, rate)

    asyncio.run_coroutine_threadsafe(go(), loop).result(10)


def steady(engine, slots: int, seconds: float = 20.0) -> None:
    """Wait until every batch slot runs and requests wait (the load run's decode phase)."""
    def full() -> bool:
        snap = engine.telemetry.latest()
        return bool(snap and snap.num_running >= slots and len(engine.telemetry.queue) > 0)

    wait_for(full, seconds, every=0.1)
    time.sleep(1.0)


def run_round(ctx, url: str, engine, demo, args, label: str, guests_n: int, hidden: bool, slots: int) -> dict:
    """One round: the presenter's tab and ``guests_n`` guests (chatting); returns its figures."""
    res: dict = {"round": label, "load_before": load_average()}
    loadgen = demo.cbp_loadgen
    pages = []
    try:
        presenter = open_page(ctx, url)
        pages.append(presenter)
        res["presenter_first_panel"] = history(presenter)[0][0] / 1000  # the run's first load: a colder cache
        for i in range(guests_n):
            try:
                g = open_page(ctx, url, hidden=hidden)
                g.fill("#msg textarea", f"Tab {i}: tell me a long story about the sea.")
                g.click("#send")
                pages.append(g)
            except Exception as exc:
                print(f"  guest {i}: {type(exc).__name__}", flush=True)
                res["guests_failed"] = res.get("guests_failed", 0) + 1
        start_load(loadgen, demo.cbp_live.loop)
        steady(engine, slots)
        res["marks"] = []
        res["first_panel"] = first_panel(ctx, url, args.loads, marks=res["marks"])
        print(f"[{label}] first panel:", fmt(res["first_panel"]), "; milestones (ms, median):",
              {k: round(pct([m[k] for m in res["marks"] if k in m], 50)) for k in ("script", "plotly", "panels", "drawn")},
              flush=True)
        presenter.bring_to_front()
        res["step"] = step_latency(presenter, engine, args.presses)
        print(f"[{label}] step press -> panels:", fmt(res["step"]), flush=True)
        made, skipped = slow_motion_skips(presenter, engine, args.seconds)
        res["slow_made"], res["slow_skipped"] = made, skipped
        print(f"[{label}] slow motion 0.5 s/step: {made} steps, {skipped} not drawn", flush=True)
        res["lag"] = full_speed_lag(presenter, engine, args.seconds)
        print(f"[{label}] full-speed lag of the drawn step:", fmt(res["lag"]), flush=True)
        start_load(loadgen, demo.cbp_live.loop)  # the phases above may have drained the first run
        steady(engine, slots)
        alone, with_page = alone_and_with_page(pages, engine, args.seconds)
        res["tps_alone"], res["tps_page"] = alone, with_page
        print(f"[{label}] engine tokens/s, same phase: {with_page:.1f} with the page vs {alone:.1f} held "
              f"({with_page / alone if alone else float('nan'):.2f}x)", flush=True)
        res["timings"] = presenter.evaluate("() => window.cbpLive.timings || null")
        if not guests_n:
            start_load(loadgen, demo.cbp_live.loop)
            res["compare"] = compare_runs(ctx, url)
            print(f"[{label}] Compare run (classic preset), click to both grids:", fmt(res["compare"]), flush=True)
    finally:
        loadgen.stop()
        for p in pages:
            try:
                p.close()
            except Exception:
                pass
    res["load_after"] = load_average()
    return res


def table(results: list[dict]) -> str:
    """The rounds as a Markdown table (rows: measures, columns: rounds)."""
    def p(v: list[float]) -> str:
        miss = sum(1 for x in v if x == NOT_SHOWN)
        return f"{pct(v, 50):.2f} / {pct(v, 90):.2f} s" + (f" ({miss} not shown)" if miss else "")

    rows = [("first panel after page load", lambda r: p(r["first_panel"])),
            ("first panel of the round's first tab (colder cache)", lambda r: f"{r['presenter_first_panel']:.2f} s"),
            ("Step press -> panels show that step", lambda r: p(r["step"])),
            ("slow motion 0.5 s/step: steps not drawn", lambda r: f"{r['slow_skipped']} of {r['slow_made']}"),
            ("full speed: age of the step after the drawn one", lambda r: p(r["lag"])),
            ("Compare: classic preset, click to both grids", lambda r: p(r["compare"])),
            ("engine tokens/s with the page / held (same phase)",
             lambda r: f"{r['tps_page']:.0f} / {r['tps_alone']:.0f} ({r['tps_page'] / r['tps_alone']:.2f}x)"
             if r.get("tps_alone") else "-"),
            ("load average before / after", lambda r: f"{r['load_before']} / {r['load_after']}")]
    out = ["| measure (p50 / p90) | " + " | ".join(r["round"] for r in results) + " |",
           "|---|" + "---|" * len(results)]
    for name, cell in rows:
        vals = []
        for r in results:
            try:
                vals.append(cell(r))
            except (KeyError, ZeroDivisionError):
                vals.append("-")
        out.append(f"| {name} | " + " | ".join(vals) + " |")
    return "\n".join(out)


def build_engine(args):
    """The engine of the run: default or talk preset, SmolLM2 or a tiny random model."""
    from engine.async_engine import AsyncEngine
    from engine.options import PLAYGROUND_DEFAULTS, TALK_PRESET

    kw = dict(TALK_PRESET if args.talk else PLAYGROUND_DEFAULTS)
    if not args.tiny:
        return AsyncEngine.from_args(**kw)
    from engine import tiny_random_llama
    from engine.model_loader import load_tokenizer

    tok = load_tokenizer(None)
    model = tiny_random_llama(len(tok), max_positions=2048)
    return AsyncEngine.from_args(model=model, tokenizer=tok, **kw)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.page_latency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tabs", type=int, default=8, help="tabs of one browser in the second round")
    p.add_argument("--presses", type=int, default=20, help="Step presses per round")
    p.add_argument("--loads", type=int, default=3, help="fresh page loads per round (first panel)")
    p.add_argument("--seconds", type=float, default=10.0, help="length of each timed phase")
    p.add_argument("--talk", action="store_true", help="serve the talk preset (python app.py --talk)")
    p.add_argument("--busy", type=int, default=0, metavar="N", help="run N busy-loop processes beside it")
    p.add_argument("--all-visible", action="store_true", help="add a round with every tab visible")
    p.add_argument("--one-tab", action="store_true", help="only the 1-tab round")
    p.add_argument("--tiny", action="store_true", help="a tiny random-weight model instead of SmolLM2")
    p.add_argument("--refresh", type=float, default=0.2, help="the page's poll period (--refresh of app.py)")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    p.add_argument("--chromium", default="/usr/bin/chromium")
    args = p.parse_args(argv)

    from playwright.sync_api import sync_playwright

    from ui.layout import build_app, launch
    from ui.talk import TALK_WINDOW

    engine = build_engine(args)
    cfg = engine.config
    window = TALK_WINDOW if args.talk else 48
    demo = build_app(engine, refresh_s=args.refresh, window=window)
    port = free_port()
    launch(demo, server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    url = f"http://127.0.0.1:{port}/"
    busy = start_busy(args.busy)
    head = (f"CPU: {cpu_flags()}; {os.cpu_count()} cores; dtype {str(engine.core.runner.dtype).removeprefix('torch.')}; "
            f"model {'tiny' if args.tiny else 'SmolLM2-135M'}; {'talk preset' if args.talk else 'default'}: "
            f"{cfg.max_num_seqs} slots, {cfg.num_blocks} blocks, {cfg.free_block_order}, window {window}; "
            f"refresh {args.refresh} s; {args.busy} busy loops; load {load_average()}; {time.strftime('%Y-%m-%d %H:%M')}")
    print(head, flush=True)
    results = []
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=args.chromium, args=CHROMIUM_FLAGS)
            ctx = browser.new_context(viewport={"width": 1366, "height": 768})
            rounds = [("1 tab", 0, False), (f"{args.tabs} tabs, {args.tabs - 1} in the background", args.tabs - 1, True)]
            if args.all_visible:
                rounds.append((f"{args.tabs} tabs, all visible", args.tabs - 1, False))
            if args.one_tab:
                rounds = rounds[:1]
            for label, guests, hidden in rounds:
                try:
                    results.append(run_round(ctx, url, engine, demo, args, label, guests, hidden, cfg.max_num_seqs))
                except Exception as exc:  # the round is reported as far as it got
                    print(f"[{label}] stopped: {type(exc).__name__}: {exc}", flush=True)
            browser.close()
    finally:
        stop_busy(busy)
        demo.close()
        engine.shutdown()
    print(f"frames served: {demo.cbp_live.polls}; figure builds: {demo.cbp_panels.builds}")
    print(head)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"head": head, "rounds": results}, default=str, indent=1))


if __name__ == "__main__":
    main()
