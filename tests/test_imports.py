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

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "dsv4_index"
FILES = sorted(p for p in PKG.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = [module_name(p) for p in FILES if p.name != "__main__.py"]

# NOTE: runs in a fresh interpreter. "bare" replaces the package __init__ by an empty package, so a
# submodule's import runs only what it imports itself; "alone" purges every dsv4_index module first.
_PROBE = r"""
import importlib, json, sys, traceback, types
mode, bare, names, pkg_dir = sys.argv[1], sys.argv[2] == "1", json.loads(sys.argv[3]), sys.argv[4]
import torch, triton  # NOTE: third-party, imported once: the subject is our own modules

def fresh():
    for k in [k for k in sys.modules if k == "dsv4_index" or k.startswith("dsv4_index.")]:
        del sys.modules[k]
    if bare:
        pkg = types.ModuleType("dsv4_index")
        pkg.__path__ = [pkg_dir]
        sys.modules["dsv4_index"] = pkg

failed = []
fresh()
for name in names:
    if mode == "alone":
        fresh()
    if bare and name == "dsv4_index":
        continue
    try:
        importlib.import_module(name)
    except BaseException:
        failed.append([name, traceback.format_exc(limit=4)])
print(json.dumps(failed))
"""


def _run(mode: str, bare: bool, names) -> list:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode, "1" if bare else "0", json.dumps(list(names)), str(PKG)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_module_list_is_complete():
    assert len(MODULES) > 30 and "dsv4_index.fused.plan" in MODULES and "dsv4_index.ops._device" in MODULES


@pytest.mark.parametrize("bare", [False, True], ids=["package", "bare"])
@pytest.mark.parametrize("order", ["forward", "reverse", "alone"])
def test_every_module_imports_in_any_order(order, bare):
    names = MODULES if order != "reverse" else MODULES[::-1]
    failed = _run("alone" if order == "alone" else "sequence", bare, names)
    assert not failed, "\n".join(f"{n}:\n{tb}" for n, tb in failed)


def test_plain_import_statement_in_fresh_interpreters():
    """``python -c "import a; import b; ..."`` literally, forward and reverse (no importlib)."""
    for names in (MODULES, MODULES[::-1]):
        code = "; ".join(f"import {n}" for n in names)
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
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
