"""The fused kernel reads the staging format and the task descriptor through the numbers their owners
export (``state/staging.py``, ``fused/tasks.py``), and those numbers are ones compiled Triton can read.

* The kernel's source spells no flag / output bit, field number, ``outs`` word or staging stride as a
  literal (they are imported by name).
* Every global a ``@triton.jit`` function of the kernel reads is one Triton's compiler accepts (a
  ``tl.constexpr``, a jit function, a module): the interpreter reads plain ints too, so a plain-int
  global passes every CPU test and fails to compile.
* The descriptor's numbers are a layout: fields distinct and inside ``NF``, per-kind names on the two
  parameter fields, bits distinct; a packed task holds its descriptor's values at the named fields.
* (slow) The kernel compiles for sm_90 from a tiny layout's plan, without a GPU.
"""

from __future__ import annotations

import ast
import builtins
import itertools
import os
import re
import types
from pathlib import Path

import pytest
import torch

from dsv4_index._triton import HAVE_TRITON, tl
from dsv4_index.fused import kernel, tasks, window
from dsv4_index.fused.tasks import FusedTask, task_spec
from dsv4_index.state import staging

from helpers.ptx import sm90_ptx

ROOT = Path(__file__).resolve().parents[2]
KERNEL = ROOT / "dsv4_index" / "fused" / "kernel.py"
KERNEL_FILES = (KERNEL, ROOT / "dsv4_index" / "fused" / "window.py")  # NOTE: the kernel and its token-program pieces


