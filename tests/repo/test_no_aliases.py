"""No method under two names (issue 39): a class-level alias ``name = other_method`` is a second public name for
one thing (``MetadataPipeline.row_of = slot_of`` said "row" for a request slot), so none is allowed; and the
dead accessors issue 39 removed stay removed."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def aliases(src: str) -> list:
    """``"Class.alias = method"`` of every class-level assignment of a method of the same class to a name."""
    out = []
    for c in ast.walk(ast.parse(src)):
        if isinstance(c, ast.ClassDef):
            defs = {n.name for n in c.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            for n in c.body:
                if isinstance(n, ast.Assign) and isinstance(n.value, ast.Name) and n.value.id in defs:
                    out += [f"{c.name}.{t.id} = {n.value.id}" for t in n.targets if isinstance(t, ast.Name)]
    return out


def test_no_method_has_an_alias():
    bad = {p.relative_to(ROOT).as_posix(): aliases(p.read_text(encoding="utf-8"))
           for p in sorted((ROOT / "dsv4_index").rglob("*.py"))}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"method aliases (keep one name): {bad}"


def test_the_alias_check_can_fail():
    assert aliases("class A:\n    def f(self):\n        pass\n    g = f\n    h = 3\n") == ["A.g = f"]


def test_removed_accessors_stay_removed():
    from dsv4_index import MetadataPipeline, MultiGroupBlockTable
    from dsv4_index.fused.plan import FusedPlan

    assert not hasattr(MetadataPipeline, "row_of")
    assert not hasattr(MultiGroupBlockTable, "device_tables")
    assert not hasattr(FusedPlan, "num_programs")
