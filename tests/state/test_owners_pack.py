"""``state/owners/pack.py`` (``pack_step``: the step's arrays for the ownership passes in one compiled call)
against the numpy construction it replaced, written here as the definition (``naive.default_drafts`` for the
draft counts): on random plans, the buffer poisoned first, every entry equal; and the range checks refuse an
array whose length is not its count or a run whose group is out of range, reading nothing out of range."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_index.state.owners.naive import default_drafts
from dsv4_index.state.owners.pack import BAD_GROUP, BAD_LENGTH, OK, pack_size, pack_step

_NONE = np.zeros(0, dtype=np.int64)
POISON = -(2**62)


def _definition(plan, f, next_n):
    """``(P, R, raw0, A, FN, largest id)`` as ``BlockOwners.check`` built them with numpy before ``pack.py``."""
    B = plan.slots.shape[0]
    P = np.zeros((7, B), dtype=np.int64)
    P[0], P[1], P[2] = plan.slots, plan.seq_lens, plan.num_scheduled
    if plan.replay_start is not None:
        P[3] = plan.replay_start
    if plan.replay_end is not None:
        P[4], P[6] = plan.replay_end, 1
    P[5] = default_drafts(plan, next_n)
    R = np.stack([plan.w_gid, plan.w_slot, plan.w_start, plan.w_end, plan.w_keep, plan.w_cu[:-1]]).astype(np.int64)
    raw0 = np.zeros(R.shape[1] + 1, dtype=np.int64)
    np.cumsum((plan.w_cu[1:] - plan.w_cu[:-1]) // f[plan.w_gid], out=raw0[1:])
    A = np.stack([plan.all_slots, plan.all_computed]).astype(np.int64).reshape(2, -1)
    FN = np.concatenate([plan.free_slots, plan.new_slots]).astype(np.int64).reshape(1, -1)
    return P, R, raw0, A, FN, int(plan.w_ids.max(initial=0))


def _ints(draw, n, lo=0, hi=1000):
    return np.asarray(draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n)), dtype=np.int64)


@st.composite
def plans(draw):
    G = draw(st.integers(1, 4))
    f = _ints(draw, G, 1, 4)
    B, N, n = draw(st.integers(0, 6)), draw(st.integers(0, 6)), draw(st.integers(0, 6))
    q = _ints(draw, B, 1, 9)
    gid = _ints(draw, N, 0, G - 1)
    lens = _ints(draw, N, 0, 3) * f[gid]  # NOTE: a run's ids: whole blocks of its group's f
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    opt = draw(st.tuples(st.booleans(), st.booleans(), st.booleans()))
    plan = SimpleNamespace(
        slots=_ints(draw, B), seq_lens=_ints(draw, B), num_scheduled=q,
        replay_start=_ints(draw, B) if opt[0] else None, replay_end=_ints(draw, B) if opt[1] else None,
        drafts=_ints(draw, B, -1, 5) if opt[2] else None,
        w_gid=gid, w_slot=_ints(draw, N), w_start=_ints(draw, N), w_end=_ints(draw, N),
        w_keep=_ints(draw, N), w_cu=cu, w_ids=_ints(draw, int(cu[-1]), 0, 2**28),
        all_slots=_ints(draw, n), all_computed=_ints(draw, n),
        free_slots=_ints(draw, draw(st.integers(0, 4))), new_slots=_ints(draw, draw(st.integers(0, 4))))
    return plan, f, draw(st.integers(1, 8))


def _pack(plan, f, next_n, buf):
    opts = np.array([plan.replay_start is not None, plan.replay_end is not None, plan.drafts is not None, next_n],
                    dtype=np.int64)
    arrays = [plan.slots, plan.seq_lens, plan.num_scheduled] + [_NONE if x is None else x for x in
                                                                 (plan.replay_start, plan.replay_end, plan.drafts)]
    return pack_step(*arrays, opts, plan.w_gid, plan.w_slot, plan.w_start, plan.w_end, plan.w_keep, plan.w_cu,
                     plan.w_ids, f, plan.all_slots, plan.all_computed, plan.free_slots, plan.new_slots, buf)


@settings(max_examples=300, deadline=None)
@given(plans())
def test_pack_step_equals_the_numpy_definition(case):
    plan, f, next_n = case
    B, N, n = plan.slots.shape[0], plan.w_gid.shape[0], plan.all_slots.shape[0]
    F = plan.free_slots.shape[0] + plan.new_slots.shape[0]
    size = pack_size(B, N, n, F)
    buf = np.full(size + 3, POISON, dtype=np.int64)
    code, top = _pack(plan, f, next_n, buf)
    assert code == OK
    P, R, raw0, A, FN, want_top = _definition(plan, f, next_n)
    want = np.concatenate([P.ravel(), R.ravel(), raw0, A.ravel(), FN.ravel()])
    assert want.shape[0] == size
    np.testing.assert_array_equal(buf[:size], want)
    assert (buf[size:] == POISON).all()  # NOTE: nothing written past what pack_size says
    assert top == want_top


def _one():
    z = np.zeros(2, dtype=np.int64)
    plan = SimpleNamespace(slots=z, seq_lens=z, num_scheduled=z + 1, replay_start=None, replay_end=None,
                           drafts=None, w_gid=np.array([0], dtype=np.int64), w_slot=z[:1], w_start=z[:1],
                           w_end=z[:1], w_keep=z[:1], w_cu=np.array([0, 1], dtype=np.int64),
                           w_ids=np.array([7], dtype=np.int64), all_slots=z, all_computed=z, free_slots=_NONE,
                           new_slots=_NONE)
    return plan, np.ones(1, dtype=np.int64)


@pytest.mark.parametrize("field,value,code", [
    ("seq_lens", np.zeros(3, dtype=np.int64), BAD_LENGTH),
    ("w_cu", np.array([0], dtype=np.int64), BAD_LENGTH),
    ("w_slot", _NONE, BAD_LENGTH),
    ("all_computed", np.zeros(1, dtype=np.int64), BAD_LENGTH),
    ("w_gid", np.array([1], dtype=np.int64), BAD_GROUP),
    ("w_gid", np.array([-1], dtype=np.int64), BAD_GROUP),
])
def test_pack_step_refuses_inconsistent_plans(field, value, code):
    plan, f = _one()
    setattr(plan, field, value)
    buf = np.zeros(64, dtype=np.int64)
    assert _pack(plan, f, 2, buf)[0] == code


def test_pack_step_refuses_a_short_buffer():
    plan, f = _one()
    assert _pack(plan, f, 2, np.zeros(pack_size(2, 1, 2, 0) - 1, dtype=np.int64))[0] == BAD_LENGTH
