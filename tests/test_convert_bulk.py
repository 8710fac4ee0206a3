"""The bulk StepInput conversion (``batch._convert_bulk``) accepts only what the one-by-one
conversion (``batch._convert``) accepts, and gives the same StepBatch."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsv4_index.batch import SlotMap, SlotMapDelta, _convert, _convert_bulk

G = 3


def _slot_map(n):
    sm = SlotMap(16)
    sm.commit(SlotMapDelta(taken={f"r{i}": 15 - i for i in range(n)}))
    return sm


ids_list = st.lists(st.one_of(st.integers(0, 50), st.integers(-3, -1), st.just(True), st.just(1.5)),
                    max_size=3)
request = st.tuples(st.sampled_from([f"r{i}" for i in range(8)] + ["zz", 7]),
                    st.one_of(st.tuples(ids_list, ids_list, ids_list), st.tuples(ids_list, ids_list),
                              st.lists(ids_list, min_size=3, max_size=3)),
                    st.one_of(st.integers(0, 100), st.integers(-2, -1), st.just(2.0)),
                    st.one_of(st.integers(0, 4), st.just(-1), st.just(None)))


def _equal(a, b):
    for k in a.__dataclass_fields__:
        x, y = getattr(a, k), getattr(b, k)
        if x is None or y is None:
            assert x is None and y is None or (np.asarray(x).size == 0 and np.asarray(y).size == 0), k
        else:
            assert np.array_equal(np.asarray(x), np.asarray(y)), k


@given(reqs=st.lists(request, min_size=1, max_size=6), extra=st.booleans(), n_held=st.integers(0, 8))
def test_bulk_equals_slow(reqs, extra, n_held):
    sm = _slot_map(n_held)
    rids = [r[0] for r in reqs]
    nst = {r[0]: r[3] for r in reqs}
    if extra:
        nst["extra"] = 1
    lists = [r[1] for r in reqs]
    ncs = [r[2] for r in reqs]
    try:
        slow = _convert(sm, G, [], [(rid, l, nc, False) for rid, l, nc in zip(rids, lists, ncs)], dict(nst),
                        (), (), {}, {})
    except (ValueError, TypeError):
        slow = None
    bulk = _convert_bulk(sm, G, rids, lists, ncs, dict(nst))
    if slow is None:
        assert bulk is None
    elif bulk is not None:
        _equal(bulk[0], slow[0])
        assert bulk[1].order == slow[1].order and not slow[1].taken and not slow[1].freed


def test_bulk_takes_the_common_step():
    sm = _slot_map(3)
    out = _convert_bulk(sm, G, ["r0", "r1"], [([5], [], []), ([], [6, 7], [])], [10, 20], {"r0": 1, "r1": 2})
    assert out is not None
    b, _ = out
    assert b.req_slots.tolist() == [15, 14] and b.write_gids.tolist() == [0, 1]
    assert b.write_ids.tolist() == [5, 6, 7] and b.write_cu.tolist() == [0, 1, 3]
