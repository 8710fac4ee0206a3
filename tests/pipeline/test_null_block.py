"""The null block (id 0) under ``checks="full"`` (issue 20, review engine_integration §3; DESIGN §5).

A sliding group may hold the null block only for blocks wholly behind the window of the row's first
token (vLLM frees those); anywhere the step reads or writes it is rejected with one line naming the
slot and batch row (the request on the id-keyed path), the group, the block column, its positions
and the id's field; the rejected step changes nothing. ``checks="safe"`` does not look (memory stays
safe: block 0 is a real block of the pool). ``validate``'s check of built metadata names the first
offending entry and counts the rest instead of dumping the row.

Layout ``tiny``: mla (full, 16 tokens per block), swa (sliding, W 8, blocks of 8), c4_state (W 8,
blocks of 4), c128_state (W 16, blocks of 8); a request with 48 cached tokens scheduling 4.
"""

from __future__ import annotations

import dataclasses
import os
import re

import numpy as np
import pytest
import torch

from dsv4_index import DSV4Layout, MetadataPipeline
from dsv4_index.frontend import batch_from_step
from dsv4_index.frontend import NewRequest, RunningRequest, StepInput
from dsv4_index.validate import MetadataError, check_metadata

from helpers.rejections import diff as _diff, state

NC, Q = 48, 4  # NOTE: window starts: swa 41 (block 5), c4_state 41 (block 10), c128_state 33 (block 4)


def _layout(sliding_tables="ring"):
    return DSV4Layout.from_config("tiny", max_model_len=256, mla_block_size=16, swa_block_size=8,
                                  indexer_causal_indices=True, sliding_tables=sliding_tables)


def _pipe(checks="full", sliding_tables="ring"):
    return MetadataPipeline(_layout(sliding_tables), 4, 64, "cpu", 0, checks=checks, backend="reference")


def _lists(swa_nulls=5, c4_nulls=10, c128_nulls=4, mla=(1, 2, 3, 4)):
    """Block lists of a request at positions [0, 52): nulls for the first blocks of each sliding group."""
    return (list(mla), [0] * swa_nulls + list(range(10, 17 - swa_nulls)),
            [0] * c4_nulls + list(range(20, 33 - c4_nulls)), [0] * c128_nulls + list(range(40, 47 - c128_nulls)))


def _new(lists, nc=NC, q=Q):
    return StepInput([NewRequest("a", tuple(lists), nc)], [], {"a": q})


def _decode(new_block_ids, nc):
    return StepInput([], [RunningRequest("a", tuple(new_block_ids), nc)], {"a": 1})


def _reject(pipe, step, pattern):
    before = state(pipe)
    with pytest.raises(ValueError) as e:
        pipe.update(step)
    msg = str(e.value)
    assert re.search(pattern, msg), msg
    assert "\n" not in msg and len(msg) < 400, msg
    assert not _diff(before, state(pipe)), "the rejected step changed the pipeline"
    return msg


def test_nulls_wholly_behind_the_window_are_accepted():
    for checks in ("safe", "full"):
        p = _pipe(checks)
        p.update(_new(_lists()))             # swa block 4 (32..39) ends before position 41
        p.build()
        for nc, c4 in ((52, [33]), (53, []), (54, []), (55, []), (56, [34])):
            p.update(_decode(([], [] if nc != 55 else [17], c4, [] if nc != 55 else [47]), nc))
            p.build()


@pytest.mark.parametrize("g,lists,block,positions,read", [
    (1, _lists(swa_nulls=6), 5, "40..47", "41..51"),      # the block holding the window start
    (1, _lists(swa_nulls=7), 5, "40..47", "41..51"),      # the first of two (one more)
    (2, _lists(c4_nulls=11), 10, "40..43", "41..51"),
    (3, _lists(c128_nulls=5), 4, "32..39", "33..51"),
])
def test_null_inside_the_window_of_a_new_request(g, lists, block, positions, read):
    name = _layout().groups[g].name
    pat = (rf"^the null block 0 in sliding group gid {g} \({name}\) of slot 0 \(batch row 0\): block {block} "
           rf"\(positions {positions}\), from write_ids\[\d+\]; the step reads positions {read} of this group "
           rf"\(only blocks wholly before position {read.split('..')[0]} may be null\)")
    msg = _reject(_pipe(), _new(lists), pat)
    assert ("; 1 more null entry in this step" in msg) == (lists[1].count(0) == 7), msg
    assert f"= new_requests['a'].block_ids[{g}][{block}]" in msg and "slot 0 = request 'a'" in msg, msg
    _pipe("safe").update(_new(lists))  # the safe level does not look


def test_null_written_by_a_running_request_and_in_a_full_group():
    p = _pipe()
    p.update(_new(_lists()))
    _reject(p, _decode(([], [], [0], []), 52),
            r"null block 0 in sliding group gid 2 \(c4_state\) of slot 0 \(batch row 0\): block 13 \(positions "
            r"52\.\.55\), from write_ids\[0\]; the step reads positions 45\.\.52 .*"
            r"running_requests\['a'\]\.new_block_ids\[2\]\[0\]")
    _reject(_pipe(), _new(_lists(mla=(1, 0, 3, 4))),
            r"^the null block 0 in full group gid 0 \(mla\) of slot 0 \(batch row 0\): block 1 \(positions 16\.\.31\), "
            r"from write_ids\[1\]; every block of a full group is read")
    p.update(_decode(([], [], [33], []), 52))  # the valid step is still accepted after the rejections


