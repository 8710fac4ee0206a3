"""Shared helpers of the script smoke tests (``test_benchmarks_smoke.py``, ``test_examples_smoke.py``): run the
repository's scripts as a user does, in a subprocess from the repository root.

Timeouts are hang guards, not speed checks: a script that takes 5 s on an idle machine can take ten times as
long on a loaded CI runner, and a suite must not fail by wall-clock under load. ``DSV4_TEST_TIMEOUT_SCALE``
(a float, default 1) scales every guard for very slow machines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Dict, List, Tuple

from helpers import ROOT

HANG_GUARD_S = 900.0  # NOTE: a hang guard: far above any script's time on a loaded 2-core machine


def hang_guard(seconds: float = HANG_GUARD_S) -> float:
    """``seconds`` scaled by ``DSV4_TEST_TIMEOUT_SCALE`` (default 1)."""
    return seconds * float(os.environ.get("DSV4_TEST_TIMEOUT_SCALE", "1"))


def scripts(folder: str) -> List[str]:
    """Every runnable script of ``folder`` (a file with a ``__main__`` guard), as repo-relative paths."""
    return sorted(f"{folder}/{p.name}" for p in (ROOT / folder).glob("*.py")
                  if 'if __name__ == "__main__":' in p.read_text())


def run_script(path: str, *args, interpret: bool = True) -> Tuple[int, str]:
    """(exit code, stdout + stderr) of ``python path args...`` from the repo root (kernels interpreted)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), MPLBACKEND="Agg")
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    p = subprocess.run([sys.executable, str(ROOT / path), *map(str, args)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=hang_guard())
    return p.returncode, p.stdout + p.stderr


_HELP_RUNNER = r"""
import contextlib, io, json, runpy, sys
res = {}
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            runpy.run_path(path, run_name="__main__")
        code = "returned without exiting: --help ran the script"
    except SystemExit as e:
        code = e.code or 0
    except BaseException as e:  # noqa: BLE001 - reported per script
        code = f"{type(e).__name__}: {e}"
    res[path] = [code, buf.getvalue()]
print("\n@@HELP@@" + json.dumps(res))
"""


def help_of(paths: List[str]) -> Dict[str, Tuple[object, str]]:
    """``path -> (exit code, output)`` of ``python path --help`` for every path, all run in ONE subprocess
    (``runpy``): torch is imported once, so the quick subset pays about one interpreter start for all."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), MPLBACKEND="Agg", TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "-c", _HELP_RUNNER, *paths], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=hang_guard())
    assert p.returncode == 0 and "@@HELP@@" in p.stdout, p.stdout + p.stderr
    return {k: (v[0], v[1]) for k, v in json.loads(p.stdout.split("@@HELP@@", 1)[1]).items()}
