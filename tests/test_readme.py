"""README.md stays a front page (issue 50): at most 250 lines, every repository path it names exists,
and every `docs/PAGE.md#anchor` it links to is a heading of that page. Its command lines are checked
against the CLI's flags by tests/test_docs_flags.py."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PATH = re.compile(r"(?<![\w./-])((?:docs|src|scripts|ports|recipes|tests|\.ci)/[\w./-]*[\w/])")
ANCHOR = re.compile(r"(docs/[\w-]+\.md)#([\w-]+)")


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_readme_is_at_most_250_lines():
    n = len(README.read_text().splitlines())
    assert n <= 250, f"README.md has {n} lines; move detail to docs/ (the front page stays at most 250)"


def test_readme_names_only_paths_that_exist():
    missing = sorted({p for p in PATH.findall(README.read_text()) if not (REPO / p).exists()})
    assert not missing, f"README.md names paths that do not exist: {', '.join(missing)}"


def test_readme_anchors_are_headings():
    bad = []
    for page, anchor in ANCHOR.findall(README.read_text()):
        headings = [ln.lstrip("#") for ln in (REPO / page).read_text().splitlines() if re.match(r"#{1,6} ", ln)]
        if anchor not in {slug(h) for h in headings}:
            bad.append(f"{page}#{anchor}")
    assert not bad, f"README.md links to anchors that are no heading: {', '.join(bad)}"


def test_the_slug_is_githubs():
    assert slug(" Playground") == "playground"
    assert slug(" Compiled step (`compile=`)") == "compiled-step-compile"
    assert slug(" Peers: the same weights through other engines") == "peers-the-same-weights-through-other-engines"
