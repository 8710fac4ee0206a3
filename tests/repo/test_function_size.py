"""No function of the package is over 80 lines of code (CONTRIBUTING's house rule).

Lines of code: the lines from ``def`` to the function's last line, less blank lines, comment-only
lines and docstring lines (of the function and of anything nested in it); a nested function counts
in its own size and in its parent's. ``ALLOWED`` names today's offenders with their size: the lead
shrinks it as each is split (an entry that is no longer over the limit, or grew, fails the test).

Run as a script to list every function over the limit: ``python tests/repo/test_function_size.py``.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path
from typing import Dict, Set

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "dsv4_index"
LIMIT = 80

# "module path:qualified name" -> lines of code today (shrink only)
ALLOWED: Dict[str, int] = {
}


def _non_code_lines(src: str, tree: ast.AST) -> Set[int]:
    """Line numbers (1-based) holding no code: blank, comment-only, or inside a docstring."""
    lines = src.splitlines()
    skip = {i + 1 for i, s in enumerate(lines) if not s.strip()}
    code: Set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                            tokenize.ENDMARKER):
            code.update(range(tok.start[0], tok.end[0] + 1))
    skip |= {i + 1 for i in range(len(lines)) if i + 1 not in code}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                skip.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return skip


def function_sizes(path: Path) -> Dict[str, int]:
    """``{qualified name: lines of code}`` of every function and method of one module."""
    src = path.read_text(encoding="utf-8")
    tree = ast.parse(src)
    skip = _non_code_lines(src, tree)
    out: Dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                span = range(child.lineno, (child.end_lineno or child.lineno) + 1)
                out[name] = sum(1 for i in span if i not in skip)
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def over_limit() -> Dict[str, int]:
    """Every package function over :data:`LIMIT` lines of code, keyed ``"path:qualname"``."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for name, n in function_sizes(path).items():
            if n > LIMIT:
                found[f"{rel}:{name}"] = n
    return found


def test_no_function_over_the_limit_outside_the_allow_list():
    found = over_limit()
    new = {k: v for k, v in found.items() if k not in ALLOWED}
    assert not new, f"functions over {LIMIT} lines of code (split them along their steps): {new}"


def test_the_allow_list_only_shrinks():
    found = over_limit()
    fixed = sorted(k for k in ALLOWED if k not in found)
    assert not fixed, f"no longer over {LIMIT} lines (or gone): remove from ALLOWED: {fixed}"
    grew = {k: (ALLOWED[k], found[k]) for k in ALLOWED if found[k] > ALLOWED[k]}
    assert not grew, f"allowed offenders that grew (allowed, now): {grew}"


def test_the_counter_counts_code_only(tmp_path):
    """Blank lines, comments and docstrings (nested ones too) are not code; a nested function counts
    in its parent."""
    f = tmp_path / "m.py"
    f.write_text('def a(x):\n    """Doc\n    string."""\n\n    # a comment\n    y = (x +\n         1)\n'
                 '    def b():\n        """Inner doc."""\n        return y  # trailing\n    return b\n\n\n'
                 'class C:\n    def m(self):\n        pass\n', encoding="utf-8")
    assert function_sizes(f) == {"a": 6, "a.b": 2, "C.m": 2}


if __name__ == "__main__":
    for key, n in sorted(over_limit().items(), key=lambda kv: -kv[1]):
        print(f"{n:5d}  {key}{'' if key in ALLOWED else '  (not allowed)'}")
    sys.exit(0)
