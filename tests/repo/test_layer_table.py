"""docs/INTERFACES.md's layer table ("Layers and imports") against the tree: it is read, not copied here.

* every module the table (or its "Beside the layers" paragraph) names exists, and every module of
  ``dsv4_index`` is named (a package's ``__init__.py`` and ``__main__.py`` need not be);
* a module imports (at module level) only modules of its own line or of the lines above it, as the table
  says; an import inside a function (or under ``if TYPE_CHECKING:``) that points up the table is one the
  paragraph's "Lazy imports" sentence names, and every import that sentence names exists.

When a module moves or is added, this test names it; update the table in the same change.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "dsv4_index"
DOC = ROOT / "docs" / "INTERFACES.md"
EXEMPT = {"__init__.py", "__main__.py"}


def _section() -> str:
    text = DOC.read_text(encoding="utf-8")
    start = text.index("## Layers and imports")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else len(text)]


def _expand(token: str) -> List[str]:
    """``state/{a,b}.py`` -> ``[state/a.py, state/b.py]``; ``ops/<op>/x.py`` -> one per op folder."""
    m = re.search(r"\{([^}]*)\}", token)
    if m:
        return [x for alt in m.group(1).split(",") for x in _expand(token[:m.start()] + alt + token[m.end():])]
    if "<op>" in token:
        ops = sorted(p.name for p in (PKG / "ops").iterdir() if p.is_dir() and not p.name.startswith("_")
                     and (p / "__init__.py").exists())
        return [x for op in ops for x in _expand(token.replace("<op>", op))]
    return [token]


def table() -> List[List[str]]:
    """The table's lines, bottom layer first: the module paths (relative to ``dsv4_index/``) of each."""
    block = re.search(r"```\n(.*?)```", _section(), re.S)
    assert block, "no code block under 'Layers and imports'"
    lines = []
    for line in block.group(1).splitlines():
        mods = []
        for tok in line.split():
            if not re.fullmatch(r"[\w/<>{},.]+\.py", tok):
                break  # NOTE: the description starts at the first token that is not a module
            mods += _expand(tok)
        if mods:
            lines.append(mods)
    return lines


def beside() -> List[str]:
    """Modules the "Beside the layers" paragraph names (``block_table.py`` ...)."""
    sec = _section()
    para = sec[sec.index("Beside the layers"):]
    para = para[:para.find("\n\n")]
    return sorted({x for tok in re.findall(r"`([\w/<>{},.]+\.py)`", para) for x in _expand(tok)})


def tree() -> List[str]:
    return sorted(str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if p.name not in EXEMPT)


def test_the_table_is_read():
    lines = table()
    assert len(lines) >= 8 and "_common.py" in lines[0] and "pipeline.py" in sum(lines, [])
    assert _expand("state/{a,b}.py") == ["state/a.py", "state/b.py"]
    assert "ops/slot_mapping/kernel.py" in _expand("ops/<op>/{__init__,kernel,naive}.py")


def test_every_listed_module_exists():
    listed = sum(table(), []) + beside()
    missing = sorted(m for m in listed if not (PKG / m).exists())
    assert not missing, f"docs/INTERFACES.md names modules that do not exist: {missing}"


def test_every_module_is_listed():
    listed = set(sum(table(), []) + beside())
    unlisted = [m for m in tree() if m not in listed]
    assert not unlisted, f"docs/INTERFACES.md's layer table does not name: {unlisted}"


def _module_of(path: str) -> str:
    parts = Path(path).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: Path) -> List[str]:
    """Package modules (dotted, relative to ``dsv4_index``) imported at module level (not in a function)."""
    rel = path.relative_to(PKG)
    pkg_parts = list(rel.parent.parts)
    out = []
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg_parts[:len(pkg_parts) - node.level + 1]
            elif node.module and node.module.startswith("dsv4_index"):
                base, node_mod = [], node.module[len("dsv4_index"):].lstrip(".")
                out += [".".join(filter(None, [node_mod, a.name])) for a in node.names] + ([node_mod] if node_mod
                                                                                          else [])
                continue
            else:
                continue
            mod = ".".join(base + ([node.module] if node.module else []))
            out += [mod] + [f"{mod}.{a.name}" if mod else a.name for a in node.names]
        elif isinstance(node, ast.Import):
            out += [a.name[len("dsv4_index."):] for a in node.names if a.name.startswith("dsv4_index.")]
    return out


