"""Import hygiene (issue 11): every module of ``dsv4_index`` imports cleanly in a fresh interpreter,
in any order and alone, with and without the package ``__init__`` (which would otherwise hide a cycle
between submodules by importing everything first); and the layering rules hold, read from the source
with ``ast``:

* ``ops/`` (the functional ops) imports nothing of ``channels``, ``state``, ``fused``, ``pipeline``,
  ``validate``;
* ``ops/<op>/kernel.py`` and ``ops/<op>/naive.py`` never import one another (any op), nor do
  ``state/<pass>/kernel.py`` and ``state/<pass>/naive.py``;
* ``fused/`` imports no built-in channel module (it only packs what builders hand it);
* the static import graph of the package is acyclic, every import statement counted (module-level,
  function-level, ``TYPE_CHECKING``), and the core never imports the tools (``dsv4_index.tools``,
  ``dsv4_index.testing``, the ``__main__`` entry point).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.scripts import hang_guard

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "dsv4_index"
FILES = sorted(p for p in PKG.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = [module_name(p) for p in FILES if p.name != "__main__.py"]

# NOTE: runs in a fresh interpreter, over the modules in forward order, in reverse order, and each
# alone (every module of the package purged first). "bare" replaces the package __init__ by an empty
# package, so a submodule's import runs only what it imports itself.
_PROBE = r"""
import importlib, json, sys, traceback, types
pkg_name, pkg_dir, bare, names = sys.argv[1], sys.argv[2], sys.argv[3] == "1", json.loads(sys.argv[4])
if pkg_name == "dsv4_index":
    import torch, triton  # NOTE: third-party, imported once: the subject is our own modules

def fresh():
    for k in [k for k in sys.modules if k == pkg_name or k.startswith(pkg_name + ".")]:
        del sys.modules[k]
    if bare:
        pkg = types.ModuleType(pkg_name)
        pkg.__path__ = [pkg_dir]
        sys.modules[pkg_name] = pkg

failed = []
for order, seq in (("forward", names), ("reverse", names[::-1]), ("alone", names)):
    fresh()
    for name in seq:
        if order == "alone":
            fresh()
        if bare and name == pkg_name:
            continue
        try:
            importlib.import_module(name)
        except BaseException:
            failed.append([order, name, traceback.format_exc(limit=4)])
