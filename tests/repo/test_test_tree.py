"""The test tree itself (CONTRIBUTING "Tests"): tests live in the folder of the area they guard, shared helpers
live in ``tests/helpers/`` only, and no test module imports another test module.

* every ``test_*.py`` is in a folder of ``tests/`` (none at the top level), and no two share a file name (pytest
  imports them by file name: ``tests/`` has no ``__init__.py``);
* every other Python file of ``tests/`` is a ``conftest.py``, a module of ``tests/helpers/``, or listed in
  ``SCRIPTS``;
* no module of ``tests/`` (helpers included) imports a ``test_*`` module, at the top or inside a function.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
SCRIPTS = {"layout/make_vllm_fixtures.py": "regenerates layout/fixtures where vLLM is installed (not a test)"}


def _files():
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def imported_test_modules(src: str) -> list:
    """The ``test_*`` modules ``src`` imports (``import test_x``, ``from test_x import``, ``from tests.test_x``,
    ``from tests.state.test_x``), wherever the import stands."""
    def is_test(mod: str) -> bool:
        return any(part.startswith("test_") for part in mod.split("."))

    out = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if is_test(a.name)]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            out += [mod] if is_test(mod) else [f"{mod}.{a.name}" for a in node.names if is_test(a.name)]
    return out



def test_no_test_module_imports_another():
    bad = {p.relative_to(TESTS).as_posix(): imported_test_modules(p.read_text()) for p in _files()}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"test modules imported (move the shared code into tests/helpers/): {bad}"


def test_the_import_check_sees_every_form():
    src = ("import test_a\nfrom test_b import x\nfrom tests.test_c import y\nfrom tests.state import test_d\n"
           "def f():\n    from test_e import z\n"
           "from helpers.rejections import state\nimport testing\nfrom dsv4_index.testing.scheduler import a\n")
    assert imported_test_modules(src) == ["test_a", "test_b", "tests.test_c", "tests.state.test_d", "test_e"]


def test_every_test_module_is_in_an_area_folder_and_its_name_is_unique():
    tests = [p for p in _files() if p.name.startswith("test_")]
    top = [p.name for p in tests if p.parent == TESTS]
    assert not top, f"test modules at the top of tests/ (move each into the folder of what it guards): {top}"
    twice = [n for n, c in Counter(p.name for p in tests).items() if c > 1]
    assert not twice, f"test module names used twice (pytest imports them by file name): {twice}"


def test_shared_code_lives_in_helpers():
    other = []
    for p in _files():
        rel = p.relative_to(TESTS).as_posix()
        if p.name.startswith("test_") or p.name == "conftest.py" or rel.startswith("helpers/") or rel in SCRIPTS:
            continue
        other.append(rel)
    assert not other, f"helper modules outside tests/helpers/: {other}"
    assert all((TESTS / rel).is_file() for rel in SCRIPTS), "SCRIPTS lists a file that is gone"