def test_imports_point_down_the_table():
    rank: Dict[str, int] = {}
    for i, mods in enumerate(table()):
        for m in mods:
            rank[_module_of(m)] = i
    for m, i in list(rank.items()):  # NOTE: a package (``from .state import X``) sits on its highest module's line
        for k in range(1, m.count(".") + 1):
            pkg = m.rsplit(".", k)[0]
            if (PKG / pkg.replace(".", "/") / "__init__.py").exists():
                rank[pkg] = max(rank.get(pkg, -1), i)
    bad = []
    for m, i in rank.items():
        path = PKG / (m.replace(".", "/") + ".py")
        if not path.exists():
            path = PKG / m.replace(".", "/") / "__init__.py"
        if not path.exists():
            continue  # NOTE: test_every_listed_module_exists names it
        for imp in _top_level_imports(path):
            j = rank.get(imp)
            if j is not None and j > i:
                bad.append(f"{m} (line {i + 1}) imports {imp} (line {j + 1})")
    assert not bad, "module-level imports that point up the table:\n" + "\n".join(sorted(set(bad)))


def _type_checking(node) -> bool:
    t = node.test if isinstance(node, ast.If) else None
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (isinstance(t, ast.Attribute)
                                                                       and t.attr == "TYPE_CHECKING")


def _lazy_imports(path: Path) -> List[str]:
    """Package modules imported inside a function (or a method) of ``path``, or under ``if TYPE_CHECKING:``."""
    tree_ = ast.parse(path.read_text(encoding="utf-8"))
    rel = path.relative_to(PKG)
    pkg_parts = list(rel.parent.parts)
    out = []
    for fn in ast.walk(tree_):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _type_checking(fn):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    mod = ".".join(pkg_parts[:len(pkg_parts) - node.level + 1] + ([node.module] if node.module else []))
                elif node.module and node.module.startswith("dsv4_index"):
                    mod = node.module[len("dsv4_index"):].lstrip(".")
                else:
                    continue
                out += [mod] + [f"{mod}.{a.name}" if mod else a.name for a in node.names]
            elif isinstance(node, ast.Import):
                out += [a.name[len("dsv4_index."):] for a in node.names if a.name.startswith("dsv4_index.")]
    return out


def documented_lazy() -> set:
    """(module, target) pairs of the paragraph's "Lazy imports ... that point upward" sentence."""
    sec = _section()
    para = sec[sec.index("Lazy imports"):]
    para = para[:para.find("\n\n")]
    pairs, src = set(), None
    for m in re.finditer(r"`([\w/.]+)\.py` (?=→)|→ `([\w.]+)`", para):
        if m.group(1):
            src = _module_of(m.group(1) + ".py")
        else:
            pairs.add((src, m.group(2)))
    return pairs


def test_lazy_imports_up_the_table_are_the_documented_ones():
    rank: Dict[str, int] = {}
    for i, mods in enumerate(table()):
        for m in mods:
            rank[_module_of(m)] = i
    up, every = set(), set()
    for m, i in rank.items():
        path = PKG / (m.replace(".", "/") + ".py")
        if not path.exists():
            continue
        for imp in _lazy_imports(path):
            every.add((m, imp))
            if rank.get(imp, -1) > i:
                up.add((m, imp))
    doc = documented_lazy()
    assert doc, f"the 'Lazy imports' sentence is not read: {doc}"
    assert not up - doc, f"lazy imports up the table that the sentence does not name: {sorted(up - doc)}"
    assert not doc - every, f"named lazy imports that no longer exist: {sorted(doc - every)}"
