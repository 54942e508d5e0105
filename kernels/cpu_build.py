"""Build and load a C++ extension with ``torch.utils.cpp_extension.load``, safely when several processes start
at once, and never silently.

* **One build at a time, never a live one taken over.** An OS file lock (the ``filelock`` package:
  ``flock``, released by the kernel when its process dies, however it dies) is held around the whole build
  and load. A second process that finds it held logs one line saying that it waits for the other build,
  then a line every :data:`HEARTBEAT_S` seconds, and loads the finished build (no second compile). A build
  killed half-way leaves torch's own ``lock`` file behind, which would make torch wait forever: with the OS
  lock held no live build can own it, so it is removed, with a line saying so.
* **One ninja.** The build runs the ``ninja`` pinned in requirements.txt (the pip package's binary, put first
  on ``PATH`` for the build), whatever other ninja the system has: two ninja versions discard each other's
  build log, and then every start rebuilds.
* **Never silent.** A compile is announced with an estimate, and a line follows every :data:`HEARTBEAT_S`
  seconds until it ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from kernels import envs

_log = logging.getLogger(__name__)
HEARTBEAT_S = 10.0  # seconds between two "still building / still waiting" lines
LOCK_FILE = "cbp-build.lock"  # the OS lock's file, in the build folder (torch's own baton is "lock")


class BuildError(RuntimeError):
    """The extension could not be built or loaded; the message says why."""


def extensions_root() -> str:
    """The folder that holds one build folder per extension: ``$CBP_KERNEL_BUILD_DIR`` if set, else torch's
    extensions folder (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions/py311_cpu``)."""
    chosen = envs.CBP_KERNEL_BUILD_DIR
    if chosen:
        return str(chosen)
    from torch.utils import cpp_extension

    try:  # torch's own choice, with its Python / accelerator subfolder (a private helper: fall back to the root)
        return os.path.dirname(cpp_extension._get_build_directory("x", False))
    except Exception:
        return cpp_extension.get_default_build_root()


def build_folder(name: str) -> str:
    """The build folder of extension ``name`` (created if missing)."""
    folder = os.path.join(extensions_root(), name)
    os.makedirs(folder, exist_ok=True)
    return folder


def is_built(name: str, folder: str) -> bool:
    """Whether the compiled library of ``name`` lies in ``folder`` (then loading takes about a second)."""
    return os.path.isfile(os.path.join(folder, f"{name}.so"))


def ninja_dir() -> str | None:
    """The folder of the pinned ``ninja`` binary (the pip package's), or None when it is not installed."""
    try:
        import ninja

        folder = str(ninja.BIN_DIR)
    except (ImportError, AttributeError):
        return None
    return folder if os.path.isfile(os.path.join(folder, "ninja")) else None


@contextlib.contextmanager
def _pinned_ninja() -> Iterator[None]:
    """``PATH`` with the pinned ninja's folder first, for the duration of the block (torch runs ``ninja``
    from ``PATH``); restored afterwards."""
    folder = ninja_dir()
    before = os.environ.get("PATH", "")
    if folder is not None:
        os.environ["PATH"] = folder + os.pathsep + before
    try:
        yield
    finally:
        os.environ["PATH"] = before


@contextlib.contextmanager
def heartbeat(line: Callable[[float], str], every: float = HEARTBEAT_S,
              log: logging.Logger | None = None) -> Iterator[None]:
    """Log ``line(seconds since the block began)`` at INFO every ``every`` seconds while the block runs (on
    ``log``, default this module's logger), so a long wait is never silent."""
    done = threading.Event()
    t0 = time.monotonic()
    logger = log or _log

    def beat() -> None:
        while not done.wait(every):
            logger.info(line(time.monotonic() - t0))

    thread = threading.Thread(target=beat, name="cbp-build-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _acquire(lock, folder: str, what: str) -> float:
    """Take the OS lock of the build folder; when another live process holds it, say so and wait (with a
    heartbeat). Returns the seconds waited."""
    from filelock import Timeout

    try:
        lock.acquire(blocking=False)
        return 0.0
    except Timeout:
        pass
    _log.info("%s: another process is building them in %s; waiting for its build (no second compile)", what, folder)
    t0 = time.monotonic()
    with heartbeat(lambda s: f"{what}: still waiting for the other process's build ({s:.0f} s)"):
        lock.acquire()
    return time.monotonic() - t0


def _remove_orphaned_baton(folder: str, what: str) -> None:
    """Remove torch's ``lock`` file left by a build that was killed half-way (torch would wait for it
    forever). Called with the OS lock held: no live build of ours can own it."""
    baton = os.path.join(folder, "lock")
    if os.path.exists(baton):
        _log.warning("%s: removing %s, left by a build that was interrupted", what, baton)
        with contextlib.suppress(OSError):
            os.remove(baton)


BUILD_CPU_S = 190.0  # CPU seconds of a first build (measured: AMD EPYC Zen 4, g++ 12; the six sources in parallel)


def estimate() -> str:
    """How long a first build takes on this machine, in words: :data:`BUILD_CPU_S` of CPU time spread over the
    cores ninja uses (at most the six sources at once), longer while other programs take the cores."""
    cores = max(1, min(os.cpu_count() or 1, 6))
    idle = BUILD_CPU_S / cores / 60
    return (f"about {BUILD_CPU_S / 60:.0f} minutes of CPU time: {idle:.1f}-{1.5 * idle:.1f} minutes with {cores} idle "
            f"core{'s' if cores > 1 else ''}, longer on a busy machine")


def build_and_load(name: str, sources: Sequence[str], *, extra_cflags: Sequence[str] = (),
                   extra_ldflags: Sequence[str] = (), extra_include_paths: Sequence[str] = (),
                   what: str = "C++ kernels") -> tuple[object, dict]:
    """Build (first time) or load (later) the extension ``name`` under the build folder's OS lock.

    Args:
        name: the extension's name (its build folder and library are named after it).
        sources: C++ source paths. extra_cflags, extra_ldflags, extra_include_paths: as torch's ``load``.
        what: how the log lines name the extension.

    Returns:
        ``(module, info)``: ``info`` has ``name``, ``seconds`` (build or load, waiting excluded),
        ``compiled`` (bool), ``waited`` (seconds spent waiting for another process's build), ``directory``.

    Raises:
        BuildError: no C++ compiler, a build folder that cannot be created or locked, or the build or the load
            failed (the first compiler error in the message).
    """
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise BuildError(f"no C++ compiler found ({cxx!r} is not on PATH)")
    if ninja_dir() is None and shutil.which("ninja") is None:
        raise BuildError("ninja not found (pip install ninja)")
    from filelock import FileLock
    from torch.utils import cpp_extension

    try:
        folder = build_folder(name)
        lock = FileLock(os.path.join(folder, LOCK_FILE))
        waited = _acquire(lock, folder, what)
    except OSError as e:  # a build folder that cannot be created or locked (permissions, a full disk)
        raise BuildError(f"cannot use the build folder of {name}: {e}") from e
    try:
        _remove_orphaned_baton(folder, what)
        cached = is_built(name, folder)
        if not cached:
            _log.info("%s: compiling %s (once per CPU and version; %s), then cached in %s", what, name, estimate(),
                      folder)
        t0 = time.perf_counter()
        verb = "compiling" if not cached else "loading (ninja checks the build)"
        try:
            with _pinned_ninja(), heartbeat(lambda s: f"{what}: still {verb} ({s:.0f} s)"):
                mod = cpp_extension.load(name=name, sources=list(sources), extra_cflags=list(extra_cflags),
                                         extra_ldflags=list(extra_ldflags),
                                         extra_include_paths=list(extra_include_paths), build_directory=folder,
                                         verbose=bool(envs.CBP_KERNEL_BUILD_VERBOSE))
        except Exception as e:  # compiler errors arrive as RuntimeError / CalledProcessError / ImportError
            msg = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
            first = next((ln for ln in msg if "error:" in ln), None) or next(iter(msg), type(e).__name__)
            raise BuildError(f"building {name} failed: {first[:300]}") from e
        seconds = time.perf_counter() - t0
    finally:
        lock.release()
    if not cached:
        _log.info("%s: compiled in %.0f s", what, seconds)
    info = {"name": name, "seconds": seconds, "compiled": not cached or seconds > 5.0, "waited": waited,
            "directory": folder}
    return mod, info
