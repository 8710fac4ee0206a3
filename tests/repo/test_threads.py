"""One torch intra-op thread by default in the library's own scripts (issue 40 item 5): every example and
benchmark that runs host work takes ``--threads N`` (default 1), through ``examples/_threads.py``."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from helpers import ROOT

THREADED = ["examples/cp_decode.py", "examples/custom_forward.py", "examples/flash_decode_step.py",
            "examples/sparse_decode_loop.py", "benchmarks/bench_step.py", "benchmarks/frontend_profile.py",
            "benchmarks/trace_overhead.py", "benchmarks/v41_groups.py"]


def _threads_module():
    spec = importlib.util.spec_from_file_location("_threads", ROOT / "examples" / "_threads.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


@pytest.mark.parametrize("path", THREADED)
def test_script_takes_threads_default_one(script_helps, path):
    code, out = script_helps[path]
    assert code == 0, out
    assert "--threads N" in out and "default 1" in " ".join(out.split()), out


def test_set_threads():
    mod = _threads_module()
    before = torch.get_num_threads()
    try:
        assert mod.set_threads(1) == 1 == torch.get_num_threads()
        assert mod.set_threads(0) == 1  # NOTE: 0 leaves the count in force
        for bad in (-1, 1.5, True, "2"):
            with pytest.raises(ValueError, match="--threads must be an int >= 0"):
                mod.set_threads(bad)
    finally:
        torch.set_num_threads(before)


def test_threads_option_parses():
    import argparse
    mod = _threads_module()
    ap = argparse.ArgumentParser()
    mod.add_threads_option(ap)
    assert ap.parse_args([]).threads == 1 and ap.parse_args(["--threads", "3"]).threads == 3
