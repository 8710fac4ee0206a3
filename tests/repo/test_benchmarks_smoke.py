"""Every script of ``benchmarks/`` runs in the suite, so a broken benchmark fails CI instead of the next
measurement session: ``--help`` of every script in one subprocess (quick subset), then one tiny step of each
on CPU (kernels in the Triton interpreter; marked slow, ``./dev test`` runs them). Nothing is timed here."""

from __future__ import annotations

import re

import pytest

from helpers.scripts import ROOT, run_script, scripts

# NOTE: the tiny-shape command of each script; a new script without an entry fails test_every_script_has_a_smoke
SMOKES = {
    "benchmarks/bench_step.py": (("--smoke", "--device", "cpu"), "smoke OK: decode B=1 on cpu"),
    "benchmarks/candidate_bench.py": (("--smoke", "--B", 2, "--ctx", 64), "smoke OK: V4.1-Flash decode B=2"),
    "benchmarks/flash_host.py": (("--steps", 3, "--batch", 4, "--max-model-len", 4096, "--ctx", 64, 1024),
                                 "update() us: first"),
    "benchmarks/frontend_profile.py": (("--steps", 2, "--batch", 4), "|"),
    "benchmarks/gpu_check.py": (("--device", "cpu", "--steps", 1, "--long-steps", 0, "--cases", "tiny"),
                                "gpu_check passed"),
    "benchmarks/host_profile.py": (("--rounds", 3, "--cases", "decode B=1"), "| decode B=1 |"),
    "benchmarks/query_bench.py": (("--smoke", "--chunk", 64, "--q", 8, "--ctx", 40),
                                  "smoke OK: V4.1-Flash B=1, chunk 64, q 8, ctx 40: 8 query rows"),
    "benchmarks/table_memory.py": ((), "| 128K | 256 | ring |"),
    "benchmarks/trace_overhead.py": (("--requests", 2, "--prefill", 64, "--steps", 2, "--max-model-len", 1024),
                                     "decode"),
    # NOTE: needs vLLM 0.33, which CI does not install: --help only here; tests/integration/test_vllm_scheduler.py
    # runs a short loop where vLLM is importable
    "benchmarks/vllm_scheduler_loop.py": (("--help",), "usage: "),
    "benchmarks/v41_groups.py": (("--smoke", "--B", 2, "--ctx", 64), "SWA per layer: groups"),
}
SCRIPTS = scripts("benchmarks")


def test_every_script_has_a_smoke():
    assert sorted(SMOKES) == SCRIPTS


@pytest.mark.parametrize("path", SCRIPTS)
def test_help(script_helps, path):
    code, out = script_helps[path]
    assert code == 0, (code, out)
    assert out.startswith("usage: "), out


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(SMOKES))
def test_one_tiny_step(path):
    args, want = SMOKES[path]
    rc, out = run_script(path, *args)
    assert rc == 0, out
    assert want in out, out


@pytest.mark.slow
def test_bench_step_without_cuda_says_so():
    """Every timing mode needs CUDA: without it the script ends in one line naming --smoke, not a traceback."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    rc, out = run_script("benchmarks/bench_step.py", "--ab")
    assert rc == 1 and "Traceback" not in out, out
    assert "needs CUDA (try --smoke --device cpu)" in out, out


PRIVATE = re.compile(r"\b(?:pipe|gpu|ref|pipeline)\._[a-z]\w*")


@pytest.mark.parametrize("path", SCRIPTS)
def test_no_private_pipeline_attributes(path):
    """A benchmark reads the pipeline through its public accessors (``stage_layout``, ``fused_plan``,
    ``builders``, ...): ``pipe._lay`` outlived its attribute once and broke ``--ab`` unseen."""
    text = (ROOT / path).read_text()
    hits = [f"{path}:{text[:m.start()].count(chr(10)) + 1}: {m.group(0)}" for m in PRIVATE.finditer(text)]
    assert not hits, "\n".join(hits)
