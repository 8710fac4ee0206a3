"""Bounded arithmetic on the id-keyed paths (issue 18 item 4): counts and block ids of INT64_MAX,
2**62, 10**30, negative, mixed sign, floats, bools and numpy scalars are rejected before any sum or
array conversion, by a ValueError (a StepTypeError for types) naming the request and the scheduler's
field, through ``update(StepInput)`` and through a ``SchedulerOutput``, with and without ``pad_to``;
the pipeline and its slot map are then exactly as before (a twin that never saw the bad step gives the
same metadata on the next step)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dsv4_index import MetadataPipeline, NewRequest, RunningRequest, StepInput, batch_from_scheduler_output

from helpers.layouts import tiny_layout
from helpers.pipelines import assert_same, meta_tensors
from helpers.vllm_stub import from_step

LAYOUT = tiny_layout()
G = len(LAYOUT.groups)
I64 = 2**63 - 1
BAD = {"INT64_MAX": I64, "2**62": 2**62, "10**30": 10**30, "-1": -1, "INT64_MIN": -(2**63), "1.5": 1.5,
       "True": True, "np.int64": np.int64(3), "2**31": 2**31}
KIND = {k: (TypeError if isinstance(v, (float, bool, np.integer)) else ValueError) for k, v in BAD.items()}


def lists(base, n_tokens):
    return tuple([base + 20 * g + i for i in range(-(-n_tokens // grp.alloc_block_size))]
                 for g, grp in enumerate(LAYOUT.groups))


def pipeline():
    p = MetadataPipeline(LAYOUT, 4, 40, "cpu", 2, backend="reference")
    p.update(StepInput([NewRequest("a", lists(1, 12), 0), NewRequest("b", lists(300, 12), 0)], [], {"a": 11, "b": 11}))
    p.build()
    return p


def next_step(**over):
    """The valid next step: "a" and "b" decode one token each (no new block)."""
    kw = dict(new_requests=[], running_requests=[RunningRequest("a", None, 11), RunningRequest("b", None, 11)],
              num_scheduled_tokens={"a": 1, "b": 1})
    kw.update(over)
    return StepInput(**kw)


def bad_steps(v):
    """(name of the field the error must name, step) for each place a count or id can be bad."""
    return {
        r"num_scheduled_tokens\['a'\]": next_step(num_scheduled_tokens={"a": v, "b": 1}),
        r"num_computed_tokens of 'b'": next_step(running_requests=[RunningRequest("a", None, 11),
                                                                   RunningRequest("b", None, v)]),
        r"new_block_ids of 'a' gid 1 .*at new_block_ids\[1\]\[0\]": next_step(running_requests=[
            RunningRequest("a", ([], [v], [], []), 11), RunningRequest("b", None, 11)]),
        r"block_ids of 'n' gid 0 .*at block_ids\[0\]\[1\]": next_step(
            new_requests=[NewRequest("n", ([5, v],) + lists(600, 3)[1:], 0)],
            num_scheduled_tokens={"a": 1, "b": 1, "n": 3}),
        r"replay_end\['a'\]": next_step(replay_end={"a": v}),
    }


def _snapshot(p):
    sm = p.slot_map
    return dict(sm.slot_of), set(sm.preempted), sm.free_slots


@pytest.mark.parametrize("form", ["step", "scheduler_output"])
@pytest.mark.parametrize("pad_to", [None, 8])
@pytest.mark.parametrize("value", list(BAD))
def test_bad_counts_and_ids_are_rejected_by_name_and_change_nothing(value, pad_to, form):
    p, twin = pipeline(), pipeline()
    before = _snapshot(p)
    for field, step in bad_steps(BAD[value]).items():
        with pytest.raises(KIND[value], match=field) as e:
            if form == "step":
                p.update(step, pad_to=pad_to)
            else:
                batch_from_scheduler_output(from_step(step), p.slot_map, G, replay_end=dict(step.replay_end))
        assert isinstance(e.value, ValueError)
        assert _snapshot(p) == before, field
    good = next_step()
    p.update(good, pad_to=pad_to)
    twin.update(good, pad_to=pad_to)
    assert_same(meta_tensors(p.build()), meta_tensors(twin.build()), value)


def test_mixed_signs_that_sum_to_a_valid_count_are_rejected():
    p = pipeline()
    before = _snapshot(p)
    for nst in ({"a": 2**62, "b": -(2**62) + 1}, {"a": I64, "b": I64}, {"a": -5, "b": 7}):
        step = next_step(num_scheduled_tokens=nst)
        for pad_to in (None, 8):
            with pytest.raises(ValueError, match=r"num_scheduled_tokens\['[ab]'\] must be an int >= 0"):
                p.update(step, pad_to=pad_to)
            with pytest.raises(ValueError, match=r"num_scheduled_tokens\['[ab]'\] must be an int >= 0"):
                batch_from_scheduler_output(from_step(step), p.slot_map, G)
        assert _snapshot(p) == before


def test_bad_values_in_many_rows_name_the_first():
    p = pipeline()
    ids = [f"r{i}" for i in range(3)]
    step = StepInput([NewRequest(r, lists(100 + 50 * i, 2), 0) for i, r in enumerate(ids)], [],
                     {"r0": 1, "r1": 10**30, "r2": -1}, finished_req_ids={"a", "b"})
    with pytest.raises(ValueError, match=r"num_scheduled_tokens\['r1'\] must be an int >= 0 and <= 2147483647"):
        p.update(step)
    out = from_step(step)
    out = dataclasses.replace(out, num_scheduled_tokens={"r0": 1, "r1": 1, "r2": 1})
    out.scheduled_new_reqs[2].num_computed_tokens = 2**62
    with pytest.raises(ValueError, match=r"scheduled_new_reqs: num_computed_tokens of 'r2' must be an int >= 0 and"):
        batch_from_scheduler_output(out, p.slot_map, G)
