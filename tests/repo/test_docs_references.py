"""The design the code cites is in the repository, and every citation of it is true.

* Nothing in the package, the docs, the README or the other top-level documents points at a file outside the
  repository (``../shared/...``, ``shared/DESIGN``, ``shared/reviews``): a fresh clone must hold what it cites.
* Every ``DESIGN §N`` / ``docs/DESIGN.md §N`` cites a section that exists in ``docs/DESIGN.md``; a quoted name
  after it (``DESIGN §4 "circular group"``) appears in that section.
* Every link to ``DESIGN.md#anchor`` names a heading of ``docs/DESIGN.md``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "DESIGN.md"
OUTSIDE = re.compile(r"\.\./shared|shared/DESIGN|shared/reviews")
CITE = re.compile(r"DESIGN(?:\.md)? §(\d+)(?: \"([^\"]+)\")?")
ANCHOR = re.compile(r"DESIGN\.md#([a-z0-9-]+)")


def texts(with_tests: bool = False):
    """(repo-relative path, text) of every file a reader of the repository meets."""
    files = [*ROOT.glob("*.md"), *(ROOT / "docs").rglob("*.md"), *(ROOT / "dsv4_index").rglob("*.py"),
             *(ROOT / "examples").glob("*.py"), *(ROOT / "benchmarks").glob("*.py"),
             *(ROOT / "benchmarks").glob("*.md"), *(ROOT / "models").rglob("*.py"), ROOT / "pyproject.toml"]
    if with_tests:
        files += [p for p in (ROOT / "tests").rglob("*.py") if p.name != Path(__file__).name]
    return [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8")) for p in sorted(set(files))]


def sections() -> dict:
    """``N -> (heading, body)`` of the numbered ``## N. ...`` sections of docs/DESIGN.md."""
    parts = re.split(r"^## (\d+)\. (.*)$", DESIGN.read_text(encoding="utf-8"), flags=re.M)
    return {int(parts[i]): (parts[i + 1], parts[i + 2]) for i in range(1, len(parts), 3)}


def flat(text: str) -> str:
    """Lower case, runs of white space as one blank (a quoted name may wrap a docstring line)."""
    return " ".join(text.lower().split())


def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^a-z0-9 -]", "", heading.lower()).replace(" ", "-")


def test_the_design_is_in_the_repository_and_numbered():
    secs = sections()
    assert sorted(secs) == list(range(1, len(secs) + 1)), sorted(secs)
    assert len(secs) >= 10  # NOTE: the numbers §1 - §10 are cited all over the tree


def test_nothing_points_outside_the_repository():
    hits = [f"{path}:{text[:m.start()].count(chr(10)) + 1}: {m.group(0)}"
            for path, text in texts() for m in OUTSIDE.finditer(text)]
    assert not hits, "\n".join(hits)


@pytest.mark.parametrize("with_tests", [False, True], ids=["package-and-docs", "tests"])
def test_every_citation_names_a_section_that_says_it(with_tests):
    secs = sections()
    bad, n = [], 0
    for path, text in texts(with_tests):
        for m in CITE.finditer(text):
            n += 1
            num, name = int(m.group(1)), m.group(2)
            where = f"{path}:{text[:m.start()].count(chr(10)) + 1}: {m.group(0)}"
            if num not in secs:
                bad.append(f"{where}: no section {num}")
            elif name is not None and flat(name) not in flat(secs[num][1]):
                bad.append(f"{where}: section {num} ({secs[num][0]}) does not say {name!r}")
    assert n > 20, n  # NOTE: the citations are found at all
    assert not bad, "\n".join(bad)


def test_every_anchor_names_a_heading():
    heads = {slug(h) for h in re.findall(r"^#+ (.*)$", DESIGN.read_text(encoding="utf-8"), flags=re.M)}
    bad = [f"{path}: #{a}" for path, text in texts() for a in ANCHOR.findall(text) if a not in heads]
    assert not bad, "\n".join(bad)


def test_the_slug_rule():
    assert slug("8. Performance budget and how it is measured") == "8-performance-budget-and-how-it-is-measured"
