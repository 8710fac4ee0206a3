"""The ownership rule as what a row reads (``state/owners/__init__.py``; issue 37 item 3): three findings of a
second, independent scheduler and hostile steps, each a step sequence that the rule before it decided wrongly.

(i) a scheduler that frees, at the start of a step, the sliding / state blocks of a request it does *not*
schedule (wholly behind the window of its committed tokens) and hands one out in the same step: valid, was
rejected ("a token would write into a block another live request holds");
(ii) a row run on an optimistic count (async scheduling: 22 + 4 drafts -> 27), its block below the window of 27
handed to C, C writes it and finishes, the row comes back at 23 and its window reads C's KV: was accepted;
(iii) a "prefix hit" of a block filled at another block position: was accepted.

Layout ``tiny``: mla (full, blocks of 32), swa (W 16, blocks of 8), c4_state (W 8, blocks of 4), c128_state
(W 16, blocks of 8).
"""

from __future__ import annotations

import pytest

from dsv4_index import DSV4Layout, MetadataPipeline
from dsv4_index.frontend import NewRequest, RunningRequest, StepInput

TINY = dict(num_hidden_layers=2, compress_ratios=[4, 16], sliding_window=16, index_topk=8)
BS = (32, 8, 4, 8)


def _pipe(checks, spec=2):
    lay = DSV4Layout.from_config(TINY, 256, mla_block_size=32, swa_block_size=8, c4_state_block_size=4,
                                 c128_state_block_size=8)
    return MetadataPipeline(lay, 4, 64, "cpu", spec, backend="reference", checks=checks)


