"""Write docs/options.md from the option declarations, so the page cannot drift from the code.

    .venv/bin/python scripts/gen_options_doc.py            # writes docs/options.md
    .venv/bin/python scripts/gen_options_doc.py --check    # exit 1 when docs/options.md differs

The tables are read from the parsers the programs build (``app.build_parser`` and
``engine.__main__.build_parser``, in their ``--help`` groups and order; each row's help and default are the
text ``--help`` prints), the :class:`engine.options.Option` declarations behind them (variable, type, bounds,
choices) and the runtime switches of :mod:`kernels.envs`. Nothing is copied by hand: ``tests/test_options_doc.py``
fails when docs/options.md is not what this script writes.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "options.md"


def _cell(text: str) -> str:
    """``text`` safe inside a Markdown table cell (pipes escaped, angle brackets as entities)."""
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _split_help(help_text: str) -> tuple[str, str | None]:
    """``(meaning, default)`` of an argparse help text ending in ``(default: ...)`` (what
    :func:`engine.options.add_options` appends, or what the declaration says itself), else ``(help, None)``."""
    at = help_text.rfind(" (default: ")
    if at < 0 or not help_text.endswith(")"):
        return help_text, None
    return help_text[:at], help_text[at + len(" (default: "):-1]


def _number(kind: str, opt) -> str:
    low = None if opt.low is None else f"{'>' if opt.low_open else '>='} {opt.low:g}"
    high = None if opt.high is None else f"<= {opt.high:g}"
    bounds = ", ".join(b for b in (low, high) if b)
    return f"{kind} {bounds}" if bounds else kind


def _values(opt, action: argparse.Action, repeatable: type | None) -> str:
    """What the option takes, from its declaration."""
    if opt.type is bool:
        return f"switch (`--no-{opt.flag[2:]}` turns it off)"
    if opt.choices:
        return " \\| ".join(f"`{c}`" for c in opt.choices)
    text = {int: _number("integer", opt), float: _number("number", opt)}.get(opt.type, "text")
    if repeatable is not None and isinstance(action, repeatable):
        text += "; repeatable"
    return text


def _default(opt, shown: str | None) -> str:
    if shown is None or shown == "":
        return "unset"
    if opt is not None and opt.type is bool:
        return {"True": "on", "False": "off"}.get(shown, shown)
    return shown


def _declared(*tables) -> dict:
    return {opt.name: opt for table in tables for opt in table}


def _groups(parser: argparse.ArgumentParser) -> list[tuple[str, list[argparse.Action]]]:
    """The parser's ``--help`` groups (title, actions), without argparse's own ``-h``."""
    out = []
    for group in parser._action_groups:  # the groups --help prints, in its order
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
        if actions:
            out.append((group.title or "", actions))
    return out


def _option_table(actions: list[argparse.Action], declared: dict, repeatable: type | None) -> list[str]:
    rows = ["| option | variable | value | default | meaning |", "|---|---|---|---|---|"]
    for action in actions:
        opt = declared.get(action.dest)
        if opt is None:
            continue
        meaning, shown = _split_help(action.help or "")
        rows.append(f"| `{opt.flag}` | `{opt.env_var}` | {_values(opt, action, repeatable)} | "
                    f"{_cell(_default(opt, shown))} | {_cell(meaning)} |")
    return rows


def _own_argument_table(actions: list[argparse.Action]) -> list[str]:
    """Arguments declared by a front end itself (``python -m engine``'s prompts, sampling flags ...)."""
    rows = ["| argument | value | default | meaning |", "|---|---|---|---|"]
    for action in actions:
        name = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}` (positional)"
        if isinstance(action, argparse._StoreTrueAction):
            value, default = "switch", "off"
        elif action.nargs == 0:
            value, default = "switch", "-"
        else:
            kind = getattr(action.type, "__name__", "text") if action.type else "text"
            value = {"int": "integer", "float": "number", "str": "text"}.get(kind, kind)
            if action.nargs in ("*", "+"):
                value += ", any number"
            default = "unset" if action.default in (None, [], "") else str(action.default)
        rows.append(f"| {name} | {value} | {_cell(default)} | {_cell(action.help or '')} |")
    return rows


def _switch_table() -> list[str]:
    from kernels import envs

    rows = ["| switch | values | default | what it does |", "|---|---|---|---|"]
    for s in envs.SWITCHES.values():
        values = (" \\| ".join(f"`{c}`" for c in s.choices) if s.choices
                  else "`1` / `0`" if s.type is bool else "a folder")
        default = ("automatic" if s.default is None else "`1`" if s.default is True else "`0`"
                   if s.default is False else f"`{s.default}`")
        rows.append(f"| `{s.name}` | {values} | {default} | {_cell(s.doc)} |")
    return rows


def render() -> str:
    """The whole of docs/options.md, from the declarations (no ``CBP_*`` variable of this process counts)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CBP_")}
    with mock.patch.dict(os.environ, clean, clear=True):
        sys.path.insert(0, str(ROOT))
        import app
        from engine.__main__ import build_parser as engine_parser
        from engine.options import ENGINE_OPTIONS
        from server.options import SERVER_OPTIONS

        app_parser = app.build_parser(env={})
        cli_parser = engine_parser()
    declared = _declared(ENGINE_OPTIONS, SERVER_OPTIONS, app.UI_OPTIONS, app.REMOTE_OPTIONS)

    out = [
        "# Options",
        "",
        "<!-- Generated by scripts/gen_options_doc.py from the option declarations: do not edit by hand. -->",
        "",
        "Every command-line option of `app.py` and `python -m engine`, and every runtime switch. This page is",
        "written by `.venv/bin/python scripts/gen_options_doc.py` from the declarations the programs build their",
        "parsers from (`engine/options.py`, `server/options.py`, `app.py`'s `UI_OPTIONS` and `REMOTE_OPTIONS`,",
        "`engine/__main__.py`, `kernels/envs.py`); `tests/test_options_doc.py` fails when it differs from what the",
        "script writes. `--help` prints the same options in the same groups.",
        "",
        "## `python app.py`",
        "",
        "Every option also reads the environment variable of its row (on a Hugging Face Space, the Space's",
        "variables and secrets); the command line wins over the variable. A variable that does not parse stops",
        "the start with one line. `--help-switches` lists the [runtime switches](#runtime-switches).",
    ]
    for title, actions in _groups(app_parser):
        rows = _option_table(actions, declared, app._Repeatable)
        if len(rows) > 2:
            out += ["", f"### {title}", "", *rows]
    engine_names = {opt.name for opt in ENGINE_OPTIONS}
    own = [a for _t, actions in _groups(cli_parser) for a in actions if a.dest not in engine_names]
    app_help = {a.dest: a.help for _t, actions in _groups(app_parser) for a in actions}
    differ = []
    for _t, actions in _groups(cli_parser):
        for a in actions:
            if a.dest in engine_names and a.help != app_help.get(a.dest):
                cli_default = _default(declared[a.dest], _split_help(a.help or "")[1])
                app_default = _default(declared[a.dest], _split_help(app_help.get(a.dest) or "")[1])
                differ.append(f"`{declared[a.dest].flag}` {_cell(cli_default)} (app: {_cell(app_default)})")
    out += [
        "",
        "## `python -m engine`",
        "",
        "Prompts (or a workload file) in, completions and a summary line out. Its own arguments (not read from",
        "the environment):",
        "",
        *_own_argument_table(own),
        "",
        "and every option of the *engine* group above, with the same flags and variables; where the engine's",
        "own default differs from the playground's: " + "; ".join(differ) + ".",
        "",
        "## Runtime switches",
        "",
        "Environment variables that choose how the engine computes (which kernel, which CPU path, where the",
        "kernel build goes), not what it serves: declared once in `kernels/envs.py`, read only through it,",
        "printed by `--help-switches` with the values set now. A value that does not parse stops the app's start",
        "with one line (exit status 2). Unset or empty means the default.",
        "",
        *_switch_table(),
        "",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 when docs/options.md differs instead of writing it")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        same = OUT.exists() and OUT.read_text(encoding="utf-8") == text
        print("docs/options.md is up to date" if same else
              "docs/options.md differs: run .venv/bin/python scripts/gen_options_doc.py")
        return 0 if same else 1
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
