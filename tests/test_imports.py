"""Import hygiene (issue 11): every module of ``dsv4_index`` imports cleanly in a fresh interpreter,
in any order and alone, with and without the package ``__init__`` (which would otherwise hide a cycle
between submodules by importing everything first); and the layering rules hold, read from the source
with ``ast``:

* ``ops/`` (the functional ops) imports nothing of ``channels``, ``state``, ``fused``, ``pipeline``,
  ``validate``;
* ``ops/<op>/kernel.py`` and ``ops/<op>/naive.py`` never import one another (any op);
* ``fused/`` imports no built-in channel module (it only packs what builders hand it).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from _scripts import hang_guard

ROOT = Path(__file__).resolve().parents[1]
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


@pytest.mark.parametrize("path", [p for p in FILES if p.parent.parent == PKG / "ops" and
                                  p.name in ("kernel.py", "naive.py")], ids=lambda p: str(p.relative_to(PKG)))
def test_kernel_and_naive_never_import_each_other(path):
    other = "naive" if path.name == "kernel.py" else "kernel"
    bad = {n for n in imports_of(path) if n.startswith("dsv4_index.ops.") and n.split(".")[-1] == other}
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
