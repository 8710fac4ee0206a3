"""Readers of the fused launch never depend on its writers: with the staged block-table writes held
back (``H_NUM_WRITES = 0`` in the device copy of the stage), every output must still equal the
reference, because a reader takes each entry staged this step from the overlay.

NOTE: the Triton interpreter runs the writer programs before the readers, so a reader that wrongly
reads the table (instead of the overlay) passes an ordinary CPU test and races on the GPU; holding the
writes back makes that mistake visible on the CPU too (it once hid a circular-group bug: a read at
position >= capacity looked for logical block ``pos // capacity`` in a run staged at block 0).
"""

import pytest
import torch

from dsv4_index.pipeline import MetadataPipeline
from dsv4_index.state.staging import H_NUM_WRITES
from dsv4_index.testing.scheduler import ReferenceScheduler, random_trace, scripted_trace

from helpers.layouts import CIRCULAR_BOTH, tiny_layout, two_layer_layout
from helpers.pipelines import CHANNEL_FIELDS, HAS_TRITON

COMMON = ("query_start_loc", "seq_lens", "idx_mapping", "positions", "token_to_req", "is_valid_token")


def build_without_writers(pipe):
    """build() with this step's table writes held back, then the writes applied (torch ops)."""
    stage = pipe.staging
    n = stage.pending_writes
    stage.dev[H_NUM_WRITES] = 0
    meta = pipe.build()
    stage.dev[H_NUM_WRITES] = n
    stage.pending_writes = n
    stage.apply_pending(pipe.tables.flat)
    return meta


def compare(i, mf, mr):
    for name in COMMON:
        assert torch.equal(getattr(mf, name), getattr(mr, name)), (i, name)
    for ch in mf.channels:
        for f in CHANNEL_FIELDS:
            a, b = getattr(mf[ch], f, None), getattr(mr[ch], f, None)
            assert (a is None) == (b is None), (i, ch, f)
            assert a is None or torch.equal(a, b), (i, ch, f, a, b)


def run(layout, steps, device, max_reqs, max_tokens, spec):
    fused = MetadataPipeline(layout, max_reqs, max_tokens, device, spec)
    ref = MetadataPipeline(layout, max_reqs, max_tokens, device, spec, backend="reference")
    assert fused.fused_plan is not None
    n = 0
    for i, step in enumerate(steps):
        pad = min(max_tokens, step.total_tokens + i % 3)
        fused.update(step, pad_to=pad)
        ref.update(step, pad_to=pad)
        n += fused.staging.pending_writes
        compare(i, build_without_writers(fused), ref.build())
        for g in range(len(layout.groups)):
            assert torch.equal(fused.tables.tables[g], ref.tables.tables[g]), (i, g)
    assert n > 0  # NOTE: the trace staged writes (else nothing was held back)


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
@pytest.mark.skipif(not HAS_TRITON, reason="needs TRITON_INTERPRET=1 or CUDA")
def test_circular_groups_read_the_overlay(device):
    layout = two_layer_layout(circular=CIRCULAR_BOTH)
    sched = ReferenceScheduler(layout, 40, max_num_batched_tokens=24, max_num_seqs=4, num_speculative_tokens=2,
                               long_prefill_threshold=12, seed=4)
    script = [{"add": [dict(req_id="a", prompt_len=70, max_new_tokens=12)]}, {}, {}, {}, {}, {},
              {"add": [dict(req_id="b", prompt_len=80, max_new_tokens=3, prefix_of="a", prefix_len=70)]},
              {}, {"add": [dict(req_id="c", prompt_len=40, max_new_tokens=4, prefix_of="a", prefix_len=40)]}]
    steps = [s for s, _ in scripted_trace(sched, script + [{}] * 5)]
    run(layout, steps, device, 5, 28, 2)


@pytest.mark.skipif(not HAS_TRITON, reason="needs TRITON_INTERPRET=1 or CUDA")
@pytest.mark.parametrize("sliding_tables", ["ring", "full"])
@pytest.mark.slow  # ./dev quick skips it
def test_ring_and_full_tables_read_the_overlay(device, sliding_tables):
    layout = tiny_layout(sliding_tables=sliding_tables)
    steps = [s for s, _ in random_trace(layout, 25, seed=3, max_num_batched_tokens=40, max_num_seqs=4)]
    run(layout, steps, device, 4, 40, 1)
