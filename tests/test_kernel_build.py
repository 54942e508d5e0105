"""The C++ build under concurrency (``kernels/cpu_build.py``): two processes that start during one build both
end up on that build (one compile; the second waits, saying so, and loads it; neither falls back to torch), and
torch's lock file left by a killed build is removed instead of waited for forever.

The extension built here is a tiny one (``tests/data/tiny_ext.cpp``) through the same code as the kernels'
(:func:`kernels.cpu_build.build_and_load`); its compiler is a wrapper that holds the compile until the test lets
it go, so the second process surely arrives during the first one's build.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kernels import cpu_build

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "tests" / "data" / "tiny_ext.cpp"
NAME = "cbp_test_tiny"
PROCESS = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
from kernels.cpu_build import build_and_load
mod, info = build_and_load(sys.argv[1], [sys.argv[2]], what="tiny extension")
print(json.dumps({**info, "answer": mod.answer()}), flush=True)
"""

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler")


class Instance:
    """One process building / loading the tiny extension; its stderr lines are collected as they come."""

    def __init__(self, env: dict) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", PROCESS, NAME, str(SOURCE)], cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip())

    def wait_for(self, text: str, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in ln for ln in self.lines):
            if self.proc.poll() is not None and not self.reader.is_alive():
                raise AssertionError(f"exited before {text!r}: {self.lines}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} within {timeout} s: {self.lines}")
            time.sleep(0.05)

    def result(self) -> dict:
        out, _ = self.proc.communicate(timeout=300)
        self.reader.join(10)
        assert self.proc.returncode == 0, "\n".join(self.lines)
        return json.loads(out.strip().splitlines()[-1])


def test_two_instances_during_one_build_share_it(tmp_path):
    go = tmp_path / "go"
    wrapper = tmp_path / "cxx"
    wrapper.write_text(f'#!/bin/sh\nwhile [ ! -e "{go}" ]; do sleep 0.05; done\nexec {os.environ.get("CXX", "c++")} "$@"\n')
    wrapper.chmod(0o755)
    build_root = tmp_path / "ext"
    (build_root / NAME).mkdir(parents=True)
    (build_root / NAME / "lock").write_text("")  # torch's baton, as a build killed half-way leaves it
    env = {**os.environ, "CBP_KERNEL_BUILD_DIR": str(build_root), "CXX": str(wrapper), "OMP_NUM_THREADS": "1"}

    first = Instance(env)
    first.wait_for("compiling cbp_test_tiny")  # it holds the build folder's lock, its compiler is held
    second = Instance(env)
    second.wait_for("waiting for its build")
    go.write_text("")
    a, b = first.result(), second.result()

    assert a["answer"] == b["answer"] == 42  # both loaded the extension: no torch fallback
    assert a["compiled"] and a["waited"] == 0
    assert not b["compiled"] and b["waited"] > 0  # no second compile: it loaded the first one's build
    assert a["directory"] == b["directory"] == str(build_root / NAME)
    assert any("removing" in ln and "interrupted" in ln for ln in first.lines), first.lines  # the orphaned baton
    assert not any("compiling" in ln for ln in second.lines), second.lines
    assert not (build_root / NAME / "lock").exists()


def test_the_pinned_ninja_runs_the_build(monkeypatch):
    """The build's PATH starts with the pinned ninja's folder (the pip package's binary), whatever ninja the
    system has, and PATH is restored afterwards."""
    folder = cpu_build.ninja_dir()
    if folder is None:
        pytest.skip("the ninja package is not installed")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    with cpu_build._pinned_ninja():
        assert shutil.which("ninja") == os.path.join(folder, "ninja")
    assert os.environ["PATH"] == "/usr/bin:/bin"


def test_heartbeat_says_something_while_a_block_runs(caplog):
    caplog.set_level("INFO", logger="kernels.cpu_build")
    with cpu_build.heartbeat(lambda s: f"still busy ({s:.1f} s)", every=0.05):
        time.sleep(0.3)
    beats = [r.getMessage() for r in caplog.records if r.getMessage().startswith("still busy")]
    assert len(beats) >= 3


def test_a_build_folder_that_cannot_be_created_is_a_build_error(tmp_path, monkeypatch):
    """A build folder that cannot be created is a BuildError (the engine then takes the torch path with one
    warning), not a crash."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("CBP_KERNEL_BUILD_DIR", str(blocker))  # a file where a folder must be
    with pytest.raises(cpu_build.BuildError, match="cannot use the build folder"):
        cpu_build.build_and_load(NAME, [str(SOURCE)])
