"""Rows in vLLM's order (running requests, then new ones), so the step after an arrival repeats the
committed order and takes the cached slots without a lookup; the free slots are reused lowest first; the
request ids of the device rows are built only when read (issue 26)."""

from __future__ import annotations

import numpy as np

from dsv4_index import (MetadataPipeline, NewRequest, RunningRequest, SlotMap, StepInput,
                        batch_from_scheduler_output, batch_from_step)
from dsv4_index.state.requests import RowIds

from helpers.layouts import tiny_layout
from helpers.pipelines import Pool
from helpers.vllm_stub import from_step

LAYOUT = tiny_layout()
G = len(LAYOUT.groups)


def lists(*ids):
    return (list(ids),) + tuple([] for _ in range(G - 1))


def test_step_after_an_arrival_repeats_the_committed_order():
    sm = SlotMap(4)
    b, d = batch_from_step(StepInput([NewRequest("a", lists(1), 0), NewRequest("b", lists(2), 0)], [],
                                     {"a": 4, "b": 4}), sm, G)
    sm.commit(d)
    # a finishes, c arrives (appended, vLLM's order), b keeps running: c takes a's slot (the lowest free)
    b, d = batch_from_step(StepInput([NewRequest("c", lists(3), 0)], [RunningRequest("b", None, 4)],
                                     {"b": 1, "c": 4}, finished_req_ids={"a"}), sm, G)
    assert d.order == ["b", "c"] and b.req_slots.tolist() == [1, 0] and b.is_new.tolist() == [False, True]
    assert b.free_slots.tolist() == [0]
    sm.commit(d)
    assert sm.last_order == ["b", "c"] and sm.free_slots == [2, 3]
    # the next step lists the running requests in that order: the cached slots, no lookup
    out = from_step(StepInput([], [RunningRequest("b", None, 5), RunningRequest("c", None, 4)], {"b": 1, "c": 1}))
    b, d = batch_from_scheduler_output(out, sm, G)
    assert b.req_slots is sm.last_slots and b.req_slots.tolist() == [1, 0]


def test_general_path_assigns_slots_in_row_order():
    """A resumed request (general path) and a new one: rows running first, slots lowest first in row order."""
    sm = SlotMap(4)
    _, d = batch_from_step(StepInput([NewRequest("a", lists(1), 0), NewRequest("b", lists(2), 0)], [],
                                     {"a": 4, "b": 4}), sm, G)
    sm.commit(d)
    _, d = batch_from_step(StepInput([], [RunningRequest("b", None, 4)], {"b": 1}, preempted_req_ids={"a"}), sm, G)
    sm.commit(d)
    b, d = batch_from_step(StepInput([NewRequest("n", lists(5), 0)],
                                     [RunningRequest("b", None, 5), RunningRequest("a", lists(1), 0, True)],
                                     {"n": 4, "a": 4, "b": 1}), sm, G)
    assert d.order == ["b", "a", "n"] and b.req_slots.tolist() == [1, 0, 2]
    assert b.is_new.tolist() == [False, True, True]


def test_req_ids_are_built_when_read():
    pipe = MetadataPipeline(LAYOUT, 4, 40, "cpu", 0, backend="reference")
    pool = Pool(LAYOUT)
    pipe.update(StepInput([NewRequest("p", tuple(pool.blocks(8)), 0), NewRequest("d", tuple(pool.blocks(8)), 7)],
                          [], {"p": 6, "d": 1}))
    meta = pipe.build()
    ids = meta.req_ids
    assert isinstance(ids, RowIds) and ids._ids is None  # NOTE: nothing built yet
    assert len(ids) == 2 and ids._ids is None
    assert ids == ["d", "p"] and ["d", "p"] == ids and list(ids) == pipe.req_ids  # decode first
    assert ids.index("p") == 1 and "d" in ids and ids[0] == "d"
    assert np.asarray(meta.req_slots).tolist() == [pipe.slot_of("d"), pipe.slot_of("p")]
