"""vLLM's V4.1 bounded replay as it arrives: ``NewRequestData.replay_start`` (vLLM 0.33; the scheduler rewinds
a prefix hit's ``num_computed_tokens`` to it) becomes the batch row's replay start, so the sliding window of the
replayed tokens starts there (docs/DESIGN.md §4 "Bounded replay"); older ``NewRequestData`` (no field) and 0 mean
no replay; the caller's ``replay_start`` dict wins; a bad value is refused naming ``replay_start``. Its
``replay_end`` is ``replay_start + W`` (``W`` the swa window, vLLM's ``prefix_replay_tokens``: model runner V2
pads the prefix-cacheable slots of ``[replay_start, replay_start + W)``) unless the caller gives bounds."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dsv4_index import MetadataPipeline, SlotMap, batch_from_scheduler_output

from helpers.layouts import tiny_layout
from helpers.vllm_stub import CachedRequestData, NewRequestData, SchedulerOutput

LAYOUT = tiny_layout()  # NOTE: W 8, swa blocks of 4
G = len(LAYOUT.groups)
W = LAYOUT.groups[[g.role for g in LAYOUT.groups].index("swa")].window
NC, Q = 12, 4


@dataclasses.dataclass
class OldNewRequestData:  # NOTE: vLLM before V4.1: no replay_start field
    req_id: str
    block_ids: tuple
    num_computed_tokens: int


def _lists(upto):
    return tuple([1 + 100 * g + j for j in range(-(-upto // grp.alloc_block_size))]
                 for g, grp in enumerate(LAYOUT.groups))


def _out(replay_start=None, cls=NewRequestData):
    if cls is NewRequestData:
        req = NewRequestData("a", [], [], None, None, _lists(NC + Q), NC, None,
                             **({} if replay_start is None else {"replay_start": replay_start}))
    else:
        req = cls("a", _lists(NC + Q), NC)
    return SchedulerOutput([req], CachedRequestData([], set(), [], {}, [], [], []), {"a": Q}, Q, {}, {}, [],
                           set(), [])


def test_the_objects_replay_start_is_the_rows():
    b, _ = batch_from_scheduler_output(_out(replay_start=NC), SlotMap(4), G)
    assert b.replay_start is not None and b.replay_start.tolist() == [NC]
    assert b.replay_end is None


@pytest.mark.parametrize("kind", ["zero", "old"])
def test_no_replay_without_the_field_or_with_zero(kind):
    out = _out(replay_start=0) if kind == "zero" else _out(cls=OldNewRequestData)
    b, _ = batch_from_scheduler_output(out, SlotMap(4), G)
    assert b.replay_start is None


def test_the_callers_dict_wins():
    b, _ = batch_from_scheduler_output(_out(replay_start=NC), SlotMap(4), G, replay_start={"a": 10})
    assert b.replay_start.tolist() == [10]


@pytest.mark.parametrize("replay_start", [None, NC])
def test_window_of_the_replayed_tokens_starts_at_replay_start(replay_start):
    pipe = MetadataPipeline(LAYOUT, 4, 32, "cpu", backend="reference", fused=False)
    pipe.update(_out(replay_start=replay_start))
    meta = pipe.build()
    pos = np.arange(NC, NC + Q)
    floor = 0 if replay_start is None else replay_start
    want = pos - np.maximum(pos - W + 1, floor) + 1  # NOTE: DESIGN §4, sliding-window indices
    assert meta["swa"].lens[:Q].tolist() == want.tolist()


@pytest.mark.parametrize("bad, err", [(NC + 1, ValueError), (True, TypeError), (1.5, TypeError)])
def test_a_bad_replay_start_is_refused(bad, err):
    sm = SlotMap(4)
    with pytest.raises(err, match=r"replay_start\['a'\]"):
        batch_from_scheduler_output(_out(replay_start=bad), sm, G)
    assert sm.slot_of == {}


def _running(nc, q):
    return SchedulerOutput([], CachedRequestData(["a"], set(), [[]], {}, [None], [nc], [0]), {"a": q}, q, {}, {},
                           [], set(), [])


def test_later_chunks_keep_the_admitted_replay_start():
    """vLLM sends ``replay_start`` only when it admits the request; the request's later chunks (short ones
    here) still have windows reaching below it: the slot map remembers it, applies it while
    ``num_computed_tokens < replay_start + max(replay_reach, W)``, then drops it; a finished request drops it
    too. Every token below ``replay_start + W`` writes no compressed row into the full group (DESIGN §4)."""
    pipe = MetadataPipeline(LAYOUT, 4, 32, "cpu", backend="reference", fused=False)
    reach = max(pipe.slot_map.replay_reach, W)
    assert pipe.slot_map.replay_reach == max(g.window or 1 for g in LAYOUT.groups) - 1
    assert pipe.slot_map.replay_window == W
    R4 = 4  # NOTE: the tiny layout's c4 ratio
    written = {"replayed": 0, "after": 0}
    q = 2
    req = NewRequestData("a", [], [], None, None, _lists(NC + reach + 8 * q), NC, None, replay_start=NC)
    pipe.update(SchedulerOutput([req], CachedRequestData([], set(), [], {}, [], [], []), {"a": q}, q, {}, {}, [],
                                set(), []))
    assert pipe.slot_map.replay == {"a": NC}
    nc, seen_drop = NC + q, False
    while nc < NC + reach + 4 * q:
        pipe.update(_running(nc, q))
        meta = pipe.build()
        pos = np.arange(nc, nc + q)
        floor = NC if nc < NC + reach else 0
        want = pos - np.maximum(pos - W + 1, floor) + 1
        assert meta["swa"].lens[:q].tolist() == want.tolist(), nc
        sm = meta["c4a"].compressed_slot_mapping[:q].tolist()
        for p, s in zip(pos.tolist(), sm):
            completes = (p + 1) % R4 == 0
            assert (s >= 0) == (completes and p >= NC + W), (p, s)  # NOTE: replayed rows are never rewritten
            written["replayed" if p < NC + W else "after"] += completes
        assert ("a" in pipe.slot_map.replay) == (nc < NC + reach), nc
        seen_drop |= "a" not in pipe.slot_map.replay
        nc += q
    assert seen_drop
    assert written["replayed"] >= 2 and written["after"] >= 2  # NOTE: both sides of replay_end were exercised
    # a finished request forgets it
    pipe2 = MetadataPipeline(LAYOUT, 4, 32, "cpu", backend="reference", fused=False)
    pipe2.update(SchedulerOutput([req], CachedRequestData([], set(), [], {}, [], [], []), {"a": q}, q, {}, {}, [],
                                 set(), []))
    pipe2.update(SchedulerOutput([], CachedRequestData([], set(), [], {}, [], [], []), {}, 0, {}, {}, [], {"a"}, []))
    assert pipe2.slot_map.replay == {}


def test_a_rejected_step_remembers_nothing():
    sm = SlotMap(4, replay_reach=W - 1)
    with pytest.raises(ValueError):
        batch_from_scheduler_output(_out(replay_start=NC + 1), sm, G)
    assert sm.replay == {}


def test_replay_end_is_replay_start_plus_w_unless_the_caller_gives_bounds():
    sm = SlotMap(4, replay_reach=15, replay_window=W)
    b, _ = batch_from_scheduler_output(_out(replay_start=NC), sm, G)
    assert b.replay_start.tolist() == [NC] and b.replay_end.tolist() == [NC + W]
    b, _ = batch_from_scheduler_output(_out(replay_start=NC), sm, G, replay_end={"a": NC + 1})
    assert b.replay_end.tolist() == [NC + 1]
    b, _ = batch_from_scheduler_output(_out(replay_start=NC), sm, G, replay_start={"a": 10})
    assert b.replay_start.tolist() == [10] and b.replay_end is None  # NOTE: the caller's start: its own bounds
    b, _ = batch_from_scheduler_output(_out(replay_start=0), sm, G)
    assert b.replay_start is None and b.replay_end is None
    b, _ = batch_from_scheduler_output(_out(replay_start=NC), SlotMap(4), G)  # NOTE: no swa window: no end
    assert b.replay_end is None
