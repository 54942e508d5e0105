"""Every runtime switch of the project, declared once: name, type, default and what it does (as vLLM's
``envs.py``). The code reads a switch only through this module (``envs.CBP_CPU_OWN_GEMM``, or
:func:`read`), at the moment it needs it, so a test may set a variable with ``monkeypatch.setenv``.

A switch is an environment variable that changes how the engine computes (which kernel, which path, where
the kernel build goes), not what it serves: the command-line options (``--max-num-seqs`` ...) are declared
in :mod:`engine.options` and also read ``CBP_<OPTION>``. ``python app.py --help-switches`` and ``python -m
engine --help-switches`` print :data:`SWITCHES` as a table; docs/options.md (generated) lists them too.

This module imports nothing of the project and no third-party package: it sits at the bottom of the import
order (``kernels`` is the lowest package).
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}

ISA_CLASSES = ("avx2", "avx512", "avx512_bf16", "amx")  # the CPU classes the kernels dispatch on, lowest first


@dataclass(frozen=True)
class Switch:
    """One runtime switch.

    Attributes:
        name: the environment variable (``CBP_...``).
        type: ``bool`` (1/0, true/false, yes/no, on/off) or ``str``.
        default: the value when the variable is unset or empty; None means "decided from the CPU" (a bool
            switch with a None default is a tri-state: unset = automatic, 1 = force on, 0 = force off).
        doc: one or two sentences for the docs table and ``--help-switches``.
        choices: the allowed values of a ``str`` switch, or None (any text).
    """

    name: str
    type: type
    default: Any
    doc: str
    choices: tuple[str, ...] | None = None

    def parse(self, text: str) -> Any:
        """``text`` as a value of this switch.

        Raises:
            ValueError: not a boolean word for a bool switch, or not one of ``choices``; the message names the
                variable.
        """
        value = text.strip()
        if self.type is bool:
            word = value.lower()
            if word not in _TRUE | _FALSE:
                raise ValueError(f"{self.name}: expected one of 1/0, true/false, yes/no, on/off, got {text!r}")
            return word in _TRUE
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{self.name}: expected one of {', '.join(self.choices)}, got {text!r}")
        return value

    def read(self, environ: Mapping[str, str] | None = None) -> Any:
        """The switch's value in ``environ`` (default: ``os.environ``, read now), or its default when unset
        or empty. Raises ``ValueError`` as :meth:`parse`."""
        raw = (os.environ if environ is None else environ).get(self.name)
        if raw is None or raw.strip() == "":
            return self.default
        return self.parse(raw)


_DECLARED = (
    Switch("CBP_ATTENTION_BACKEND", str, None,
           "Force one kernel backend for every call: torch (the test oracle), cpp (the C++ CPU kernels; raises "
           "when they cannot be built) or triton (CUDA). Unset: Triton on CUDA tensors, the C++ kernels on CPU "
           "tensors when they build, else torch. Read when kernels is imported.",
           choices=("torch", "cpp", "triton")),
    Switch("CBP_CPU_MAX_ISA", str, None,
           "Compile the C++ kernels and choose every CPU path as on a CPU of this class at most: avx2 (no "
           "AVX-512: float32, the own float32 GEMM, one-call layers), avx512 (no BF16: float32, torch's linears), "
           "avx512_bf16 (no AMX) or amx. A class above this CPU's changes nothing. Lets an AVX-512 machine run "
           "what an AVX2-only CPU runs; torch's own libraries (MKL, oneDNN) still use every instruction the CPU "
           "has. Unset: everything the CPU has.", choices=ISA_CLASSES),
    Switch("CBP_CPU_OWN_GEMM", bool, True,
           "The engine's own GEMMs for CPU linears where the CPU's rule picks them (bfloat16 on AVX512-BF16 "
           "without AMX, float32 on AVX2-only CPUs); 0 turns both off (oneDNN / MKL linears, the Python layer "
           "loop). Read once per process."),
    Switch("CBP_CPU_OWN_GEMM_F32", bool, None,
           "The own float32 GEMM: unset = on AVX2-only CPUs, 1 = also on AVX-512 CPUs, 0 = never. Read once "
           "per process."),
    Switch("CBP_CPU_F32_LINEARS", bool, True,
           "Where bfloat16 matmuls are slow (Intel AVX512-BF16 without AMX, CPUs without native bfloat16), "
           "bfloat16 linears keep a float32 copy of their weight for calls of 48 rows or more; 0 turns the "
           "copy off."),
    Switch("CBP_CPU_FUSED_LAYERS", bool, True,
           "Every decoder layer in one C++ call where every linear is on an own GEMM; 0 runs the Python "
           "layer loop (the same kernels, one call each). Read when a model's forward is first run."),
    Switch("CBP_CPU_BF16_DOT", bool, False,
           "bfloat16 KV caches: the C++ attention computes Q K^T and P V with VDPBF16PS dot products (P "
           "rounded to bfloat16; faster, flips near-tied greedy choices). Read at every call."),
    Switch("CBP_CPU_QK_DOT", bool, None,
           "bfloat16 KV caches: Q K^T with VDPBF16PS, P V in float32. Unset: on AMD CPUs (where VDPBF16PS runs "
           "at twice the float32 FMA rate), off elsewhere; 1 / 0 force it. Read at every call."),
    Switch("CBP_KERNEL_BUILD_DIR", str, None,
           "Where the C++ kernels are built and cached (one folder per CPU, sources and checkout). Unset: torch's "
           "extensions folder ($TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions)."),
    Switch("CBP_KERNEL_BUILD_VERBOSE", bool, False, "Show the compiler's command lines and output while the C++ "
           "kernels build."),
)

SWITCHES: dict[str, Switch] = {s.name: s for s in _DECLARED}


def read(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The value of the switch ``name`` (see :meth:`Switch.read`).

    Raises:
        KeyError: ``name`` is not a declared switch. ValueError: the variable's text is not a valid value.
    """
    return SWITCHES[name].read(environ)


def check_all(environ: Mapping[str, str] | None = None) -> None:
    """Parse every declared switch once (at start-up: a bad value fails at once, not at the first kernel call).

    Raises:
        ValueError: the first switch whose text is not a valid value (the message names it).
    """
    for switch in _DECLARED:
        switch.read(environ)


def help_table(environ: Mapping[str, str] | None = None) -> str:
    """The switches as plain text for ``--help-switches``: name, allowed values, default, what it does, and
    the value set now where one is."""
    env = os.environ if environ is None else environ
    out = ["Runtime switches (environment variables; unset = the default):", ""]
    for s in _DECLARED:
        values = "|".join(s.choices) if s.choices else ("1|0" if s.type is bool else "PATH")
        default = "auto" if s.default is None else ("1" if s.default is True else "0" if s.default is False
                                                     else str(s.default))
        now = env.get(s.name)
        out.append(f"  {s.name}={values}  (default: {default}{f'; set: {now}' if now else ''})")
        out += [f"      {line}" for line in textwrap.wrap(s.doc, 94)]
    return "\n".join(out)


def __getattr__(name: str) -> Any:
    """``envs.CBP_X``: the switch's value now (see :func:`read`)."""
    if name in SWITCHES:
        return SWITCHES[name].read()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *SWITCHES])
