"""Remote mode against a real server: our own ``app.py`` started as a separate process on a tiny random-weight
model saved to a folder, driven only through its HTTP interfaces, as a vLLM deployment would be: a chat streams
through :class:`ui.remote.client.RemoteClient`, the counters read from ``/metrics`` move, Stop (the page's
handler) aborts the request on the server, the KV map receives the server's KV events (when the server has
``--kv-events-config``), and ``app.py --backend-url`` serves the remote page. Every wait is bounded; the
processes are killed at the end."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import app
from ui.remote.client import RemoteClient
from ui.remote.kv import KVMap, KVSubscriber
from ui.remote.metrics import MetricsScraper, parse_metrics
from ui.remote.page import build_remote_app

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT = 240  # seconds: model load, and the C++ kernel build on a machine that never built it
HAS_KV_EVENTS = "kv_events_config" in {a.dest for a in app.build_parser(env={})._actions}
LONG_PROMPT = ("Here is a long shared preamble that several chats send word for word, so that its full KV "
               "blocks are stored once and found again by the prefix cache. " * 3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the process exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"{url} did not answer within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model, tokenizer):
    """Our server on the tiny model: ``{"url", "kv", "replay"}`` (KV endpoints None without the flag)."""
    folder = tmp_path_factory.mktemp("tiny-model")
    tiny_model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    port = _free_port()
    argv = [sys.executable, "app.py", "--model", str(folder), "--port", str(port), "--num-blocks", "256",
            "--max-num-seqs", "8", "--dtype", "float32", "--device", "cpu", "--log-level", "warning"]
    kv = replay = None
    if HAS_KV_EVENTS:
        kv_port, replay_port = _free_port(), _free_port()
        kv, replay = f"tcp://127.0.0.1:{kv_port}", f"tcp://127.0.0.1:{replay_port}"
        # as vLLM, the server binds an endpoint with "*" (and connects to any other)
        argv += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                   "endpoint": f"tcp://*:{kv_port}",
                                                   "replay_endpoint": f"tcp://*:{replay_port}", "topic": "kv-events"})]
    log = folder / "server.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_http(url + "/health", proc, log, START_TIMEOUT)
        yield {"url": url, "kv": kv, "replay": replay, "log": log}
    finally:
        _stop(proc)


def _samples(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def _aborted(url: str) -> float:
    return sum(v for (name, labels), v in _samples(url).items()
               if name.startswith("cbp:request_success") and name.endswith("_total") and
               dict(labels).get("finished_reason") == "abort")


def _messages(text: str = "Count slowly from one to one thousand.") -> list[dict]:
    return [{"role": "user", "content": text}]


def test_a_chat_streams_and_the_counters_move(server):
    url = server["url"]

    async def run():
        client = RemoteClient(url)
        scraper = MetricsScraper([url], timeout=30)  # (its 2 s default: a loaded machine may be slower)
        (before,) = scraper.scrape()[0].engines
        chunks, running_seen = 0, []
        async for _ in client.stream_chat(_messages(), max_tokens=160, temperature=0.0, extra={"ignore_eos": True}):
            chunks += 1
            if chunks in (3, 20):
                (e,) = (await asyncio.to_thread(scraper.scrape))[0].engines
                running_seen.append(e.running)
        (after,) = scraper.scrape()[0].engines
        return client, before, after, chunks, running_seen

    client, before, after, chunks, running_seen = asyncio.run(run())
    assert client.model and chunks >= 10
    (rec,) = client.log.records()
    assert (rec.status, rec.finish_reason, rec.completion_tokens) == ("finished", "length", 160)
    assert before.dialect in ("cbp", "vllm") and max(running_seen) >= 1, running_seen
    if before.dialect == "vllm":  # our server's vLLM names: engine "0", vllm:cache_config_info
        assert (before.engine, before.block_size, before.num_gpu_blocks) == ("0", 16, 256)
        assert after.ttft is not None and after.ttft.count >= 1 and after.itl is not None
    assert after.generation_tokens - before.generation_tokens >= 160
    assert after.raw.get("cbp:num_requests_pending", 0) == 0


def test_stop_on_the_page_aborts_the_request_on_the_server(server):
    url = server["url"]
    aborted_before = _aborted(url)

    async def run():
        client = RemoteClient(url)
        demo = build_remote_app(client, MetricsScraper([url], timeout=30), refresh_s=1.0)
        h, tab = demo.cbp_remote, SimpleNamespace(session_hash="tab", headers={})
        await h.chat.start("Count slowly from one to one thousand.", [], tab, temperature=0.0, top_p=1.0,
                           max_new_tokens=600)
        deadline = time.monotonic() + 60
        while not json.loads(h.poll("tab"))["chat"]["text"]:  # the first text
            assert time.monotonic() < deadline, "no text within 60 s"
            await asyncio.sleep(0.02)
        pending = parse_metrics(httpx.get(url + "/metrics", timeout=30).text)[0].raw["cbp:num_requests_pending"]
        await h.chat.stop(tab)
        await asyncio.sleep(0.2)  # the reply's task closes its stream
        history, _send = h.chat.commit(tab)
        _header, _notice, counters, timeline, *_ = await h.refresh()
        return client, pending, history, counters, timeline

    client, pending, history, counters, timeline = asyncio.run(run())
    assert pending == 1
    assert history[-2]["metadata"]["id"] == "cbp-stopped" and history[-2]["metadata"]["title"].startswith("⏹")
    assert client.log.records()[-1].status == "aborted"
    deadline = time.monotonic() + 60
    while True:
        samples = {name: v for (name, _), v in _samples(url).items()}
        if samples.get("cbp:num_requests_pending") == 0 and _aborted(url) > aborted_before:
            break
        assert time.monotonic() < deadline, f"not aborted on the server: {samples.get('cbp:num_requests_pending')}"
        time.sleep(0.2)
    assert "(cbp)" in counters or "(vllm)" in counters
    assert len(timeline.data[0].y) == 1


@pytest.mark.skipif(not HAS_KV_EVENTS, reason="the server has no --kv-events-config yet (server/ is being "
                                               "extended to publish KV cache events): KV map not tested end to end")
def test_the_kv_map_receives_the_servers_block_stored_events(server):
    url = server["url"]
    kv_map = KVMap()
    # (a replay that answers later than the 2 s default on a loaded machine would count as lost)
    sub = KVSubscriber(server["kv"], kv_map, server["replay"], topic="kv-events", replay_timeout=30).start()
    try:
        assert sub.connected.wait(30)
        time.sleep(0.5)  # a SUB socket gets only what is published after it joined

        async def run():
            client = RemoteClient(url)
            for _ in range(2):
                async for _ in client.stream_chat(_messages(LONG_PROMPT), max_tokens=4, temperature=0.0):
                    pass

        asyncio.run(run())
        deadline = time.monotonic() + 60
        while kv_map.totals.stored < 2 or not any(r.depth >= 1 for r in kv_map.records()):
            assert time.monotonic() < deadline, f"no BlockStored chain: {kv_map.totals} {sub.error}"
            time.sleep(0.1)
    finally:
        sub.stop()
    assert sub.error is None and kv_map.block_size == 16 and kv_map.totals.lost == 0
    e = parse_metrics(httpx.get(url + "/metrics", timeout=30).text)[0]
    assert e.prefix_hits and e.prefix_hits >= 32  # the second chat found the first one's blocks


def test_app_backend_url_serves_the_remote_page(server, tmp_path):
    port = _free_port()
    log = tmp_path / "remote.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CBP_BACKEND_URL": server["url"]}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "app.py", "--port", str(port)], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, env=env)
    try:
        _wait_http(f"http://127.0.0.1:{port}/", proc, log, START_TIMEOUT)
        page = httpx.get(f"http://127.0.0.1:{port}/config", timeout=30).text
        assert "remote mode" in page and server["url"] in page
        assert "remote mode: UI at /" in log.read_text()
    finally:
        _stop(proc)