print(json.dumps(failed))
"""


def probe(pkg_name: str, pkg_dir: Path, bare: bool, names, cwd: Path) -> list:
    """[(order, module, traceback)] of every failed import."""
    out = subprocess.run([sys.executable, "-c", _PROBE, pkg_name, str(pkg_dir), "1" if bare else "0",
                          json.dumps(list(names))], cwd=cwd, capture_output=True, text=True, timeout=hang_guard())
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_module_list_is_complete():
    assert len(MODULES) > 30 and "dsv4_index.fused.plan" in MODULES and "dsv4_index.ops._device" in MODULES


@pytest.mark.parametrize("bare", [False, True], ids=["package", "bare"])
@pytest.mark.slow  # ./dev quick skips it
def test_every_module_imports_in_any_order_and_alone(bare):
    failed = probe("dsv4_index", PKG, bare, MODULES, ROOT)
    assert not failed, "\n".join(f"{o} {n}:\n{tb}" for o, n, tb in failed)


def test_probe_finds_a_cycle(tmp_path):
    """The probe can fail: a two-module cycle that works only when ``b`` is imported first."""
    pkg = tmp_path / "cyc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\nX = 1\n")
    (pkg / "b.py").write_text("from .a import X\n")
    failed = probe("cyc", pkg, True, ["cyc.a", "cyc.b"], tmp_path)
    assert {(o, n) for o, n, _ in failed} == {("forward", "cyc.a"), ("alone", "cyc.a")}


@pytest.mark.slow  # ./dev quick skips it
def test_plain_import_statements_in_fresh_interpreters():
    """``python -c "import a; import b; ..."`` literally, forward and reverse (no importlib)."""
    for names in (MODULES, MODULES[::-1]):
        code = "; ".join(f"import {n}" for n in names)
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                             timeout=hang_guard())
        assert out.returncode == 0, out.stderr[-3000:]


# ----------------------------------------------------------------------------------------------
# layering, read from the source
# ----------------------------------------------------------------------------------------------
def imports_of(path: Path) -> set:
    """Absolute module names a file imports (relative imports resolved; ``from x import y`` gives
    ``x`` and ``x.y``, since ``y`` may be a submodule)."""
    pkg = module_name(path) if path.name == "__init__.py" else module_name(path).rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def _under(names: set, prefix: str) -> set:
    return {n for n in names if n == prefix or n.startswith(prefix + ".")}


def test_imports_of_resolves_relative_imports():
    got = imports_of(PKG / "ops" / "slot_mapping" / "__init__.py")
    assert "dsv4_index._common" in got and "dsv4_index.ops._args" in got
    assert {"dsv4_index.ops.slot_mapping.kernel", "dsv4_index.ops.slot_mapping.naive"} <= got
    assert "dsv4_index.ops._device" in imports_of(PKG / "ops" / "slot_mapping" / "kernel.py")


@pytest.mark.parametrize("path", [p for p in FILES if "ops" in p.relative_to(PKG).parts[:1]],
                         ids=lambda p: str(p.relative_to(PKG)))
def test_ops_import_no_higher_layer(path):
    names = imports_of(path)
    for layer in ("channels", "state", "fused", "pipeline", "validate"):
        bad = _under(names, f"dsv4_index.{layer}")
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", [p for p in FILES if p.parent.parent in (PKG / "ops", PKG / "state") and
                                  p.name in ("kernel.py", "naive.py")], ids=lambda p: str(p.relative_to(PKG)))
def test_kernel_and_naive_never_import_each_other(path):
    """``ops/<op>/`` and ``state/<pass>/``: the compiled pass and its definition stand apart."""
    other = "naive" if path.name == "kernel.py" else "kernel"
    pkg = ".".join(path.relative_to(ROOT).with_suffix("").parts[:2]) + "."
    bad = {n for n in imports_of(path) if n.startswith(pkg) and n.split(".")[-1] == other}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_every_op_has_kernel_and_naive():
    ops = [p for p in (PKG / "ops").iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    assert len(ops) >= 7
    for p in ops:
        assert (p / "kernel.py").exists() and (p / "naive.py").exists(), p.name


BUILTIN_CHANNELS = {f"dsv4_index.channels.{m}" for m in ("window", "compressed", "indexer", "causal")}


@pytest.mark.parametrize("path", sorted((PKG / "fused").glob("*.py")), ids=lambda p: p.name)
def test_fused_imports_no_builtin_channel(path):
    names = imports_of(path)
    # NOTE: the channels package __init__ imports every built-in channel, so it is barred too
    bad = (names & BUILTIN_CHANNELS) | {n for n in names if n == "dsv4_index.channels"}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"
    src = path.read_text()
    for cls in ("WindowChannel", "CompressedChannel", "IndexerChannel", "CausalCompressedChannel"):
        assert cls not in src, f"{path.name} names the builder class {cls}"


# ----------------------------------------------------------------------------------------------
# the static import graph: acyclic, lazy imports included; the core never imports the tools
# ----------------------------------------------------------------------------------------------
TOOLS = ("dsv4_index.tools", "dsv4_index.testing", "dsv4_index.__main__")


def import_graph(root: Path, pkg_name: str) -> dict:
    """module -> the package modules it imports, from every import statement of its source (also
    inside functions and ``if TYPE_CHECKING``), relative imports resolved.

    ``from X import n`` is an edge to ``X`` and, when that is a module, to ``X.n``; importing ``a.b.c``
    is an edge to the packages ``a.b`` and ``a`` too, except the packages the importer is inside
    (Python runs those ``__init__`` files before the importer anyway, and an ``__init__`` importing its
    own submodules is no cycle)."""
    base = root / pkg_name
    files = sorted(base.rglob("*.py"))

    def name_of(path: Path) -> str:
        parts = path.relative_to(root).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    mods = {name_of(p): p for p in files}
    graph = {}
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        inside = {".".join(mod.split(".")[:i]) for i in range(1, mod.count(".") + 1)} | (
            {mod} if path.name == "__init__.py" else set())
        out = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = pkg.split(".")
                    target = ".".join(parts[:len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                out.update({f"{target}.{a.name}" for a in node.names} & mods.keys())
                out.add(target)
        # NOTE: importing a.b.c runs the packages a.b and a first: edges to those outside the importer
        out |= {".".join(m.split(".")[:i]) for m in out for i in range(1, m.count(".") + 1)}
        graph[mod] = {m for m in out if m in mods and m != mod and m not in inside}
    return graph


def find_cycle(graph: dict, skip=frozenset()):
    """One cycle of ``graph`` (a list of modules, first == last) ignoring the edges in ``skip``; None."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    stack: list = []

    def visit(u):
        color[u] = GREY
        stack.append(u)
        for v in sorted(graph[u]):
            if (u, v) in skip:
                continue
            if color[v] == GREY:
                return stack[stack.index(v):] + [v]
            if color[v] == WHITE:
                found = visit(v)
                if found:
                    return found
        stack.pop()
        color[u] = BLACK
        return None

    for u in sorted(graph):
        if color[u] == WHITE:
            found = visit(u)
            if found:
                return found
    return None


