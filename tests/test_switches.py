"""Runtime switches (``kernels/envs.py``): each declared once and read only through that module, listed in the
docs and by ``--help-switches``; ``CBP_CPU_MAX_ISA`` caps the CPU flags every choice reads and the build's
instruction set."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import cpu_features, envs

ROOT = Path(__file__).resolve().parent.parent
ZEN4 = ("AuthenticAMD", "fpu sse4_2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512_bf16 avx512_vnni")
SAPPHIRE = ("GenuineIntel", "sse4_2 avx avx2 fma avx512f avx512bw avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8")


def source_files() -> list[Path]:
    files = [*ROOT.glob("*.py"), *ROOT.glob("kernels/csrc/*.cpp"), *ROOT.glob("kernels/csrc/*.h")]
    for package in ("engine", "kernels", "server", "ui", "bench"):
        files += (ROOT / package).rglob("*.py")
    return [f for f in files if f.name != "envs.py" and "__pycache__" not in f.parts]


def test_no_switch_is_read_outside_the_envs_module():
    """``os.environ`` / ``getenv`` never read a ``CBP_`` variable outside kernels/envs.py (the options'
    ``CBP_<OPTION>`` variables are read by engine/options.py through their declared names, never spelled)."""
    read = re.compile(r"""(environ|getenv)\W*(\.get)?\W*["']CBP_""")
    bad = [f"{f.relative_to(ROOT)}: {line.strip()}" for f in source_files()
           for line in f.read_text(encoding="utf-8").splitlines() if read.search(line)]
    assert not bad, "read the switch through kernels.envs: " + "; ".join(bad)


def test_every_switch_is_in_the_docs_table_and_in_help_switches():
    docs = (ROOT / "docs" / "options.md").read_text(encoding="utf-8")  # generated: scripts/gen_options_doc.py
    table = {m.group(1) for m in re.finditer(r"^\| `(CBP_[A-Z0-9_]+)` \|", docs, re.M)}
    assert table == set(envs.SWITCHES), "docs/options.md's switch table must list exactly the declared switches"
    text = envs.help_table({})
    assert all(name in text for name in envs.SWITCHES)
    for args in (["app.py"], ["-m", "engine"]):
        out = subprocess.run([sys.executable, *args, "--help-switches"], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0 and "CBP_CPU_MAX_ISA=avx2|avx512|avx512_bf16|amx" in out.stdout, out.stderr


def test_switch_values_parse_or_fail_naming_the_variable():
    assert envs.read("CBP_CPU_OWN_GEMM", {}) is True
    assert envs.read("CBP_CPU_OWN_GEMM", {"CBP_CPU_OWN_GEMM": "off"}) is False
    assert envs.read("CBP_CPU_QK_DOT", {"CBP_CPU_QK_DOT": " "}) is None  # empty: the default (automatic)
    assert envs.read("CBP_CPU_MAX_ISA", {"CBP_CPU_MAX_ISA": "avx2"}) == "avx2"
    with pytest.raises(ValueError, match="CBP_CPU_MAX_ISA"):
        envs.check_all({"CBP_CPU_MAX_ISA": "sse2"})
    with pytest.raises(ValueError, match="CBP_CPU_FUSED_LAYERS"):
        envs.read("CBP_CPU_FUSED_LAYERS", {"CBP_CPU_FUSED_LAYERS": "maybe"})
    with pytest.raises(AttributeError):
        envs.CBP_NO_SUCH_SWITCH  # noqa: B018


@pytest.mark.parametrize("cap, kept, dropped, cflags", [
    (None, "amx_bf16", "", []),
    ("avx512_bf16", "avx512_fp16", "amx_bf16 amx_tile", ["-mno-amx-tile"]),
    ("avx512", "avx512bw", "avx512_bf16 avx512_fp16 amx_bf16", ["-mno-amx-tile", "-mno-avx512bf16",
                                                                "-mno-avx512fp16"]),
    ("avx2", "fma avx2", "avx512f avx512bw avx512_bf16 amx_tile", ["-mno-amx-tile", "-mno-avx512f"]),
])
def test_max_isa_caps_the_flags_and_the_build(cap, kept, dropped, cflags, monkeypatch):
    """A cap drops the CPU flags above its class (what every dispatch rule reads) and adds the compiler flags
    that keep a -march=native build within it (only for features this CPU has)."""
    monkeypatch.setattr(cpu_features, "native_cpu_info", lambda: SAPPHIRE)
    if cap is None:
        monkeypatch.delenv("CBP_CPU_MAX_ISA", raising=False)
    else:
        monkeypatch.setenv("CBP_CPU_MAX_ISA", cap)
    words = set(cpu_features.cpu_info()[1].split())
    assert set(kept.split()) <= words and not set(dropped.split()) & words
    assert cpu_features.build_cflags() == cflags
    assert cpu_features.isa_class() == (cap or "amx")
    assert cpu_features.executable_classes() == ["avx2", "avx512", "avx512_bf16", "amx"]


def test_a_cap_above_the_cpu_changes_nothing(monkeypatch):
    monkeypatch.setattr(cpu_features, "native_cpu_info", lambda: ZEN4)
    monkeypatch.setenv("CBP_CPU_MAX_ISA", "amx")
    assert cpu_features.cpu_info() == (ZEN4[0], " ".join(ZEN4[1].split())) and cpu_features.build_cflags() == []
    assert cpu_features.executable_classes() == ["avx2", "avx512", "avx512_bf16"]


def test_avx2_cap_takes_the_avx2_dispatch(monkeypatch):
    """Under CBP_CPU_MAX_ISA=avx2 an AVX-512 CPU chooses as an AVX2-only one: float32 by default (no native
    bfloat16), the own float32 GEMM, no own bfloat16 GEMM, no VDPBF16PS, no oneDNN packing."""
    from kernels import cpu_linear, cpu_ops

    monkeypatch.setattr(cpu_features, "native_cpu_info", lambda: ZEN4)
    monkeypatch.setattr(cpu_ops, "gemm_f32_available", lambda: True)
    monkeypatch.setenv("CBP_CPU_MAX_ISA", "avx2")
    for rule in (cpu_linear.native_bf16, cpu_linear.bf16_matmul_outruns_f32, cpu_linear.gemm_dot_products,
                 cpu_linear.own_gemm_f32_cpu):
        monkeypatch.setattr(cpu_linear, rule.__name__, rule.__wrapped__)  # the uncached rules
    assert not cpu_linear.native_bf16() and not cpu_linear.bf16_matmul_outruns_f32()
    assert not cpu_linear.gemm_dot_products() and cpu_linear.own_gemm_f32_cpu()
    monkeypatch.delenv("CBP_CPU_MAX_ISA")
    assert cpu_linear.native_bf16() and cpu_linear.gemm_dot_products() and not cpu_linear.own_gemm_f32_cpu()
