"""The fused kernel compiled to sm_90 PTX without a GPU (``test_fused_format``, ``test_query_optin``): one
variant's constants in, its PTX size out, in a subprocess without ``TRITON_INTERPRET`` (the interpreter does not
compile)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Tuple

from helpers import ROOT

_SCRIPT = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dsv4_index.fused.kernel import fused_step_kernel as k
c = json.loads(sys.stdin.read())
nw = c.pop("num_warps")
c = {n: tuple(v) if isinstance(v, list) else v for n, v in c.items()}
ptr = {"stage_ptr": "*i32", "tables_ptr": "*i32", "base32": "*i32", "base64": "*i64", "base8": "*i8",
       "outs_ptr": "*i64"}
sig = {a: ptr.get(a, "constexpr" if a in c else "i32") for a in k.arg_names}
ck = triton.compile(ASTSource(k, sig, constexprs=c), target=GPUTarget("cuda", 90, 32), options={"num_warps": nw})
ptx = ck.asm["ptx"]
lines = [s.strip() for s in ptx.splitlines()]
print("ptx", len(ptx), sum(s.endswith(";") and not s.startswith((".", "//", "$")) for s in lines))
"""


def sm90_ptx(consts: dict, num_warps: int, cache_dir, timeout: float = 600) -> Tuple[int, int]:
    """(PTX characters, instructions) of the fused kernel with the constexprs ``consts`` (a variant's
    ``consts``), compiled for sm_90; fails the test with the compiler's stderr when it does not compile."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(cache_dir))
    r = subprocess.run([sys.executable, "-c", _SCRIPT], input=json.dumps(dict(consts, num_warps=num_warps)), env=env,
                       cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0 and r.stdout.startswith("ptx"), r.stderr[-3000:]
    chars, instructions = map(int, r.stdout.split()[1:3])
    return chars, instructions