def _code(path: Path) -> str:
    """The source less comments and docstrings (what the kernel computes with)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            body[0] = ast.Pass()
    return ast.unparse(tree)


def test_the_kernel_spells_no_format_literal():
    code = "\n".join(_code(f) for f in KERNEL_FILES)
    bad = {
        "a bit tested as a literal": re.findall(r"[&|]\s*\d+\b|\b\d+\s*[&|]", code),
        "the per-row stride as rows + 1": re.findall(r"rows\s*\+\s*1\b", code),
        "a field of TAB not named S_*": [m for m in re.findall(r"TAB\[TI \* NF \+ ([^\]]+)\]", code)
                                         if not re.fullmatch(r"S_[A-Z_]+( \+ K)?", m)],
        "the outs row spelled as a number": re.findall(r"\*\s*8\s*\+", code),
        "an old private field alias": re.findall(r"\b_(?:NF|KIND|TASK|A|B|FLAGS|HAS|GID|EXTRA|BT|BC)\b", code),
    }
    assert not {k: v for k, v in bad.items() if v}, bad


def _jit_functions(module):
    tree = ast.parse(Path(module.__file__).read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
            yield node


def _globals_read(fn: ast.FunctionDef):
    """Names ``fn`` loads that it neither takes nor assigns."""
    local = {a.arg for a in fn.args.args}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            local.add(node.id)
    return sorted({n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - local)


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton (the check is about what its compiler accepts)")
def test_jit_code_reads_only_globals_the_compiler_accepts():
    from triton.runtime.jit import KernelInterface

    def accepted(v) -> bool:
        return (isinstance(v, (tl.constexpr, types.ModuleType, KernelInterface))
                or getattr(v, "__module__", "").startswith("triton.language"))

    bad = []
    assert len(list(_jit_functions(kernel))) >= 10
    for mod in (kernel, window):
        for fn in _jit_functions(mod):
            for name in _globals_read(fn):
                if name in vars(mod):
                    if not accepted(vars(mod)[name]):
                        bad.append(f"{fn.name}: {name} = {vars(mod)[name]!r}")
                elif not hasattr(builtins, name):
                    bad.append(f"{fn.name}: {name} is not defined")
    assert not bad, bad


def test_descriptor_fields_are_one_layout():
    fields = {n: int(v) for n, v in vars(tasks).items() if n.startswith("S_") and n not in
              ("S_BLOCK_SIZE", "S_WINDOW", "S_RATIO", "S_ROWS_PER_BLOCK", "S_NEXT_N")}
    fields.update({"_S_A": tasks._S_A, "_S_B": tasks._S_B})
    taken = sorted(list(fields.values()) + [int(tasks.S_MUL) + k for k in range(1, tasks.MAX_OUTPUTS)])
    assert taken == list(range(int(tasks.NF))), fields  # distinct, no gap, inside NF
    assert {int(tasks.S_BLOCK_SIZE), int(tasks.S_RATIO)} == {tasks._S_A}
    assert {int(tasks.S_WINDOW), int(tasks.S_ROWS_PER_BLOCK), int(tasks.S_NEXT_N)} == {tasks._S_B}
    assert sorted(int(f) for f in (tasks.FLAG_WRITE_FLOOR, tasks.FLAG_WINDOW_FLOOR, tasks.FLAG_CIRCULAR)) == [1, 2, 4]
    assert [int(h) for h in (tasks.HAS_OUT1, tasks.HAS_OUT2, tasks.HAS_OUT3)] == [2, 4, 8]
    assert int(tasks.OUTS_GEO) == tasks.MAX_OUTPUTS and int(tasks.O_SCRATCH) == tasks.MAX_OUTPUTS + tasks.GEO_WORDS
    assert int(tasks.OUTS_WORDS) == int(tasks.O_SCRATCH) + 1
    geo = sorted(int(g) for g in (tasks.G_TABLE, tasks.G_STRIDE, tasks.G_WIDTH, tasks.G_RING, tasks.G_GID))
    assert geo == list(range(tasks.GEO_WORDS))


def test_a_packed_task_holds_its_values_at_the_named_fields():
    out = torch.zeros(4, dtype=torch.int32)
    t = FusedTask("window", (out, out, None, out), gid=3, a=16, b=128, width=40, write_floor=True, circular=True)
    s = task_spec(7, t, lambda g: (2, 1, 4), [1, 4, 1, 2], True)
    assert len(s) == int(tasks.NF) and all(type(v) is int for v in s)
    assert (s[tasks.S_KIND], s[tasks.S_TASK], s[tasks.S_BLOCK_SIZE], s[tasks.S_WINDOW], s[tasks.S_WIDTH]) == \
        (tasks.KINDS["window"], 7, 16, 128, 40)
    assert (s[tasks.S_RING], s[tasks.S_CPW], s[tasks.S_CPR], s[tasks.S_CPI], s[tasks.S_GID]) == (1, 2, 1, 4, 3)
    assert s[tasks.S_FLAGS] == int(tasks.FLAG_WRITE_FLOOR) | int(tasks.FLAG_CIRCULAR)
    assert s[tasks.S_HAS] == 1 | int(tasks.HAS_OUT1) | int(tasks.HAS_OUT3)
    assert [s[tasks.S_MUL + k] for k in range(4)] == [1, 4, 1, 2]
    tile = (tasks.S_BT, tasks.S_BC, tasks.S_NCHUNK, tasks.S_START, tasks.S_NPROG, tasks.S_REP)
    assert [s[f] for f in tile] == [0] * 6
    c = task_spec(0, FusedTask("causal", (out, out), gid=0, a=4, b=64, width=8), lambda g: (1, 0, 1), [1, 1, 1, 1],
                  False)
    assert (c[tasks.S_RATIO], c[tasks.S_ROWS_PER_BLOCK], c[tasks.S_FLAGS], c[tasks.S_HAS]) == (4, 64, 0, 3)


def test_staging_exports_the_row_stride_and_the_write_halves():
    lay = staging.StageLayout.for_tokens(9, 2, 3, 5)
    stride = lay.rows + staging.ROW_ARRAY_PAD
    assert lay.seq_lens - lay.qsl == lay.slots - lay.seq_lens == stride
    assert lay.extra_at(2) - lay.extra_at(1) == stride and lay.overlay == lay.extra_at(3)
    st = staging.StepStaging(torch.device("cpu"), 16, 2, 3, 8, 5)
    st.stage_writes_only(torch.tensor([11, 12, 13]).numpy(), torch.tensor([0, 5, 2]).numpy())
    w, n = st.layout(0).writes, 3
    dev = st.dev.tolist()
    assert dev[w + staging.W_VALUES * n:w + (staging.W_VALUES + 1) * n] == [11, 12, 13]
    assert dev[w + staging.W_DESTS * n:w + (staging.W_DESTS + 1) * n] == [0, 5, 2]
    flat = torch.zeros(6, dtype=torch.int32)
    st.apply_pending(flat)
    assert flat.tolist() == [11, 0, 13, 0, 0, 12]


@pytest.mark.slow  # ./dev quick skips it
@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_the_kernel_compiles_for_sm90_without_a_gpu(tmp_path):
    """Compiled Triton reads what the interpreter does not check (constexpr globals, static branches):
    one plan of the tiny layout (and of tiny_v41), with and without ``query_batches``, every tile variant's
    constants, compiled to PTX in a subprocess without TRITON_INTERPRET."""
    from triton.backends import backends
    if "nvidia" not in backends:
        pytest.skip("triton has no NVIDIA backend here")
    from helpers.layouts import tiny_layout

    from dsv4_index import DSV4Layout
    from dsv4_index.fused.plan import LARGE, SMALL, TINY, FusedPlan
    from dsv4_index.pipeline import MetadataPipeline
    if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
        pytest.skip("builds the plan with TRITON_INTERPRET=1 or on CUDA")
    # NOTE: the second layout has units of several tasks (one window task per sliding group); each with and without
    # the query paths (query_batches: fused/query.py compiled in, or no query task at all)
    for layout, query in itertools.product((tiny_layout(circular={"c4_state": 16, "c128_state": 32}),
                                            DSV4Layout.from_config("tiny_v41", 256, mla_block_size=16,
                                                                   swa_group_per_layer=True)), (True, False)):
        pipe = MetadataPipeline(layout, 4, 64, "cuda" if torch.cuda.is_available() else "cpu", query_batches=query)
        p = pipe.fused_plan
        plan = FusedPlan(p.tasks, pipe.tables, pipe.ctx.group_cp, pipe.staging.dev, 2, tiny=TINY, small=SMALL,
                         large=LARGE)
        for v in plan._variants:
            sm90_ptx(v["consts"], v["cfg"].num_warps, tmp_path, timeout=300)


def test_tasks_of_one_code_are_one_unit():
    """One window task per sliding group of equal geometry compiles once: V4.1 with a sliding group per
    layer has no more units than with one sliding group, and the units cover every task once."""
    from dsv4_index import DSV4Layout, MetadataPipeline

    def units(**kw):
        lay = DSV4Layout.from_config("tiny_v41", 256, mla_block_size=16, **kw)
        plan = MetadataPipeline(lay, 4, 64, "cuda" if torch.cuda.is_available() else "cpu", 1).fused_plan
        tok, nf = plan._variants[1]["consts"]["TOK"], int(tasks.NF)
        us = [tok[i:i + nf] for i in range(0, len(tok), nf)]
        n_tok = sum(t.kind in tasks.TOKEN_KINDS for t in plan.tasks)
        rows = sorted(u[tasks.S_TASK] + k for u in us for k in range(u[tasks.S_REP]))
        assert rows == list(range(len(plan.tasks) - n_tok, len(plan.tasks)))  # every token task's row, once
        return len(us), max(u[tasks.S_REP] for u in us), lay.num_groups

    one, rep1, g1 = units()
    per_layer, rep, g = units(swa_group_per_layer=True)
    assert g > g1 and per_layer <= one and rep >= g - g1 + 1, (one, per_layer, rep, g, g1)
