"""The holes of issue 26 ("the same code does not check what matters most"), each as a step that is now
rejected with one line and leaves every state as it was, beside the legitimate step next to it that is
accepted (``state/owners.py``, ``state/contract.py``).

Layout ``tiny``: mla (full, prefix-cacheable, blocks of 32), swa (W 16, blocks of 8, a ring of 11
columns at 64 tokens a step), c4_state (W 8, blocks of 4), c128_state (W 16, blocks of 8).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dsv4_index import MetadataPipeline
from dsv4_index.batch import APPEND
from dsv4_index.frontend import batch_from_step
from dsv4_index.frontend import NewRequest, RunningRequest, StepInput

from helpers.batches import (BS, admit as _admit, batch as _batch, block_ids as _ids, reject as _reject,
                             repro_pipe as _pipe)
from helpers.layouts import two_layer_layout as _layout
from helpers.vllm_stub import from_step


# ----------------------------------------------------------------------------------------------
# a write into a block another live request holds
# ----------------------------------------------------------------------------------------------
def _two(checks="safe"):
    p = _pipe(checks)
    p.update(_batch([(0, 0, 30, True), (1, 0, 30, True)], _admit(0, 1000, 0, 30) + _admit(1, 2000, 0, 30)))
    return p


@pytest.mark.parametrize("checks", ["safe", "full"])
@pytest.mark.parametrize("g", [0, 1, 2, 3])
def test_a_row_given_the_block_another_request_writes(checks, g):
    """B's appended block (it writes positions 30..32 there) is A's current block of that group."""
    p = _two(checks)
    a_block = int(p.tables.row(g, 0)[-1])
    nxt = [(gg, s, APPEND, [base + 100 * gg + 50]) for gg in range(4) for s, base in ((0, 1000), (1, 2000))
           if -(-33 // BS[gg]) > -(-30 // BS[gg])]
    bad = [(gg, s, st, [a_block] if (gg, s) == (g, 1) else ids) for gg, s, st, ids in nxt]
    if not any(gg == g and s == 1 for gg, s, _, _ in nxt):  # NOTE: no block to append: cut back the last one
        bad.append((g, 1, len(p.tables.row(g, 1)) - 1, [a_block]))
    _reject(p, _batch([(0, 30, 3, False), (1, 30, 3, False)], bad),
            rf"gives slot 1 block position \d+ of gid {g} \(\w+\), where it writes, but slot 0 holds block "
            rf"{a_block} too .*another live request holds")
    p.update(_batch([(0, 30, 3, False), (1, 30, 3, False)], nxt))  # the real step is still accepted


def _a_at_40():
    p = _pipe("full")
    p.update(_batch([(0, 0, 40, True)], _admit(0, 1000, 0, 40)))
    return p


def test_the_vllm_pattern_a_block_shared_in_the_step_its_allocator_fills_it():
    """A fills its mla block 1 (positions 32..63) in this step; B, admitted in the same step, holds blocks 0
    and 1 as a prefix hit (64 tokens: replay from 48, replay_end 64): accepted. B holding A's block one
    position further on, where B writes, is not; nor is a B without replay_end (its replayed tokens would
    write A's block); nor A rewinding into the block B now shares (below A's filled mark)."""
    p = _a_at_40()
    a_mla = [int(x) for x in p.tables.row(0, 0)]                       # [1000, 1001]
    fill_a = [(g, 0, APPEND, ids[len(p.tables.row(g, 0)):]) for g, ids in enumerate(_ids(1000, 64)) if g]
    lo = [0, 6, 12, 6]  # NOTE: the block of position 48 per group: B's sliding rows start there
    b_runs = [(0, 1, 0, a_mla + [2002])] + [(g, 1, 0, [0] * lo[g] + ids[lo[g]:])
                                             for g, ids in enumerate(_ids(2000, 67)) if g]
    rows = [(0, 40, 24, False), (1, 48, 19, True)]
    bad = [(0, 1, 0, [a_mla[0], 2002, a_mla[1]])] + b_runs[1:]
    _reject(_a_at_40(), _batch(rows, fill_a + bad, replay_start=[0, 48], replay_end=[0, 64]),
            r"gives slot 1 block position 2 of gid 0 \(mla\), where it writes, but slot 0 holds block 1001")
    _reject(_a_at_40(), _batch(rows, fill_a + b_runs, replay_start=[0, 48]),
            r"gives slot 1 block position 1 of gid 0 \(mla\), where it writes, but slot 0 holds block 1001")
    p.update(_batch(rows, fill_a + b_runs, replay_start=[0, 48], replay_end=[0, 64]))
    _reject(p, _batch([(0, 50, 3, False)]), r"slot 0 writes gid 0 \(mla\) from position 50, below the position 64 "
                                            r".*but slot 1 holds that block too")
    p.update(_batch([(0, 50, 3, False)], free=[1]))  # alone, A may rewrite its own block


# ----------------------------------------------------------------------------------------------
# ring columns after a cut back
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("checks", ["safe", "full"])
def test_a_cut_back_ring_row_is_not_read_where_its_columns_hold_later_blocks(checks):
    """After 150 tokens the swa ring (11 columns) holds blocks 9..19; the row is cut back to 8 blocks and
    the step reads from block 5 (num_computed_tokens 60): column 5 holds block 16."""
    p = _pipe(checks)
    lists = _ids(1000, 153)
    p.update(_batch([(0, 150, 3, True)], [(g, 0, 0, ids) for g, ids in enumerate(lists)]))
    assert int(p.tables.ring[1]) == 11
    cut = [(1, 0, 7, [5555]), (2, 0, 15, [5556]), (3, 0, 7, [5557])]  # NOTE: every sliding row cut to 63 tokens
    _reject(p, _batch([(0, 60, 3, False)], cut),
            r"slot 0 reads gid 1 \(swa\) from block 5 \(position 45, num_computed_tokens 60\), but its ring columns "
            r"hold blocks 7 and up only \(a write run of this step rewrote them; write_starts\)")
    # the whole sliding rows sent again from block 0 keep what the window reads: accepted
    again = [(g, 0, 0, ids[:-(-63 // BS[g])]) for g, ids in enumerate(_ids(3000, 63)) if g]
    p.update(_batch([(0, 60, 3, False)], again))
    m = p.build()
    swa = m["swa"]
    row = [3000 + 100 + j for j in range(8)]
    assert swa.indices[0, :16].tolist() == [row[pos // 8] * 8 + pos % 8 for pos in range(45, 61)]


# ----------------------------------------------------------------------------------------------
# no jump past what was written, on every input form
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["batch", "step", "scheduler_output"])
def test_num_computed_tokens_never_jumps_past_what_was_written(form):
    p = _pipe("full", max_model_len=512)
    lists = _ids(1000, 310)
    first = StepInput([NewRequest("a", lists, 290)], [], {"a": 10})   # writes 290..299: 300 tokens known
    p.update(first)

    def step(nc):
        s = StepInput([], [RunningRequest("a", tuple([] for _ in BS), nc)], {"a": 1})
        if form == "batch":
            return batch_from_step(s, p.slot_map, 4)[0]
        return from_step(s) if form == "scheduler_output" else s

    who = "slot 0" if form == "batch" else "request 'a'"
    _reject(p, step(305), r"num_computed_tokens\[0\] = 305 of slot 0 jumps past what its steps wrote: positions "
                          r"300\.\.304 were never written" + (r".*request 'a'" if form != "batch" else ""))
    assert who
    p.update(step(298))   # a rewind (rejected drafts) is fine
    p.update(step(299))
    p.update(step(300))


# ----------------------------------------------------------------------------------------------
# checks="full": one id twice in a sliding row (validate=True never fails after a commit)
# ----------------------------------------------------------------------------------------------
def test_an_id_twice_in_a_sliding_row():
    lists = list(_ids(1000, 33))
    lists[1] = lists[1][:3] + [lists[1][1]] + lists[1][4:]            # swa block 1 at positions 1 and 3
    _reject(_pipe("full"), _batch([(0, 30, 3, True)], [(g, 0, 0, ids) for g, ids in enumerate(lists)]),
            r"block id 1101 twice in sliding gid 1 \(swa\) of slot 0 from its window start on")
    _pipe("safe").update(_batch([(0, 30, 3, True)], [(g, 0, 0, ids) for g, ids in enumerate(lists)]))
    p = _pipe(validate=True)
    p.update(_batch([(0, 30, 3, True)], _admit(0, 1000, 30, 3)))
    p.build()
    held = int(p.tables.row(1, 0)[-1])
    _reject(p, _batch([(0, 33, 3, False)], [(1, 0, APPEND, [held])]), rf"block {held} at block position \d+ too: one "
                                                                    rf"block id twice in gid 1 of slot 0")
    p.update(_batch([(0, 33, 3, False)], [(1, 0, APPEND, [7777])]))
    p.build()


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
def test_validate_true_never_fails_after_an_accepted_duplicate():
    """Random single-id duplications inside the sliding rows of reference-scheduler steps: update() refuses
    each one or build() (check_metadata) accepts it."""
    from dsv4_index.testing.scheduler import ReferenceScheduler

    rng = np.random.default_rng(3)
    lay = _layout()
    sched = ReferenceScheduler(lay, 40, max_num_batched_tokens=24, max_num_seqs=4, num_speculative_tokens=2,
                               long_prefill_threshold=16, seed=3)
    p = MetadataPipeline(lay, 4, 32, "cpu", 2, backend="reference", validate=True)
    refused = 0
    for n, (step, _) in enumerate(sched.random_trace(60, 3, prompt_len=(1, 90), max_new_tokens=(1, 12))):
        b, delta = batch_from_step(step, p.slot_map, 4)
        runs = [r for r in range(len(b.write_gids)) if b.write_gids[r] in (1, 2, 3)
                and b.write_cu[r + 1] - b.write_cu[r] >= 2] if b.write_gids is not None else []
        if runs and n % 2:
            r = int(rng.choice(runs))
            ids = b.write_ids.copy()
            hi = int(b.write_cu[r + 1])
            ids[hi - 1] = ids[hi - 2]
            try:
                p.update(dataclasses.replace(b, write_ids=ids))
            except ValueError:
                refused += 1
            else:  # NOTE: accepted (both positions behind the window): build() must pass; the trace ends
                p.build()
                break
        p.update(step)
        p.build()
    assert refused >= 5, refused


# ----------------------------------------------------------------------------------------------
# the ring capacity rule
# ----------------------------------------------------------------------------------------------
def test_a_circular_ring_below_window_minus_one_plus_spec_is_refused_at_construction():
    lay = _layout(circular={"c128_state": 16})  # W 16
    with pytest.raises(ValueError, match=r"circular group gid 3 \('c128_state'\): capacity 16 is below window - 1 "
                                         r"\+ num_speculative_tokens = 16 - 1 \+ 2 = 17"):
        MetadataPipeline(lay, 4, 64, "cpu", 2, backend="reference")
    MetadataPipeline(lay, 4, 64, "cpu", 1, backend="reference")
    MetadataPipeline(_layout(circular={"c128_state": 17}), 4, 64, "cpu", 2, backend="reference")
