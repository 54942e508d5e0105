"""The playground in front of a real vLLM (and, in the same run, in front of our own server): ``make remote-vllm``.

For each backend (``--backends vllm,ours``) it starts the server with KV cache events on (vLLM's CPU backend
from ``.venv-peers`` with ``--enable-prefix-caching --kv-events-config ...``; ours with the same JSON), starts
the playground in remote mode against it (``app.py --backend-url ... --kv-events-url ... --kv-replay-url ...``),
opens the page in Chromium, starts the load generator (``--chats`` synthetic chats) and sends one chat of
its own, and meanwhile follows the backend itself: its ``/metrics`` every second and its KV events on a
subscriber of its own. Then it reads what the page shows (counters, KV map caption), takes a screenshot
(``--screenshot-dir``) and prints one table: what moved, on the backend and on the page.

Not part of CI (vLLM is not installed there); CI runs the remote mode against our own server
(``tests/test_remote.py``). Needs ``.venv-peers`` (``bash bench/peers_setup.sh``) and the HF export of the
model (``python -m bench.hf_export``); ``make remote-vllm`` makes both on first use.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import httpx
import zmq
from prometheus_client.parser import text_string_to_metric_families

from bench.browser import CHROMIUM, CHROMIUM_FLAGS
from bench.peers_run import _kill_group, child_env, free_port, peers_python, peers_versions, wait_ready
from engine.kv_wire import decode_batch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVED = "smollm2"
LONG_PROMPT = ("Here is a long question, so that the prompt fills whole KV blocks: " +
               "describe the tides, the moon and the sea, and how sailors used them. " * 24)


def kv_json(pub: int, replay: int) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
                       "replay_endpoint": f"tcp://*:{replay}", "topic": "kv-events"})


def backend_cmd(which: str, args, port: int, pub: int, replay: int) -> list[str]:
    if which == "vllm":
        return [peers_python(args.peers_venv), "-P", "-m", "vllm.entrypoints.openai.api_server", "--host",
                "127.0.0.1", "--port", str(port), "--model", args.hf_dir, "--served-model-name", SERVED,
                "--dtype", args.dtype, "--max-num-seqs", "16", "--enable-prefix-caching",
                "--kv-events-config", kv_json(pub, replay)]
    return [sys.executable, os.path.join(ROOT, "app.py"), "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", SERVED, "--dtype", args.dtype, "--max-num-seqs", "16",
            "--kv-events-config", kv_json(pub, replay)]


class Follower:
    """The backend seen directly: a KV event subscriber and a /metrics poller (one thread each)."""

    def __init__(self, url: str, pub: int) -> None:
        self.url, self.pub = url, pub
        self.batches = 0
        self.events: dict[str, int] = {}
        self.block_sizes: set[int] = set()
        self.hashes: set = set()
        self.seq_gaps = 0
        self.samples: list[dict] = []
        self.names: set[str] = set()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._kv, daemon=True), threading.Thread(target=self._metrics,
                                                                                        daemon=True)]

    def start(self) -> Follower:
        for t in self.threads:
            t.start()
        return self

    def _kv(self) -> None:
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.connect(f"tcp://127.0.0.1:{self.pub}")
        sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
        last = -1
        while not self.stop.is_set():
            if not sub.poll(200):
                continue
            _, seq_b, payload = sub.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            if last >= 0 and seq != last + 1:
                self.seq_gaps += 1
            last = seq
            batch = decode_batch(payload)
            self.batches += 1
            for e in batch.events:
                self.events[e.type] = self.events.get(e.type, 0) + 1
                if e.type == "BlockStored":
                    self.block_sizes.add(e.block_size)
                    self.hashes.update(e.block_hashes)
        sub.close(linger=0)

    def _metrics(self) -> None:
        with httpx.Client(timeout=5) as http:
            while not self.stop.is_set():
                try:
                    fams = list(text_string_to_metric_families(http.get(self.url + "/metrics").text))
                except (httpx.HTTPError, ValueError):
                    time.sleep(1)
                    continue
                row: dict[str, float] = {}
                for f in fams:
                    self.names.add(f.name)
                    for s in f.samples:
                        if s.name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                      "vllm:kv_cache_usage_perc", "vllm:generation_tokens_total",
                                      "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
                                      "vllm:num_preemptions_total"):
                            row[s.name] = row.get(s.name, 0.0) + s.value
                row["t"] = time.time()
                self.samples.append(row)
                self.stop.wait(1.0)

    def summary(self) -> dict:
        def series(name):
            return [r.get(name, 0.0) for r in self.samples]

        gen, hits, queries = (series("vllm:generation_tokens_total"), series("vllm:prefix_cache_hits_total"),
                              series("vllm:prefix_cache_queries_total"))
        return {"kv_batches": self.batches, "kv_events": dict(self.events), "kv_block_sizes": sorted(self.block_sizes),
                "kv_distinct_hashes": len(self.hashes), "kv_seq_gaps": self.seq_gaps,
                "running_max": max(series("vllm:num_requests_running") or [0]),
                "waiting_max": max(series("vllm:num_requests_waiting") or [0]),
                "kv_usage_max": max(series("vllm:kv_cache_usage_perc") or [0]),
                "generation_tokens": (gen[-1] - gen[0]) if gen else 0,
                "prefix_hit_rate": ((hits[-1] - hits[0]) / max(queries[-1] - queries[0], 1)) if hits else 0,
                "preemptions": series("vllm:num_preemptions_total")[-1] if self.samples else 0,
                "vllm_names": len([n for n in self.names if n.startswith("vllm:")])}


def drive_page(page_url: str, chats: int, seconds: float, shot: str | None) -> dict:
    """Open the remote page, start the load and one chat, wait, read what it shows; a screenshot."""
    from playwright.sync_api import sync_playwright

    out: dict = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        page = browser.new_page(viewport={"width": 1366, "height": 1100})
        page.set_default_timeout(60_000)
        page.goto(page_url)
        page.wait_for_selector("#start-load")
        slider = page.locator("#num-chats input[type=number]")
        if slider.count():
            slider.fill(str(chats))
            slider.press("Enter")
        page.click("#start-load")
        page.fill("#msg textarea", LONG_PROMPT)
        page.click("#send")
        t0 = time.time()
        first_counters = None
        while time.time() - t0 < seconds:
            time.sleep(2)
            text = page.locator("#remote-counters-area").inner_text()
            first_counters = first_counters or text
        out["counters_text"] = page.locator("#remote-counters-area").inner_text()
        out["kv_caption"] = page.locator("#remote-kv-caption").inner_text()
        out["load_status"] = page.locator("#load-status-area").inner_text()
        out["chat_bubbles"] = page.locator("#chatbot .message").count()
        if shot:
            os.makedirs(os.path.dirname(shot) or ".", exist_ok=True)
            page.screenshot(path=shot, full_page=True)
            out["screenshot"] = shot
        browser.close()
    return out


def run_backend(which: str, args) -> dict:
    port, pub, replay, page_port = free_port(), free_port(), free_port(), free_port()
    log_dir = args.log_dir
    os.makedirs(log_dir, exist_ok=True)
    procs = []
    try:
        blog = os.path.join(log_dir, f"remote_{which}_backend.log")
        with open(blog, "w") as f:
            procs.append(subprocess.Popen(backend_cmd(which, args, port, pub, replay), cwd=ROOT, stdout=f,
                                          stderr=subprocess.STDOUT, start_new_session=True,
                                          env=child_env(args.threads, 1, which == "vllm")))
        ready = wait_ready(f"http://127.0.0.1:{port}/health", procs[0], 600, blog)
        print(f"{which}: backend ready in {ready:.0f} s (log {blog})", flush=True)
        follower = Follower(f"http://127.0.0.1:{port}", pub).start()
        plog = os.path.join(log_dir, f"remote_{which}_page.log")
        page_cmd = [sys.executable, os.path.join(ROOT, "app.py"), "--host", "127.0.0.1", "--port", str(page_port),
                    "--backend-url", f"http://127.0.0.1:{port}", "--kv-events-url", f"tcp://127.0.0.1:{pub}",
                    "--kv-replay-url", f"tcp://127.0.0.1:{replay}", "--kv-events-topic", "kv-events"]
        with open(plog, "w") as f:
            procs.append(subprocess.Popen(page_cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        wait_ready(f"http://127.0.0.1:{page_port}/", procs[1], 120, plog)
        shot = os.path.join(args.screenshot_dir, f"remote_{which}.png") if args.screenshot_dir else None
        page = drive_page(f"http://127.0.0.1:{page_port}/", args.chats, args.seconds, shot)
        follower.stop.set()
        time.sleep(1.5)
        return {"backend": which, **follower.summary(), **page}
    finally:
        for p in reversed(procs):
            _kill_group(p)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="vllm,ours", help="comma-separated: vllm, ours")
    ap.add_argument("--peers-venv", default=".venv-peers")
    ap.add_argument("--hf-dir", default=".peers/smollm2-hf")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--chats", type=int, default=16, help="synthetic chats of the page's load generator")
    ap.add_argument("--seconds", type=float, default=60.0, help="how long the page runs before it is read")
    ap.add_argument("--screenshot-dir", default="out")
    ap.add_argument("--log-dir", default="out")
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args(argv)
    results = []
    for which in [b.strip() for b in args.backends.split(",") if b.strip()]:
        results.append(run_backend(which, args))
    if "vllm" in args.backends:
        print("vLLM:", peers_versions(args.peers_venv))
    keys = ["kv_batches", "kv_events", "kv_block_sizes", "kv_distinct_hashes", "kv_seq_gaps", "running_max",
            "waiting_max", "kv_usage_max", "generation_tokens", "prefix_hit_rate", "preemptions", "vllm_names",
            "chat_bubbles"]
    print(f"{'':22}" + "".join(f"{r['backend']:>34}" for r in results))
    for k in keys:
        print(f"{k:22}" + "".join(f"{str(r.get(k)):>34}" for r in results))
    for r in results:
        print(f"--- {r['backend']}: page counters ---\n{r.get('counters_text')}\n--- KV caption ---\n"
              f"{r.get('kv_caption')}\n--- load ---\n{r.get('load_status')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
