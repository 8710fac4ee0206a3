"""Ring and circular sliding tables (DESIGN §4 "Sliding tables as rings", "circular group"): window
lists and slot mappings == an independent plain-Python model; kernel == reference (outputs poisoned);
a ring too small for the step is a ValueError naming block_table. Circular groups take chunks longer
than their capacity: window entries inside the step's chunk are in-step token rows ``-2 - row``."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dsv4_index
from dsv4_index import reference

from helpers.slot_batches import (DEVICE, POISON, batch_tensors, batches, cdiv, make_table, needs_triton, poisoned,
                                  py_slot_mapping, py_window)

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


@st.composite
def ring_cases(draw, max_q=12):
    circular = draw(st.booleans())
    W = draw(st.sampled_from([1, 3, 8, 20]))
    batch = draw(batches(max_reqs=4, max_ctx=300, max_q=max_q, unit=16))
    q_max = max(batch[0], default=1) or 1
    if circular:
        # NOTE: the ring holds the W - 1 positions before the chunk; the chunk itself may be longer
        bs = max(W - 1, 1) + draw(st.integers(0, 5))
        world, rank, inter = 1, 0, 1
        cols = 1 + draw(st.integers(0, 2))  # extra columns are never read
    else:
        bs = draw(st.sampled_from([1, 4, 16]))
        world = draw(st.sampled_from([1, 2]))
        rank = draw(st.integers(0, world - 1))
        inter = draw(st.sampled_from([d for d in (1, 2, 4) if bs % d == 0]))
        cols = cdiv(W - 1 + q_max, bs) + 1 + draw(st.integers(0, 2))  # DESIGN §4 ring width
    fracs = draw(st.lists(st.floats(0, 1), min_size=4, max_size=4))
    replay = [int(f * (s - q)) for f, q, s in zip(fracs, *batch)] if draw(st.booleans()) else None
    return dict(batch=batch, circular=circular, W=W, bs=bs, cols=cols, world=world, rank=rank,
                inter=inter, replay=replay, pad=draw(st.integers(0, 3)), extra_w=draw(st.integers(0, 5)),
                seed=draw(st.integers(0, 999)))


def _args(c, device):
    q_lens, seq_lens = c["batch"]
    qsl, sl = batch_tensors(q_lens, seq_lens, device)
    # NOTE: a ring has its columns even for an empty batch (one garbage row nobody reads)
    bt = make_table([c["cols"]] * max(len(q_lens), 1), seed=c["seed"], extra_cols=0, device=device)
    kw = dict(cp_world_size=c["world"], cp_rank=c["rank"], cp_interleave=c["inter"])
    if c["circular"]:
        kw["circular_capacity"] = c["bs"]
    else:
        kw["ring"] = True
    return qsl, sl, bt, kw, sum(q_lens) + c["pad"], c["W"] + c["extra_w"]


def _replay_tensor(c, device):
    return None if c["replay"] is None else torch.tensor(c["replay"], dtype=torch.int32, device=device)


def py_split_at_chunk(q_lens, seq_lens, idx, W, replay):
    """Circular window rows: entries at positions >= the request's chunk start s are the step's token
    row qs + (x - s), encoded -2 - row; the others keep their ring slot."""
    out, t, qs = [list(r) for r in idx], 0, 0
    for b, (q, sl) in enumerate(zip(q_lens, seq_lens)):
        s = sl - q
        for p in range(s, sl):
            start = max(p - W + 1, replay[b] if replay is not None else 0, 0)
            for j, x in enumerate(range(start, p + 1)):
                if x >= s:
                    out[t][j] = -2 - (qs + x - s)
            t += 1
        qs += q
    return out


@given(ring_cases())
def test_reference_matches_python_model(c):
    q_lens, seq_lens = c["batch"]
    qsl, sl, bt, kw, T, width = _args(c, "cpu")
    circ = c["bs"] if c["circular"] else None
    idx, lens = reference.window_indices(qsl, sl, bt, c["bs"], c["W"], replay_start=_replay_tensor(c, "cpu"),
                                         out=poisoned((T, width), torch.int32, "cpu"),
                                         out_lens=poisoned((T,), torch.int32, "cpu"), **kw)
    want_idx, want_lens = py_window(q_lens, seq_lens, bt.tolist(), c["bs"], c["W"], width, T, c["replay"],
                                    c["world"], c["rank"], c["inter"], ring=not c["circular"], circular=circ)
    if c["circular"]:
        want_idx = py_split_at_chunk(q_lens, seq_lens, want_idx, c["W"], c["replay"])
    assert idx.tolist() == want_idx and lens.tolist() == want_lens
    slots = reference.slot_mapping(qsl, sl, bt, c["bs"], out=poisoned((T,), torch.int64, "cpu"), **kw)
    assert slots.tolist() == py_slot_mapping(q_lens, seq_lens, bt.tolist(), c["bs"], T, c["world"],
                                             c["rank"], c["inter"], circular=circ, ring=not c["circular"])


@needs_triton
@given(ring_cases())
def test_kernel_matches_reference(c):
    qsl, sl, bt, kw, T, width = _args(c, DEVICE)
    rs = _replay_tensor(c, DEVICE)
    res = []
    for backend in ("triton", "reference"):
        idx, lens = dsv4_index.window_indices(qsl, sl, bt, c["bs"], c["W"], replay_start=rs,
                                              out=poisoned((T, width), torch.int32, DEVICE),
                                              out_lens=poisoned((T + 1,), torch.int32, DEVICE),
                                              backend=backend, **kw)
        slots = dsv4_index.slot_mapping(qsl, sl, bt, c["bs"], out=poisoned((T,), torch.int64, DEVICE),
                                        backend=backend, **kw)
        res.append([x.cpu() for x in (idx, lens, slots)])
    for a, b in zip(*res):
        assert torch.equal(a, b) and not bool((a == POISON).any())


def test_hand_example_ring_and_circular():
    # bs 4, ring of 3 columns [10, 20, 30]: logical block i in column i % 3. Token at pos 21 (block 5
    # -> column 2), W 6: positions 16..21 = blocks 4 (column 1), 5 (column 2)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    sl = torch.tensor([22], dtype=torch.int32)
    bt = torch.tensor([[10, 20, 30]], dtype=torch.int32)
    idx, lens = reference.window_indices(qsl, sl, bt, 4, 6, ring=True)
    assert idx.tolist() == [[80, 81, 82, 83, 120, 121]] and lens.tolist() == [6]
    assert reference.slot_mapping(qsl, sl, bt, 4, ring=True).tolist() == [121]
    # circular capacity 8: slot = bt[0] * 8 + p % 8 before the chunk start (21 here), in-step rows
    # after: positions 16..20 -> 16 * 8 + 0..4 (ring), 21 -> token row 0 -> -2
    idx, _ = reference.window_indices(qsl, sl, bt[:, :1] + 6, 8, 6, circular_capacity=8)
    assert idx.tolist() == [[128, 129, 130, 131, 132, -2]]
    # positions 5..9 wrap around the ring of 8: 5, 6, 7, 0, 1; then the token itself (row 0)
    idx, _ = reference.window_indices(qsl, torch.tensor([11], dtype=torch.int32), bt[:, :1], 8, 6,
                                      circular_capacity=8)
    assert idx.tolist() == [[85, 86, 87, 80, 81, -2]]


@pytest.mark.parametrize("backend", ["reference", None])
def test_too_small_rings_are_rejected(backend):
    # a prefill of 9 tokens after 30 cached, W 8: the request reads positions 23..38 at once
    qsl, sl = batch_tensors([9], [39])
    win = lambda bt, bs, **kw: dsv4_index.window_indices(qsl, sl, bt, bs, 8, backend=backend, **kw)  # noqa: E731
    ok = make_table([5], seed=0, extra_cols=0)       # 16 positions need blocks 5..9 of 4: 5 columns
    win(ok, 4, ring=True)
    with pytest.raises(ValueError, match="block_table.*ring of 4 columns"):
        win(ok[:, :4], 4, ring=True)
    # circular: only positions 23..29 (before the chunk start 30) are read from the ring
    win(ok[:, :1], 7, circular_capacity=7)
    with pytest.raises(ValueError, match="block_table.*circular group of capacity 6"):
        win(ok[:, :1], 6, circular_capacity=6)
    # slot mapping: only the step's writes must fit (positions 30..38: 9 positions, 3 blocks of 4)
    dsv4_index.slot_mapping(qsl, sl, ok[:, :3], 4, ring=True, backend=backend)
    with pytest.raises(ValueError, match="block_table"):
        dsv4_index.slot_mapping(qsl, sl, ok[:, :2], 4, ring=True, backend=backend)
    # a circular group takes a chunk longer than its capacity (the address map, two tokens per slot)
    for cap in (9, 8, 2):
        got = dsv4_index.slot_mapping(qsl, sl, ok[:, :1], cap, circular_capacity=cap, backend=backend,
                                      validate=True)
        assert got.tolist() == [int(ok[0, 0]) * cap + p % cap for p in range(30, 39)]
    # argument checks
    for kw, name in [(dict(ring=True, circular_capacity=4), "exclusive"), (dict(ring=1), "ring"),
                     (dict(circular_capacity=6), "multiple of block_size"),
                     (dict(circular_capacity=4 * (ok.shape[1] + 1)), "columns, but a circular group"),
                     (dict(circular_capacity=4, cp_world_size=2), "circular_capacity")]:
        with pytest.raises(ValueError, match=name):
            win(ok, 4, **kw)
    with pytest.raises(ValueError, match="block_table"):
        win(ok[:, :0], 4, ring=True)
