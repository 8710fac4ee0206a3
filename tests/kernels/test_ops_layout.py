"""Layout rules of the op layer (reviews/architecture.md §4): one folder per op, ``kernel.py`` and
``naive.py`` never import each other, nothing under ``ops/`` imports a higher layer, the references
have the ops' signatures, and any module imports first without a cycle."""

import ast
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dsv4_index
from dsv4_index import ops, reference

OPS_DIR = Path(dsv4_index.__file__).parent / "ops"
OP_NAMES = ["token_to_req", "slot_mapping", "compressed_slot_mapping", "window_indices",
            "causal_compressed_indices", "topk_to_slots", "indexer_lengths", "candidate_blocks_to_physical",
            "candidate_topk_to_slots"]
HIGHER = ("channels", "pipeline", "fused", "state", "validate", "kernels", "block_table", "geometry")


def _imports(path: Path):
    """(level, module, names) of every import statement in a file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(0, a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.level, node.module or "", tuple(a.name for a in node.names)))
    return out


def test_one_folder_per_op():
    assert sorted(p.name for p in OPS_DIR.iterdir() if p.is_dir() and p.name != "__pycache__") == \
        sorted(OP_NAMES)
    for op in OP_NAMES:
        assert {"__init__.py", "kernel.py", "naive.py"} <= {p.name for p in (OPS_DIR / op).iterdir()}
    assert not list((Path(dsv4_index.__file__).parent / "reference").glob("*.py"))  # reference.py only


@pytest.mark.parametrize("op", OP_NAMES)
def test_kernel_and_naive_imports(op):
    for level, mod, names in _imports(OPS_DIR / op / "kernel.py"):
        # NOTE: triton only through the optional-triton shim (dsv4_index/_triton.py), never `import triton`
        ok = (level == 0 and mod.split(".")[0] in ("torch", "__future__")) or \
             (level == 2 and mod == "_device") or (level == 3 and mod == "_triton" and set(names) <= {"triton", "tl"})
        assert ok, f"{op}/kernel.py imports {'.' * level}{mod} {names}"
    for level, mod, names in _imports(OPS_DIR / op / "naive.py"):
        # NOTE: numpy for the host formulas of staged per-request arrays (issue 18: beside the reference)
        ok = (level == 0 and mod.split(".")[0] in ("torch", "numpy", "typing", "__future__")) or \
             (level == 3 and mod == "_common")
        assert ok, f"{op}/naive.py imports {'.' * level}{mod} {names}"
    # only __init__.py imports both
    init = _imports(OPS_DIR / op / "__init__.py")
    assert any(lvl == 1 and mod == "" and {"kernel", "naive"} <= set(n) for lvl, mod, n in init)


def test_nothing_under_ops_imports_a_higher_layer():
    for path in OPS_DIR.rglob("*.py"):
        for _level, mod, names in _imports(path):
            parts = set(mod.split(".")) | set(names)
            assert not parts & set(HIGHER), f"{path.relative_to(OPS_DIR)} imports {mod} {names}"


@pytest.mark.parametrize("op", OP_NAMES)
def test_reference_has_the_ops_signature(op):
    a, b = inspect.signature(getattr(reference, op)), inspect.signature(getattr(ops, op))
    assert [(p.name, p.kind, p.default) for p in a.parameters.values()] == \
        [(p.name, p.kind, p.default) for p in b.parameters.values()]
    assert "backend is ignored" in getattr(reference, op).__doc__
    assert getattr(dsv4_index, op) is getattr(ops, op)


@pytest.mark.slow  # ./dev quick skips it
def test_modules_import_first_in_any_order():
    """A fresh interpreter imports each of these first (no cycle hides behind a lazy package)."""
    # NOTE: two leaves here (a fresh interpreter costs seconds); every module was checked this way
    mods = ["dsv4_index.ops.topk_to_slots.naive", "dsv4_index.reference"]
    env = dict(os.environ, PYTHONPATH=str(Path(dsv4_index.__file__).parent.parent))
    procs = [subprocess.Popen([sys.executable, "-c", f"import {m}; import dsv4_index; "
                               "dsv4_index.reference.slot_mapping; dsv4_index.ops.IndexerLengths"],
                              env=env, stderr=subprocess.PIPE) for m in mods]
    for m, p in zip(mods, procs):
        _, err = p.communicate(timeout=900)  # NOTE: a hang guard, not a speed check
        assert p.returncode == 0, f"import {m} first: {err.decode()[-2000:]}"
