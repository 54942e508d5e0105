"""Take the README's talk-mode screenshots: the playground on the embedded model, paused mid-handover.

Starts the app in this process (the talk preset: 4 batch slots, 96 KV blocks), opens it in Debian's chromium at 1366x768,
adds 16 synthetic chats with the page's load generator, sends one chat from the page, runs the engine in slow
motion and pauses it in the step right after a waiting request took a finished one's slot while the page's
own chat runs (outlined); then saves the page.

    .venv/bin/python scripts/talk_screenshot.py --out docs/talk-mode.png

With ``--blocks`` it takes the block hand-over picture instead: free blocks handed out most recently freed
first (``--free-block-order mru``), the presenter presses "⏭ Next block reuse", the engine pauses on the step
where a block freed by one request is taken by another, and the block map shows the blocks taken in that
step (▷) with one of them hovered: whose it was and the step it was freed.

    .venv/bin/python scripts/talk_screenshot.py --blocks --out docs/block-handover.png

With ``--compare`` it takes the Compare slide: the Compare tab after one run of the classic preset (the whole
1366x768 screen), saved as a palette PNG (Pillow) to keep it small.

    .venv/bin/python scripts/talk_screenshot.py --compare --out docs/compare-slide.png
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from playwright.sync_api import sync_playwright  # noqa: E402

from engine.async_engine import AsyncEngine  # noqa: E402
from engine.options import TALK_PRESET  # noqa: E402
from ui.layout import build_app, launch  # noqa: E402
from ui.talk import TALK_WINDOW  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def handover(engine) -> bool:
    """True when the newest step admitted a request into a slot that another request left the step before."""
    snaps = engine.telemetry.snapshots(2)
    if len(snaps) < 2 or not snaps[-1].admitted:
        return False
    before = {s.batch_slot: s.request_id for s in snaps[-2].batch_slots}
    return any(s.request_id in snaps[-1].admitted and before.get(s.batch_slot) in snaps[-2].finished
               for s in snaps[-1].batch_slots)


def mine_running(engine) -> bool:
    """True when the page's own chat (``chat-*``) holds blocks in the newest step (so it is outlined)."""
    snap = engine.telemetry.latest()
    return any(r.startswith("chat-") for r in snap.block_tables)


def block_handover(page, engine) -> None:
    """Press "Next block reuse" until the engine pauses on a step where a block freed by one request is
    taken by another, scroll to the panels and hover one such block on the block map."""
    end = time.monotonic() + 300
    while time.monotonic() < end and not mine_running(engine):
        time.sleep(0.05)
    engine.set_min_step_time(0.0)
    take = None
    for _ in range(20):
        page.click("#next-reuse")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not engine.paused:
            time.sleep(0.05)
        snap = engine.telemetry.latest()
        takes = [t for t in snap.block_takes if t.kind == "reused" and t.previous_owner]
        if takes and engine.paused:
            take = takes[0]
            break
        engine.resume()
    time.sleep(1.5)  # the panels catch up
    page.locator("#pacing").scroll_into_view_if_needed()
    page.evaluate("document.querySelector('#pacing').scrollIntoView({block: 'start'})")
    if take is not None:  # hover the block: the line above the panels says whose it was and when it was freed
        at = page.evaluate("""(b) => { const gd = document.querySelector('#blockmap .js-plotly-plot');
            const cols = gd.data[0].z[0].length, L = gd._fullLayout;
            const box = gd.querySelector('.nsewdrag').getBoundingClientRect();
            return [box.left + L.xaxis.l2p(b % cols), box.top + L.yaxis.l2p(Math.floor(b / cols))]; }""",
                           take.block_id)
        page.mouse.move(at[0], at[1])
        time.sleep(0.5)
    print(f"paused at step {engine.step_count}; block {take and take.block_id} was {take and take.previous_owner}'s")


def compare_slide(page, out: str) -> None:
    """Run the classic preset on the Compare tab and save the screen as a palette PNG."""
    page.click("button[role=tab][data-tab-id=compare]")
    page.click("#compare-run")
    for plot in ("#compare-static", "#compare-continuous"):
        page.wait_for_selector(f"{plot} .js-plotly-plot .heatmaplayer image", state="attached")
    page.wait_for_function("() => /\\d/.test(document.querySelector('#compare-summary').innerText)")
    page.wait_for_timeout(1000)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=out)
    from PIL import Image

    Image.open(out).convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT).save(out, optimize=True)
    print(f"wrote {out} ({Path(out).stat().st_size // 1024} KB)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/talk-mode.png")
    p.add_argument("--chromium", default="/usr/bin/chromium")
    p.add_argument("--width", type=int, default=1366)
    p.add_argument("--height", type=int, default=768)
    p.add_argument("--blocks", action="store_true", help="the block hand-over picture (see above)")
    p.add_argument("--compare", action="store_true", help="the Compare slide (see above)")
    args = p.parse_args()

    engine = AsyncEngine.from_args(block_size=16, **TALK_PRESET)
    demo = build_app(engine, refresh_s=0.25, window=TALK_WINDOW)
    port = _free_port()
    launch(demo, server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=args.chromium, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": args.width, "height": args.height})
            page.set_default_timeout(120_000)
            page.goto(f"http://127.0.0.1:{port}/")
            page.wait_for_selector("#msg textarea")
            if args.compare:
                compare_slide(page, args.out)
                browser.close()
                return
            page.click("#start-load")  # 16 synthetic chats, 4 a second, on the app's own event loop
            end = time.monotonic() + 60
            while time.monotonic() < end and not engine.telemetry.latest():
                time.sleep(0.05)
            engine.set_min_step_time(0.15)
            page.fill("#msg textarea", "Explain in a few sentences how a paged KV cache lets many chats share "
                      "one machine.")
            page.click("#send")
            if args.blocks:
                block_handover(page, engine)
            else:
                end = time.monotonic() + 300
                while time.monotonic() < end and not (handover(engine) and mine_running(engine)):
                    time.sleep(0.01)
                engine.pause()
                time.sleep(2.0)  # a few panel refreshes
                page.evaluate("window.scrollTo(0, 0)")
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=args.out)
            print(f"paused after step {engine.step_count}; wrote {args.out}")
            browser.close()
    finally:
        engine.resume()
        demo.close()
        engine.shutdown()


if __name__ == "__main__":
    main()
