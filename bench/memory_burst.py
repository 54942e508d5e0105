"""Does a burst of bad bodies leave the server's memory where it found it? (``python -m bench.memory_burst``)

Starts the real server in a separate process (``python app.py --host 127.0.0.1 --port <free port>``,
default embedded model; ``--tiny``: the API alone on a random-weight 2-layer model, seconds to start),
samples its resident set size (RSS, from ``/proc/<pid>/status`` ``VmRSS``) every ``--sample-ms``
milliseconds, and sends it, on loopback only, a burst of ``--bad`` bad bodies and ``--good`` small chat
completions at once (asyncio + httpx, at most ``--concurrency`` in flight, each with a timeout). The bad
bodies cycle through five kinds, sized from the body limit ``--max-request-body-bytes`` (L):

* ``over_declared``: a body of L + 1 KiB with its ``Content-Length`` (413 before any byte is read);
* ``over_chunked``: L + 64 KiB sent chunked, without ``Content-Length`` (413 once past L);
* ``long_prompt``: valid JSON of about L - 1 KiB, one long user message (400: refused by its length in
  characters before it is tokenized);
* ``malformed``: about L - 1 KiB of JSON cut short (400);
* ``tokenized``: the longest prompt the character check lets through (capped below L), text of many
  tokens: tokenized whole, then refused by the context length (400).

Prints the RSS at ready, before the burst (``pre``: after a short warm-up of every kind and
``--settle-s`` seconds of quiet), its peak during the burst, after ``--quiet-s`` seconds of quiet
(``after``), the ratio after / pre (issue 22's bound: at most 1.10), the status codes per kind and the
good requests' latencies. ``--json PATH`` keeps every figure and the sampled RSS series.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"  # the only address this script sends to
DEFAULT_LIMIT = 4 * 1024 * 1024  # bytes: the server's default --max-request-body-bytes
KINDS = ("over_declared", "over_chunked", "long_prompt", "malformed", "tokenized")
GOOD = {"messages": [{"role": "user", "content": "Say hello in five words."}], "max_tokens": 16, "temperature": 0}
JSON = {"content-type": "application/json"}


# ---------------------------------------------------------------------------------------------- server
def free_port() -> int:
    """A TCP port free on 127.0.0.1 at the time of the call."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` in bytes (``VmRSS`` of ``/proc/<pid>/status``; 0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


class RSSSampler:
    """Samples the RSS of ``pid`` every ``interval_s`` seconds in a daemon thread; :meth:`peak` and
    :attr:`series` (``(seconds since start, bytes)``) read it."""

    def __init__(self, pid: int, interval_s: float = 0.02) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.series: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.series.append((time.monotonic() - self._t0, rss_bytes(self.pid)))
            self._stop.wait(self.interval_s)

    def start(self) -> RSSSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def peak(self, since_s: float = 0.0) -> int:
        """Highest RSS sampled at or after ``since_s`` seconds from the start (bytes)."""
        return max((b for t, b in self.series if t >= since_s), default=0)

    def now_s(self) -> float:
        return time.monotonic() - self._t0


def tiny_server_command(port: int, limit: int) -> list[str]:
    """The tiny server of ``--tiny`` (:mod:`bench.tiny_server`): a random-weight 2-layer Llama with the default
    tokenizer, 128 blocks, its 1024-token context, 512 tokens a step, body limit ``limit``; starts in seconds."""
    return [sys.executable, "-m", "bench.tiny_server", str(port), "--max-model-len", "1024", "--num-blocks", "128",
            "--max-num-batched-tokens", "512", "--max-body-bytes", str(limit), "--name", "tiny-test"]


def server_command(tiny: bool, port: int, limit: int, extra: list[str]) -> list[str]:
    """The command line of the server under test (run from the repository root)."""
    if tiny:
        return tiny_server_command(port, limit)
    return [sys.executable, "app.py", "--host", HOST, "--port", str(port), "--max-request-body-bytes", str(limit),
            "--log-level", "warning", *extra]


