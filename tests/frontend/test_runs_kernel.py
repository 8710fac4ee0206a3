"""The front door's runs pass (frontend/runs/kernel.py) equals its definition (frontend/runs/naive.py) exactly on
random packed steps (outputs poisoned beforehand): same verdict on a value out of ``[0, LIMIT]``, same gids,
slots and offsets; an inconsistent layout (offset, length or row out of range) is refused without a read or
write out of bounds; and serving id-keyed steps after ``warmup()`` compiles no new signature of it."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_index._numba import compile_pinned, signatures
from dsv4_index.frontend.rules import LIMIT
from dsv4_index.frontend.runs import kernel, naive

POISON = -(2**40) - 7
VALUES = st.one_of(st.integers(0, 100), st.sampled_from([0, LIMIT, LIMIT + 1, -1, -(2**63), 2**63 - 1]))


def _kernel(a, n_checked, at_lens, n_lens, at_rows, n_rows, G, req_slots, room=0):
    outs = [np.full(n_lens + room, POISON, dtype=np.int64) for _ in range(2)]
    outs.append(np.full(n_lens + room + 1, POISON, dtype=np.int64))
    N = kernel.runs_of(a, n_checked, at_lens, n_lens, at_rows, n_rows, G, req_slots, *outs)
    return N, outs


@settings(max_examples=300, deadline=None)
@given(data=st.data(), G=st.integers(1, 5), n_checked=st.integers(0, 12), n_chosen=st.integers(0, 7),
       identity=st.booleans(), room=st.integers(0, 3), readonly=st.booleans())
def test_kernel_equals_naive(data, G, n_checked, n_chosen, identity, room, readonly):
    checked = data.draw(st.lists(VALUES, min_size=n_checked, max_size=n_checked))
    lens = data.draw(st.lists(st.integers(0, 3), min_size=n_chosen * G, max_size=n_chosen * G))
    B = data.draw(st.integers(max(n_chosen, 1), 10))
    rows = [] if identity else data.draw(st.lists(st.integers(0, B - 1), min_size=n_chosen, max_size=n_chosen))
    if identity:
        B = max(B, n_chosen)
    req_slots = np.asarray(data.draw(st.lists(st.integers(0, 1000), min_size=B, max_size=B)), dtype=np.int64)
    a = np.asarray(checked + lens + rows + data.draw(st.lists(st.integers(-5, 5), max_size=3)), dtype=np.int64)
    if readonly:
        a.flags.writeable = False
        req_slots.flags.writeable = False
    args = (a, n_checked, n_checked, len(lens), n_checked + len(lens), len(rows), G, req_slots)
    N, (w_g, w_s, w_cu) = _kernel(*args, room=room)
    ref = naive.runs_of(*args)
    if ref is None:
        assert N == kernel.BAD_VALUE
        return
    assert N == len(ref[0]) >= 0
    assert w_g[:N].tolist() == ref[0].tolist() and w_s[:N].tolist() == ref[1].tolist()
    assert w_cu[:N + 1].tolist() == ref[2].tolist()
    assert (w_g[N:] == POISON).all() and (w_s[N:] == POISON).all() and (w_cu[N + 1:] == POISON).all()


@pytest.mark.parametrize("change", ["row high", "row negative", "lens past end", "rows past end", "checked past end",
                                    "G zero", "lens not G per row", "rows count", "outputs short", "negative len"])
def test_kernel_refuses_an_inconsistent_layout(change):
    G, lens, rows = 2, [1, 0, 2, 1], [0, 2]
    a = np.asarray([5, 6] + lens + rows, dtype=np.int64)
    req_slots = np.arange(3, dtype=np.int64)
    args = dict(a=a, n_checked=2, at_lens=2, n_lens=4, at_rows=6, n_rows=2, G=G, req_slots=req_slots)
    N, _ = _kernel(*args.values())
    assert N == 3
    if change == "row high":
        a[7] = 3
    elif change == "row negative":
        a[6] = -1
    elif change == "lens past end":
        args["at_lens"] = 6
    elif change == "rows past end":
        args["at_rows"] = 7
    elif change == "checked past end":
        args["n_checked"] = 9
    elif change == "G zero":
        args["G"] = 0
    elif change == "lens not G per row":
        args["n_lens"] = 3
    elif change == "rows count":
        args["n_rows"] = 1
    elif change == "negative len":
        a[4] = -2
    outs = [np.full(4, POISON, dtype=np.int64) for _ in range(2)] + [np.full(5, POISON, dtype=np.int64)]
    if change == "outputs short":
        outs[2] = np.full(4, POISON, dtype=np.int64)
    assert kernel.runs_of(*args.values(), *outs) == kernel.BAD_LAYOUT


def test_serving_compiles_no_new_signature():
    """Pinned: ``warmup()`` compiles the one signature, id-keyed steps (read-only and writable arrays) add none."""
    from dsv4_index import DSV4Layout, MetadataPipeline, NewRequest, RunningRequest, StepInput
    compile_pinned()
    before = signatures(kernel.runs_of)
    lay = DSV4Layout.from_config("flash", max_model_len=4096)
    p = MetadataPipeline(lay, 8, 256, "cpu", 1, backend="reference")
    p.warmup()
    G = len(lay.groups)
    need = [-(-40 // g.alloc_block_size) for g in lay.groups]
    first = [list(range(1 + 100 * g, 1 + 100 * g + need[g])) for g in range(G)]
    p.update(StepInput([NewRequest("a", tuple(first), 30)], [], {"a": 10}))
    more = [-(-41 // grp.alloc_block_size) - n for grp, n in zip(lay.groups, need)]
    nxt = [list(range(1 + 100 * g + need[g], 1 + 100 * g + need[g] + more[g])) for g in range(G)]
    assert any(nxt) and not all(nxt)
    p.update(StepInput([], [RunningRequest("a", tuple(nxt), 40)], {"a": 1}))
    assert p.last_batch[0].write_ids.tolist() == sum(nxt, [])
    assert signatures(kernel.runs_of) == before
