"""A vLLM ``SchedulerOutput`` in, a StepBatch out (issue 20 item 4): the field names of vLLM's HEAD
(``helpers/vllm_stub.py``), ``new_block_ids=None`` on the fast path, malformed outputs named, unknown ids a
no-op, the pipeline's array-level errors named as requests, and the README's vLLM section as written.

Pipelines here run the PyTorch reference (the subject is the host path).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

from dsv4_index import MetadataPipeline, NewRequest, RunningRequest, SlotMap, StepInput, batch_from_scheduler_output
from dsv4_index.frontend import convert as frontend
from dsv4_index.frontend import batch_from_step

from helpers.layouts import tiny_layout
from helpers.pipelines import assert_same, eventful_trace, meta_tensors
from helpers.vllm_stub import CachedRequestData, NewRequestData, SchedulerOutput, from_step

LAYOUT = tiny_layout()
G = len(LAYOUT.groups)


def pipe():
    return MetadataPipeline(LAYOUT, 4, 40, "cpu", 2, backend="reference")


def empty_lists():
    return tuple([] for _ in range(G))


def state(sm: SlotMap):
    return dict(sm.slot_of), set(sm.preempted), sm.free_slots, sm.last_order


def _running(sm, rid="a", nc=40, new=None, q=1):
    c = CachedRequestData([rid], set(), [[]], {}, [new], [nc], [1])
    return SchedulerOutput([], c, {rid: q}, q, {}, {}, [], set(), [])


def _admitted():
    """A pipeline and its slot map holding request "a" (40 tokens)."""
    p, sm = pipe(), SlotMap(4)
    lists = tuple([1 + 10 * g + i for i in range(-(-41 // grp.alloc_block_size))]
                  for g, grp in enumerate(LAYOUT.groups))
    out = SchedulerOutput([NewRequestData("a", [], [], None, None, lists, 0, None)],
                          CachedRequestData([], set(), [], {}, [], [], []), {"a": 40}, 40, {}, {}, [], set(), [])
    b, d = batch_from_scheduler_output(out, sm, G)
    p.update(b)
    sm.commit(d)
    return p, sm


# ----------------------------------------------------------------------------------------------
# a trace through both front ends: the same metadata
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("old", [False, True])
def test_scheduler_output_trace_equals_step_input(old, monkeypatch):
    trace = eventful_trace(LAYOUT, 14, need=("preempted", "resumed", "replay", "finished", "spec"), seeds=range(200))
    calls = {"fast": 0, "general": 0}
    general = frontend.convert

    def count(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped
    by_step, by_out, sm = pipe(), pipe(), SlotMap(4)
    for i, (step, _) in enumerate(trace):
        out = from_step(step, old=old)
        with monkeypatch.context() as m:
            m.setattr(frontend, "convert", count("general", general))
            batch, delta = batch_from_scheduler_output(out, sm, G, replay_start=dict(step.replay_start),
                                                       replay_end=dict(step.replay_end))
        pad = step.total_tokens + i % 3
        by_step.update(step, pad_to=pad)
        by_out.update(batch, pad_to=pad)
        sm.commit(delta)
        assert sm.slot_of == by_step.slot_map.slot_of and sm.preempted == by_step.slot_map.preempted, i
        a, b = meta_tensors(by_step.build()), meta_tensors(by_out.build())
        a.pop("req_ids"), b.pop("req_ids")
        assert_same(a, b, i)
    # NOTE: steps without resumed requests or replay bounds take the fast path
    easy = sum(bool(step.num_scheduled_tokens) and not step.replay_start and not step.replay_end
               and not any(r.resumed for r in step.running_requests) for step, _ in trace)
    assert 0 < calls["general"] <= len(trace) - easy and easy >= 4


def test_none_new_block_ids_take_the_fast_path(monkeypatch):
    p, sm = _admitted()

    def no_general(*a, **k):
        raise AssertionError("the general path ran")
    monkeypatch.setattr(frontend, "convert", no_general)
    b, d = batch_from_scheduler_output(_running(sm), sm, G)
    assert b.num_runs == 0 and b.req_slots.tolist() == [0] and b.num_computed_tokens.tolist() == [40]
    b2, d2 = batch_from_step(StepInput([], [RunningRequest("a", None, 40)], {"a": 1}), sm, G)
    assert b2.num_runs == 0 and d2.order == d.order == ["a"]
    p.update(b)
    assert p.build().num_tokens == 1


def test_running_request_with_none_through_the_pipeline():
    p = pipe()
    lists = tuple([1 + 10 * g] for g in range(G))
    p.update(StepInput([NewRequest("a", lists, 0)], [], {"a": 3}))
    p.update(StepInput([], [RunningRequest("a", None, 3)], {"a": 1}))
    m = p.build()
    assert m.req_ids == ["a"] and m.num_tokens == 1


# ----------------------------------------------------------------------------------------------
# malformed outputs: a ValueError / TypeError naming the field and request; nothing changes
# ----------------------------------------------------------------------------------------------
def _drop(obj, name):
    d = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.name != name}
    return type("Partial", (), d)()


MALFORMED = {
    "no scheduled_cached_reqs": (lambda o: _drop(o, "scheduled_cached_reqs"), TypeError,
                                 r"SchedulerOutput has no field 'scheduled_cached_reqs'"),
    "no num_scheduled_tokens": (lambda o: _drop(o, "num_scheduled_tokens"), TypeError,
                                r"has no field 'num_scheduled_tokens'"),
    "no finished_req_ids": (lambda o: _drop(o, "finished_req_ids"), TypeError, r"has no field 'finished_req_ids'"),
    "no req_ids": (lambda o: dataclasses.replace(o, scheduled_cached_reqs=_drop(o.scheduled_cached_reqs, "req_ids")),
                   TypeError, r"scheduled_cached_reqs has no field 'req_ids'"),
    "no new_block_ids": (lambda o: dataclasses.replace(
        o, scheduled_cached_reqs=_drop(o.scheduled_cached_reqs, "new_block_ids")), TypeError,
        r"scheduled_cached_reqs has no field 'new_block_ids'"),
    "no resumed field": (lambda o: dataclasses.replace(
        o, scheduled_cached_reqs=_drop(o.scheduled_cached_reqs, "resumed_req_ids")), TypeError,
        r"neither 'resumed_req_ids' nor 'resumed_from_preemption'"),
    "new request without block_ids": (lambda o: dataclasses.replace(
        o, scheduled_new_reqs=[_drop(o.scheduled_new_reqs[0], "block_ids")]), TypeError,
        r"scheduled_new_reqs\[0\] has no field 'block_ids'"),
    "short new_block_ids": (lambda o: _cached(o, new_block_ids=[None]), ValueError,
                            r"scheduled_cached_reqs.new_block_ids has 1 entries, scheduled_cached_reqs.req_ids has 2"),
    "long num_computed_tokens": (lambda o: _cached(o, num_computed_tokens=[40, 40, 7]), ValueError,
                                 r"num_computed_tokens has 3 entries"),
    "bare string resumed": (lambda o: _cached(o, resumed_req_ids="ab"), TypeError,
                            r"resumed_req_ids must be a set or list of request ids, got the bare string 'ab'"),
    "bare string finished": (lambda o: dataclasses.replace(o, finished_req_ids="a"), TypeError,
                             r"finished_req_ids must be a set or list of request ids, got the bare string"),
    "bare string preempted": (lambda o: dataclasses.replace(o, preempted_req_ids="b"), TypeError,
                              r"preempted_req_ids must be a set or list.*bare string"),
    "req_ids a string": (lambda o: _cached(o, req_ids="ab"), TypeError, r"req_ids must be a list of request ids"),
    "new_block_ids a dict": (lambda o: _cached(o, new_block_ids={"a": None, "b": None}), TypeError,
                             r"new_block_ids must be a list \(one entry per request\), got dict"),
    "num_scheduled_tokens a list": (lambda o: dataclasses.replace(o, num_scheduled_tokens=[("a", 1), ("b", 1)]),
                                    TypeError, r"num_scheduled_tokens must be a dict"),
    "scheduled_new_reqs a dict": (lambda o: dataclasses.replace(o, scheduled_new_reqs={"n": 1}), TypeError,
                                  r"scheduled_new_reqs must be a list"),
    "block lists a string": (lambda o: _cached(o, new_block_ids=["abc", None]), TypeError,
                             r"scheduled_cached_reqs: new_block_ids of 'a' must be a tuple with one list per gid"),
    "a group's list an int": (lambda o: _cached(o, new_block_ids=[(5,) + empty_lists()[1:], None]), TypeError,
                              r"new_block_ids of 'a' gid 0 must be a list of block ids, got int"),
    "a falsy group entry": (lambda o: _cached(o, new_block_ids=[(0,) + empty_lists()[1:], None]), TypeError,
                            r"new_block_ids of 'a' gid 0 must be a list of block ids, got int"),
    "flags not bools": (lambda o: dataclasses.replace(o, scheduled_cached_reqs=_old(o, [1, 0])), TypeError,
                        r"resumed_from_preemption must hold bools, got 1"),
    "short flags": (lambda o: dataclasses.replace(o, scheduled_cached_reqs=_old(o, [False])), ValueError,
                    r"resumed_from_preemption has 1 entries"),
    "wrong group count": (lambda o: _cached(o, new_block_ids=[([1],), None]), ValueError,
                          rf"new_block_ids of 'a' has 1 per-gid block lists, expected {G}"),
    "unknown cached id": (lambda o: dataclasses.replace(_cached(o, req_ids=["a", "zz"]),
                                                        num_scheduled_tokens={"n": 3, "a": 1, "zz": 1}), ValueError,
                          r"scheduled_cached_reqs: request 'zz' is not in the batch"),
    "resumed not listed": (lambda o: _cached(o, resumed_req_ids={"zz"}), ValueError,
                           r"resumed_req_ids lists 'zz', which is not in scheduled_cached_reqs.req_ids"),
}


def _cached(o, **kw):
    return dataclasses.replace(o, scheduled_cached_reqs=dataclasses.replace(o.scheduled_cached_reqs, **kw))


def _old(o, flags):
    from helpers.vllm_stub import OldCachedRequestData
    c = o.scheduled_cached_reqs
    return OldCachedRequestData(c.req_ids, flags, c.new_token_ids, c.new_block_ids, c.num_computed_tokens)


def _base_output():
    """Slot map holding "a" and "b"; a valid output schedules both and a new request "n"."""
    sm = SlotMap(4)
    first = SchedulerOutput([NewRequestData(r, [], [], None, None, tuple([i + 1] for _ in range(G)), 0, None)
                             for i, r in enumerate("ab")], CachedRequestData([], set(), [], {}, [], [], []),
                            {"a": 4, "b": 4}, 8, {}, {}, [], set(), [])
    sm.commit(batch_from_scheduler_output(first, sm, G)[1])
    cached = CachedRequestData(["a", "b"], set(), [[], []], {}, [None, None], [4, 4], [1, 1])
    out = SchedulerOutput([NewRequestData("n", [], [], None, None, tuple([9] for _ in range(G)), 0, None)], cached,
                          {"n": 3, "a": 1, "b": 1}, 5, {}, {}, [], set(), [], set())
    return sm, out


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_output_names_the_field(name):
    make, exc, match = MALFORMED[name]
    sm, out = _base_output()
    batch_from_scheduler_output(out, sm, G)  # the base output is valid
    before = state(sm)
    with pytest.raises(exc, match=match) as e:
        batch_from_scheduler_output(make(out), sm, G)
    assert isinstance(e.value, ValueError)  # NOTE: type errors are ValueErrors too: a pipeline rejects them
    assert state(sm) == before


def test_unknown_finished_or_preempted_id_is_a_no_op():
    sm, out = _base_output()
    before = state(sm)
    b, d = batch_from_scheduler_output(dataclasses.replace(out, finished_req_ids={"never-seen"},
                                                           preempted_req_ids={"also-never"}), sm, G)
    want, _ = batch_from_scheduler_output(out, copy.deepcopy(sm), G)
    assert b.free_slots.tolist() == [] and d.freed == [] and d.preempted == [] and d.forgotten == []
    for k in want.__dataclass_fields__:
        x, y = getattr(b, k), getattr(want, k)
        assert (x is None and y is None) or np.array_equal(x, y), k
    assert state(sm) == before


# ----------------------------------------------------------------------------------------------
# the pipeline's array-level errors, named as the scheduler's requests and fields
# ----------------------------------------------------------------------------------------------
def test_pipeline_errors_name_the_request_and_field():
    p, sm = _admitted()
    g = 0
    big = 2**31 - 1  # NOTE: the converter lets it through; its slots do not fit int32 in any group
    nb = tuple([big] if k == g else [] for k in range(G))
    b, d = batch_from_scheduler_output(_running(sm, nc=40, new=nb), sm, G)
    with pytest.raises(ValueError) as e:
        p.update(b)
    msg = str(frontend.explain(e.value, b, d, "scheduler_output"))
    assert re.search(rf"write_ids\[0\] = {big} in gid {g} .*\[write_ids\[0\] = "
                     rf"scheduled_cached_reqs\['a'\]\.new_block_ids\[{g}\]\[0\]\]$", msg), msg
    # a coverage error names the request instead of its slot
    b, d = batch_from_scheduler_output(_running(sm, nc=40, q=300), sm, G)
    p2 = MetadataPipeline(LAYOUT, 4, 400, "cpu", 2, backend="reference")
    p2.update(batch_from_scheduler_output(_admitted_output(), SlotMap(4), G)[0])
    with pytest.raises(ValueError) as e:
        p2.update(b)
    msg = str(frontend.explain(e.value, b, d, "scheduler_output"))
    assert msg.startswith(str(e.value)) and msg.endswith("[slot 0 = request 'a']"), msg
    # a step form names its own fields
    step = StepInput([], [RunningRequest("a", nb, 40)], {"a": 1})
    b, d = batch_from_step(step, sm, G)
    with pytest.raises(ValueError) as e:
        p.update(b)
    assert f"running_requests['a'].new_block_ids[{g}][0]" in str(frontend.explain(e.value, b, d, "step"))


def _admitted_output():
    lists = tuple([1 + 10 * g + i for i in range(-(-41 // grp.alloc_block_size))]
                  for g, grp in enumerate(LAYOUT.groups))
    return SchedulerOutput([NewRequestData("a", [], [], None, None, lists, 0, None)],
                           CachedRequestData([], set(), [], {}, [], [], []), {"a": 40}, 40, {}, {}, [], set(), [])


# ----------------------------------------------------------------------------------------------
# README "## vLLM integration" runs as written
# ----------------------------------------------------------------------------------------------
def readme_block() -> str:
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = text.split("\n## vLLM integration", 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_vllm_section_runs():
    code = readme_block()
    assert code.count("pipe.update(out)") == 2
    ns = {}
    exec(compile(code, "README.md", "exec"), ns)
    assert ns["meta"].req_ids is not None  # the pipeline owns the slot map on this path
    assert ns["meta"].num_tokens == 1


def test_pipeline_update_names_the_request_of_an_array_level_error():
    p2 = MetadataPipeline(LAYOUT, 4, 40, "cpu", 2, backend="reference")
    p2.update(StepInput([NewRequest("a", _admitted_output().scheduled_new_reqs[0].block_ids, 0)], [], {"a": 40}))
    nb = tuple([2**31 - 1] if k == 0 else [] for k in range(G))
    with pytest.raises(ValueError, match=r"\[write_ids\[0\] = running_requests\['a'\]\.new_block_ids\[0\]\[0\]\]"):
        p2.update(StepInput([], [RunningRequest("a", nb, 40)], {"a": 1}))
