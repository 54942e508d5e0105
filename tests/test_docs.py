"""The docs stay light and connected: README.md is at most 300 lines (the rest lives in guides under docs/), and
every relative link of README.md and docs/*.md points at a file that exists and, for a Markdown file, at a
heading it has (GitHub's anchors)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 300
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code (links are not read inside code)."""
    return _CODE.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text without Markdown marks, lower case, punctuation other than ``-``
    and ``_`` dropped, spaces as ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = text.replace("`", "").replace("*", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor of a Markdown file's headings (repeats get GitHub's ``-1``, ``-2`` ...)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(_FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = slug(heading)
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out


def links(path: Path) -> list[str]:
    return _LINK.findall(prose(path.read_text(encoding="utf-8")))


def test_slug_follows_githubs_rule():
    assert slug("Hostile visitors (`python -m bench.hostile`)") == "hostile-visitors-python--m-benchhostile"
    assert slug("Prefill attention: C++ against SDPA") == "prefill-attention-c-against-sdpa"
    assert slug("CPU classes, and running another class's path") == "cpu-classes-and-running-another-classs-path"


def test_readme_is_at_most_300_lines():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, (f"README.md has {n} lines (at most {README_MAX_LINES}): move detail into a "
                                   "guide under docs/ and link it")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_at_an_existing_file_and_heading(doc):
    broken = []
    for target in links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, f"{doc.relative_to(ROOT)}: broken links: " + "; ".join(broken)


def test_every_image_in_docs_is_linked():
    linked = {(d.parent / t.partition("#")[0]).resolve() for d in DOCS for t in links(d)}
    unlinked = [p.name for p in (ROOT / "docs").glob("*.png") if p.resolve() not in linked]
    assert not unlinked, f"images in docs/ that no page shows (remove them or link them): {unlinked}"
