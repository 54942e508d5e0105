"""The CPU's vendor and vector features as the kernels see them, capped by ``CBP_CPU_MAX_ISA``.

Every CPU-dependent choice of the kernels (the dtype, which GEMM, the one-call decoder layers, the attention's
dot products) reads the flags from :func:`cpu_info`, and the C++ build adds :func:`build_cflags` to
``-march=native``. With ``CBP_CPU_MAX_ISA`` unset both are the CPU's own; set to a class below the CPU's, the
flags above that class are dropped and the compiler is told not to use them, so an AVX-512 machine builds and
dispatches exactly as an AVX2-only CPU does (the test suite runs that way in CI: ``.ci/run``).

The classes, lowest first (:data:`kernels.envs.ISA_CLASSES`): ``avx2`` (AVX2 and FMA, no AVX-512), ``avx512``
(AVX-512 without BF16), ``avx512_bf16`` (AVX512-BF16, no AMX), ``amx`` (AMX-BF16).
"""

from __future__ import annotations

import functools
import sys

from kernels import envs

# CPU flags (as /proc/cpuinfo spells them) above each class: dropped when it is the cap
_ABOVE: dict[str, tuple[str, ...]] = {
    "avx2": ("avx512", "amx"),
    "avx512": ("avx512_bf16", "avx512_fp16", "amx"),
    "avx512_bf16": ("amx",),
    "amx": (),
}
# the compiler flag that turns a dropped CPU flag off (-mno-avx512f turns every AVX-512 subset off with it)
_NO_FLAG = {"avx512f": "-mno-avx512f", "avx512_bf16": "-mno-avx512bf16", "avx512_fp16": "-mno-avx512fp16",
            "amx_tile": "-mno-amx-tile"}


@functools.cache
def native_cpu_info() -> tuple[str, str]:
    """``(vendor_id, flags)`` of the first CPU in ``/proc/cpuinfo``, uncapped (empty strings off Linux or
    when the file cannot be read). Read once per process."""
    vendor, flags = "", ""
    if sys.platform != "linux":
        return vendor, flags
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id") and not vendor:
                    vendor = line.split(":", 1)[1].strip()
                elif line.startswith(("flags", "Features")) and not flags:
                    flags = line.split(":", 1)[1]
                if vendor and flags:
                    break
    except OSError:
        pass
    return vendor, flags


def _dropped(flags: set[str], cap: str | None) -> set[str]:
    if cap is None:
        return set()
    return {f for f in flags if f.startswith(_ABOVE[cap])}


def cpu_info() -> tuple[str, str]:
    """``(vendor_id, flags)`` as the kernels see them: :func:`native_cpu_info` without the flags above
    ``CBP_CPU_MAX_ISA`` (read at each call).

    Raises:
        ValueError: ``CBP_CPU_MAX_ISA`` is not one of the classes.
    """
    vendor, flags = native_cpu_info()
    words = flags.split()
    dropped = _dropped(set(words), envs.CBP_CPU_MAX_ISA)
    return vendor, " ".join(w for w in words if w not in dropped)


def build_cflags() -> list[str]:
    """The compiler flags that keep a ``-march=native`` build within ``CBP_CPU_MAX_ISA`` (empty when unset or
    when the CPU has nothing above the cap): only features this CPU has are named, so the compiler knows
    each one."""
    dropped = _dropped(set(native_cpu_info()[1].split()), envs.CBP_CPU_MAX_ISA)
    if "avx512f" in dropped:
        dropped = {f for f in dropped if not f.startswith("avx512")} | {"avx512f"}
    return [_NO_FLAG[f] for f in sorted(dropped) if f in _NO_FLAG]


def isa_class(flags: str | None = None) -> str | None:
    """The highest class of :data:`kernels.envs.ISA_CLASSES` that ``flags`` (default: :func:`cpu_info`'s)
    reach, or None below AVX2 with FMA (or off x86)."""
    words = set((cpu_info()[1] if flags is None else flags).split())
    if "amx_bf16" in words:
        return "amx"
    if "avx512_bf16" in words:
        return "avx512_bf16"
    if "avx512f" in words:
        return "avx512"
    if "avx2" in words and "fma" in words:
        return "avx2"
    return None


def executable_classes() -> list[str]:
    """The classes this CPU can execute (every class up to its own, uncapped), lowest first."""
    top = isa_class(native_cpu_info()[1])
    if top is None:
        return []
    return list(envs.ISA_CLASSES[: envs.ISA_CLASSES.index(top) + 1])
