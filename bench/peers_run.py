"""The subprocesses of the vLLM comparison (``bench/peers.py``): vLLM's offline worker in its own venv,
and the two HTTP servers (ours, vLLM's) each driven by vLLM's serving benchmark client.

Children hand back one ``@@PEERS_RESULT {json}`` line; their full output goes to a log file.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
RESULT_PREFIX = "@@PEERS_RESULT "
SERVED_NAME = "smollm2"


def peers_python(venv: str) -> str:
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        raise SystemExit(f"{py} not found: run `bash bench/peers_setup.sh` (or `make bench-peers`) first")
    return py


def child_env(threads: int, kv_cache_gib: float, peers: bool) -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    if peers:
        env.pop("PYTHONPATH", None)  # the peers venv must not see the project's packages
        env["VLLM_CPU_KVCACHE_SPACE"] = str(int(round(kv_cache_gib)))
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
        env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


def cpu_times() -> tuple[int, int] | None:
    """``(steal, total)`` clock ticks of all CPUs from ``/proc/stat`` (None off Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    ticks = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return ticks[7], sum(ticks)


def steal_since(start: tuple[int, int] | None) -> float | None:
    """Percent of CPU time the hypervisor gave to other guests since ``start`` (:func:`cpu_times`): on a
    shared VM a half of the comparison that ran while this was high ran on a slower machine."""
    end = cpu_times()
    if start is None or end is None or end[1] <= start[1]:
        return None
    return 100.0 * (end[0] - start[0]) / (end[1] - start[1])


def peers_versions(venv: str) -> dict:
    """vLLM's and torch's versions in the peers venv, from its installed package metadata (no import)."""
    import glob

    out = {}
    for key, names in (("vllm", ("vllm_cpu", "vllm")), ("vllm torch", ("torch",))):
        for name in names:
            found = sorted(glob.glob(os.path.join(venv, "lib", "python*", "site-packages", f"{name}-*.dist-info")))
            if found:
                out[key] = os.path.basename(found[-1])[len(name) + 1:-len(".dist-info")]
                break
    return out


def read_result(text: str) -> dict | None:
    """The last ``@@PEERS_RESULT {...}`` line of a child's output, parsed (None if absent)."""
    found = None
    for ln in text.splitlines():
        if ln.startswith(RESULT_PREFIX):
            found = json.loads(ln[len(RESULT_PREFIX):])
    return found


def _tail(path: str, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def _error_lines(path: str, n: int = 6) -> str:
    """The last few distinct error lines of a log (``...Error: ...``), for a short report."""
    try:
        with open(path, errors="replace") as f:
            lines = [ln.rstrip() for ln in f if "Error" in ln or "error" in ln]
    except OSError:
        return ""
    seen: list[str] = []
    for ln in reversed(lines):
        if ln not in seen:
            seen.append(ln)
        if len(seen) >= n:
            break
    return "\n".join(reversed(seen))


def run_child(cmd: list[str], env: dict, log_path: str, timeout: float) -> dict:
    """Run ``cmd`` with its output in ``log_path``; its ``@@PEERS_RESULT`` JSON, or SystemExit."""
    with open(log_path, "w") as logf:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(p)
            raise SystemExit(
                f"timed out after {timeout:.0f} s: {' '.join(cmd)}\n--- {log_path} ---\n{_tail(log_path)}") from None
    with open(log_path, errors="replace") as f:
        res = read_result(f.read())
    if rc != 0 or res is None:
        raise SystemExit(f"failed (exit {rc}): {' '.join(cmd)}\n--- tail of {log_path} ---\n{_tail(log_path)}")
    return res


def run_vllm(spec: dict, args, log=print) -> dict:
    """vLLM's offline side: ``bench/vllm_worker.py`` in the peers venv on the same spec."""
    py = peers_python(args.peers_venv)
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        cmd = [py, "-P", os.path.join(BENCH, "vllm_worker.py"), "--model", args.hf_dir, "--spec", spec_path,
               "--dtype", args.dtype, "--threads", str(args.threads), "--kv-cache-gib", str(int(round(args.kv_cache_gib))),
               "--max-num-seqs", str(args.max_num_seqs)]
        if args.max_num_batched_tokens:
            cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        log_path = os.path.join(args.log_dir, "vllm_worker.log")
        log(f"vllm: {' '.join(cmd)}  (log: {log_path})")
        res = run_child(cmd, child_env(args.threads, args.kv_cache_gib, True), log_path, args.timeout)
    log(f"vllm: loaded in {res.get('load_s', 0):.1f} s")
    return res


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_group(p: subprocess.Popen, grace: float = 20.0) -> None:
    """Stop a child started with ``start_new_session=True`` and everything it started (vLLM's engine
    processes): SIGTERM to its process group, SIGKILL after ``grace`` seconds."""
    if p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=grace)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def wait_ready(url: str, p: subprocess.Popen, timeout: float, log_path: str) -> float:
    """Poll ``url`` until it answers 200; seconds waited. SystemExit if the server dies or times out."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if p.poll() is not None:
            raise SystemExit(f"server exited ({p.returncode}) before it was ready\n--- {log_path} ---\n{_tail(log_path)}")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return time.perf_counter() - t0
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(1.0)
    raise SystemExit(f"server not ready after {timeout:.0f} s: {url}\n--- {log_path} ---\n{_tail(log_path)}")


def client_cmd(py: str, port: int, args, out_path: str) -> list[str]:
    """vLLM's serving benchmark client against ``127.0.0.1:port`` (random dataset, all at once)."""
    return [py, "-P", os.path.join(BENCH, "vllm_serve_client.py"), "--out", out_path,
            "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
            "--model", args.hf_dir, "--tokenizer", args.hf_dir, "--served-model-name", SERVED_NAME,
            "--dataset-name", "random", "--random-input-len", str(args.http_input_len),
            "--random-output-len", str(args.http_output_len), "--num-prompts", str(args.http_num_prompts),
            "--request-rate", "inf", "--ignore-eos", "--temperature", "0", "--seed", "0", "--disable-tqdm"]


def server_cmds(args, port_ours: int, port_vllm: int) -> tuple[list[str], list[str]]:
    ours = [sys.executable, os.path.join(ROOT, "app.py"), "--host", "127.0.0.1", "--port", str(port_ours),
            "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory", f"{args.kv_cache_gib}GiB",
            "--dtype", args.dtype, "--served-model-name", SERVED_NAME]
    vllm = [peers_python(args.peers_venv), "-P", "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
            "--port", str(port_vllm), "--model", args.hf_dir, "--served-model-name", SERVED_NAME,
            "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs)]
    if args.max_num_batched_tokens:
        ours += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        vllm += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    return ours, vllm


def run_http(which: str, server: list[str], port: int, args, log=print) -> dict:
    """Start ``server`` (ours or vLLM's), drive it with vLLM's client, stop it; the client's summary."""
    py = peers_python(args.peers_venv)
    slog = os.path.join(args.log_dir, f"http_server_{which}.log")
    clog = os.path.join(args.log_dir, f"http_client_{which}.log")
    env = child_env(args.threads, args.kv_cache_gib, which == "vllm")
    log(f"{which}: {' '.join(server)}  (log: {slog})")
    with open(slog, "w") as logf:
        p = subprocess.Popen(server, cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        ready = wait_ready(f"http://127.0.0.1:{port}/v1/models", p, args.timeout, slog)
        log(f"{which}: server ready in {ready:.0f} s")
        with tempfile.TemporaryDirectory() as tmp:
            cmd = client_cmd(py, port, args, os.path.join(tmp, "r.json"))
            res = run_child(cmd, child_env(args.threads, args.kv_cache_gib, True), clog, args.timeout)
        res["server_ready_s"] = ready
        res["server_log"] = slog
        if res.get("failed") or res.get("completed", 0) < args.http_num_prompts:
            res["invalid"] = (f"{res.get('failed')} of {args.http_num_prompts} requests failed "
                              f"(errors {res.get('first_errors')}; server log {slog})")
            log(f"{which}: HTTP run INVALID: {res['invalid']}")
            log(_error_lines(slog))
        return res
    finally:
        _kill_group(p)
