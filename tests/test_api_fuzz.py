"""Schema-driven fuzzing of the API with Schemathesis (a well-kept library: we write no fuzzer of our own).

A real server process (:mod:`bench.tiny_server`: a tiny random model behind :func:`server.build_server` and
:func:`server.serve`, the playground's uvicorn protocol and HTTP limits) on a free port; Schemathesis reads its
``/openapi.json`` and sends every operation examples, boundary values and random bodies, valid and not
(a bounded number per operation, fixed seed: about half a minute). Every answer must be no 5xx, documented
(status code, content type) and match its documented schema (server-sent events included); the server must
answer ``/health`` afterwards.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server_url():
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "bench.tiny_server", str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600  # the tokenizer (and, on a fresh checkout, the C++ kernels' build) first
    try:
        while True:
            if proc.poll() is not None:
                out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
                pytest.fail(f"the server process ended at start (status {proc.returncode}):\n{out[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("the server process did not answer /health within 600 s")
            time.sleep(0.5)
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_schemathesis_finds_no_server_error_and_no_schema_violation(server_url, tmp_path):
    url, proc = server_url
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json", "--checks", CHECKS,
           "--max-examples", "20", "--seed", "20261207", "--generation-database", "none", "--workers", "1",
           "--request-timeout", "30", "--suppress-health-check", "all", "--no-color", "--max-failures", "5"]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    assert "generated" in out and " passed" in out, out[-2000:]
    assert proc.poll() is None, "the server process died"
    health = httpx.get(url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
