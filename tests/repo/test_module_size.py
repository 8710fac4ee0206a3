"""Module size (issues 29, 37): a module holds one concept, whatever its length; one over 400 lines says why
on its first line (``# over 400 lines: <reason>``), so that nobody splits a concept to pass a count (functions
keep their 80-line limit, ``test_function_size.py``)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 400
REASON = "# over 400 lines:"


def _long_modules():
    out = []
    for path in sorted((ROOT / "dsv4_index").rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        if len(lines) > LIMIT:
            out.append((path.relative_to(ROOT).as_posix(), len(lines), lines[0] if lines else ""))
    return out


def test_no_module_over_the_limit_without_a_reason():
    bad = [(p, n) for p, n, first in _long_modules()
           if not (first.startswith(REASON) and len(first.strip()) > len(REASON) + 10)]
    assert not bad, f"modules over {LIMIT} lines without a '{REASON} ...' first line: {bad}"


def test_the_check_sees_a_long_module(tmp_path, monkeypatch):
    pkg = tmp_path / "dsv4_index"
    pkg.mkdir()
    (pkg / "long.py").write_text("x = 1\n" * (LIMIT + 1))
    (pkg / "ok.py").write_text(REASON + " a reason long enough\n" + "x = 1\n" * LIMIT)
    (pkg / "short.py").write_text("x = 1\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    found = {p: first for p, _, first in _long_modules()}
    assert set(found) == {"dsv4_index/long.py", "dsv4_index/ok.py"}
    assert not found["dsv4_index/long.py"].startswith(REASON) and found["dsv4_index/ok.py"].startswith(REASON)
