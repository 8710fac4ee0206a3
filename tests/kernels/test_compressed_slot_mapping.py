"""compressed_slot_mapping (token-aligned and compact): kernel == reference == DESIGN §4 model."""

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
                                  py_compact, py_compressed)

from dsv4_index.ops.compressed_slot_mapping import kernel as K, naive as Rm

GEOMS = [(1, 8), (2, 4), (2, 128), (4, 64), (128, 2)]  # (R, S): ratios 1 and 2 of DeepSeek-V4.1 too


def _needed(seq_lens, R, S, world=1, rank=0, interleave=1):
    n = cp_owned_count(torch.tensor(seq_lens, dtype=torch.long) // R, world, rank, interleave)
    return [cdiv(int(x), S) for x in n]


def _run(backend, device, qsl, sl, bt, S, R, *, compact, n_out, n_cu=None, **kw):
    out = poisoned((n_out,), torch.int64, device)
    if not compact:
        got = dsv4_index.compressed_slot_mapping(qsl, sl, bt, S, R, out=out, backend=backend, **kw)
        assert got is out
        return out.cpu(), None
    cu = poisoned((n_cu,), torch.int32, device)
    got = dsv4_index.compressed_slot_mapping(qsl, sl, bt, S, R, compact=True, out=out, out_cu=cu,
                                             backend=backend, **kw)
    assert got[0] is out and got[1] is cu
    return out.cpu(), cu.cpu()


# ----------------------------------------------------------------------------------------------
# reference vs the independent plain-Python model
# ----------------------------------------------------------------------------------------------
def test_hand_examples():
    # R=4, S=2, row [5, 8, 2]; request 0: positions 2..9 complete rows 0 (pos 3) and 1 (pos 7)
    qsl = torch.tensor([0, 8, 9], dtype=torch.int32)
    sl = torch.tensor([10, 4], dtype=torch.int32)  # request 1: decode at pos = R - 1 = 3
    bt = torch.tensor([[5, 8, 2], [7, -3, -3]], dtype=torch.int32)
    got = reference.compressed_slot_mapping(qsl, sl, bt, 2, 4, num_tokens=10)
    want = [-1] * 10
    want[1], want[5], want[8] = 5 * 2 + 0, 5 * 2 + 1, 7 * 2 + 0
    assert got.tolist() == want
    rows, cu = reference.compressed_slot_mapping(qsl, sl, bt, 2, 4, compact=True, num_tokens=10)
    assert cu.tolist() == [0, 2, 3]
    assert rows.tolist() == [10, 11, 14] + [-1] * (10 // 4 + 2 - 3)
    # DCP world 2, interleave 1: rank 1 owns odd rows, local row (c // 2)
    got = reference.compressed_slot_mapping(qsl, sl, bt, 2, 4, cp_world_size=2, cp_rank=1,
                                            num_tokens=10)
    assert got[[1, 5, 8]].tolist() == [-1, 5 * 2 + 0, -1]


@given(batch=batches(unit=4, max_ctx=700), geom=st.sampled_from(GEOMS), seed=st.integers(0, 999),
       pad=st.integers(0, 5), dcp=st.sampled_from([(1, 0, 1), (2, 1, 1), (4, 2, 8), (2, 0, 64)]))
def test_reference_matches_python_model(batch, geom, seed, pad, dcp):
    q_lens, seq_lens = batch
    R, S = geom
    world, rank, inter = dcp
    qsl, sl = batch_tensors(q_lens, seq_lens)
    bt = make_table(_needed(seq_lens, R, S, world, rank, inter), seed=seed)
    T = sum(q_lens) + pad
    kw = dict(cp_world_size=world, cp_rank=rank, cp_interleave=inter)
    got = reference.compressed_slot_mapping(qsl, sl, bt, S, R, out=poisoned((T,), torch.int64,
                                                                             "cpu"), **kw)
    assert got.tolist() == py_compressed(q_lens, seq_lens, bt.tolist(), S, R, T, world, rank, inter)
    n_out = T // R + len(q_lens)
    rows, cu = reference.compressed_slot_mapping(qsl, sl, bt, S, R, compact=True, num_tokens=T,
                                                 **kw)
    want_rows, want_cu = py_compact(q_lens, seq_lens, bt.tolist(), S, R, n_out, world, rank, inter)
    assert rows.tolist() == want_rows and cu.tolist() == want_cu


@given(batch=batches(unit=4, max_ctx=300), world=st.sampled_from([2, 4]),
       inter=st.sampled_from([1, 8, 64]), R=st.sampled_from([2, 4]))
def test_dcp_union_covers_each_row_once(batch, world, inter, R):
    q_lens, seq_lens = batch
    qsl, sl = batch_tensors(q_lens, seq_lens)
    T = sum(q_lens)
    hits, rows_hits, cus = torch.zeros(T, dtype=torch.long), 0, set()
    for rank in range(world):
        bt = make_table(_needed(seq_lens, R, 4, world, rank, inter), seed=rank)
        kw = dict(cp_world_size=world, cp_rank=rank, cp_interleave=inter, num_tokens=T)
        hits += (reference.compressed_slot_mapping(qsl, sl, bt, 4, R, **kw) >= 0).long()
        rows, cu = reference.compressed_slot_mapping(qsl, sl, bt, 4, R, compact=True, **kw)
        rows_hits = rows_hits + (rows >= 0).long()
        cus.add(tuple(cu.tolist()))
    done = [(p + 1) % R == 0 for _, p in
            [(b, s - q + i) for b, (q, s) in enumerate(zip(q_lens, seq_lens)) for i in range(q)]]
    assert hits.tolist() == [int(d) for d in done]
    assert len(cus) == 1  # cu is rank independent
    n = list(cus)[0][-1]
    assert rows_hits[:n].tolist() == [1] * n and not bool(rows_hits[n:].any())


# ----------------------------------------------------------------------------------------------
# kernel vs reference
# ----------------------------------------------------------------------------------------------
@needs_triton
@settings(max_examples=15)
@given(batch=batches(unit=4, max_ctx=700), geom=st.sampled_from(GEOMS), seed=st.integers(0, 999),
       pad=st.integers(0, 200), extra=st.integers(0, 130),
       dcp=st.sampled_from([(1, 0, 1), (2, 1, 1), (4, 3, 8), (2, 0, 64)]))
def test_kernel_matches_reference(batch, geom, seed, pad, extra, dcp):
    device = DEVICE
    q_lens, seq_lens = batch
    R, S = geom
    world, rank, inter = dcp
    qsl, sl = batch_tensors(q_lens, seq_lens, device)
    bt = make_table(_needed(seq_lens, R, S, world, rank, inter), seed=seed, device=device)
    T = sum(q_lens) + pad
    kw = dict(cp_world_size=world, cp_rank=rank, cp_interleave=inter, num_tokens=T)
    a, _ = _run("triton", device, qsl, sl, bt, S, R, compact=False, n_out=T, **kw)
    b, _ = _run("reference", device, qsl, sl, bt, S, R, compact=False, n_out=T, **kw)
    assert torch.equal(a, b) and not bool((a == POISON).any())
    n_out, n_cu = T // R + len(q_lens) + extra, len(q_lens) + 1 + extra % 3
    a, acu = _run("triton", device, qsl, sl, bt, S, R, compact=True, n_out=n_out, n_cu=n_cu, **kw)
    b, bcu = _run("reference", device, qsl, sl, bt, S, R, compact=True, n_out=n_out, n_cu=n_cu,
                  **kw)
    assert torch.equal(a, b) and torch.equal(acu, bcu)
    assert not bool((a == POISON).any()) and not bool((acu == POISON).any())


@needs_triton
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("inter", [1, 8, 64])
def test_kernel_dcp_every_rank(device, world, inter):
    q_lens, seq_lens = [1, 4, 0, 40, 9], [512, 260, 128, 40, 300]
    R, S = 4, 64
    qsl, sl = batch_tensors(q_lens, seq_lens, device)
    T = sum(q_lens) + 6
    for rank in range(world):
        bt = make_table(_needed(seq_lens, R, S, world, rank, inter), seed=rank, device=device)
        kw = dict(cp_world_size=world, cp_rank=rank, cp_interleave=inter, num_tokens=T)
        a, _ = _run("triton", device, qsl, sl, bt, S, R, compact=False, n_out=T, **kw)
        assert a.tolist() == py_compressed(q_lens, seq_lens, bt.tolist(), S, R, T, world, rank,
                                           inter)
        n_out = T // R + 5
        a, cu = _run("triton", device, qsl, sl, bt, S, R, compact=True, n_out=n_out, n_cu=6, **kw)
        rows, want_cu = py_compact(q_lens, seq_lens, bt.tolist(), S, R, n_out, world, rank, inter)
        assert a.tolist() == rows and cu.tolist() == want_cu


@needs_triton
def test_kernel_many_requests_and_row_tiles(device):
    # more requests than one request tile (64) and more output rows than one program (128)
    g = torch.Generator().manual_seed(0)
    q_lens = torch.randint(0, 6, (150,), generator=g).tolist()
    seq_lens = [q + c for q, c in zip(q_lens, torch.randint(0, 40, (150,), generator=g).tolist())]
    qsl, sl = batch_tensors(q_lens, seq_lens, device)
    bt = make_table(_needed(seq_lens, 2, 4), seed=1, device=device)
    T = sum(q_lens)
    n_out = T // 2 + 150
    a, acu = _run("triton", device, qsl, sl, bt, 4, 2, compact=True, n_out=n_out, n_cu=151,
                  num_tokens=T)
    rows, cu = py_compact(q_lens, seq_lens, bt.tolist(), 4, 2, n_out)
    assert a.tolist() == rows and acu.tolist() == cu


@needs_triton
def test_kernel_empty_batch_and_int64_slots(device):
    qsl, sl = batch_tensors([], [], device)
    bt = torch.zeros((0, 2), dtype=torch.int32, device=device)
    a, cu = _run("triton", device, qsl, sl, bt, 2, 128, compact=True, n_out=3, n_cu=2,
                 num_tokens=0)
    assert a.tolist() == [-1] * 3 and cu.tolist() == [0, 0]
    a, _ = _run("triton", device, qsl, sl, bt, 2, 128, compact=False, n_out=4)
    assert a.tolist() == [-1] * 4
    q_lens, seq_lens = [1, 3], [256, 128]
    qsl, sl = batch_tensors(q_lens, seq_lens, device)
    bt = make_table([1, 1], seed=2, base=2 ** 31 // 2 - 1, device=device)
    a, _ = _run("triton", device, qsl, sl, bt, 2, 128, compact=False, n_out=4)
    assert a.tolist() == py_compressed(q_lens, seq_lens, bt.tolist(), 2, 128, 4)
    assert int(a.max()) >= 2 ** 31


@needs_triton
def test_kernel_garbage_inputs_stay_in_bounds(device):
    q_lens, seq_lens = [3, 8, 2], [1, 900, 2]  # negative positions, table too narrow
    qsl, sl = batch_tensors(q_lens, seq_lens, device)
    bt = make_table([1, 1, 1], seed=6, extra_cols=0, device=device)
    for compact in (False, True):
        out = poisoned((20,), torch.int64, device)
        cu = poisoned((4,), torch.int32, device) if compact else None
        K.launch(qsl, sl, bt, None, None, 4, 2, 1, 0, 1, 13, out, cu)
        slots = Rm.compressed_slot_mapping(qsl, sl, bt, 4, 2, torch.arange(3, device=device), None, 1, 0,
                                           1, 13)
        if compact:
            slots, want_cu = Rm.compact(qsl, sl, bt, 4, 2, torch.arange(3, device=device), None, 1, 0, 1,
                                       13, 20, 4)
            assert torch.equal(cu.cpu(), want_cu.cpu())
        assert torch.equal(out[:slots.numel()].cpu(), slots.cpu())


# ----------------------------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["reference", None])
def test_value_errors(backend):
    qsl, sl = batch_tensors([2, 1], [9, 20], "cpu")
    bt = make_table([1, 2], seed=0)

    def call(**kw):
        return dsv4_index.compressed_slot_mapping(
            kw.pop("qsl", qsl), kw.pop("sl", sl), kw.pop("bt", bt), kw.pop("S", 4),
            kw.pop("R", 4), backend=backend, **kw)

    cases = [
        (dict(qsl=torch.tensor([0, 3, 2], dtype=torch.int32)), "query_start_loc"),
        (dict(sl=torch.tensor([1, 20], dtype=torch.int32)), "seq_lens"),
        (dict(bt=bt[:, :1]), "block_table"),
        (dict(S=0), "rows_per_block"),
        (dict(R=0), "compress_ratio"),
        (dict(cp_world_size=2, cp_rank=-1), "cp_rank"),
        (dict(out=torch.zeros(3, dtype=torch.int32)), "out"),
        (dict(out=torch.zeros(2, dtype=torch.int64)), "out"),
        (dict(compact=True, num_tokens=3, out=torch.zeros(1, dtype=torch.int64)), "out"),
        (dict(compact=True, out=torch.zeros(1, dtype=torch.int64)), "out"),
        (dict(compact=True, out_cu=torch.zeros(2, dtype=torch.int32)), "out_cu"),
        (dict(compact=True, out_cu=torch.zeros(3, dtype=torch.int64)), "out_cu"),
        (dict(out_cu=torch.zeros(3, dtype=torch.int32)), "out_cu"),
        (dict(num_tokens=2), "num_tokens"),
    ]
    for kw, name in cases:
        with pytest.raises(ValueError, match=name):
            call(**kw)
