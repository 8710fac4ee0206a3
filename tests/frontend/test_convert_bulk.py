"""The repeat conversion (``frontend.fast.convert_repeat``) accepts only what the row-by-row conversion
(``frontend.convert.convert``) accepts, and gives the same StepBatch (values and dtypes), with and without
the slot map's cached rows."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_index.frontend.convert import convert as _convert
from dsv4_index.frontend.fast import convert_repeat as _fast
from dsv4_index.frontend.rules import SCHED
from dsv4_index.state.requests import SlotMap, SlotMapDelta

G = 3
BIG = st.sampled_from([2**31 - 1, 2**31, 2**62, 2**63 - 1, 2**63, 10**30, -(2**63), -1])
ODD = st.sampled_from([True, False, 1.5, 2.0, np.int64(3), None, "4"])


def _running(rids, lists, ncs):
    """Running rows ``(req_id, block lists, num_computed_tokens, resumed=False)``."""
    return [(rid, x, nc, False) for rid, x, nc in zip(rids, lists, ncs, strict=True)]


def strategies(bad: bool, n_held: int = 10):
    """Valid steps (``bad`` False), or steps where any value may be out of the rules."""
    value = st.one_of(st.integers(0, 100), BIG, ODD) if bad else st.integers(0, 100)
    ids_list = st.lists(st.one_of(st.integers(0, 50), BIG, ODD) if bad else st.integers(0, 50), max_size=3)
    entry = st.one_of(ids_list, ids_list.map(tuple), st.sampled_from(["", "12", 0, None, ()])) if bad else ids_list
    lists_of = st.one_of(st.tuples(ids_list, ids_list, ids_list), st.just(None), st.tuples(ids_list, ids_list),
                         st.lists(ids_list, min_size=3, max_size=3), st.tuples(entry, entry, entry),
                         st.just(()), st.just("abc")) if bad else \
        st.one_of(st.tuples(ids_list, ids_list, ids_list), st.just(None))
    rid = st.sampled_from([f"r{i}" for i in range(10 if bad or not n_held else n_held)] + (["zz", 7] if bad else []))
    new_rid = st.sampled_from(["n0", "n1", "n2"] + ([5, "r0"] if bad else []))
    request = st.tuples(rid, lists_of, value, value)
    new_request = st.tuples(new_rid, st.one_of(st.tuples(ids_list, ids_list, ids_list),
                                               *([st.tuples(ids_list), st.just("ab")] if bad else [])), value)
    return request, new_request


def _slot_map(n, cached):
    sm = SlotMap(16)
    d = SlotMapDelta(taken={f"r{i}": 15 - i for i in range(n)})
    if cached:
        d.order = [f"r{i}" for i in range(n)]
        d.slots = np.arange(15, 15 - n, -1, dtype=np.int64)
    sm.commit(d)
    return sm


def _equal(a, b):
    for k in a.__dataclass_fields__:
        x, y = getattr(a, k), getattr(b, k)
        if x is None or y is None:
            assert x is None and y is None, k
        else:
            assert x.dtype == y.dtype and np.array_equal(x, y), k


def _trusted(lists) -> bool:
    """What a RunningRequest guarantees at construction."""
    return lists is None or (type(lists) is tuple and all(type(x) in (list, tuple) for x in lists))


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
@settings(max_examples=300, deadline=None)
@given(data=st.data(), bad=st.booleans(), extra=st.booleans(), n_held=st.integers(0, 10), cached=st.booleans(),
       trusted=st.booleans())
def test_fast_equals_general(data, bad, extra, n_held, cached, trusted):
    request, _ = strategies(bad, n_held)
    reqs = data.draw(st.lists(request, min_size=1, max_size=6, unique_by=lambda r: r[0]) if not bad else
                     st.lists(request, min_size=1, max_size=6))
    extra = extra and bad
    sm = _slot_map(n_held, cached)
    rids = [r[0] for r in reqs]
    nst = {r[0]: r[3] for r in reqs}
    if extra:
        nst["extra"] = 1
    lists = [r[1] for r in reqs]
    ncs = [r[2] for r in reqs]
    trusted = trusted and all(map(_trusted, lists))
    try:
        slow = _convert(sm, G, SCHED, [], _running(rids, lists, ncs), dict(nst),
                        (), (), {}, {})
    except ValueError:  # NOTE: StepTypeError is a ValueError too
        slow = None
    fast = _fast(sm, G, [], rids, lists, ncs, dict(nst), (), (), trusted)
    if slow is None:
        assert fast is None
    elif fast is not None:
        _equal(fast[0], slow[0])
        assert fast[1] == slow[1] and not slow[1].taken and not slow[1].freed
        assert np.array_equal(fast[1].slots, slow[1].slots)


@pytest.mark.parametrize("cached", [False, True])
def test_fast_takes_the_common_step(cached):
    sm = _slot_map(3, cached)
    rids = ["r0", "r1", "r2"]
    out = _fast(sm, G, [], rids, [([5], [], []), None, ([], [6, 7], [])], [10, 20, 30], {"r0": 1, "r1": 2, "r2": 1},
                (), (), False)
    assert out is not None
    b, d = out
    assert b.req_slots.tolist() == [15, 14, 13] and b.write_gids.tolist() == [0, 1] and d.order == rids
    assert b.write_slots.tolist() == [15, 13] and b.write_ids.tolist() == [5, 6, 7] and b.write_cu.tolist() == [0, 1, 3]
    assert (b.req_slots is sm.last_slots) == cached


ids_set = st.lists(st.sampled_from([f"r{i}" for i in range(10)] + ["n0", "never"]), max_size=3)


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
@settings(max_examples=300, deadline=None)
@given(data=st.data(), bad=st.booleans(), finished=ids_set, preempted=ids_set, n_held=st.integers(0, 14),
       cached=st.booleans(), trusted=st.booleans())
def test_fast_with_new_finished_preempted_equals_general(data, bad, finished, preempted, n_held, cached, trusted):
    request, new_request = strategies(bad, n_held)
    unique = (lambda r: r[0]) if not bad else None
    reqs = data.draw(st.lists(request, max_size=5, unique_by=unique) if unique else st.lists(request, max_size=5))
    new = data.draw(st.lists(new_request, max_size=3, unique_by=unique) if unique else
                    st.lists(new_request, max_size=3))
    sm = _slot_map(n_held, cached)
    sm.preempted = {"r9"} if n_held < 9 else set()
    nst = {r[0]: r[3] for r in reqs}
    nst.update({r[0]: 1 for r in new})
    rids, lists, ncs = [r[0] for r in reqs], [r[1] for r in reqs], [r[2] for r in reqs]
    trusted = trusted and all(map(_trusted, lists)) and all(_trusted(r[1]) for r in new)
    try:
        slow = _convert(sm, G, SCHED, list(new), _running(rids, lists, ncs),
                        dict(nst), finished, preempted, {}, {})
    except ValueError:
        slow = None
    try:
        fast = _fast(sm, G, list(new), rids, lists, ncs, dict(nst), finished, preempted, trusted)
    except ValueError:  # NOTE: only the id-set type errors, which the general path raises first too
        assert slow is None
        return
    if slow is None:
        assert fast is None
    elif fast is not None:
        _equal(fast[0], slow[0])
        assert fast[1] == slow[1]
        assert np.array_equal(fast[1].slots, slow[1].slots)


class _CountingDict(dict):
    """A slot map's ``slot_of`` that counts per-request lookups (the cached rows need none)."""

    gets = 0

    def get(self, *a):
        _CountingDict.gets += 1
        return super().get(*a)


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
@settings(max_examples=200, deadline=None)
@given(data=st.data(), n_held=st.integers(1, 10), bad=st.booleans(), running_first=st.booleans())
def test_last_rows_less_finished_equals_general(data, n_held, bad, running_first):
    """The first step after a change: the last batch's rows less finished / preempted ones (the
    cached slots, less theirs), plus new requests, ``num_scheduled_tokens`` new-first or (vLLM)
    running-first; sometimes a row dropped or swapped (then the per-request lookups)."""
    sm = _slot_map(n_held, True)
    sm.slot_of = _CountingDict(sm.slot_of)
    order = [f"r{i}" for i in range(n_held)]
    away = data.draw(st.lists(st.sampled_from(order), unique=True, max_size=min(3, n_held)))
    fin = [r for r in away if data.draw(st.booleans())]
    pre = [r for r in away if r not in fin]
    ids = [r for r in order if r not in away]
    perturbed = bool(ids) and data.draw(st.booleans())
    if perturbed:
        ids = ids[1:] if data.draw(st.booleans()) else ids[::-1]
    request, new_request = strategies(bad, n_held)
    lists = [data.draw(request)[1] for _ in ids]
    ncs = [data.draw(st.integers(0, 100)) for _ in ids]
    new = data.draw(st.lists(new_request, max_size=2, unique_by=lambda r: r[0]))
    new = [r for r in new if r[0] not in ids]
    nst = {r: 1 for r in ids} if running_first else {}
    nst.update({r[0]: 2 for r in new})
    nst.update({r: 1 for r in ids})
    if not ids and not new:
        return
    try:
        slow = _convert(sm, G, SCHED, list(new), _running(ids, lists, ncs),
                        dict(nst), fin, pre, {}, {})
    except ValueError:
        slow = None
    _CountingDict.gets = 0
    fast = _fast(sm, G, list(new), ids, lists, ncs, dict(nst), fin, pre, False)
    if slow is None:
        assert fast is None
        return
    if not perturbed and ids:
        assert fast is not None and _CountingDict.gets == 0  # NOTE: no lookup per request
    if fast is not None:
        _equal(fast[0], slow[0])
        assert fast[1] == slow[1] and np.array_equal(fast[1].slots, slow[1].slots)


def test_counts_and_ids_convert_once_read_only():
    """Counts, ids and run positions share one conversion; the arrays are read-only views."""
    sm = _slot_map(3, True)
    b, _ = _fast(sm, G, [], ["r0", "r1", "r2"], [None, ([], [4, 5], [6]), None], [7, 8, 9],
                 {"r0": 1, "r1": 2, "r2": 3}, (), (), False)
    assert b.num_computed_tokens.tolist() == [7, 8, 9] and b.num_scheduled_tokens.tolist() == [1, 2, 3]
    assert b.write_ids.tolist() == [4, 5, 6] and b.write_cu.tolist() == [0, 2, 3]
    assert b.write_gids.tolist() == [1, 2] and b.write_slots.tolist() == [14, 14]
    assert b.write_starts.tolist() == [-1, -1]
    assert not b.num_computed_tokens.flags.writeable and not b.write_ids.flags.writeable