GRAPH = import_graph(ROOT, "dsv4_index")


def test_import_graph_reads_lazy_relative_and_type_checking_imports():
    g = GRAPH
    assert "dsv4_index.frontend.convert" in g["dsv4_index.frontend"]
    assert {"dsv4_index.frontend.rules", "dsv4_index.state.requests", "dsv4_index.batch"} <= \
        g["dsv4_index.frontend.fast"]
    assert "dsv4_index.validate" in g["dsv4_index.pipeline"]  # NOTE: a function-level import
    assert "dsv4_index.state" not in g["dsv4_index.state.requests"]  # NOTE: its own package


def test_the_graph_finds_lazy_and_type_checking_cycles(tmp_path):
    """The check can fail: a cycle closed by a function-level import, and one by a TYPE_CHECKING import."""
    pkg = tmp_path / "cyc"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("from .sub.b import X\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("X = 1\ndef f():\n    from ..a import Y\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import Z\n")
    (pkg / "d.py").write_text("from . import c\n")
    g = import_graph(tmp_path, "cyc")
    assert g["cyc.sub.b"] == {"cyc.a"} and g["cyc.c"] == {"cyc.d"} and g["cyc.d"] == {"cyc.c"}
    assert find_cycle(g) in (["cyc.a", "cyc.sub.b", "cyc.a"], ["cyc.c", "cyc.d", "cyc.c"])
    assert find_cycle(g, skip={("cyc.sub.b", "cyc.a"), ("cyc.d", "cyc.c")}) is None


def test_static_import_graph_is_acyclic():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _is_tool(mod: str) -> bool:
    return any(mod == t or mod.startswith(t + ".") for t in TOOLS)


def test_core_never_imports_the_tools():
    bad = sorted((a, b) for a, targets in GRAPH.items() if not _is_tool(a) for b in targets
                 if _is_tool(b))
    assert not bad, f"core modules import tools: {bad}"


def test_front_door_rules_import_nothing_of_the_front_door():
    assert not {m for m in GRAPH["dsv4_index.frontend.rules"] if m.startswith("dsv4_index.frontend")}
    assert not {m for m in GRAPH["dsv4_index.state.requests"] if m.startswith("dsv4_index.frontend")}
