"""Every ```python block of README.md runs.

The blocks run in order, in one namespace (a later block may use an earlier block's names, as a reader
would), in a fresh interpreter on the CPU with the PyTorch reference (no TRITON_INTERPRET), from a
temporary folder. A block that needs CUDA is written for ``device="cpu"`` with a comment that "cuda" works
the same. The extractor is generic: any section's new ```python block is picked up.
"""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from helpers.scripts import hang_guard

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
FENCE = re.compile(r"^([ \t]*)```python[ \t]*\n(.*?)^\1```[ \t]*$", re.S | re.M)   # also inside list items

RUNNER = r'''
import sys, traceback
blocks = {blocks!r}
ns = {{"__name__": "__readme__"}}
for i, (line, src) in enumerate(blocks):
    try:
        exec(compile(src, f"README.md:{{line}}", "exec"), ns)
    except BaseException:
        traceback.print_exc()
        print(f"README block {{i}} (line {{line}}) failed", file=sys.stderr)
        sys.exit(1)
print(f"ran {{len(blocks)}} README blocks")
'''


def python_blocks(text: str):
    """(first line number, source) of every fenced ```python block (indented ones dedented)."""
    return [(text.count("\n", 0, m.start(2)) + 1, textwrap.dedent(m.group(2))) for m in FENCE.finditer(text)]


def test_extractor_finds_blocks():
    text = ("intro\n```python\nx = 1\n```\n```bash\nls\n```\n* item\n\n  ```python\n  z = x\n  ```\n"
            "```python\ny = z\n```\n")
    assert python_blocks(text) == [(3, "x = 1\n"), (11, "z = x\n"), (14, "y = z\n")]


def test_every_python_block_compiles():
    blocks = python_blocks(README.read_text())
    assert blocks, "README.md has no ```python block"
    for line, src in blocks:
        compile(src, f"README.md:{line}", "exec")       # SyntaxError names the block's line


def test_every_python_block_runs(tmp_path):
    blocks = python_blocks(README.read_text())
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DSV4_INDEX_BACKEND")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["CUDA_VISIBLE_DEVICES"] = ""        # NOTE: the README's blocks are written for the CPU
    p = subprocess.run([sys.executable, "-c", RUNNER.format(blocks=blocks)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=hang_guard())
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"ran {len(blocks)} README blocks" in p.stdout, p.stdout + p.stderr
