import dataclasses

import pytest

from dsv4_index.step import NewRequest, RunningRequest, StepInput


def make_step(**over):
    kw = dict(
        new_requests=[NewRequest("a", ([1, 2], [3], [0, 0, 5]), 0)],
        running_requests=[RunningRequest("b", ([], [4], [6]), 300)],
        num_scheduled_tokens={"a": 257, "b": 3},
        finished_req_ids={"c"},
        preempted_req_ids=["d"],
        replay_start={"b": 200},
    )
    kw.update(over)
    return StepInput(**kw)


def test_valid_step():
    s = make_step()
    s.validate_static()
    s.validate_static(num_groups=3)
    assert s.total_tokens == 260 and s.num_reqs == 2
    assert isinstance(s.new_requests[0].block_ids, tuple)
    assert isinstance(RunningRequest("x", [[1], [2]], 0).new_block_ids, tuple)
    assert s.new_requests[0].block_ids[2] == [0, 0, 5]  # null block may repeat


def test_defaults_and_frozen():
    s = StepInput([], [], {})
    s.validate_static()
    assert s.total_tokens == 0 and s.replay_start == {} and len(s.finished_req_ids) == 0
    assert RunningRequest("x", ([],), 0).resumed is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.num_scheduled_tokens = {}


@pytest.mark.parametrize("over,match", [
    (dict(num_scheduled_tokens={"a": -1, "b": 3}), "num_scheduled_tokens"),
    (dict(num_scheduled_tokens={"a": 1.5, "b": 3}), "num_scheduled_tokens"),
    (dict(num_scheduled_tokens={"a": 1}), "'b'"),
    (dict(num_scheduled_tokens={"a": 1, "b": 1, "z": 1}), "'z'"),
    (dict(num_scheduled_tokens=[("a", 1)]), "num_scheduled_tokens"),
    (dict(new_requests=[NewRequest("a", ([1], [3], [5]), -2)]), "num_computed_tokens"),
    (dict(running_requests=[RunningRequest("b", ([], [4], [6]), -1)]), "num_computed_tokens"),
    (dict(finished_req_ids={"a"}), "finished_req_ids"),
    (dict(preempted_req_ids=["b"]), "preempted_req_ids"),
    (dict(running_requests=[RunningRequest("a", ([], [], []), 1)],
          num_scheduled_tokens={"a": 1}), "more than once"),
    (dict(running_requests=[RunningRequest("b", ([], [4]), 300)]), "per-gid"),
    (dict(new_requests=[NewRequest("a", ([1, 2, 1], [3], [5]), 0)]), "twice in gid 0"),
    (dict(running_requests=[RunningRequest("b", ([], [4], [6, 6]), 300)]), "twice in gid 2"),
    (dict(new_requests=[NewRequest("a", ([1, -2], [3], [5]), 0)]), "block id"),
    (dict(replay_start={"zz": 0}), "replay_start"),
    (dict(replay_start={"b": -1}), "replay_start"),
    (dict(replay_start={"b": 301}), "replay_start"),
])
def test_validation_errors(over, match):
    with pytest.raises(ValueError, match=match):
        make_step(**over).validate_static()


def test_num_groups_mismatch():
    with pytest.raises(ValueError, match="expected 4"):
        make_step().validate_static(num_groups=4)


def test_replay_start_unscheduled_request_is_not_checked_against_positions():
    make_step(num_scheduled_tokens={"a": 257, "b": 0}, replay_start={"b": 999}).validate_static()


def test_block_ids_must_be_per_gid_sequence():
    with pytest.raises(ValueError, match="block_ids"):
        NewRequest("a", "oops", 0)
    with pytest.raises(ValueError, match="new_block_ids"):
        RunningRequest("a", 3, 0)


@pytest.mark.parametrize("over", [
    dict(num_scheduled_tokens={"a": -1, "b": 3}), dict(num_scheduled_tokens={"a": 1.5, "b": 3}),
    dict(num_scheduled_tokens={"a": True, "b": 3}), dict(num_scheduled_tokens={"a": 1}),
    dict(num_scheduled_tokens={"a": 1, "b": 1, "z": 1}), dict(num_scheduled_tokens=[("a", 1)]),
    dict(new_requests=[NewRequest("a", ([1], [3], [5]), -2)]),
    dict(new_requests=[NewRequest("a", ([1], [3], [5]), 2.0)]),
    dict(running_requests=[RunningRequest("b", ([], [4], [6]), -1)]),
    dict(finished_req_ids={"a"}), dict(preempted_req_ids=["b"]),
    dict(running_requests=[RunningRequest("a", ([], [], []), 1)], num_scheduled_tokens={"a": 1}),
    dict(running_requests=[RunningRequest("b", ([], [4]), 300)]),
    dict(new_requests=[NewRequest("a", ([1, 2, 1], [3], [5]), 0)]),
    dict(running_requests=[RunningRequest("b", ([], [4], [6, 6]), 300)]),
    dict(new_requests=[NewRequest("a", ([1, -2], [3], [5]), 0)]),
    dict(new_requests=[NewRequest("a", ([1, True], [3], [5]), 0)]),
    dict(replay_start={"zz": 0}), dict(replay_start={"b": -1}), dict(replay_start={"b": 301}),
])
def test_bulk_check_rejects_what_the_slow_check_rejects(over):
    """The bulk form never accepts a step the one-by-one check rejects (it falls back to it)."""
    s = make_step(**over)
    assert s._summary() is None
    with pytest.raises(ValueError):
        s.validate_static()


def test_bulk_check_summary_matches_the_step():
    s = make_step()
    sm = s._summary(3)
    assert sm is not None and s._summary(4) is None
    assert sm.rids == ["a", "b"] and sm.ncs == [0, 300] and sm.width == 3
    assert sm.nz.tolist() == [0, 1]
    assert sm.lens.tolist() == [[2, 1, 3], [0, 1, 1]]
    assert sm.flat.tolist() == [1, 2, 3, 0, 0, 5, 4, 6]


def test_bulk_and_slow_checks_agree_on_random_steps():
    import random
    rng = random.Random(0)
    for _ in range(300):
        reqs = []
        for i in range(rng.randint(0, 4)):
            lists = tuple([rng.choice([0, 1, 2, 3, -1]) for _ in range(rng.randint(0, 3))] for _ in range(2))
            reqs.append((f"r{rng.randint(0, 5)}", lists, rng.choice([0, 5, -1])))
        new = [NewRequest(r, ls, c) for r, ls, c in reqs[:2]]
        run = [RunningRequest(r, ls, c) for r, ls, c in reqs[2:]]
        nst = {r: rng.choice([0, 1, 2]) for r, _, _ in reqs}
        s = StepInput(new, run, nst, finished_req_ids=rng.choice([set(), {"r1"}]),
                      replay_start=rng.choice([{}, {"r0": rng.choice([0, 3, 9])}]))
        try:
            s._validate_static_slow()
            ok = True
        except ValueError:
            ok = False
        sm = s._summary()
        assert ok or sm is None, s
        if sm is None and ok:
            s.validate_static()  # the fallback accepts it
