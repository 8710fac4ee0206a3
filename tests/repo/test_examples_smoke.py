"""Every script of ``examples/`` answers ``--help`` (one subprocess for all: quick subset) and runs one tiny
step on CPU (marked slow; ``test_examples.py`` checks what the examples print in depth)."""

from __future__ import annotations

import pytest

from helpers.scripts import run_script, scripts

# NOTE: the tiny-shape command of each script; a new script without an entry fails test_every_script_has_a_smoke
SMOKES = {
    "examples/cp_decode.py": (("--steps", 1), "OK"),
    "examples/custom_forward.py": (("cpu",), "topk_to_slots(c4a) slots"),
    "examples/flash_decode_step.py": (("--small", "--device", "cpu", "--steps", 1, "--batch", 2),
                                      "OK: every checked token"),
    "examples/inspect_step.py": (("--requests", 2, "--out", "{tmp}/step.png"), "tiny: 2 requests"),
    "examples/sparse_decode_loop.py": (("--steps", 2, "--device", "cpu"), "OK: paged == dense"),
}
SCRIPTS = scripts("examples")


def test_every_script_has_a_smoke():
    assert sorted(SMOKES) == SCRIPTS


@pytest.mark.parametrize("path", SCRIPTS)
def test_help(script_helps, path):
    code, out = script_helps[path]
    assert code == 0, (code, out)
    assert out.startswith("usage: "), out


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(SMOKES))
def test_one_tiny_step(path, tmp_path):
    args, want = SMOKES[path]
    rc, out = run_script(path, *(str(a).format(tmp=tmp_path) for a in args), interpret=False)
    assert rc == 0, out
    assert want in out, out
