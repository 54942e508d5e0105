"""docs/options.md is generated from the option declarations (``scripts/gen_options_doc.py``) and cannot drift:
this fails when the file differs from what the script writes now (run the script and commit the result)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("gen_options_doc", ROOT / "scripts" / "gen_options_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_options_doc_is_what_the_generator_writes():
    expected = _generator().render()
    actual = (ROOT / "docs" / "options.md").read_text(encoding="utf-8")
    assert actual == expected, ("docs/options.md differs from the option declarations: run "
                                "`.venv/bin/python scripts/gen_options_doc.py` and commit docs/options.md")


def test_options_doc_lists_every_declared_option_and_switch():
    import app
    from engine.options import ENGINE_OPTIONS
    from kernels import envs
    from server.options import SERVER_OPTIONS

    text = (ROOT / "docs" / "options.md").read_text(encoding="utf-8")
    for opt in (*ENGINE_OPTIONS, *SERVER_OPTIONS, *app.UI_OPTIONS, *app.REMOTE_OPTIONS):
        assert f"| `{opt.flag}` | `{opt.env_var}` |" in text, opt.name
    for name in envs.SWITCHES:
        assert f"| `{name}` |" in text, name
    for flag in ("--num-prompts", "--workload", "--max-tokens", "--quiet"):  # python -m engine's own
        assert f"| `{flag}` |" in text, flag