def start_server(cmd: list[str], port: int, timeout_s: float, log_path: str,
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``cmd`` (output to ``log_path``) and wait until ``GET /health`` answers 200 (at most
    ``timeout_s`` seconds). Raises ``RuntimeError`` (with the log's tail) when it exits or times out."""
    env = {**os.environ, **(env or {})}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    env.setdefault("HF_HUB_OFFLINE", "1")
    log = open(log_path, "wb")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    proc.log_file = log  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=f"http://{HOST}:{port}", timeout=5) as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            try:
                if http.get("/health").status_code == 200:
                    return proc
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
    stop_server(proc)
    tail = Path(log_path).read_text(errors="replace")[-3000:]
    raise RuntimeError(f"the server did not become ready in {timeout_s:.0f} s:\n{tail}")


def stop_server(proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    """Interrupt the server (SIGINT, as Ctrl-C), then kill it if it has not exited in ``timeout_s`` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    getattr(proc, "log_file", None) and proc.log_file.close()


# ---------------------------------------------------------------------------------------------- bodies
def bad_request(kind: str, limit: int, char_limit: int | None) -> dict:
    """``httpx`` request arguments of one bad body of ``kind`` (see the module's doc) for body limit
    ``limit`` (bytes) and the server's prompt limit ``char_limit`` (characters; None: not known yet)."""
    room = limit - 1024
    if kind == "over_declared":
        return {"content": b'{"prompt": "' + b"a" * (limit + 1024) + b'"}', "headers": JSON}
    if kind == "over_chunked":
        async def chunks():
            yield b'{"prompt": "'
            for _ in range((limit + 65536) // 65536):
                yield b"a" * 65536
            yield b'"}'
        return {"content": chunks(), "headers": JSON}
    if kind == "long_prompt":
        return {"json": {"messages": [{"role": "user", "content": "a" * room}], "max_tokens": 4}}
    if kind == "malformed":
        return {"content": b'{"messages": [{"role": "user", "content": "' + b"a" * room, "headers": JSON}
    if kind == "tokenized":
        n = min(char_limit or room, room)
        words = "the quick brown fox jumps over the lazy dog 0123456789 "
        text = (words * (n // len(words) + 1))[:n]
        return {"json": {"messages": [{"role": "user", "content": text}], "max_tokens": 4}}
    raise ValueError(kind)


async def _send(http: httpx.AsyncClient, kind: str, request: dict, sem: asyncio.Semaphore,
                timeout_s: float) -> tuple[str, str, float, str]:
    """Post one request; returns ``(kind, status or error name, seconds, body text's first 300 characters)``."""
    async with sem:
        t0 = time.perf_counter()
        try:
            r = await asyncio.wait_for(http.post("/v1/chat/completions", **request), timeout_s)
            return kind, str(r.status_code), time.perf_counter() - t0, r.text[:300]
        except (TimeoutError, httpx.HTTPError) as e:
            return kind, type(e).__name__, time.perf_counter() - t0, ""


async def burst(base_url: str, requests: list[tuple[str, dict]], concurrency: int,
                timeout_s: float) -> list[tuple[str, str, float, str]]:
    """Send ``requests`` (``(kind, httpx arguments)``) at once, at most ``concurrency`` in flight."""
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits, trust_env=False) as http:
        return await asyncio.gather(*(_send(http, k, req, sem, timeout_s) for k, req in requests))


def char_limit_of(base_url: str, limit: int) -> int | None:
    """The server's prompt limit in characters, read from its refusal of a prompt just under the body limit."""
    with httpx.Client(base_url=base_url, timeout=120, trust_env=False) as http:
        r = http.post("/v1/chat/completions", **bad_request("long_prompt", limit, None))
    m = re.search(r"at most (\d+) characters", r.text)
    return int(m.group(1)) if m else None


def plan(bad: int, good: int, limit: int, char_limit: int | None, seed: int = 0) -> list[tuple[str, dict]]:
    """``bad`` bad bodies (the kinds in turn) and ``good`` good requests, shuffled (``seed``)."""
    reqs = [(KINDS[i % len(KINDS)], bad_request(KINDS[i % len(KINDS)], limit, char_limit)) for i in range(bad)]
    reqs += [("good", {"json": GOOD})] * good
    random.Random(seed).shuffle(reqs)
    return reqs


def summarize(results: list[tuple[str, str, float, str]]) -> dict[str, dict[str, int]]:
    """``{kind: {status: count}}``."""
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for kind, status, _, _ in results:
        counts[kind][status] += 1
    return {k: dict(sorted(v.items())) for k, v in sorted(counts.items())}


# ---------------------------------------------------------------------------------------------- run
def measure(pid: int, base_url: str, *, bad: int, good: int, limit: int, concurrency: int = 32,
            timeout_s: float = 180.0, settle_s: float = 3.0, quiet_s: float = 5.0, sample_s: float = 0.02,
            warmup: bool = True, log=print) -> dict:
    """Warm up, measure the RSS of ``pid`` before, during and after one burst against ``base_url``.

    Returns the figures: ``ready``, ``pre``, ``peak``, ``after`` (bytes), ``ratio`` (after / pre),
    ``counts`` (``{kind: {status: count}}``), ``good_s`` (latencies of the good requests, seconds),
    ``burst_s`` (seconds), ``char_limit`` and the sampled ``series`` (``[seconds, bytes]``).
    """
    sampler = RSSSampler(pid, sample_s).start()
    try:
        ready = rss_bytes(pid)
        char_limit = char_limit_of(base_url, limit)
        if warmup:  # first use of each path (tokenizer, chat template, JSON errors, the model's forward)
            asyncio.run(burst(base_url, plan(len(KINDS), 2, limit, char_limit, seed=1), 2, timeout_s))
        time.sleep(settle_s)
        pre = rss_bytes(pid)
        reqs = plan(bad, good, limit, char_limit)
        log(f"RSS ready {ready / 2**20:.0f} MiB, pre-burst {pre / 2**20:.0f} MiB; sending {bad} bad bodies "
            f"and {good} good requests, {concurrency} at a time (body limit {limit} bytes, prompt limit "
            f"{char_limit} characters)")
        t_burst = sampler.now_s()
        t0 = time.perf_counter()
        results = asyncio.run(burst(base_url, reqs, concurrency, timeout_s))
        burst_s = time.perf_counter() - t0
        t_end = sampler.now_s()
        time.sleep(quiet_s)
        after = rss_bytes(pid)
        peak = sampler.peak(t_burst)
    finally:
        sampler.stop()
    good_s = sorted(s for k, st, s, _ in results if k == "good" and st == "200")
    examples = {f"{k} {st}": text for k, st, _, text in results if text and not st.startswith("2")}
    return {"ready": ready, "pre": pre, "peak": peak, "after": after, "ratio": after / pre,
            "counts": summarize(results), "good_s": good_s, "burst_s": burst_s, "char_limit": char_limit,
            "burst_window_s": [t_burst, t_end], "examples": examples,
            "series": [[round(t, 3), b] for t, b in sampler.series]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.memory_burst", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bad", type=int, default=200, help="bad bodies in the burst (default: 200)")
    p.add_argument("--good", type=int, default=50, help="good chat completions in the burst (default: 50)")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight at most (default: 32)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per request (default: 180)")
    p.add_argument("--settle-s", type=float, default=3.0, help="quiet seconds before 'pre' (default: 3)")
    p.add_argument("--quiet-s", type=float, default=5.0, help="quiet seconds after the burst (default: 5)")
    p.add_argument("--sample-ms", type=float, default=20.0, help="RSS sampling period, ms (default: 20)")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_LIMIT,
                   help=f"the server's body limit, bytes (default: {DEFAULT_LIMIT})")
    p.add_argument("--tiny", action="store_true", help="serve the API alone on a tiny random model (fast)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for /health (default: 600)")
    p.add_argument("--server-arg", action="append", default=[], help="extra app.py argument (repeatable)")
    p.add_argument("--server-env", action="append", default=[], metavar="NAME=VALUE",
                   help="environment variable of the server process (repeatable), e.g. MALLOC_ARENA_MAX=2")
    p.add_argument("--json", default=None, help="write the figures and the RSS series to this JSON file")
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    port = args.port or free_port()
    log_path = os.path.join(tempfile.gettempdir(), f"memory_burst_server_{port}.log")
    cmd = server_command(args.tiny, port, args.max_request_body_bytes, args.server_arg)
    print("server:", " ".join(cmd[1:]), f"(log {log_path})", flush=True)
    t0 = time.perf_counter()
    env = dict(kv.split("=", 1) for kv in args.server_env)
    proc = start_server(cmd, port, args.start_timeout, log_path, env)
    print(f"ready in {time.perf_counter() - t0:.1f} s, pid {proc.pid}", flush=True)
    try:
        res = measure(proc.pid, f"http://{HOST}:{port}", bad=args.bad, good=args.good,
                      limit=args.max_request_body_bytes, concurrency=args.concurrency, timeout_s=args.timeout,
                      settle_s=args.settle_s, quiet_s=args.quiet_s, sample_s=args.sample_ms / 1000,
                      log=lambda s: print(s, flush=True))
    finally:
        stop_server(proc)
    mib = 2 ** 20
    print(f"RSS pre {res['pre'] / mib:.0f} MiB, peak {res['peak'] / mib:.0f} MiB, after {args.quiet_s:g} s quiet "
          f"{res['after'] / mib:.0f} MiB: after/pre {res['ratio']:.3f} ({'within' if res['ratio'] <= 1.10 else 'OVER'}"
          f" the 10% bound); burst {res['burst_s']:.1f} s")
    for kind, counts in res["counts"].items():
        print(f"  {kind:14s} " + ", ".join(f"{s}: {n}" for s, n in counts.items()))
    if res["good_s"]:
        g = res["good_s"]
        print(f"  good latency: min {g[0]:.2f} s, median {g[len(g) // 2]:.2f} s, max {g[-1]:.2f} s")
    for key, text in res["examples"].items():
        print(f"  e.g. {key}: {text[:160]}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
