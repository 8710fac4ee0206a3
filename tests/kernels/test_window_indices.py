"""window_indices: kernel == reference == DESIGN §4 model (replay floor, DCP, wide rows)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dsv4_index

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning")  # Triton interpreter noise
from dsv4_index import reference
from dsv4_index._common import cp_owned_count

from helpers.slot_batches import (DEVICE, POISON, batch_tensors, batches, cdiv, make_table, needs_triton, poisoned,
                                  py_window)

from dsv4_index.ops.window_indices import kernel as K, naive as Rm


def _needed(seq_lens, unit, world=1, rank=0, interleave=1):
    n = cp_owned_count(torch.tensor(seq_lens, dtype=torch.long), world, rank, interleave)
    return [cdiv(int(x), unit) for x in n]


def _replay(draw_fracs, q_lens, seq_lens):
    """replay_start[b] in [0, first scheduled position], from fractions in [0, 1]."""
    return [int(f * (s - q)) for f, q, s in zip(draw_fracs, q_lens, seq_lens)]


def _run(backend, device, qsl, sl, bt, bs, W, T, width, **kw):
    out = poisoned((T, width), torch.int32, device)
    lens = poisoned((T + 2,), torch.int32, device)
    got = dsv4_index.window_indices(qsl, sl, bt, bs, W, out=out, out_lens=lens, backend=backend,
                                    **kw)
    assert got[0] is out and got[1] is lens
    return out.cpu(), lens.cpu()


# ----------------------------------------------------------------------------------------------
# reference vs the independent plain-Python model
# ----------------------------------------------------------------------------------------------
def test_hand_examples():
    # bs=4, W=3, row [6, 2, 9]: tokens at positions 4, 5 (seq 6) and position 0 of request 1
    qsl = torch.tensor([0, 2, 3], dtype=torch.int32)
    sl = torch.tensor([6, 1], dtype=torch.int32)
    bt = torch.tensor([[6, 2, 9], [3, -7, -7]], dtype=torch.int32)
    idx, lens = reference.window_indices(qsl, sl, bt, 4, 3, num_tokens=4)
    assert idx.tolist() == [[6 * 4 + 2, 6 * 4 + 3, 2 * 4 + 0], [6 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1],
                            [3 * 4, -1, -1], [-1, -1, -1]]
    assert lens.tolist() == [3, 3, 1, 0]
    # replay floor 4: token at pos 4 sees only itself, pos 5 sees 4, 5
    idx, lens = reference.window_indices(qsl, sl, bt, 4, 3, num_tokens=3,
                                         replay_start=torch.tensor([4, 0], dtype=torch.int32))
    assert idx[:2].tolist() == [[2 * 4, -1, -1], [2 * 4, 2 * 4 + 1, -1]] and lens[:2].tolist() == [1, 2]
    # DCP world 2, interleave 2, rank 0 owns 0,1, 4,5 (local 0,1, 2,3): window of pos 5 = {3,4,5}
    idx, lens = reference.window_indices(qsl, sl, bt, 4, 3, cp_world_size=2, cp_interleave=2,
                                         num_tokens=3)
    assert idx[1].tolist() == [6 * 4 + 2, 6 * 4 + 3, -1] and lens[1].item() == 2


@given(batch=batches(unit=8, max_ctx=200), seed=st.integers(0, 999), pad=st.integers(0, 3),
       W=st.sampled_from([1, 5, 16, 40]), extra_w=st.integers(0, 9), use_replay=st.booleans(),
       fracs=st.lists(st.floats(0, 1), min_size=4, max_size=4),
       dcp=st.sampled_from([(1, 0, 1), (2, 1, 1), (4, 2, 8), (2, 0, 64)]))
def test_reference_matches_python_model(batch, seed, pad, W, extra_w, use_replay, fracs, dcp):
    q_lens, seq_lens = batch
    world, rank, inter = dcp
    qsl, sl = batch_tensors(q_lens, seq_lens)
    bt = make_table(_needed(seq_lens, 8, world, rank, inter), seed=seed)
    replay = _replay(fracs, q_lens, seq_lens) if use_replay else None
    T, width = sum(q_lens) + pad, W + extra_w
    idx, lens = reference.window_indices(
        qsl, sl, bt, 8, W, cp_world_size=world, cp_rank=rank, cp_interleave=inter,
        replay_start=torch.tensor(replay, dtype=torch.int32) if use_replay else None,
        out=poisoned((T, width), torch.int32, "cpu"), out_lens=poisoned((T,), torch.int32, "cpu"))
    want_idx, want_lens = py_window(q_lens, seq_lens, bt.tolist(), 8, W, width, T, replay, world,
                                    rank, inter)
    assert idx.tolist() == want_idx and lens.tolist() == want_lens


@given(batch=batches(unit=8, max_ctx=200), world=st.sampled_from([2, 4]),
       inter=st.sampled_from([1, 8, 64]), W=st.sampled_from([3, 16, 128]))
def test_dcp_union_covers_each_window_position_once(batch, world, inter, W):
    q_lens, seq_lens = batch
    qsl, sl = batch_tensors(q_lens, seq_lens)
    T, bs = sum(q_lens), 8
    seen = [[] for _ in range(T)]
    for rank in range(world):
        bt = make_table(_needed(seq_lens, bs, world, rank, inter), seed=rank, extra_cols=0)
        idx, lens = reference.window_indices(qsl, sl, bt, bs, W, cp_world_size=world,
                                             cp_rank=rank, cp_interleave=inter, num_tokens=T)
        where = {}  # slot -> (request, local position), from this rank's table
        for b, row in enumerate(bt.tolist()):
            for k, blk in enumerate(row):
                for o in range(bs):
                    where[blk * bs + o] = (b, k * bs + o)
        for t in range(T):
            row = idx[t].tolist()
            assert all(x == -1 for x in row[lens[t]:])
            for s in row[:lens[t]]:
                b, lp = where[s]
                seen[t].append((lp // inter) * inter * world + rank * inter + lp % inter)
    toks = [(b, s - q + i) for b, (q, s) in enumerate(zip(q_lens, seq_lens)) for i in range(q)]
    for t, (_, p) in enumerate(toks):
        assert sorted(seen[t]) == list(range(max(p - W + 1, 0), p + 1))


# ----------------------------------------------------------------------------------------------
# kernel vs reference
# ----------------------------------------------------------------------------------------------
@needs_triton
@settings(max_examples=12)
@given(batch=batches(unit=64, max_ctx=400), seed=st.integers(0, 999), pad=st.integers(0, 40),
       W=st.sampled_from([8, 128]), extra_w=st.sampled_from([0, 3, 200]), use_replay=st.booleans(),
       fracs=st.lists(st.floats(0, 1), min_size=4, max_size=4),
       dcp=st.sampled_from([(1, 0, 1), (2, 1, 1), (4, 3, 8), (2, 0, 64)]))
def test_kernel_matches_reference(batch, seed, pad, W, extra_w, use_replay, fracs, dcp):
    device = DEVICE
    q_lens, seq_lens = batch
    world, rank, inter = dcp
    qsl, sl = batch_tensors(q_lens, seq_lens, device)
    bt = make_table(_needed(seq_lens, 64, world, rank, inter), seed=seed, device=device)
    replay = _replay(fracs, q_lens, seq_lens)
    kw = dict(cp_world_size=world, cp_rank=rank, cp_interleave=inter,
              replay_start=torch.tensor(replay, dtype=torch.int32, device=device)
              if use_replay else None)
    T, width = sum(q_lens) + pad, W + extra_w
    a, al = _run("triton", device, qsl, sl, bt, 64, W, T, width, **kw)
    b, bl = _run("reference", device, qsl, sl, bt, 64, W, T, width, **kw)
    assert torch.equal(a, b) and torch.equal(al, bl)
    assert not bool((a == POISON).any()) and not bool((al == POISON).any())


@needs_triton
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("inter", [1, 8, 64])
def test_kernel_dcp_every_rank(device, world, inter):
    q_lens, seq_lens = [1, 3, 0, 30], [300, 70, 64, 30]  # incl. window longer than context
    qsl, sl = batch_tensors(q_lens, seq_lens, device)
    T = sum(q_lens) + 2
    for rank in range(world):
        bt = make_table(_needed(seq_lens, 64, world, rank, inter), seed=rank, device=device)
        a, al = _run("triton", device, qsl, sl, bt, 64, 128, T, 128, cp_world_size=world,
                     cp_rank=rank, cp_interleave=inter)
        want, want_lens = py_window(q_lens, seq_lens, bt.tolist(), 64, 128, 128, T, None, world,
                                    rank, inter)
        assert a.tolist() == want and al.tolist() == want_lens + [0, 0]


@needs_triton
def test_kernel_empty_batch(device):
    qsl, sl = batch_tensors([], [], device)
    bt = torch.zeros((0, 3), dtype=torch.int32, device=device)
    a, al = _run("triton", device, qsl, sl, bt, 64, 8, 3, 8)
    assert a.tolist() == [[-1] * 8] * 3 and al.tolist() == [0] * 5


@needs_triton
def test_kernel_garbage_inputs_stay_in_bounds(device):
    # no value checks: negative positions, replay_start negative / past pos, table too narrow
    q_lens, seq_lens = [3, 6, 2, 2], [1, 900, 40, 40]
    qsl, sl = batch_tensors(q_lens, seq_lens, device)
    bt = make_table([1, 2, 1, 1], seed=6, extra_cols=0, device=device)
    replay = torch.tensor([-5, 0, 50, -3], dtype=torch.int32, device=device)
    for rp in (None, replay):
        out = poisoned((15, 16), torch.int32, device)
        lens = poisoned((15,), torch.int32, device)
        K.launch(qsl, sl, bt, None, rp, 64, 16, bt.shape[1], 0, 1, 0, 1, out, lens)
        want, want_lens = Rm.window_indices(qsl, sl, bt, 64, 16, torch.arange(4, device=device), 0, rp,
                                             1, 0, 1, 15, 16)
        assert torch.equal(out.cpu(), want.cpu()) and torch.equal(lens.cpu(), want_lens.cpu())
    assert int(lens[3]) == 0  # request 1's positions 894.. lie beyond the 2-column table


# ----------------------------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["reference", None])
def test_value_errors(backend):
    qsl, sl = batch_tensors([2, 1, 0], [9, 70, 0], "cpu")
    bt = make_table([1, 2, 0], seed=0)

    def call(**kw):
        return dsv4_index.window_indices(
            kw.pop("qsl", qsl), kw.pop("sl", sl), kw.pop("bt", bt), kw.pop("bs", 64),
            kw.pop("W", 8), backend=backend, **kw)

    rs = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    cases = [
        (dict(qsl=torch.tensor([0, 3, 2, 2], dtype=torch.int32)), "query_start_loc"),
        (dict(sl=torch.tensor([1, 70, 0], dtype=torch.int32)), "seq_lens"),
        (dict(bt=bt[:, :1]), "block_table"),
        (dict(replay_start=rs(8, 0, 0)), "replay_start"),  # past the first position 7
        (dict(replay_start=rs(0, -1, 0)), "replay_start"),
        (dict(replay_start=rs(0, 0)), "replay_start"),
        (dict(replay_start=rs(0, 0, 0).long()), "replay_start"),
        (dict(W=0), "window"),
        (dict(bs=0), "block_size"),
        (dict(out=torch.zeros(3, 7, dtype=torch.int32)), "out"),
        (dict(out=torch.zeros(3, 8, dtype=torch.int64)), "out"),
        (dict(out=torch.zeros(2, 8, dtype=torch.int32)), "out"),
        (dict(num_tokens=3, out_lens=torch.zeros(2, dtype=torch.int32)), "out_lens"),
        (dict(out_lens=torch.zeros(3, dtype=torch.int64)), "out_lens"),
        (dict(cp_world_size=2, cp_rank=5), "cp_rank"),
    ]
    for kw, name in cases:
        with pytest.raises(ValueError, match=name):
            call(**kw)
    # allowed: replay_start at the first position; any value on the zero-length request
    call(replay_start=rs(7, 69, 123))
