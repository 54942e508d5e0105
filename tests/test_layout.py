"""The project's layout rules, checked on the source (parsed with ``ast``, nothing imported).

Imports run one way: ``app.py`` -> ``ui`` / ``server`` -> ``engine`` -> ``kernels``. ``bench`` (the
benchmark harness) may import anything, and nothing but the tests imports ``bench``. ``ui`` and
``server`` are siblings and never import each other, and they use only the engine's public API (the names
``engine/__init__.py`` exports), never its modules; ``bench`` imports no test module. Every Python file
stays under 500 lines, and every function of the project's packages under 80 (Triton kernels excepted).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SKIP_DIRS = {"__pycache__", "node_modules"}  # plus every hidden folder (.venv, .git, ...)
MAX_LINES = 500
MAX_FUNCTION_LINES = 80
SOURCE = ("engine", "kernels", "server", "ui", "bench", "app.py")  # the project's own code (not the tests)
# functions still being cut into named parts: remove each name from this set once it is cut
LONG_FUNCTIONS_BEING_CUT: set[str] = set()


def python_files(under: str | None = None) -> list[Path]:
    """Every ``.py`` file of the repository (or of its folder ``under``), hidden folders excluded."""
    top = ROOT / under if under else ROOT
    out = []
    for folder, dirs, files in os.walk(top):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS)
        out += [Path(folder) / f for f in sorted(files) if f.endswith(".py")]
    return out


def imported_packages(path: Path, root: Path = ROOT) -> set[str]:
    """Top-level names of every module ``path`` imports, anywhere in the file (functions included);
    relative imports are resolved against the file's own package (its folder under ``root``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = path.relative_to(root).parent.parts  # e.g. ("engine",)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                names.add((node.module or "").split(".")[0])
            else:
                base = package[: len(package) - (node.level - 1)]
                if base:
                    names.add(base[0])
                elif node.module:
                    names.add(node.module.split(".")[0])
    return names


def offenders(files: list[Path], forbidden: set[str]) -> list[str]:
    return [f"{p.relative_to(ROOT)} imports {', '.join(sorted(imported_packages(p) & forbidden))}"
            for p in files if imported_packages(p) & forbidden]


def test_imported_packages_reads_absolute_relative_and_nested_imports(tmp_path):
    pkg = tmp_path / "engine" / "sub"
    pkg.mkdir(parents=True)
    f = pkg / "m.py"
    f.write_text("import os.path\nfrom . import core\nfrom .. import ui\n"
                 "def g():\n    from bench.report import write_report\n")
    assert imported_packages(f, tmp_path) == {"os", "engine", "bench"}
    top = tmp_path / "app.py"
    top.write_text("from . import ui\n")
    assert imported_packages(top, tmp_path) == set()


@pytest.mark.parametrize("package", ["engine", "kernels"])
def test_engine_and_kernels_import_no_front_end_and_no_bench(package):
    files = python_files(package)
    assert files, f"no Python file under {package}/"
    bad = offenders(files, {"ui", "server", "bench", "app"})
    assert not bad, f"{package}/ must not import ui, server, app or bench (imports run app -> ui/server -> " \
                    f"engine -> kernels): " + "; ".join(bad)


def test_kernels_do_not_import_the_engine():
    bad = offenders(python_files("kernels"), {"engine"})
    assert not bad, "kernels/ is below engine/ and must not import it: " + "; ".join(bad)


def test_nothing_outside_bench_and_tests_imports_bench():
    files = [p for p in python_files() if p.relative_to(ROOT).parts[0] not in ("bench", "tests")]
    bad = offenders(files, {"bench"})
    assert not bad, "only bench/ itself and the tests may import bench: " + "; ".join(bad)


def test_bench_imports_no_test_module():
    bad = offenders(python_files("bench"), {"tests"})
    assert not bad, "bench/ must not import tests/ (a helper both need is kept in each): " + "; ".join(bad)


def test_ui_and_server_do_not_import_each_other():
    bad = offenders(python_files("ui"), {"server"})
    if (ROOT / "server").is_dir():
        bad += offenders(python_files("server"), {"ui"})
    assert not bad, "ui/ and server/ are siblings and must not import each other: " + "; ".join(bad)


def engine_modules_imported(path: Path) -> list[str]:
    """The engine modules (``engine.x``) that ``path`` imports by name, anywhere in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.startswith("engine.")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("engine."):
            out.append(node.module or "")
    return out


def test_ui_and_server_use_only_the_engines_public_api():
    """``from engine import X`` only: what the front ends need of the engine is widened on purpose in
    ``engine/__init__.py`` (documented there), not reached for module by module."""
    import engine

    bad = [f"{p.relative_to(ROOT)} imports {', '.join(sorted(set(mods)))}"
           for p in python_files("ui") + python_files("server") if (mods := engine_modules_imported(p))]
    assert not bad, "ui/ and server/ import the engine only as `from engine import ...`: " + "; ".join(bad)
    names = set()
    for p in python_files("ui") + python_files("server"):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "engine":
                names.update(a.name for a in node.names)
    assert names <= set(engine.__all__), f"not in engine.__all__: {sorted(names - set(engine.__all__))}"


def test_every_python_file_is_under_500_lines():
    """Layout rule: no Python file over 500 lines (split long modules by job). May fail while other
    modules are still being split; the message lists them."""
    long = {str(p.relative_to(ROOT)): n for p in python_files()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, (f"LAYOUT RULE: every Python file must be at most {MAX_LINES} lines; split these by job: "
                      + ", ".join(f"{k} ({v} lines)" for k, v in sorted(long.items())))


def long_functions(paths: list[Path], root: Path = ROOT, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """``"path:name" -> lines`` (path relative to ``root``) of every function, methods and nested functions
    included, longer than ``limit`` lines in ``paths``, except Triton kernels (``@triton.jit``: a kernel's
    body is one launch)."""
    out = {}
    for p in paths:
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"), filename=str(p))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit and not any("jit" in ast.unparse(d) for d in node.decorator_list):
                    out[f"{p.relative_to(root).as_posix()}:{node.name}"] = n
    return out


def test_long_functions_finds_long_functions_and_methods_but_not_triton_kernels(tmp_path):
    body = "".join(f"        x{i} = {i}\n" for i in range(85))
    (tmp_path / "m.py").write_text(f"class C:\n    def long(self):\n{body}\n"
                                   f"@triton.jit\ndef kernel():\n{body}\ndef short():\n    pass\n")
    assert long_functions([tmp_path / "m.py"], tmp_path) == {"m.py:long": 86}


def test_no_function_is_over_80_lines():
    """Layout rule: no function of the project's code over 80 lines (cut long ones into named parts);
    :data:`LONG_FUNCTIONS_BEING_CUT` lists those still being cut, each of which must still be long."""
    files = [p for p in python_files() if p.relative_to(ROOT).parts[0] in SOURCE]
    long = long_functions(files)
    over = {k: v for k, v in long.items() if k not in LONG_FUNCTIONS_BEING_CUT}
    assert not over, (f"LAYOUT RULE: every function must be at most {MAX_FUNCTION_LINES} lines; cut these into "
                      "named parts: " + ", ".join(f"{k} ({v} lines)" for k, v in sorted(over.items())))
    done = sorted(LONG_FUNCTIONS_BEING_CUT - set(long))
    assert not done, f"these are cut now (or gone): remove them from LONG_FUNCTIONS_BEING_CUT: {done}"
