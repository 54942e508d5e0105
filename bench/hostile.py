"""What hostile visitors cost the server (``python -m bench.hostile``): the figures of docs/performance.md.

Starts the API in a separate process (:mod:`bench.tiny_server`: a tiny random model behind
``server.build_server`` and ``server.serve``, the playground's uvicorn protocol and HTTP limits; ``--url``: a
server already running instead), then, on loopback only:

1. **bodies**: each hostile body kind, alone: status and seconds to its answer (client side, the upload of up to
   4 MiB included);
2. **/health under attack**: ``/health`` polled every 5 ms on its own connection, from a process of its own,
   while ``--attackers`` (8) hostile bodies of one kind arrive at once, ``--rounds`` times per kind: p50 / p99 /
   max latency (ms) of the polls under way during the attack, and the same for 2 s of quiet beforehand;
3. **heads**: a 128 MiB header and 100,000 header fields: status and seconds to it; a slowloris head (one
   byte every 0.5 s): seconds until the server drops it (the server's ``--timeout-request-head``);
4. **parsers** (``--parsers``): GET /health requests a second on one kept-alive connection for uvicorn's
   httptools protocol as it is, with the edge's limits (``server.http_edge``), and h11 with its head limit,
   each in its own server process, one after the other, ``--parser-rounds`` times interleaved (medians).

Prints the CPU, the load average before and after (other processes share the cores), and every figure;
``--json PATH`` keeps them.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
CHAT = [{"role": "user", "content": "hi"}]
JSON_HEADERS = {"content-type": "application/json"}


def hostile_bodies() -> dict[str, bytes]:
    """Hostile bodies (each at most 4 MiB) by kind."""
    def dumps(obj) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

    return {
        "stop: 1M integers (2 MB)": dumps({"messages": CHAT, "stop": [1] * 1_000_000}),
        "stop: 500k strings": dumps({"messages": CHAT, "stop": ["a"] * 500_000}),
        "allowed_token_ids: 500k strings": dumps({"messages": CHAT, "allowed_token_ids": ["x"] * 500_000}),
        "logit_bias: 200k bad values": dumps({"messages": CHAT, "logit_bias": {str(i): "x" for i in range(200_000)}}),
        "messages: 120k": dumps({"messages": CHAT * 120_000}),
        "unknown field: 1.5M items": dumps({"messages": CHAT, "junk": [0] * 1_500_000}),
        "nesting 100k deep": b'{"messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"a":'
                             + b"[" * 100_000 + b"]" * 100_000 + b"}}",
    }


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def start_server(port: int, protocol: str = "edge") -> subprocess.Popen:
    """The tiny API on ``port`` (``protocol``: ``edge`` = as served; for ``--parsers`` also ``httptools``, ``h11``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "bench.tiny_server", str(port), "--protocol", protocol], cwd=ROOT,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_ready(url: str, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{url} did not answer /health within {timeout:.0f} s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------- measurements
def time_body(url: str, raw: bytes) -> tuple[int, float]:
    with httpx.Client(base_url=url, timeout=300) as h:
        t0 = time.perf_counter()
        r = h.post("/v1/chat/completions", content=raw, headers=JSON_HEADERS)
        return r.status_code, time.perf_counter() - t0


def _poll(url: str, done, out) -> None:
    """The poller process: GET /health every 5 ms on one connection until ``done``; ``(start, end)`` of each
    (``time.monotonic``, the same clock in every process) to ``out``."""
    polls: list[tuple[float, float]] = []
    with httpx.Client(base_url=url, timeout=300) as h:
        while not done.is_set():
            t0 = time.monotonic()
            h.get("/health")
            polls.append((t0, time.monotonic()))
            time.sleep(0.005)
    out.put(polls)


def health_under_attack(url: str, raw: bytes | None, attackers: int) -> dict:
    """/health latencies (ms) while ``attackers`` copies of ``raw`` arrive at once (None: quiet, 2 s). The poller
    runs in a process of its own, so that the attacking threads' share of this one's GIL is not measured."""
    ctx = multiprocessing.get_context("spawn")
    done, out = ctx.Event(), ctx.Queue()
    statuses: list[int] = []

    def attack():
        statuses.append(time_body(url, raw)[0] if raw is not None else 0)

    poller = ctx.Process(target=_poll, args=(url, done, out))
    poller.start()
    time.sleep(1.5)  # the poller's start
    t0, start = time.perf_counter(), time.monotonic()
    if raw is None:
        time.sleep(2.0)
    else:
        threads = [threading.Thread(target=attack) for _ in range(attackers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    wall, end = time.perf_counter() - t0, time.monotonic()
    done.set()
    polls = out.get(timeout=60)
    poller.join()
    # the polls under way during the attack (a poll that began before it and ended within it counts)
    latencies = [(b - a) * 1000 for a, b in polls if b >= start and a <= end] or [0.0]
    q = statistics.quantiles(latencies, n=100, method="inclusive") if len(latencies) > 1 else latencies * 99
    return {"p50_ms": round(q[49], 1), "p99_ms": round(q[98], 1), "max_ms": round(max(latencies), 1),
            "polls": len(latencies), "attack_s": round(wall, 2), "statuses": sorted(set(statuses))}


def raw_exchange(url: str, parts, gap: float = 0.0, timeout: float = 120.0) -> tuple[str, float]:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        t0 = time.perf_counter()
        try:
            for i, part in enumerate(parts):
                if gap and i:
                    time.sleep(gap)
                sock.sendall(part)
        except OSError:
            pass
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except OSError:
            pass
        return got.split(b"\r\n", 1)[0].decode(errors="replace") or "(closed)", time.perf_counter() - t0


def heads(url: str, slowloris: bool) -> dict:
    out = {}
    big = b"GET /health HTTP/1.1\r\nHost: b\r\nX-Big: "

    def chunks():
        yield big
        block = b"a" * (1 << 20)
        for _ in range(128):
            yield block
        yield b"\r\n\r\n"

    out["128 MiB header"] = raw_exchange(url, chunks())
    fields = b"".join(b"X-F%d: 1\r\n" % i for i in range(100_000))
    out["100,000 header fields"] = raw_exchange(url, [b"GET /health HTTP/1.1\r\nHost: b\r\n" + fields + b"\r\n"])
    if slowloris:
        head = b"GET /health HTTP/1.1\r\nHost: b\r\nX-Slow: " + b"s" * 200 + b"\r\n\r\n"
        out["slowloris (1 byte / 0.5 s)"] = raw_exchange(url, (head[i:i + 1] for i in range(len(head))), gap=0.5)
    return {k: {"status": s, "seconds": round(t, 3)} for k, (s, t) in out.items()}


def parser_rate(protocol: str, seconds: float) -> float:
    """GET /health a second, one kept-alive connection, on a fresh server with ``protocol``."""
    port = free_port()
    proc = start_server(port, protocol)
    try:
        wait_ready(f"http://{HOST}:{port}")
        with socket.create_connection((HOST, port)) as sock:
            req = b"GET /health HTTP/1.1\r\nHost: b\r\n\r\n"
            n, end = 0, time.perf_counter() + seconds
            t0 = time.perf_counter()
            while time.perf_counter() < end:
                sock.sendall(req)
                got = b""
                while not got.endswith(b"}"):
                    got += sock.recv(65536)
                n += 1
            return n / (time.perf_counter() - t0)
    finally:
        proc.terminate()
        proc.wait(10)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="attack this running server instead of starting one")
    p.add_argument("--attackers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-slowloris", action="store_true", help="skip the slow head (it waits for the head timeout)")
    p.add_argument("--no-heads", action="store_true", help="skip the header attacks (for a server without limits)")
    p.add_argument("--parsers", action="store_true", help="also compare the HTTP protocols' request rates")
    p.add_argument("--parser-seconds", type=float, default=5.0)
    p.add_argument("--parser-rounds", type=int, default=3, help="rounds of the three protocols, interleaved")
    p.add_argument("--json", help="write every figure here")
    a = p.parse_args(argv)
    report: dict = {"cpu": cpu_name(), "cores": os.cpu_count(), "load_before": load()}
    print(f"CPU {report['cpu']} ({report['cores']} cores); load average {report['load_before']}", flush=True)
    proc = None
    url = a.url
    if url is None:
        port = free_port()
        proc = start_server(port)
        url = f"http://{HOST}:{port}"
    try:
        wait_ready(url)
        bodies = hostile_bodies()
        report["bodies"] = {}
        for name, raw in bodies.items():
            status, seconds = time_body(url, raw)
            report["bodies"][name] = {"bytes": len(raw), "status": status, "seconds": round(seconds, 3)}
            print(f"body   {name:34s} {len(raw) / 1e6:5.2f} MB -> {status} in {seconds * 1000:7.1f} ms", flush=True)
        report["health"] = {"quiet": health_under_attack(url, None, 0)}
        print(f"health quiet: {report['health']['quiet']}", flush=True)
        for name, raw in bodies.items():
            rounds = [health_under_attack(url, raw, a.attackers) for _ in range(a.rounds)]
            report["health"][name] = rounds
            for r in rounds:
                print(f"health x{a.attackers} {name:30s} p50 {r['p50_ms']:6.1f}  p99 {r['p99_ms']:6.1f}  max "
                      f"{r['max_ms']:6.1f} ms ({r['polls']} polls, attack {r['attack_s']} s, {r['statuses']})",
                      flush=True)
        report["heads"] = {} if a.no_heads else heads(url, not a.no_slowloris)
        for name, r in report["heads"].items():
            print(f"head   {name:30s} {r['status']} after {r['seconds']} s", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
    if a.parsers:
        rates: dict[str, list[float]] = {"httptools": [], "edge": [], "h11": []}
        for _ in range(a.parser_rounds):
            for protocol, got in rates.items():
                got.append(round(parser_rate(protocol, a.parser_seconds), 1))
                print(f"parser {protocol:10s} {got[-1]:8.1f} GET /health per second (one connection)", flush=True)
        report["parsers_rps"] = rates
        for protocol, got in rates.items():
            print(f"parser {protocol:10s} median {statistics.median(got):8.1f} of {got}", flush=True)
    report["load_after"] = load()
    print(f"load average after: {report['load_after']}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
