"""Run a command so that it is never silent for long: ``python scripts/heartbeat.py LABEL -- COMMAND ...``.

On a terminal the command runs as it is (pip draws its own progress bars there, which name the package being
installed). Otherwise (a pipe: CI logs, ``make demo | tee``) its output is passed through as it comes, and
after 10 s without a byte a line says that LABEL is still running, every 10 s until the command prints again
(pip prints nothing while it unpacks a wheel: a minute or more for torch). Exits with the command's status.
Standard library only: the Makefile runs it before the virtual environment exists.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

QUIET_S = 10.0


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: heartbeat.py LABEL -- COMMAND ...", file=sys.stderr)
        return 2
    label, cmd = argv[0], argv[2:]
    if sys.stdout.isatty():
        return subprocess.call(cmd)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    t0 = last = time.monotonic()
    lock = threading.Lock()

    def beat() -> None:
        nonlocal last
        while proc.poll() is None:
            time.sleep(1.0)
            with lock:
                if time.monotonic() - last >= QUIET_S:
                    sys.stdout.write(f"   ... {label}: still running ({time.monotonic() - t0:.0f} s)\n")
                    sys.stdout.flush()
                    last = time.monotonic()

    threading.Thread(target=beat, daemon=True).start()
    out = sys.stdout.buffer
    while chunk := os.read(proc.stdout.fileno(), 65536):
        with lock:
            out.write(chunk)
            out.flush()
            last = time.monotonic()
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