@pytest.mark.parametrize("tables", ["ring", "full"])
def test_held_null_that_a_rewound_step_reads(tables):
    """A step whose window reaches back to a null the row holds (array form: positions named by slot)."""
    p = _pipe(sliding_tables=tables)
    p.update(_new(_lists()))
    b, _ = batch_from_step(_decode(([], [], [], []), 52), p.slot_map, 4)
    rewound = dataclasses.replace(b, num_computed_tokens=np.array([40]))  # swa window from 33: block 4
    if tables == "ring":  # NOTE: the ring never stored block 4 (behind the window at admission): a stale column
        for checks in ("full", "safe"):
            q = _pipe(checks, sliding_tables=tables)
            q.update(_new(_lists()))
            _reject(q, rewound, r"^slot 0 reads gid 1 \(swa\) from block 4 \(position 33, num_computed_tokens 40\), "
                                r"but its ring columns hold blocks 5 and up only")
        return
    _reject(p, rewound, r"^the null block 0 in sliding group gid 1 \(swa\) of slot 0 \(batch row 0\): block 4 "
                        r"\(positions 32\.\.39\), held since an earlier step; the step reads positions 33\.\.40")
    q = _pipe("safe", sliding_tables=tables)
    q.update(_new(_lists()))
    q.update(rewound)


def test_held_blocks_across_the_end_of_the_ring_are_accepted():
    """swa keeps a ring of 10 columns: at 80 cached tokens the window starts in block 9 (column 9) and the
    row holds block 10 in column 0; the general path reads both (and nothing past the row)."""
    lists = ([1, 2, 3, 4, 5, 6], [0] * 9 + [10, 11], [0] * 18 + [20, 21, 22], [0] * 8 + [40, 41, 42])
    p = _pipe()
    assert int(p.tables.ring[1]) == 10
    p.update(_new(lists, nc=80))
    for nc in (84, 85):
        p.update(_decode(([], [], [23] if nc == 84 else [], []), nc))
    b, _ = batch_from_step(_decode(([], [], [], []), 86), p.slot_map, 4)
    # NOTE: window from 65: block 8, which the ring never stored (behind the window at admission)
    _reject(p, dataclasses.replace(b, num_computed_tokens=np.array([72])),
            r"slot 0 reads gid 1 \(swa\) from block 8 .* but its ring columns hold blocks 9 and up only")


def test_the_pass_and_its_definition_give_one_message():
    msgs = []
    for cross_check in (False, True):  # NOTE: True: the compiled checks compared with their definition
        p = _pipe()
        p.requests.cross_check = cross_check
        p.update(_new(_lists()))
        p.update(_decode(([], [], [33], []), 52))
        b, _ = batch_from_step(_decode(([], [], [], []), 53), p.slot_map, 4)
        bad = dataclasses.replace(b, write_gids=np.array([2]), write_slots=np.array([0]), write_starts=np.array([-1]),
                                  write_cu=np.array([0, 1]), write_ids=np.array([0]))
        msgs.append(_reject(p, bad, r"null block 0 in sliding group gid 2 \(c4_state\) .* block 14 "))
        p.update(dataclasses.replace(bad, write_ids=np.array([34])))
    assert msgs[0] == msgs[1]


def test_validate_names_the_first_entry_and_counts_the_rest():
    p = _pipe()
    p.update(_new(_lists()))
    meta = p.build()
    meta["swa"].indices[1, 2:5] = 3  # NOTE: slots 3 lie in block 0 of swa
    with pytest.raises(MetadataError) as e:
        check_metadata(meta)
    msg = str(e.value)
    assert re.search(r"^swa: indices\[1, 2\] outside the cache or in the null block 0 \(2 more entries\) at token 1 "
                     r"\(request 'a', batch row 0, position 49\): expected -1 or a slot in \[0, inf\) outside "
                     r"block 0, found 3$", msg), msg
    assert isinstance(meta["swa"].indices, torch.Tensor)


def test_same_message_on_the_reference_and_the_fused_pipeline():
    """The check runs on the host before any backend: the fused (Triton, interpreted on CPU) pipeline
    rejects the step with the same message."""
    if not (os.environ.get("TRITON_INTERPRET") or torch.cuda.is_available()):
        pytest.skip("the fused pipeline needs CUDA or TRITON_INTERPRET=1")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    msgs = []
    for backend in ("reference", None):
        p = MetadataPipeline(_layout(), 4, 64, dev, 0, checks="full", backend=backend)
        assert (p.fused_plan is not None) == (backend is None)
        msgs.append(_reject(p, _new(_lists(swa_nulls=6)), "null block 0 in sliding group gid 1"))
    assert msgs[0] == msgs[1]
