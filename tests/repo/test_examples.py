"""The example scripts run end to end (as a user runs them, from the repo root) with small arguments."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.scripts import hang_guard

pytestmark = pytest.mark.slow  # runs the example scripts end to end (./dev quick skips it)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def run(script, *args):
    p = subprocess.run([sys.executable, str(EXAMPLES / script), *map(str, args)], cwd=ROOT, capture_output=True,
                       text=True, timeout=hang_guard(), env=dict(os.environ))
    return p.returncode, p.stdout + p.stderr


def summary(out: str) -> dict:
    """``key  value`` rows of the decode loop's summary table (between the dashed lines under "summary")."""
    lines = out.splitlines()
    rows = {}
    for line in lines[lines.index("summary") + 2:]:
        if line.startswith("---"):
            break
        k, v = line.split("  ", 1)
        rows[k.strip()] = v.strip()
    return rows


def test_sparse_decode_loop():
    rc, out = run("sparse_decode_loop.py", "--steps", 30, "--seed", 1, "--validate")
    assert rc == 0, out
    s = summary(out)
    assert s["steps"] == "30", out
    assert s["check_metadata passes"] == "30", out
    assert "events seen: chunked prefill, decode" in out and "OK: paged == dense" in out, out
    assert all(float(s[k]) <= 1e-4 for k in s if k.startswith("max |paged - dense|")), out
    # replayed tokens are compared too, and no write lands in another request's blocks
    hits, replayed = s["prefix hits (replayed tokens)"].replace("(", "").replace(")", "").split()
    assert int(hits) > 0 and int(replayed) > 0, out
    assert s["tokens compared with dense (replayed included)"] == s["tokens (valid / padding)"].split(" / ")[0], out
    assert s["writes into blocks held by another request"] == "0", out
    assert s["writes into blocks the writer does not hold"] == "0", out
    assert int(s["cache writes checked"]) > 1000, out
    assert s["state groups"] == "sliding (ring tables)", out


def test_sparse_decode_loop_record_and_replay(tmp_path):
    trace = tmp_path / "steps.jsonl"
    rc, out = run("sparse_decode_loop.py", "--steps", 10, "--record", trace)
    assert rc == 0, out
    from dsv4_index.tools.replay import replay_trace
    res = replay_trace(trace, progress=False)
    assert res.ok, res.report()
    assert res.num_steps == 10


def test_sparse_decode_loop_circular():
    rc, out = run("sparse_decode_loop.py", "--steps", 30, "--circular", "--validate")
    assert rc == 0, out
    s = summary(out)
    assert s["state groups"] == "circular" and s["check_metadata passes"] == "30", out
    assert "c4_state (circular, capacity 16), c128_state (circular, capacity 28)" in out, out
    assert "events seen: chunked prefill, decode" in out and "OK: paged == dense" in out, out
    assert s["writes into blocks held by another request"] == "0", out


@pytest.mark.parametrize("args", [("--config", "tiny_v41"), ("--config", "tiny_v41", "--groups", "per-layer"),
                                  ("--groups", "vllm")], ids=["v41", "v41_swa_per_layer", "vllm_groups"])
def test_sparse_decode_loop_any_layout(args):
    # DeepSeek-V4.1 (ratio-2 layers with the C2 ring, ratio-1 layers) and engine group plans: paged == dense
    rc, out = run("sparse_decode_loop.py", "--steps", 40, "--seed", 1, "--validate", *args)
    assert rc == 0, out
    s = summary(out)
    assert s["check_metadata passes"] == "40" and "OK: paged == dense" in out, out
    assert "events seen: chunked prefill, decode" in out and "prefix-cache hit, replayed tokens" in out, out
    if "tiny_v41" in args:
        assert {"max |paged - dense| c1 (layer 3)", "max |paged - dense| c2 (layer 1)",
                "max |paged - dense| c1_shared (layer 4)", "max |paged - dense| c2_shared (layer 2)"} <= set(s), out
        assert s["state groups"] == "circular", out
    assert s["writes into blocks held by another request"] == "0", out


