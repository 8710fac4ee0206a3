"""Hybrid kernel blocks and ring tables (issue #20 item 3): the scheduler hands out whole allocation
blocks, so a ring row may hold up to ``blocks_per_kv_block - 1`` kernel blocks past the step's last
token; rings are sized for that (``cdiv(W - 1 + T, block_size) + f`` columns)."""

import itertools
import math

import pytest

from dsv4_index import DSV4Layout
from dsv4_index._common import cdiv
from dsv4_index.geometry import GroupSpec
from dsv4_index.frontend import NewRequest, RunningRequest, StepInput

from helpers.pipelines import HAS_TRITON, compare_step, three_pipelines

KBS = {"mla": 128, "swa": 32, "c4_state": 2, "c128_state": 4}


def _steps(layout, chunks):
    """One request scheduled in ``chunks``, allocation blocks handed out as vLLM does (whole blocks for
    the positions computed after the step)."""
    ids, have, done = itertools.count(1), [0] * layout.num_groups, 0
    for i, q in enumerate(chunks):
        new = []
        for g, gs in enumerate(layout.groups):
            k = 1 if gs.kind == "circular" else cdiv(done + q, gs.alloc_block_size)
            new.append([next(ids) for _ in range(max(k - have[g], 0))])
            have[g] = max(have[g], k)
        req = NewRequest("a", tuple(new), 0) if i == 0 else RunningRequest("a", tuple(new), done)
        yield StepInput([req] if i == 0 else [], [] if i == 0 else [req], {"a": q})
        done += q


@pytest.mark.slow  # ./dev quick skips it
def test_issue_repro_is_accepted_and_matches_reference():
    lay = DSV4Layout.from_config("flash", max_model_len=2048, kernel_block_size=KBS)
    swa = lay.group("swa")
    assert swa.blocks_per_kv_block == 2 and swa.columns(256) == (math.ceil((127 + 256) / 32) + 2, 14)
    if HAS_TRITON:
        pipes = three_pipelines(lay, 4, 256)
    else:
        from dsv4_index import MetadataPipeline
        pipes = {"reference": MetadataPipeline(lay, 4, 256, "cpu", backend="reference")}
    for i, step in enumerate(_steps(lay, [200, 214, 230])):  # the third was "a ring of 13 blocks" before
        compare_step(pipes, step, tag=i)


@pytest.mark.parametrize("f,bs,W", [(1, 64, 128), (2, 32, 128), (4, 2, 8), (2, 4, 128), (8, 16, 128)])
def test_ring_holds_every_step_the_scheduler_can_send(f, bs, W):
    # exhaustive over small T: the blocks a row holds (whole allocation blocks covering the step) minus
    # the lowest block the step reads never exceed the ring width
    for T in (1, 5, 64, 256):
        g = GroupSpec(1, "swa", "sliding", bs, W, False, 1 << 20, blocks_per_kv_block=f, ring=True)
        ring = g.columns(T)[1]
        for nc in range(0, 3 * f * bs + W + 3):
            for q in {1, T // 2 or 1, T}:
                held = cdiv(nc + q, bs * f) * f
                lowest = max(nc - W + 1, 0) // bs
                assert held - lowest <= ring, (f, bs, W, T, nc, q)
