"""How closely the page's panels follow the engine, measured in a real browser (Debian's chromium) as a
presenter meets it: ``python -m bench.page_latency [--tabs 8] [--tiny]``.

One process serves the app on loopback; Playwright drives one Chromium profile (all tabs in one context,
as one person's browser) at 1366x768. Printed, for 1 tab and then with ``--tabs`` tabs of which all but the
presenter's chat at once while the load generator runs:

- first panel: seconds from navigation start to the first drawn panel (fresh page loads);
- step: seconds from a Step press (engine paused) to the presenter's panels showing that step (20 presses);
- slow motion: at 0.5 s per step, how many engine steps were never drawn;
- lag: at full speed, sampled every 0.1 s, how long the engine's step after the drawn one had existed
  (0 when the drawn step is the newest);
- the engine's generated tokens/s over the same load with no page open and with the tabs open; and with
  the same number of tabs simulated by plain HTTP pollers in another process (the server's share of the
  cost, without the browser's drawing on the same cores).

The tab rounds run twice: all tabs visible (headless Chromium treats every page as visible, as if each
tab were its own window side by side: the worst case), and with every tab but the presenter's in the
background, as in one desktop browser window where only the front tab is shown. Headless Chromium cannot
put a tab in the background, so that round marks the guests hidden with an init script
(``document.hidden`` true, ``visibilityState`` "hidden"): the page's script then polls once a second
without figures, as it does in a real background tab (Chromium throttles background timers to once a
second as well).

Figures are p50 / p90 over the samples. The CPU (flags) and dtype are printed with them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) of ``values`` (nearest rank); nan when empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def fmt(values: list[float], unit: str = "s") -> str:
    return f"p50 {pct(values, 50):.3f} {unit} / p90 {pct(values, 90):.3f} {unit} (n={len(values)})"


def cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "?"
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    keep = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{model} ({', '.join(keep)})"


def history(page) -> list[tuple[float, int]]:
    return [tuple(x) for x in page.evaluate("() => window.cbpLive.history")]


HIDDEN_TAB_JS = """
Object.defineProperty(Document.prototype, "hidden", {get: () => true, configurable: true});
Object.defineProperty(Document.prototype, "visibilityState", {get: () => "hidden", configurable: true});
"""


def first_panel(context, url: str, loads: int) -> list[float]:
    out = []
    for _ in range(loads):
        page = context.new_page()
        page.goto(url)
        page.wait_for_function("() => window.cbpLive && window.cbpLive.history.length > 0", timeout=60_000)
        out.append(history(page)[0][0] / 1000)
        page.close()
    return out


def step_latency(page, engine, presses: int) -> list[float]:
    """Pause, then press Step ``presses`` times; per press, seconds until the panels show the new step."""
    page.click("#pause")
    while not engine.paused:
        time.sleep(0.01)
    time.sleep(0.5)
    out = []
    for _ in range(presses):
        before = engine.step_count
        t_click = page.evaluate("() => { document.querySelector('#step').click(); return performance.now(); }")
        deadline = time.monotonic() + 5
        while engine.step_count == before and time.monotonic() < deadline:
            time.sleep(0.005)
        target = engine.step_count
        shown = None
        while shown is None and time.monotonic() < deadline + 5:
            shown = next((t for t, s in history(page) if s >= target and t >= t_click), None)
            time.sleep(0.01)
        out.append(((shown if shown is not None else float("inf")) - t_click) / 1000)
        time.sleep(0.2)
    page.click("#resume")
    return out


def slow_motion_skips(page, engine, seconds: float, per_step: float = 0.5) -> tuple[int, int]:
    """Engine steps made and steps never drawn during ``seconds`` at ``per_step`` seconds per step."""
    engine.set_min_step_time(per_step)
    time.sleep(1.0)
    first = engine.step_count + 1
    time.sleep(seconds)
    last = engine.step_count - 1
    drawn = {s for _, s in history(page)}
    engine.set_min_step_time(0.0)
    steps = range(first, last + 1)
    return len(steps), sum(1 for s in steps if s not in drawn)


def full_speed_lag(page, engine, seconds: float) -> list[float]:
    """Sampled every 0.1 s: how long the step after the drawn one had existed (0: the newest is drawn)."""
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        drawn = page.evaluate("() => { const h = window.cbpLive.history; return h.length ? h[h.length - 1][1] : 0; }")
        now = time.monotonic()
        after = [s.time for s in engine.telemetry.snapshots() if s.step == drawn + 1]
        out.append(max(0.0, now - after[0]) if after else 0.0)
        time.sleep(0.1)
    return out


def start_load(page, n: int = 64, rate: float = 20.0) -> None:
    """Start a load-generator run from ``page`` (its handlers run on the server's event loop)."""
    for box, value in (("#num-chats", n), ("#load-rate", rate)):
        field = page.locator(f"{box} input[type=number]")
        field.fill(str(value))
        field.press("Enter")
    time.sleep(0.3)
    page.click("#start-load")


def poll_like_tabs(url: str, tabs: int, seconds: float, background: int = 0) -> None:
    """Poll ``/cbp/live`` as ``tabs`` tabs would, for ``seconds``: visible ones every 0.2 s with figures, the
    last ``background`` of them every 1 s without (as the page's script does in a hidden tab); run in its
    own process (``--poll-worker``) so the pollers take none of the server process's time."""
    import threading

    import httpx

    end = time.monotonic() + seconds

    def one(n: int) -> None:
        key = ""
        hidden = n >= tabs - background
        with httpx.Client(timeout=10) as client:
            while time.monotonic() < end:
                body = client.get(url + "cbp/live", params={"session": f"poller-{n}", "since": key,
                                                            "figs": 0 if hidden else 1}).text
                # only the frame's head is parsed: decoding the figures is the browser's work, and this
                # process shares the server's cores
                head = body.split(',"figs":', 1)[0]
                frame = json.loads(head if head == body else head + "}")
                key = frame.get("key") or key
                time.sleep(1.0 if hidden else 0.2)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(tabs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def fresh_load(context, url: str) -> None:
    """Start a load-generator run from a page that is closed at once (no tab left drawing)."""
    page = context.new_page()
    page.goto(url)
    start_load(page)
    page.close()
    time.sleep(3)


def server_share(context, url: str, engine, tabs: int, seconds: float, background: int = 0) -> tuple[float, float]:
    """Engine tokens/s with no page or poller and with ``tabs`` pollers (``background`` of them as hidden
    tabs) in another process (load restarted for each)."""
    import subprocess
    import sys

    fresh_load(context, url)
    alone = tokens_per_s(engine, seconds)
    fresh_load(context, url)
    proc = subprocess.Popen([sys.executable, "-m", "bench.page_latency", "--poll-worker", url, str(tabs),
                             str(seconds + 2), str(background)])
    time.sleep(1)
    polled = tokens_per_s(engine, seconds)
    proc.wait()
    return alone, polled


def tokens_per_s(engine, seconds: float) -> float:
    """Generated tokens per second over the next ``seconds``, from the engine's own counters."""
    t0, n0 = time.monotonic(), engine.telemetry.stats().get("generated_tokens", 0)
    time.sleep(seconds)
    return (engine.telemetry.stats().get("generated_tokens", 0) - n0) / (time.monotonic() - t0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.page_latency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tabs", type=int, default=8, help="tabs of one browser in the second round")
    p.add_argument("--presses", type=int, default=20)
    p.add_argument("--seconds", type=float, default=10.0, help="length of each timed phase")
    p.add_argument("--tiny", action="store_true", help="a tiny random-weight model instead of SmolLM2")
    p.add_argument("--refresh", type=float, default=0.2, help="the page's poll period (--refresh of app.py)")
    p.add_argument("--chromium", default="/usr/bin/chromium")
    p.add_argument("--poll-worker", nargs=4, metavar=("URL", "TABS", "SECONDS", "BACKGROUND"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.poll_worker:
        url, tabs, seconds, background = args.poll_worker
        poll_like_tabs(url, int(tabs), float(seconds), int(background))
        return

    from playwright.sync_api import sync_playwright

    from engine.async_engine import AsyncEngine
    from ui.layout import build_app, launch

    kw = {"max_num_seqs": 16, "num_blocks": 384}
    if args.tiny:
        from transformers import LlamaConfig, LlamaForCausalLM

        from engine.model_loader import load_tokenizer

        tok = load_tokenizer(None)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             tie_word_embeddings=True)).eval()
        engine = AsyncEngine.from_args(model=model, tokenizer=tok, **kw)
    else:
        engine = AsyncEngine.from_args(**kw)
    demo = build_app(engine, refresh_s=args.refresh)
    port = 7870
    launch(demo, server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    url = f"http://127.0.0.1:{port}/"
    print(f"CPU: {cpu_flags()}; dtype {engine.core.runner.dtype}; model {'tiny' if args.tiny else 'SmolLM2-135M'}; "
          f"refresh {args.refresh} s; {time.strftime('%Y-%m-%d')}")
    loadgen = demo.cbp_loadgen
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=args.chromium, args=CHROMIUM_FLAGS)
            ctx = browser.new_context(viewport={"width": 1366, "height": 768})
            print("first panel after page load (idle engine):", fmt(first_panel(ctx, url, 5)))
            fresh_load(ctx, url)  # the run goes on in the server with no page open
            base_tps = tokens_per_s(engine, args.seconds)
            print(f"engine alone (no page open), load generator running: {base_tps:.1f} generated tok/s")
            presenter = ctx.new_page()
            presenter.goto(url)
            presenter.wait_for_function("() => window.cbpLive && window.cbpLive.history.length > 0")
            rounds = (("1 tab", 0, False), (f"{args.tabs} tabs, all visible", args.tabs - 1, False),
                      (f"{args.tabs} tabs, {args.tabs - 1} in the background", args.tabs - 1, True))
            for label, extra, background in rounds:
                guests = []
                for i in range(extra):
                    g = ctx.new_page()
                    if background:
                        g.add_init_script(HIDDEN_TAB_JS)
                    g.goto(url)
                    g.wait_for_function("() => window.cbpLive && (window.cbpLive.frames || 0) > 0")
                    g.fill("#msg textarea", f"Tab {i}: tell me a long story about the sea.")
                    g.click("#send")
                    guests.append(g)
                start_load(presenter)  # keeps every batch slot busy through the timed phases
                time.sleep(2)
                if extra:
                    print(f"[{label}] first panel of one more tab:", fmt(first_panel(ctx, url, 3)))
                presenter.bring_to_front()
                print(f"[{label}] step press -> panels:", fmt(step_latency(presenter, engine, args.presses)))
                made, skipped = slow_motion_skips(presenter, engine, args.seconds)
                print(f"[{label}] slow motion 0.5 s/step: {made} steps, {skipped} not drawn")
                print(f"[{label}] full-speed lag of the drawn step:", fmt(full_speed_lag(presenter, engine, args.seconds)))
                start_load(presenter)  # the phases above may have drained the first run
                time.sleep(2)
                tps = tokens_per_s(engine, args.seconds)
                print(f"[{label}] engine with the page open: {tps:.1f} generated tok/s ({tps / base_tps:.2f}x alone)")
                for g in guests:
                    g.close()
            presenter.close()
            for tabs, background in ((1, 0), (args.tabs, 0), (args.tabs, args.tabs - 1)):
                alone, polled = server_share(ctx, url, engine, tabs, args.seconds, background)
                print(f"[{tabs} polling tabs ({background} as background tabs), another process, no browser "
                      f"drawing] engine {polled:.1f} vs {alone:.1f} generated tok/s alone ({polled / alone:.2f}x)")
            browser.close()
        polls = demo.cbp_live.polls
        print(f"frames served: {polls}; figure builds: {demo.cbp_panels.builds}")
    finally:
        loadgen.stop()
        demo.close()
        engine.shutdown()


if __name__ == "__main__":
    main()
