"""Every per-op Triton kernel compiles for sm_90 without a GPU (issue 40: under Triton 3.6 and 3.9; the fused
kernel's own check is ``tests/fused/test_fused_format.py::test_the_kernel_compiles_for_sm90_without_a_gpu``).

Compiled Triton checks what the interpreter does not (constexpr globals, static branches, mask and operand
types), so a kernel can pass every interpreter test and fail to compile. Here one subprocess (with
``TRITON_INTERPRET=1``) runs unfused pipelines (``fused=False``: every op's own kernel) over hand-written
steps of several layouts and converts top-k picks, recording each kernel launch's arguments; a second one
(without ``TRITON_INTERPRET``) compiles every distinct launch (its constexprs, argument types and
``num_warps``) to PTX for ``GPUTarget("cuda", 90, 32)``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dsv4_index._triton import HAVE_TRITON
from helpers import ROOT

_CAPTURE = r"""
import json, sys
import torch
from triton.runtime.interpreter import InterpretedFunction
from helpers.layouts import tiny_layout
from helpers.pipelines import make_pipeline, topk_channels, two_steps
from dsv4_index import DSV4Layout

seen = {}
run = InterpretedFunction.run


def arg(v):
    if isinstance(v, torch.Tensor):
        return {"tensor": str(v.dtype).replace("torch.", "")}
    if isinstance(v, bool) or isinstance(v, int) or v is None:
        return v
    return repr(v)


def record(self, *args, grid, warmup, **kwargs):
    names = self.arg_names
    call = dict(zip(names, map(arg, args)))
    call.update({k: arg(v) for k, v in kwargs.items()})
    key = json.dumps([self.fn.__module__, self.fn.__name__, call], sort_keys=True)
    seen.setdefault(key, (self.fn.__module__, self.fn.__name__, call))
    return run(self, *args, grid=grid, warmup=warmup, **kwargs)


InterpretedFunction.run = record
cases = [(tiny_layout(), {}), (tiny_layout(circular={"c4_state": 16, "c128_state": 32}), {}),
         (DSV4Layout.from_config("tiny_v41", 256, mla_block_size=16, swa_group_per_layer=True), {}),
         (tiny_layout(cp_world_size=2), {"cp_world_size": 2, "cp_rank": 1})]
for layout, kw in cases:
    pipe = make_pipeline(layout, fused=False, backend="triton", **kw)
    for step in two_steps(layout):
        pipe.update(step, pad_to=96)
        meta = pipe.build()
        for name in topk_channels(meta):
            width = pipe._builders[name].k_capacity  # NOTE: the channel's index_topk
            topk = torch.randint(-1, 40, (96, width), dtype=torch.int32)
            meta.topk_to_slots(name, topk)
            meta.topk_to_slots(name, topk, compact=True)
# NOTE: V4.1's two-level indexer (candidate blocks of the tiny V4.1's ratio-1 channel)
v41 = DSV4Layout.from_config("tiny_v41", 256, mla_block_size=16, swa_block_size=8)
pipe = make_pipeline(v41, fused=False, backend="triton")
for step in two_steps(v41):
    pipe.update(step, pad_to=96)
    meta = pipe.build()
    blocks = torch.randint(-1, 40, (96, 4), dtype=torch.int32)
    cols = torch.randint(-1, 8, (96, pipe._builders["c1a"].k_capacity), dtype=torch.int32)
    meta.candidate_blocks_to_physical("c1a", blocks)
    for compact in (False, True):
        meta.candidate_topk_to_slots("c1a", blocks, cols, compact=compact)
# NOTE: the functional op (its own kernel: a request search, not the pipeline's precomputed rows)
from dsv4_index import ops
qsl, seq = torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([40, 9], dtype=torch.int32)
table = torch.arange(8, dtype=torch.int32).view(2, 4)
for compact in (False, True):
    ops.topk_to_slots(torch.randint(-1, 10, (5, 4), dtype=torch.int32), qsl, seq, table, 16, 4, compact=compact,
                      backend="triton")
print("@@CALLS@@" + json.dumps([seen[k] for k in sorted(seen)]))
"""

_COMPILE = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

PTR = {"int32": "*i32", "int64": "*i64", "int8": "*i8", "uint8": "*u8", "bool": "*i1", "float32": "*fp32"}
done = []
for module, name, call in json.loads(sys.stdin.read()):
    k = getattr(importlib.import_module(module), name)
    const = {k.arg_names[i] for i in k.constexprs}
    opts = {o: call.pop(o) for o in ("num_warps", "num_stages") if o in call}
    sig, consts = {}, {}
    for a in k.arg_names:
        v = call[a]
        if a in const:
            sig[a], consts[a] = "constexpr", v
        elif isinstance(v, dict):
            sig[a] = PTR[v["tensor"]]
        elif isinstance(v, bool):
            sig[a] = "i1"
        else:
            sig[a] = "i32" if -2**31 <= v < 2**31 else "i64"
    ck = triton.compile(ASTSource(k, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32), options=opts)
    assert ".target sm_90" in ck.asm["ptx"], name
    done.append(name)
print("@@DONE@@" + json.dumps(sorted(set(done))))
"""


@pytest.mark.slow  # ./dev quick skips it
@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_every_op_kernel_compiles_for_sm90_without_a_gpu(tmp_path):
    from triton.backends import backends
    if "nvidia" not in backends:
        pytest.skip("triton has no NVIDIA backend here")
    base = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
                TRITON_CACHE_DIR=str(tmp_path))
    base.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", _CAPTURE], env=dict(base, TRITON_INTERPRET="1",
                       DSV4_INDEX_BACKEND="triton"), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "@@CALLS@@" in r.stdout, r.stderr[-3000:]
    calls = json.loads(r.stdout.split("@@CALLS@@")[1])
    kernels = {c[1] for c in calls}
    # NOTE: every op's kernel was launched (a kernel that no launch reached would pass unchecked)
    want = {"_token_to_req_kernel", "_slot_mapping_kernel", "_compressed_slot_mapping_kernel",
            "_window_indices_kernel", "_causal_compressed_indices_kernel", "_topk_to_slots_kernel",
            "_indexer_lengths_kernel", "_candidate_phys_kernel", "_candidate_topk_kernel"}
    assert want <= kernels, sorted(want - kernels)
    r = subprocess.run([sys.executable, "-c", _COMPILE], input=json.dumps(calls), env=base, cwd=ROOT,
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0 and "@@DONE@@" in r.stdout, r.stderr[-3000:]
    assert set(json.loads(r.stdout.split("@@DONE@@")[1])) == kernels
