"""The array-form step (``StepBatch``), the request-id -> slot map (``SlotMap``) and the two front ends
that build batches (``batch_from_step``, ``batch_from_scheduler_output``).

Pipelines here run the PyTorch reference (the subject is the host path; test_fused compares kernels).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch

from dsv4_index import (MetadataPipeline, NewRequest, RunningRequest, SlotMap, StepBatch, StepInput,
                        batch_from_scheduler_output, batch_from_step)
from dsv4_index.batch import APPEND

from helpers.layouts import tiny_layout
from helpers.pipelines import assert_same, eventful_trace, meta_tensors

LAYOUT = tiny_layout()
G = len(LAYOUT.groups)
ARRAYS = ("req_slots", "num_computed_tokens", "num_scheduled_tokens", "is_new", "free_slots", "write_gids",
          "write_slots", "write_starts", "write_cu", "write_ids", "replay_start", "replay_end")


def lists(*ids):
    """Per-gid block lists: ``ids`` for gid 0, ``[]`` for the others."""
    return (list(ids),) + tuple([] for _ in range(G - 1))


def arrays(b: StepBatch) -> dict:
    return {k: None if getattr(b, k) is None else np.asarray(getattr(b, k)).tolist() for k in ARRAYS}


def state(sm: SlotMap):
    return dict(sm.slot_of), set(sm.preempted), sm.free_slots


def commit(sm, step):
    batch, delta = batch_from_step(step, sm, G)
    sm.commit(delta)
    return batch


def ref_pipe(**kw):
    return MetadataPipeline(LAYOUT, 4, 40, "cpu", 2, backend="reference", **kw)


# ----------------------------------------------------------------------------------------------
# StepBatch
# ----------------------------------------------------------------------------------------------
def test_step_batch_counts_and_json_round_trip():
    b = StepBatch(req_slots=np.array([2, 0]), num_computed_tokens=np.array([5, 0]),
                  num_scheduled_tokens=np.array([1, 7]), is_new=np.array([False, True]), free_slots=np.array([1]),
                  write_gids=np.array([0, 1]), write_slots=np.array([0, 0]), write_starts=np.array([0, APPEND]),
                  write_cu=np.array([0, 2, 3]), write_ids=np.array([4, 5, 6]), replay_start=np.array([0, 0]))
    assert (b.num_rows, b.num_tokens, b.num_runs) == (2, 8, 2)
    c = StepBatch.from_json(b.to_json())
    assert arrays(c) == arrays(b) and c.replay_end is None and c.is_new.dtype == bool
    empty = StepBatch(req_slots=np.zeros(0, np.int64), num_computed_tokens=np.zeros(0, np.int64),
                      num_scheduled_tokens=np.zeros(0, np.int64))
    assert (empty.num_rows, empty.num_tokens, empty.num_runs) == (0, 0, 0)


def test_batch_from_step_arrays():
    sm = SlotMap(4)
    b_lists = ([3], [4]) + tuple([] for _ in range(G - 2))
    b = commit(sm, StepInput([NewRequest("a", lists(1, 2), 0), NewRequest("b", b_lists, 8)], [], {"a": 5, "b": 2},
                             replay_start={"b": 3}))
    # NOTE: a new row gets one run per gid from block 0, empty ones included (they cut the row)
    assert G == 4 and arrays(b) == dict(
        req_slots=[0, 1], num_computed_tokens=[0, 8], num_scheduled_tokens=[5, 2], is_new=[True, True],
        free_slots=[], write_gids=[0, 1, 2, 3] * 2, write_slots=[0] * 4 + [1] * 4, write_starts=[0] * 8,
        write_cu=[0, 2, 2, 2, 2, 3, 4, 4, 4], write_ids=[1, 2, 3, 4], replay_start=[0, 3], replay_end=None)
    # running: appends (APPEND) only for groups that got ids; finished slots freed before the step
    b = commit(sm, StepInput([], [RunningRequest("b", lists(9), 10)], {"b": 1}, finished_req_ids={"a"}))
    assert arrays(b) == dict(req_slots=[1], num_computed_tokens=[10], num_scheduled_tokens=[1], is_new=[False],
                             free_slots=[0], write_gids=[0], write_slots=[1], write_starts=[APPEND], write_cu=[0, 1],
                             write_ids=[9], replay_start=None, replay_end=None)
    assert sm.slot_of == {"b": 1}


# ----------------------------------------------------------------------------------------------
# SlotMap commit semantics
# ----------------------------------------------------------------------------------------------
def test_slot_map_lowest_free_slot_first_and_reuse():
    sm = SlotMap(4)
    b = commit(sm, StepInput([NewRequest(r, lists(i + 1), 0) for i, r in enumerate("abc")], [],
                             {"a": 1, "b": 1, "c": 1}))
    assert b.req_slots.tolist() == [0, 1, 2] and sm.slot_of == {"a": 0, "b": 1, "c": 2}
    # a slot freed by a finish is reused in the same step, lowest first
    b = commit(sm, StepInput([NewRequest("d", lists(7), 0), NewRequest("e", lists(8), 0)], [], {"d": 1, "e": 1},
                             finished_req_ids=["b"]))
    assert b.free_slots.tolist() == [1] and b.req_slots.tolist() == [1, 3]
    assert sm.slot_of == {"a": 0, "c": 2, "d": 1, "e": 3}
    # a preempted request's slot is reused; the request is remembered
    b = commit(sm, StepInput([NewRequest("f", lists(9), 0)], [], {"f": 1}, preempted_req_ids={"a"}))
    assert b.free_slots.tolist() == [0] and b.req_slots.tolist() == [0] and sm.preempted == {"a"}
    # every slot taken: resuming needs a free one (and nothing changes when refused)
    before = state(sm)
    with pytest.raises(ValueError, match="running_requests: no free request slot"):
        batch_from_step(StepInput([], [RunningRequest("a", lists(5), 0, resumed=True)], {"a": 3}), sm, G)
    assert state(sm) == before
    b = commit(sm, StepInput([], [RunningRequest("a", lists(5), 0, resumed=True)], {"a": 3}, finished_req_ids={"c"}))
    assert b.is_new.tolist() == [True] and b.req_slots.tolist() == [2] and b.write_starts.tolist() == [0] * G
    assert sm.slot_of["a"] == 2 and sm.preempted == set()


@pytest.mark.parametrize("how", ["resumed", "new"])
def test_preempted_request_comes_back_either_way(how):
    sm = SlotMap(2)
    commit(sm, StepInput([NewRequest("a", lists(1), 0), NewRequest("b", lists(2), 0)], [], {"a": 4, "b": 4}))
    commit(sm, StepInput([], [RunningRequest("b", lists(), 4)], {"b": 1}, preempted_req_ids=["a"]))
    assert sm.preempted == {"a"} and sm.slot_of == {"b": 1}
    back = (StepInput([], [RunningRequest("a", lists(3), 0, resumed=True)], {"a": 2}) if how == "resumed" else
            StepInput([NewRequest("a", lists(3), 0)], [], {"a": 2}))
    b = commit(sm, back)
    assert b.is_new.tolist() == [True] and b.req_slots.tolist() == [0] and b.write_ids.tolist() == [3]
    assert sm.slot_of == {"a": 0, "b": 1} and sm.preempted == set()


def test_finishing_a_preempted_request_forgets_it():
    sm = SlotMap(2)
    commit(sm, StepInput([NewRequest("a", lists(1), 0)], [], {"a": 4}))
    commit(sm, StepInput([], [], {}, preempted_req_ids=["a"]))
    commit(sm, StepInput([], [], {}, finished_req_ids=["a"]))
    assert sm.preempted == set() and sm.slot_of == {} and sm.free_slots == [0, 1]
    with pytest.raises(ValueError, match="resumed but was never preempted"):
        batch_from_step(StepInput([], [RunningRequest("a", lists(3), 0, resumed=True)], {"a": 1}), sm, G)


def test_conversion_is_pure_until_commit():
    sm = SlotMap(3)
    commit(sm, StepInput([NewRequest("a", lists(1), 0)], [], {"a": 4}))
    before = state(sm)
    step = StepInput([NewRequest("b", lists(2), 0)], [], {"b": 1}, finished_req_ids={"a"})
    b1, d1 = batch_from_step(step, sm, G)
    b2, d2 = batch_from_step(step, sm, G)
    assert state(sm) == before and arrays(b1) == arrays(b2) and d1 == d2 and b1.req_slots.tolist() == [0]


# ----------------------------------------------------------------------------------------------
# batch_from_step: every error names the field, and changes nothing
# ----------------------------------------------------------------------------------------------
def _base():
    """SlotMap with "a" running in slot 0 and "p" preempted; a valid step schedules "a" and new "n"."""
    sm = SlotMap(2)
    commit(sm, StepInput([NewRequest("a", lists(1), 0), NewRequest("p", lists(2), 0)], [], {"a": 4, "p": 4}))
    commit(sm, StepInput([], [], {}, preempted_req_ids=["p"]))
    return sm


def _step(**over):
    kw = dict(new_requests=[NewRequest("n", lists(5), 0)], running_requests=[RunningRequest("a", lists(6), 4)],
              num_scheduled_tokens={"n": 3, "a": 1})
    kw.update(over)
    return StepInput(**kw)


BAD = {
    "bare string finished": (dict(finished_req_ids="ab"), r"finished_req_ids .*bare string"),
    "bare string preempted": (dict(preempted_req_ids="a"), r"preempted_req_ids .*bare string"),
    "non-str finished id": (dict(finished_req_ids=[3]), r"finished_req_ids must hold str"),
    "id set not iterable": (dict(preempted_req_ids=5), r"preempted_req_ids must be a set or list"),
    "duplicate new": (dict(new_requests=[NewRequest("n", lists(5), 0), NewRequest("n", lists(7), 0)]),
                      r"new_requests: request 'n' is listed more than once"),
    "duplicate new and running": (dict(running_requests=[RunningRequest("a", lists(), 4),
                                                         RunningRequest("n", lists(), 0)]),
                                  r"running_requests: request 'n' is listed more than once"),
    "unknown running": (dict(running_requests=[RunningRequest("zz", lists(), 4)],
                             num_scheduled_tokens={"n": 3, "zz": 1}),
                        r"running_requests: request 'zz' is not in the batch"),
    "resumed never preempted": (dict(running_requests=[RunningRequest("zz", lists(8), 0, resumed=True)],
                                     num_scheduled_tokens={"n": 3, "zz": 1}),
                                r"running_requests: request 'zz' is resumed but was never preempted"),
    "new already holds a slot": (dict(new_requests=[NewRequest("a", lists(5), 0)], running_requests=[],
                                      num_scheduled_tokens={"a": 3}),
                                 r"new_requests: request 'a' already holds a slot"),
    "new also finished": (dict(finished_req_ids={"n"}), r"new_requests: request 'n' is also in finished_req_ids"),
    "no free slot": (dict(new_requests=[NewRequest("n", lists(5), 0), NewRequest("m", lists(7), 0)],
                          num_scheduled_tokens={"n": 3, "m": 1, "a": 1}), r"new_requests: no free request slot"),
    "non-str id": (dict(new_requests=[NewRequest(5, lists(5), 0)], num_scheduled_tokens={5: 3, "a": 1}),
                   r"new_requests: request ids must be str"),
    "negative block id": (dict(new_requests=[NewRequest("n", lists(5, -2), 0)]),
                          r"new_requests: block_ids of 'n' gid 0 has a bad block id -2"),
    "float block id": (dict(running_requests=[RunningRequest("a", lists(1.5), 4)]),
                       r"running_requests: new_block_ids of 'a' gid 0 has a bad block id 1.5"),
    "bool block id": (dict(new_requests=[NewRequest("n", lists(True), 0)]), r"new_requests: block_ids of 'n'"),
    "wrong group count": (dict(running_requests=[RunningRequest("a", ([6],), 4)]),
                          r"running_requests: new_block_ids of 'a' has 1 per-gid block lists, expected"),
    "negative computed": (dict(new_requests=[NewRequest("n", lists(5), -1)]),
                          r"new_requests: num_computed_tokens of 'n' must be an int >= 0"),
    "float computed": (dict(running_requests=[RunningRequest("a", lists(), 4.0)]),
                       r"running_requests: num_computed_tokens of 'a'"),
    "negative scheduled": (dict(num_scheduled_tokens={"n": -3, "a": 1}), r"num_scheduled_tokens\['n'\] must be"),
    "bool scheduled": (dict(num_scheduled_tokens={"n": True, "a": 1}), r"num_scheduled_tokens\['n'\] must be"),
    "scheduled not a dict": (dict(num_scheduled_tokens=[("n", 3), ("a", 1)]), r"num_scheduled_tokens must be a dict"),
    "no scheduled entry": (dict(num_scheduled_tokens={"n": 3}), r"running_requests: request 'a' has no entry in "
                                                                 r"num_scheduled_tokens"),
    "scheduled unknown id": (dict(num_scheduled_tokens={"n": 3, "a": 1, "zz": 2}),
                             r"num_scheduled_tokens lists 'zz', which is in neither"),
    "replay_start unscheduled": (dict(replay_start={"zz": 0}), r"replay_start lists 'zz', which is not scheduled"),
    "replay_end unscheduled": (dict(replay_end={"p": 4}), r"replay_end lists 'p', which is not scheduled"),
    "replay_start negative": (dict(replay_start={"a": -1}), r"replay_start\['a'\] must be an int >= 0"),
    "replay_end not a dict": (dict(replay_end=[("a", 2)]), r"replay_end must be a dict"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_batch_from_step_errors_name_the_field(name):
    over, match = BAD[name]
    sm = _base()
    batch_from_step(_step(), sm, G)  # the base step is valid
    before = state(sm)
    with pytest.raises(ValueError, match=match):
        batch_from_step(_step(**over), sm, G)
    assert state(sm) == before


def test_block_list_entries_are_fixed_at_construction():
    with pytest.raises(ValueError, match=r"block_ids of 'n' gid 0 must be a list of block ids, got str"):
        NewRequest("n", ("12",) + lists()[1:], 0)
    with pytest.raises(TypeError, match=r"new_block_ids of 'a' gid 1 must be a list of block ids, got int"):
        RunningRequest("a", ([], 5, [], []), 0)
    assert RunningRequest("a", None, 3).new_block_ids is None


def test_batch_from_step_rejects_other_inputs():
    with pytest.raises(ValueError, match="step must be a StepInput"):
        batch_from_step({"new_requests": []}, SlotMap(1), G)


# ----------------------------------------------------------------------------------------------
# batch_from_scheduler_output (vLLM-like, duck-typed)
# ----------------------------------------------------------------------------------------------
def scheduler_output(step: StepInput, form: str):
    """The vLLM-style ``SchedulerOutput`` of ``step``: ``form`` "set" (``resumed_req_ids``, vLLM >= 0.11)
    or "list" (``resumed_from_preemption``, older; no ``preempted_req_ids`` when empty)."""
    run = step.running_requests
    cached = NS(req_ids=[r.req_id for r in run], new_token_ids=[[] for _ in run],
                new_block_ids=[None if not r.resumed and not any(r.new_block_ids) else tuple(map(list, r.new_block_ids))
                               for r in run],
                num_computed_tokens=[r.num_computed_tokens for r in run])
    if form == "set":
        cached.resumed_req_ids = {r.req_id for r in run if r.resumed}
    else:
        cached.resumed_from_preemption = [r.resumed for r in run]
    out = NS(scheduled_new_reqs=[NS(req_id=r.req_id, prompt_token_ids=[], block_ids=tuple(map(list, r.block_ids)),
                                    num_computed_tokens=r.num_computed_tokens) for r in step.new_requests],
             scheduled_cached_reqs=cached, num_scheduled_tokens=dict(step.num_scheduled_tokens),
             total_num_scheduled_tokens=step.total_tokens, finished_req_ids=set(step.finished_req_ids))
    if form == "set" or step.preempted_req_ids:
        out.preempted_req_ids = set(step.preempted_req_ids)
    return out


@pytest.mark.parametrize("form", ["set", "list"])
def test_scheduler_output_equals_step_input_over_a_trace(form):
    trace = eventful_trace(LAYOUT, 14, need=("preempted", "resumed", "replay", "finished", "spec"),
                           seeds=range(200))
    by_step, by_out = ref_pipe(), ref_pipe()
    sm = SlotMap(4)
    for i, (step, _) in enumerate(trace):
        out = scheduler_output(step, form)
        batch, delta = batch_from_scheduler_output(out, sm, G, replay_start=dict(step.replay_start),
                                                   replay_end=dict(step.replay_end))
        want, _ = batch_from_step(step, copy.deepcopy(by_step.slot_map), G)
        assert arrays(batch) == arrays(want), i
        pad = step.total_tokens + i % 3
        by_step.update(step, pad_to=pad)
        by_out.update(batch, pad_to=pad)
        sm.commit(delta)
        assert sm.slot_of == by_step.slot_map.slot_of and sm.preempted == by_step.slot_map.preempted
        a, b = meta_tensors(by_step.build()), meta_tensors(by_out.build())
        assert b.pop("req_ids") is None and sorted(a.pop("req_ids")) == sorted(r for r in delta.order
                                                                             if step.num_scheduled_tokens[r])
        assert_same(a, b, i)
        for x, y in zip(by_step.tables.tables, by_out.tables.tables, strict=True):
            assert torch.equal(x, y), i


def test_scheduler_output_with_no_new_blocks_and_no_preempted_field():
    sm = SlotMap(2)
    first = StepInput([NewRequest("a", lists(1), 0)], [], {"a": 3})
    b, d = batch_from_scheduler_output(scheduler_output(first, "list"), sm, G)
    sm.commit(d)
    assert b.req_slots.tolist() == [0] and b.write_ids.tolist() == [1]
    out = scheduler_output(StepInput([], [RunningRequest("a", lists(), 3)], {"a": 1}), "list")
    assert out.scheduled_cached_reqs.new_block_ids == [None] and not hasattr(out, "preempted_req_ids")
    b, _ = batch_from_scheduler_output(out, sm, G)
    assert b.num_runs == 0 and b.req_slots.tolist() == [0] and b.num_computed_tokens.tolist() == [3]


# ----------------------------------------------------------------------------------------------
# a pipeline driven by hand-built StepBatches (caller-owned slots)
# ----------------------------------------------------------------------------------------------
class HandSlots:
    """A caller that owns its slots with another policy (highest free slot first), sends explicit
    write starts for even gids and APPEND for odd ones, and int32 arrays."""

    def __init__(self, n):
        self.slot, self.free, self.sent = {}, set(range(n)), {}

    def convert(self, step: StepInput) -> StepBatch:
        gone = [r for r in (*step.finished_req_ids, *step.preempted_req_ids) if r in self.slot]
        freed = [self.slot.pop(r) for r in gone]
        self.free |= set(freed)
        # NOTE: rows in vLLM's order, as the id-keyed conversion makes them: running, then new
        rows = [(r.req_id, r.new_block_ids, r.num_computed_tokens, r.resumed) for r in step.running_requests]
        rows += [(r.req_id, r.block_ids, r.num_computed_tokens, True) for r in step.new_requests]
        slots, runs = [], []
        for rid, ls, _, fresh in rows:
            if fresh:
                self.slot[rid] = max(self.free)
                self.free.discard(self.slot[rid])
                self.sent[rid] = [0] * G
            s = self.slot[rid]
            slots.append(s)
            for g, ids in enumerate(ls):
                if ids:
                    start = 0 if fresh else (self.sent[rid][g] if g % 2 == 0 else APPEND)
                    runs.append((g, s, start, list(ids)))
                    self.sent[rid][g] = (0 if fresh else self.sent[rid][g]) + len(ids)
        i32 = np.int32
        cu = np.cumsum([0] + [len(r[3]) for r in runs]).astype(i32)

        def per_row(d):
            return np.array([d.get(r[0], 0) for r in rows], dtype=i32) if d else None
        return StepBatch(req_slots=np.array(slots, i32), num_computed_tokens=np.array([r[2] for r in rows], i32),
                         num_scheduled_tokens=np.array([step.num_scheduled_tokens[r[0]] for r in rows], i32),
                         is_new=np.array([r[3] for r in rows], bool), free_slots=np.array(freed, i32),
                         write_gids=np.array([r[0] for r in runs], i32),
                         write_slots=np.array([r[1] for r in runs], i32),
                         write_starts=np.array([r[2] for r in runs], i32), write_cu=cu,
                         write_ids=np.array([b for r in runs for b in r[3]], i32),
                         replay_start=per_row(step.replay_start), replay_end=per_row(step.replay_end))


def test_hand_built_step_batches_equal_step_inputs():
    trace = eventful_trace(LAYOUT, 14, need=("preempted", "resumed", "replay", "finished", "spec"),
                           seeds=range(200))
    ids, arr, hand = ref_pipe(), ref_pipe(), HandSlots(4)
    differ = 0
    for i, (step, views) in enumerate(trace):
        batch = hand.convert(step)
        ids.update(step, pad_to=step.total_tokens + 2)
        arr.update(batch, pad_to=step.total_tokens + 2)
        a, b = meta_tensors(ids.build()), meta_tensors(arr.build())
        order = a.pop("req_ids")
        assert b.pop("req_ids") is None
        assert b.pop("req_slots") == [hand.slot[r] for r in order] == b["idx_mapping"].tolist()
        assert a.pop("req_slots") == [ids.slot_of(r) for r in order]
        differ += a.pop("idx_mapping").tolist() != b.pop("idx_mapping").tolist()
        assert_same(a, b, i)
        for v in views:  # the same rows, wherever each caller put them
            for g in range(G):
                x, y = ids.tables.row(g, ids.slot_of(v.req_id)), arr.tables.row(g, hand.slot[v.req_id])
                assert np.array_equal(x, y), (i, v.req_id, g)
    assert differ > 0  # the two callers really used different slots


@pytest.mark.parametrize("over,match", [
    (dict(req_slots=np.array([7])), r"req_slots\[0\] = 7 is not a slot"),
    (dict(req_slots=np.array([0, 0]), num_computed_tokens=np.array([0, 0]), num_scheduled_tokens=np.array([1, 1]),
          is_new=np.array([True, True])), "req_slots: slot 0 appears in 2 batch rows"),
    (dict(num_computed_tokens=np.array([-1])), r"num_computed_tokens\[0\] = -1 is negative"),
    (dict(num_scheduled_tokens=np.array([1, 2])), "num_scheduled_tokens has 2 entries"),
    (dict(is_new=np.array([False])), r"req_slots\[0\] = 0 holds no request"),
    (dict(free_slots=np.array([1])), r"free_slots\[0\] = 1 does not hold a request"),
    (dict(write_cu=np.array([0, 3])), "write_cu has 2 entries"),
    (dict(write_starts=np.full(G, 2)), r"write_starts\[0\] = 2 leaves a hole"),
    (dict(write_ids=np.arange(G) - 1), "write_ids.*negative"),
    (dict(write_gids=np.arange(G) + 1), rf"write_gids\[{G - 1}\] = {G} is not a group"),
    (dict(replay_start=np.array([5])), "replay_start"),
    (dict(req_slots=np.array([0.0])), "req_slots must be a 1-D integer array"),
    (dict(num_scheduled_tokens=np.array([41])), "num_scheduled_tokens: the step schedules 41 tokens"),
])
def test_step_batch_rejections_name_the_array_and_change_nothing(over, match):
    pipe = ref_pipe()
    kw = dict(req_slots=np.array([0]), num_computed_tokens=np.array([0]), num_scheduled_tokens=np.array([3]),
              is_new=np.array([True]), write_gids=np.arange(G), write_slots=np.zeros(G, np.int64),
              write_starts=np.zeros(G, np.int64), write_cu=np.arange(G + 1), write_ids=np.arange(4, 4 + G))
    with pytest.raises(ValueError, match=match):
        pipe.update(StepBatch(**{**kw, **over}))
    assert not pipe.occupied.any() and not pipe.tables.num_blocks.any() and pipe.last_step_stats.num_h2d_copies == 0
    pipe.update(StepBatch(**kw))  # the good batch goes through afterwards
    m = pipe.build()
    assert m.req_ids is None and m.req_slots.tolist() == [0] and m.num_tokens == 3
    assert [pipe.tables.row(g, 0).tolist() for g in range(G)] == [[4 + g] for g in range(G)]


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
def test_long_decode_trace_fast_path_equals_hand_built_batches(monkeypatch):
    """A decode-heavy trace (8 requests, 60 steps): the id-keyed path (mostly the fast path, with the
    slot map's cached rows) and hand-built StepBatches give the same metadata every step."""
    from dsv4_index.frontend import convert as frontend
    from dsv4_index.testing.scheduler import random_trace
    trace = list(random_trace(LAYOUT, 60, 3, num_blocks=96, max_num_batched_tokens=40, max_num_seqs=4,
                              num_speculative_tokens=1, prompt_len=(1, 30), max_new_tokens=(8, 30),
                              arrival_prob=0.3))
    calls = {"general": 0}
    general = frontend.convert

    def counted(*a, **k):
        calls["general"] += 1
        return general(*a, **k)
    monkeypatch.setattr(frontend, "convert", counted)
    ids, arr, hand = ref_pipe(), ref_pipe(), HandSlots(4)
    for i, (step, _) in enumerate(trace):
        batch = hand.convert(step)
        ids.update(step)
        arr.update(batch)
        a, b = meta_tensors(ids.build()), meta_tensors(arr.build())
        for k in ("req_ids", "req_slots", "idx_mapping"):
            a.pop(k), b.pop(k)
        assert_same(a, b, i)
    assert calls["general"] < len(trace) // 2, calls


def test_duck_typed_requests_are_checked_like_scheduler_output():
    """Objects that only look like RunningRequests get every type check (no construction-time trust)."""
    sm = SlotMap(2)
    commit(sm, StepInput([NewRequest("a", lists(1), 0)], [], {"a": 4}))
    fake = NS(req_id="a", new_block_ids=(0,) + lists()[1:], num_computed_tokens=4, resumed=False)
    with pytest.raises(TypeError, match=r"new_block_ids of 'a' gid 0 must be a list of block ids, got int"):
        batch_from_step(StepInput([], [fake], {"a": 1}), sm, G)
