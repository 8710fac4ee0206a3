"""Contradictory scheduler input is refused with one line naming the request and both fields, and
nothing of the rejected step is remembered (issue 26):

* an id both finished and preempted in one step;
* an id finished (or preempted) and scheduled in the same step, as new, running or resumed (vLLM
  never resumes a request in the step that preempts it: its waiting queue is skipped in a step that
  preempted);

for a ``StepInput`` and for a vLLM ``SchedulerOutput``, through the conversions and through a pipeline.
"""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest

from dsv4_index import (MetadataPipeline, NewRequest, RunningRequest, SlotMap, StepInput,
                        batch_from_scheduler_output, batch_from_step)

from helpers.layouts import tiny_layout
from helpers.pipelines import Pool
from helpers.vllm_stub import from_step

LAYOUT = tiny_layout()
G = len(LAYOUT.groups)


def lists(*ids):
    return (list(ids),) + tuple([] for _ in range(G - 1))


def held(*rids) -> SlotMap:
    """A slot map holding ``rids`` (each with one block)."""
    sm = SlotMap(4)
    _, d = batch_from_step(StepInput([NewRequest(r, lists(10 + i), 0) for i, r in enumerate(rids)], [],
                                     {r: 4 for r in rids}), sm, G)
    sm.commit(d)
    return sm


def snapshot(sm: SlotMap):
    return dict(sm.slot_of), set(sm.preempted), sm.num_free, sm.last_order


def convert(step: StepInput, sm: SlotMap, form: str):
    if form == "step":
        return batch_from_step(step, sm, G)
    return batch_from_scheduler_output(from_step(step), sm, G)


FORMS = ["step", "scheduler_output"]
WHERE = {"step": ("new_requests", "running_requests"), "scheduler_output": ("scheduled_new_reqs",
                                                                             "scheduled_cached_reqs")}


def _cases(form):
    new_f, run_f = WHERE[form]
    run_a = RunningRequest("a", lists(20), 4)
    return {
        "finished and preempted (held)": (
            ("a", "b"), StepInput([], [RunningRequest("b", None, 4)], {"b": 1}, finished_req_ids={"a"},
                                  preempted_req_ids={"a"}),
            "preempted_req_ids: request 'a' is also in finished_req_ids"),
        "finished and preempted (never seen)": (
            ("b",), StepInput([], [RunningRequest("b", None, 4)], {"b": 1}, finished_req_ids={"x"},
                              preempted_req_ids={"x"}),
            "preempted_req_ids: request 'x' is also in finished_req_ids"),
        "finished and running": (
            ("a",), StepInput([], [run_a], {"a": 1}, finished_req_ids={"a"}),
            f"{run_f}: request 'a' is also in finished_req_ids"),
        "preempted and running": (
            ("a",), StepInput([], [run_a], {"a": 1}, preempted_req_ids={"a"}),
            f"{run_f}: request 'a' is also in preempted_req_ids"),
        "preempted and resumed in the same step": (
            ("a",), StepInput([], [RunningRequest("a", lists(10), 0, resumed=True)], {"a": 4},
                              preempted_req_ids={"a"}),
            f"{run_f}: request 'a' is also in preempted_req_ids"),
        "finished and new": (
            (), StepInput([NewRequest("n", lists(1), 0)], [], {"n": 4}, finished_req_ids={"n"}),
            f"{new_f}: request 'n' is also in finished_req_ids"),
        "preempted and new": (
            ("a",), StepInput([NewRequest("n", lists(1), 0)], [], {"n": 4}, preempted_req_ids={"n"}),
            f"{new_f}: request 'n' is also in preempted_req_ids"),
    }


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", list(_cases("step")))
def test_contradiction_is_refused_naming_request_and_both_fields(form, case):
    rids, step, msg = _cases(form)[case]
    sm = held(*rids)
    before = snapshot(sm)
    with pytest.raises(ValueError, match="^" + re.escape(msg)) as e:
        convert(step, sm, form)
    assert "\n" not in str(e.value)
    assert snapshot(sm) == before


@pytest.mark.parametrize("form", FORMS)
def test_nothing_of_a_rejected_contradiction_is_remembered(form):
    """A finished-and-preempted step is refused by the pipeline, state unchanged; once the request
    really finished, a "resume" of it is refused (it was never remembered as preempted)."""
    pipe = MetadataPipeline(LAYOUT, 4, 40, "cpu", 0, backend="reference")
    pool = Pool(LAYOUT)
    blocks = {r: tuple(pool.blocks(8)) for r in "ab"}  # NOTE: every group covers 8 tokens

    def send(step):
        pipe.update(from_step(step) if form == "scheduler_output" else step)

    send(StepInput([NewRequest("a", blocks["a"], 0), NewRequest("b", blocks["b"], 0)], [], {"a": 4, "b": 4}))
    sm = pipe.slot_map
    before, occ = copy.deepcopy(snapshot(sm)), pipe.occupied
    with pytest.raises(ValueError, match="request 'a' is also in finished_req_ids"):
        send(StepInput([], [RunningRequest("b", None, 4)], {"b": 1}, finished_req_ids={"a"}, preempted_req_ids={"a"}))
    assert snapshot(sm) == before and np.array_equal(pipe.occupied, occ)
    send(StepInput([], [RunningRequest("b", None, 4)], {"b": 1}, finished_req_ids={"a"}))
    assert "a" not in sm.slot_of and "a" not in sm.preempted
    with pytest.raises(ValueError, match="request 'a' is resumed but was never preempted"):
        send(StepInput([], [RunningRequest("a", blocks["a"], 0, resumed=True), RunningRequest("b", None, 5)],
                       {"a": 4, "b": 1}))


def test_preempted_then_resumed_in_a_later_step_is_accepted():
    """The legitimate order: preempted in one step, resumed in a later one."""
    sm = held("a", "b")
    _, d = batch_from_step(StepInput([], [RunningRequest("b", None, 4)], {"b": 1}, preempted_req_ids={"a"}), sm, G)
    sm.commit(d)
    assert sm.preempted == {"a"}
    b, d = batch_from_step(StepInput([], [RunningRequest("b", None, 5), RunningRequest("a", lists(12), 0, True)],
                                     {"a": 4, "b": 1}), sm, G)
    sm.commit(d)
    assert b.is_new.tolist() == [False, True] and sm.preempted == set() and "a" in sm.slot_of


def test_static_check_refuses_the_same():
    step = StepInput([], [RunningRequest("a", None, 4)], {"a": 1}, finished_req_ids=["z"], preempted_req_ids=["z"])
    with pytest.raises(ValueError, match=r"^preempted_req_ids: request 'z' is also in finished_req_ids"):
        step.validate_static(G)