def test_sparse_decode_loop_is_deterministic():
    outs = [run("sparse_decode_loop.py", "--steps", 12, "--seed", 3) for _ in range(2)]
    assert outs[0][0] == outs[1][0] == 0, outs
    a, b = ({k: v for k, v in summary(o).items() if not k.startswith("update+build")} for _, o in outs)
    assert a == b and a["steps"] == "12", (a, b)


def test_sparse_decode_loop_kernels():
    rc, out = run("sparse_decode_loop.py", "--steps", 4, "--kernels")
    assert rc == 0, out
    assert summary(out)["metadata backend"].startswith("triton ("), out


def _example_module():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import sparse_decode_loop
    finally:
        sys.path.remove(str(EXAMPLES))
    return sparse_decode_loop


def test_sparse_decode_loop_fails_on_shared_block_writes(monkeypatch, capsys):
    """A scheduler that drops replay_end: replayed tokens would write compressed rows into the prefix
    owner's blocks. The pipeline's ownership check (``checks="safe"``, state/owners.py) now refuses that
    step at ``update()``, naming both holders, before the example's own counter could see a write."""
    import dataclasses

    from dsv4_index.testing.scheduler import ReferenceScheduler

    sparse_decode_loop = _example_module()
    monkeypatch.setenv("DSV4_INDEX_BACKEND", os.environ.get("DSV4_INDEX_BACKEND", "reference"))
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    schedule = ReferenceScheduler.schedule

    def no_replay_end(self):
        step = dataclasses.replace(schedule(self), replay_end={})
        self._last = (step, self._last[1])
        return step

    monkeypatch.setattr(ReferenceScheduler, "schedule", no_replay_end)
    with pytest.raises(ValueError, match=r"a token would write into a block another live request holds.*"
                                         r"request 'd'"):
        sparse_decode_loop.main(["--steps", "9", "--device", "cpu"])  # d hits a's prefix at step 7


def test_sparse_decode_loop_fails_on_mismatch(monkeypatch, capsys):
    """The exit code reports a paged output that differs from dense."""
    sparse_decode_loop = _example_module()
    from models.deepseek_v4 import DSV4Attention

    # NOTE: main() sets these; monkeypatch restores them afterwards
    monkeypatch.setenv("DSV4_INDEX_BACKEND", os.environ.get("DSV4_INDEX_BACKEND", "reference"))
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    paged = DSV4Attention.forward_paged
    monkeypatch.setattr(DSV4Attention, "forward_paged", lambda self, x, meta, caches:
                        paged(self, x, meta, caches) + (2e-4 if self.kind == "c128" else 0.0))
    assert sparse_decode_loop.main(["--steps", "3", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "FAIL: max |paged - dense|" in out, out


def test_custom_forward():
    rc, out = run("custom_forward.py")
    assert rc == 0, out
    assert "step 1: requests ['a', 'b'] (2 decodes first), tokens 3 padded to 8" in out, out
    assert "topk_to_slots(c4a) slots       (8, 4)" in out, out
    assert "picks [0, 1, 7] -> c4a slots" in out and "compiled" not in out, out


def test_custom_forward_compiled():
    """The same forward under torch.compile(fullgraph=True) equals eager, cache writes included."""
    rc, out = run("custom_forward.py", "--compile")
    assert rc == 0, out
    assert out.count("compiled forward (fullgraph) == eager") == 2, out
    assert "step 1: requests ['a', 'b'] (2 decodes first), tokens 3 padded to 8" in out, out


def test_inspect_step(tmp_path):
    """The example is a thin wrapper of ``python -m dsv4_index inspect`` (tiny layout by default)."""
    png = tmp_path / "sub" / "step.png"
    rc, out = run("inspect_step.py", "--out", png)
    assert rc == 0, out
    assert "tiny: 6 requests" in out, out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 50_000, png.stat().st_size