def _lists(base, lo, hi):
    """Block lists of positions ``[lo, hi)`` beyond the blocks of ``[0, lo)``: ids ``base + 100 * gid + j``."""
    return tuple([base + 100 * g + j for j in range(-(-lo // bs), -(-hi // bs))] for g, bs in enumerate(BS))


@pytest.mark.parametrize("checks", ["safe", "full"])
def test_eager_free_of_an_unscheduled_request_is_accepted(checks):
    """(i) X prefilled 19 tokens and is not scheduled next; its c4_state block 2 (positions 8..11, wholly behind
    the window 12..19 of its next token) goes to the new Y, which writes it."""
    p = _pipe(checks)
    p.update(StepInput([NewRequest("x", _lists(1000, 0, 19), 0)], [], {"x": 19}))
    y = _lists(3000, 0, 4)
    y[2][0] = 1202                                   # X's c4_state block 2
    p.update(StepInput([NewRequest("y", y, 0)], [], {"y": 4}))
    p.update(StepInput([], [RunningRequest("x", _lists(1000, 19, 20), 19)], {"x": 1}))  # X reads blocks 3, 4 only


@pytest.mark.parametrize("checks", ["safe", "full"])
def test_a_read_of_a_block_handed_over_on_an_optimistic_count_is_rejected(checks):
    """(ii) X at 22 with 4 drafts (27); scheduled next at the optimistic 27, its c4_state block 4 (positions
    16..19) goes to C, who writes it and finishes; X comes back at 23 (drafts rejected) and would read it."""
    p = _pipe(checks, spec=4)
    p.update(StepInput([NewRequest("x", _lists(1000, 0, 22), 0)], [], {"x": 22}))
    p.update(StepInput([], [RunningRequest("x", _lists(1000, 22, 27), 22)], {"x": 5}))
    c = _lists(3000, 0, 4)
    c[2][0] = 1204                                   # X's c4_state block 4
    p.update(StepInput([NewRequest("c", c, 0)], [RunningRequest("x", _lists(1000, 27, 28), 27)], {"x": 1, "c": 4}))
    back = StepInput([], [RunningRequest("x", ((), (), (), ()), 23)], {"x": 1}, finished_req_ids=["c"])
    with pytest.raises(ValueError, match=r"slot 0 would read gid 2 \(c4_state\) block 1204 at block position 4 "
                                         r"\(num_computed_tokens 23\), but slot 1 filled that block at block "
                                         r"position 0 in step 3"):
        p.update(back)
    p.update(StepInput([], [RunningRequest("x", ((), (), (), ()), 27)], {"x": 1}, finished_req_ids=["c"]))


@pytest.mark.parametrize("checks", ["safe", "full"])
def test_the_optimistic_hand_over_is_accepted_when_the_count_holds(checks):
    """(ii), valid: the same hand-over, and X comes back at the count it was freed on."""
    p = _pipe(checks, spec=4)
    p.update(StepInput([NewRequest("x", _lists(1000, 0, 22), 0)], [], {"x": 22}))
    p.update(StepInput([], [RunningRequest("x", _lists(1000, 22, 27), 22)], {"x": 5}))
    c = _lists(3000, 0, 4)
    c[2][0] = 1204
    p.update(StepInput([NewRequest("c", c, 0)], [], {"c": 4}))   # X not scheduled: block 4 is in its band
    p.update(StepInput([], [RunningRequest("x", _lists(1000, 27, 28), 27)], {"x": 1}, finished_req_ids=["c"]))


@pytest.mark.parametrize("checks", ["safe", "full"])
@pytest.mark.parametrize("finished", [False, True])
def test_a_prefix_hit_of_a_block_filled_at_another_position_is_rejected(checks, finished):
    """(iii) A filled mla blocks 1000 (positions 0..31) and 1001 (32..63); B, admitted with 32 computed tokens,
    lists 1001 as its block 0: it would read A's positions 32..63 as its own 0..31 (also once A is gone)."""
    p = _pipe(checks)
    p.update(StepInput([NewRequest("a", _lists(1000, 0, 40), 0)], [], {"a": 40}))
    b = _lists(3000, 0, 36)
    b[0][0] = 1001
    bad = StepInput([NewRequest("b", b, 32)], [], {"b": 4}, finished_req_ids=["a"] if finished else [])
    with pytest.raises(ValueError, match=r"write_ids\[0\] = 1001 gives slot \d block position 0 of gid 0 \(mla\) as "
                                         r"a prefix hit .* filled at block position 1 \(slot 0, step 1\)"):
        p.update(bad)
    b[0][0] = 1000                                   # the same block position: a real prefix hit
    p.update(StepInput([NewRequest("b", b, 32)], [], {"b": 4}, finished_req_ids=["a"] if finished else []))


@pytest.mark.parametrize("checks", ["safe", "full"])
def test_a_read_of_a_block_its_filler_rewrote_after_the_hit_is_rejected(checks):
    """A prefilled 22 tokens (step 1) and ran 22 + 4 drafts (step 2); E, admitted in step 2 at 24 computed
    tokens, took A's c4_state blocks 0..5 as prefix hits (1205: positions 20..23, A's drafts at 23 included)
    and passed block 5 in step 3 (E at 25..32). A comes back at 23 in step 4 (drafts rejected) and rewrites
    position 23 while nobody else holds 1205; A finishes, and E's window moves back to 28 (positions 21..28):
    E would read position 23, which changed since it took the block. Rejected: A's rewrite is a new fill of
    step 4 (h37o's "a row's own rewrite of a block nobody else holds keeps its fill" accepted it)."""
    p = _pipe(checks, spec=4)
    none = ((), (), (), ())
    p.update(StepInput([NewRequest("a", _lists(1000, 0, 22), 0)], [], {"a": 22}))
    e = _lists(3000, 0, 25)
    e[2][:6] = [1200 + j for j in range(6)]          # A's c4_state blocks 0..5, hits at the same positions
    p.update(StepInput([NewRequest("e", e, 24)], [RunningRequest("a", _lists(1000, 22, 27), 22)], {"a": 5, "e": 1}))
    p.update(StepInput([], [RunningRequest("e", _lists(3000, 25, 33), 25)], {"e": 8}))
    p.update(StepInput([], [RunningRequest("a", none, 23)], {"a": 1}))
    with pytest.raises(ValueError, match=r"slot 1 would read gid 2 \(c4_state\) block 1205 at block position 5 "
                                         r"\(num_computed_tokens 28\), but slot 0 filled that block at block "
                                         r"position 5 in step 4, after slot 1 last wrote or took it"):
        p.update(StepInput([], [RunningRequest("e", none, 28)], {"e": 1}, finished_req_ids=["a"]))
    p.update(StepInput([], [RunningRequest("e", none, 33)], {"e": 1}, finished_req_ids=["a"]))  # E where it was


@pytest.mark.parametrize("released", [True, False])
def test_a_hand_over_its_holder_releases_in_the_same_step_keeps_verified_reads(released):
    """The compiled pass re-reads every row's window after a write into a block another row may still hold
    (``owners.meta[0]``: the last such step), and skips rows verified since otherwise (owners/kernel.py
    ``_reads``). X's c4_state block 4 goes to C: with X scheduled at 27 in the same step, X releases it there
    (no row but C holds it after the step: not such a write); with X not scheduled, block 4 stays in X's draft
    band (such a write). Either way the step is accepted, and X's return at 23 is rejected."""
    p = _pipe("safe", spec=4)
    p.update(StepInput([NewRequest("x", _lists(1000, 0, 22), 0)], [], {"x": 22}))
    p.update(StepInput([], [RunningRequest("x", _lists(1000, 22, 27), 22)], {"x": 5}))
    c = _lists(3000, 0, 4)
    c[2][0] = 1204                                   # X's c4_state block 4
    x = [RunningRequest("x", _lists(1000, 27, 28), 27)] if released else []
    p.update(StepInput([NewRequest("c", c, 0)], x, {"c": 4, **({"x": 1} if released else {})}))
    assert p.requests.owners.meta[0] == (0 if released else 3)
    with pytest.raises(ValueError, match=r"slot 0 would read gid 2 \(c4_state\) block 1204 at block position 4"):
        p.update(StepInput([], [RunningRequest("x", ((), (), (), ()), 23)], {"x": 1}, finished_req_ids=["c"]))
