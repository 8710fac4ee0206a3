import dataclasses

import numpy as np
import pytest

from dsv4_index.frontend import NewRequest, RunningRequest, StepInput


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
    (dict(new_requests=[NewRequest("a", ([1, 2**31], [3], [5]), 0)]),
     r"block_ids of 'a' gid 0 .* at block_ids\[0\]\[1\]"),
    (dict(running_requests=[RunningRequest("b", ([], [4], [10**30]), 300)]), r"new_block_ids\[2\]\[0\]"),
    (dict(num_scheduled_tokens={"a": 2**62, "b": 3}), r"num_scheduled_tokens\['a'\] must be an int >= 0 and <= "),
    (dict(running_requests=[RunningRequest("b", ([], [4], [6]), 2**63 - 1)]), "num_computed_tokens of 'b'"),
    (dict(replay_end={"b": 2**31}), r"replay_end\['b'\]"),
    (dict(new_requests=[NewRequest("a", ([1, -2], [3], [5]), 0)]), "block id"),
    (dict(replay_start={"zz": 0}), "replay_start"),
    (dict(replay_start={"b": -1}), "replay_start"),
    (dict(replay_start={"b": 301}), "replay_start"),
    # NOTE: bools and floats are not ints
    (dict(num_scheduled_tokens={"a": True, "b": 3}), "num_scheduled_tokens"),
    (dict(new_requests=[NewRequest("a", ([1], [3], [5]), 2.0)]), "num_computed_tokens"),
    (dict(new_requests=[NewRequest("a", ([1, True], [3], [5]), 0)]), "block id"),
    (dict(running_requests=[RunningRequest("b", ([], [np.int64(4)], [6]), 300)]), r"bad block id np.int64\(4\)"),
    (dict(num_scheduled_tokens={"a": np.int64(3), "b": 3}), r"num_scheduled_tokens\['a'\].*int64"),
    (dict(replay_end={"zz": 4}), "replay_end"),
    (dict(replay_end={"b": -1}), "replay_end"),
    (dict(finished_req_ids="ab"), "finished_req_ids.*bare string"),
    (dict(preempted_req_ids="d"), "preempted_req_ids.*bare string"),
])
def test_validation_errors(over, match):
    with pytest.raises(ValueError, match=match):
        make_step(**over).validate_static()


def test_duplicate_block_ids_are_a_full_check_not_a_step_rule():
    # NOTE: DESIGN §5: duplicates are the pipeline's checks="full" contract check (full groups)
    make_step(new_requests=[NewRequest("a", ([1, 2, 1], [3], [5]), 0)]).validate_static()


def test_validate_static_runs_the_converters_rules():
    """The same message as the converter for a stateless error (one checker)."""
    from dsv4_index import SlotMap, batch_from_step
    bad = make_step(num_scheduled_tokens={"a": 10**30, "b": 3})
    with pytest.raises(ValueError) as e1:
        bad.validate_static(3)
    with pytest.raises(ValueError) as e2:
        batch_from_step(bad, SlotMap(4), 3)
    assert str(e1.value) == str(e2.value)


def test_none_new_block_ids_is_no_new_block():
    make_step(running_requests=[RunningRequest("b", None, 300)]).validate_static(3)


def test_num_groups_mismatch():
    with pytest.raises(ValueError, match="expected 4"):
        make_step().validate_static(num_groups=4)


def test_replay_end_is_optional_and_kept():
    s = make_step(replay_end={"b": 320})
    s.validate_static(num_groups=3)
    assert s.replay_end == {"b": 320} and make_step().replay_end == {}


def test_replay_start_unscheduled_request_is_not_checked_against_positions():
    make_step(num_scheduled_tokens={"a": 257, "b": 0}, replay_start={"b": 999}).validate_static()


def test_block_ids_must_be_per_gid_sequence():
    with pytest.raises(ValueError, match="block_ids"):
        NewRequest("a", "oops", 0)
    with pytest.raises(ValueError, match="new_block_ids"):
        RunningRequest("a", 3, 0)
