"""``./dev``'s install step says what it is doing while pip runs (a silent minute reads like a hang), and a
failing pip ends in the log's tail and a non-zero exit. pip is replaced by a fake interpreter that prints
pip-like lines slowly; ``./dev``'s own functions are sourced, nothing is installed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers.scripts import hang_guard

ROOT = Path(__file__).resolve().parents[2]
FAKE_PIP = """#!/usr/bin/env bash
echo "Collecting torch"
[ "${FAIL:-0}" = 1 ] && { echo "ERROR: no matching distribution"; exit 1; }
sleep 1.2; echo "Collecting triton"; sleep 1.2
echo "Installing collected packages: torch, triton"; sleep 0.3
echo "Successfully installed torch triton"
"""


def functions() -> str:
    """``./dev``'s shell functions (from ``say()`` up to ``setup()``), without its command dispatch."""
    text = (ROOT / "dev").read_text()
    return text[text.index("say() {"):text.index("setup() {")]


def run_step(tmp_path: Path, fail: bool):
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text(FAKE_PIP)
    (venv / "python").chmod(0o755)
    (tmp_path / "fns.sh").write_text(functions())
    script = ('set -euo pipefail\nVENV=.venv\nLOG=.venv/install.log\n: > "$LOG"\nsource ./fns.sh\n'
              'pip_step "installing the requirements" -r x\necho "step returned"\n')
    env = dict(os.environ, DEV_STATUS_EVERY="1", FAIL="1" if fail else "0")
    return subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=hang_guard())


@pytest.mark.slow  # NOTE: a few seconds of sleeping pip (./dev quick skips it)
def test_install_step_shows_progress(tmp_path):
    p = run_step(tmp_path, fail=False)
    assert p.returncode == 0 and "step returned" in p.stdout, p.stdout + p.stderr
    status = re.findall(r"dev:     \.\.\. (\d+)s  (.*)", p.stderr)
    assert len(status) >= 2, p.stderr                      # NOTE: a status line while pip runs, not only at the end
    assert any(what.startswith("Collecting") for _, what in status), p.stderr
    assert p.stderr.rstrip().endswith("done (" + p.stderr.rstrip().rsplit("done (", 1)[1]), p.stderr
    assert "Collecting torch" not in p.stdout               # NOTE: pip's own output stays in the log
    assert "Collecting torch" in (tmp_path / ".venv" / "install.log").read_text()


def test_failing_install_shows_the_log_tail_and_exits(tmp_path):
    p = run_step(tmp_path, fail=True)
    assert p.returncode == 1 and "step returned" not in p.stdout, p.stdout + p.stderr
    assert "FAILED" in p.stderr and "ERROR: no matching distribution" in p.stderr, p.stderr
