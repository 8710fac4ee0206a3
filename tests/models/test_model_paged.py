"""Paged == dense: the small DSV4 attention run step by step through MetadataPipeline metadata and
paged caches (written and read only through that metadata) equals the dense forward of each request's
sequence, for every layer kind, over randomized reference-scheduler traces (chunked prefill splitting
compress groups, windows crossing blocks, spec tokens rejected and rewritten, preemption, finishing
mid-batch, padded tokens, prefix-cache hits with bounded replay), with ring sliding tables (the default)
and with circular compressor-state groups.

Replayed tokens (positions below a prefix hit's ``replay_end``) are compared too: their window lists
start at ``replay_start``, so their reference is the dense model with its sliding window floored
there; their compressed rows come from the blocks shared with the prefix owner, which no replayed
token may rewrite (checked against the scheduler's block ownership every step)."""

import pytest

from helpers.paged_model import run_trace

pytestmark = pytest.mark.slow  # model equivalence (./dev quick skips it)


@pytest.mark.parametrize("seed", [0, 1])
def test_paged_equals_dense(seed):
    seen = run_trace(seed, 35, num_blocks=40, budget=24, chunk=7)
    # the trace must exercise what the test is about
    assert seen["rejected"] > 0 and seen["split_group"] > 0 and seen["finished"] > 0, seen
    assert seen["preempted"] > 0, seen


def test_paged_equals_dense_prefix_hits():
    """Prefix-cache hits with bounded replay, ring sliding tables: every token equals dense, replayed
    ones included (dense window floored at replay_start)."""
    seen = run_trace(1, 28, num_blocks=60, budget=24, chunk=12, prefix=True, prefix_prob=0.8, prompt_hi=120)
    assert seen["hits"] >= 5 and seen["replayed"] >= 40, seen


@pytest.mark.parametrize("circular", [{"c128_state": 24}, {"c4_state": 12, "c128_state": 24}],
                         ids=["c128_state", "both_states"])
def test_paged_equals_dense_prefix_hits_circular(circular):
    """Circular compressor-state groups (one block of `capacity` rows per request; chunks longer than the
    ring: in-step window entries read from the step, the write plan after the reads): paged == dense over
    prefix hits, replayed tokens compared."""
    seen = run_trace(1, 28, num_blocks=50, budget=24, chunk=12, prefix=True, prefix_prob=0.8, prompt_hi=120,
                     circular=circular)
    assert seen["hits"] >= 5 and seen["replayed"] >= 40 and seen["split_group"] > 0, seen
