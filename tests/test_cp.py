"""Decode context parallelism (docs/CP.md): per-rank partial attention over sharded caches, merged by
log-sum-exp, equals the single-rank paged model and the dense model at every step of a randomized
trace (prefill chunks, decodes, spec tokens); the ranks' written slots partition the tokens.

Ranks are simulated by threads of this process (``ThreadComm``), and the example is also launched
for real with ``torch.distributed.run`` (gloo on CPU)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from cp_decode import (CFG, CPRankPipeline, ThreadComm, cp_layouts, run_rank,  # noqa: E402
                       sub_layout, summary)
from dsv4_index.scheduler import ReferenceScheduler  # noqa: E402
from dsv4_index.validate import MetadataError, check_cp_partition  # noqa: E402
from models.deepseek_v4.attention import merge_partials, sink_attention, sink_attention_lse  # noqa: E402

TOL = 1e-4


# ----------------------------------------------------------------------------------------------
# the merge itself
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 4])
def test_merge_partials_equals_full_softmax(world):
    g = torch.Generator().manual_seed(world)
    T, N, H, D = 5, 11, 3, 8
    q, keys = torch.randn(T, H, D, generator=g), torch.randn(T, N, D, generator=g)
    valid = torch.rand(T, N, generator=g) < 0.7
    valid[0] = False  # a token that sees nothing but the sink
    sink = torch.randn(H, generator=g)
    full = sink_attention(q, keys, valid, sink)
    owner = torch.randint(0, world, (N,), generator=g)
    owner[:3] = 0  # rank world-1 may own nothing: its lse is -inf
    parts = [sink_attention_lse(q, keys, valid & (owner == r), sink if r == 0 else None) for r in range(world)]
    merged = merge_partials(torch.stack([o for o, _ in parts]), torch.stack([l for _, l in parts]))
    assert not merged.isnan().any()
    assert (merged - full).abs().max() <= 1e-5
    if world > 1:  # the sink counted on every rank is wrong: the check can fail
        twice = [sink_attention_lse(q, keys, valid & (owner == r), sink) for r in range(world)]
        bad = merge_partials(torch.stack([o for o, _ in twice]), torch.stack([l for _, l in twice]))
        assert (bad - full).abs().max() > 1e-3


# ----------------------------------------------------------------------------------------------
# simulated ranks: merged == single-rank paged == dense over a trace
# ----------------------------------------------------------------------------------------------
# NOTE: "triton" runs the kernels (fused build included) under TRITON_INTERPRET=1 when it is set
# (slow on CPU: ~0.25 s per rank-step); "reference" forces the pure-PyTorch ops.
@pytest.mark.parametrize("world,interleave,backend", [
    (1, 1, "reference"), (2, 1, "triton"), (2, 4, "reference"), (4, 1, "reference"), (4, 2, "reference"),
    (4, 4, "triton")])
def test_merged_equals_single_rank(world, interleave, backend, monkeypatch):
    if backend == "reference" or os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        monkeypatch.setenv("DSV4_INDEX_BACKEND", "reference")
    steps = 22 if backend == "reference" else 16
    res = ThreadComm(world).run(lambda c: run_rank(c, interleave=interleave, steps=steps, seed=world))
    r0 = res[0]
    assert not r0["failures"], summary(r0)
    assert r0["err_single"] <= TOL and r0["err_dense"] <= TOL, summary(r0)
    # the trace must exercise what the test is about
    assert r0["prefill_tokens"] > 0 and r0["decode_tokens"] > 0 and r0["spec_rejected"] > 0, summary(r0)
    assert r0["steps"] >= steps // 2 and len(r0["build_ms_median"]) == world


def test_interleave_must_divide_rows_per_block():
    # c16 rows per block = 32 // 16 = 2: interleave 4 would put a rank's rows past its virtual blocks
    with pytest.raises(ValueError, match="cp_interleave"):
        cp_layouts(CFG.to_dict(), 256, 2, 4, mla_block_size=32, swa_block_size=4)
    L = cp_layouts(CFG.to_dict(), 256, 2, 2, mla_block_size=32, swa_block_size=4)
    assert [g.name for g in L.kv.groups] == ["mla", "swa"] and [g.gid for g in L.state.groups] == [0, 1]
    assert L.sched.group("mla").block_size == 64 and L.sched.group("c4_state").block_size == 4
    with pytest.raises(ValueError):
        sub_layout(L.rank, ["swa"]).group("mla")


def test_partition_check_catches_wrong_rank_order():
    """Ranks' metadata of one step partition the tokens; swapping two ranks' metadata must fail."""
    L = cp_layouts(CFG.to_dict(), 256, 2, 1, mla_block_size=64, swa_block_size=4, indexer_causal_indices=True)
    sched = ReferenceScheduler(L.sched, 40, max_num_batched_tokens=64, max_num_seqs=4, enable_prefix_caching=False)
    sched.add_request("a", 50, 4)
    sched.add_request("b", 9, 4)
    step = sched.schedule()
    pipes = [CPRankPipeline(L, r, 4, 64, "cpu") for r in range(2)]
    metas = []
    for p in pipes:
        p.update(step)
        p.build()
        metas.append(p.last_kv)
    check_cp_partition(metas)
    with pytest.raises(MetadataError):
        check_cp_partition(metas[::-1])


# ----------------------------------------------------------------------------------------------
# the example under torch.distributed.run
# ----------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("nproc,interleave", [(2, 1), (4, 2)])
def test_torchrun_example(nproc, interleave):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(_free_port()), str(ROOT / "examples" / "cp_decode.py"),
           "--steps", "20", "--interleave", str(interleave)]
    # NOTE: the distributed plumbing is under test here; the kernels are covered above
    env = dict(os.environ, OMP_NUM_THREADS="1", DSV4_INDEX_BACKEND="reference")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert f"DCP world={nproc} interleave={interleave}" in out and "  OK" in out, out[-4000:]
