"""idx_mapping (slot-indexed tables) on every op that reads a block table, bounded replay
(``replay_end``) of slot_mapping and compressed_slot_mapping (both forms), and meta-device
rejection of every op: kernel == reference == plain-Python DESIGN §4 model, outputs poisoned."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dsv4_index
from dsv4_index import reference

from helpers.slot_batches import (DEVICE, POISON, batch_tensors, batches, cdiv, make_table, needs_triton, poisoned,
                                  py_compact, py_compressed, py_slot_mapping)

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

BS, R, S = 16, 4, 4  # raw block 16 tokens; compressed: ratio 4, 4 rows per block (16 tokens)
OPS = ("slot", "compressed", "compact", "window", "causal", "topk")


def _call(op, backend, qsl, sl, bt, T, *, idx=None, dcp=(1, 0, 1), topk=None, width=None):
    """Run one op into poisoned out= buffers; returns a tuple of CPU tensors."""
    dev = qsl.device
    kw = dict(cp_world_size=dcp[0], cp_rank=dcp[1], cp_interleave=dcp[2], idx_mapping=idx,
              backend=backend)
    B = sl.numel()
    if op == "slot":
        r = (dsv4_index.slot_mapping(qsl, sl, bt, BS, out=poisoned((T,), torch.int64, dev), **kw),)
    elif op == "compressed":
        r = (dsv4_index.compressed_slot_mapping(qsl, sl, bt, S, R, out=poisoned((T,), torch.int64, dev),
                                                **kw),)
    elif op == "compact":
        r = dsv4_index.compressed_slot_mapping(qsl, sl, bt, S, R, compact=True, num_tokens=T,
                                               out=poisoned((T // R + B + 2,), torch.int64, dev),
                                               out_cu=poisoned((B + 1,), torch.int32, dev), **kw)
    elif op == "window":
        r = dsv4_index.window_indices(qsl, sl, bt, BS, 24, out=poisoned((T, 24), torch.int32, dev),
                                      out_lens=poisoned((T,), torch.int32, dev), **kw)
    elif op == "causal":
        r = dsv4_index.causal_compressed_indices(qsl, sl, bt, S, R, width,
                                                 out=poisoned((T, width), torch.int32, dev),
                                                 out_lens=poisoned((T,), torch.int32, dev), **kw)
    else:
        r = dsv4_index.topk_to_slots(topk, qsl, sl, bt, S, R, compact=True,
                                     out=poisoned((T, topk.shape[1]), torch.int32, dev),
                                     out_lens=poisoned((T,), torch.int32, dev), **kw)
    return tuple(x.cpu() for x in r)


# ----------------------------------------------------------------------------------------------
# idx_mapping: request b reads table row idx_mapping[b]
# ----------------------------------------------------------------------------------------------
@needs_triton
@given(batch=batches(unit=16, max_ctx=160), seed=st.integers(0, 999), extra=st.integers(0, 3),
       pad=st.integers(0, 3), dcp=st.sampled_from([(1, 0, 1), (2, 1, 8)]), op=st.sampled_from(OPS))
def test_idx_mapping_reads_the_mapped_row(batch, seed, extra, pad, dcp, op):
    q_lens, seq_lens = batch
    B = len(q_lens)
    qsl, sl = batch_tensors(q_lens, seq_lens, DEVICE)
    bt = make_table([cdiv(s, BS) for s in seq_lens], seed=seed, extra_rows=0)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(B + extra, generator=g)
    big = torch.randint(-2 ** 31, 2 ** 31 - 1, (B + extra, bt.shape[1]), generator=g,
                        dtype=torch.int64).to(torch.int32)  # garbage rows nobody may read
    big[perm[:B]] = bt
    idx = perm[:B].to(torch.int32)
    T = sum(q_lens) + pad
    topk = torch.randint(-2, max(seq_lens, default=0) // R + 2, (T, 7), generator=g, dtype=torch.int32)
    width = max(seq_lens, default=0) // R + 3
    args = dict(dcp=dcp, topk=topk.to(DEVICE), width=width)
    want = _call(op, "reference", qsl, sl, bt.to(DEVICE), T, **args)  # plain table, row b
    for backend in ("triton", "reference"):
        got = _call(op, backend, qsl, sl, big.to(DEVICE), T, idx=idx.to(DEVICE), **args)
        for g_, w in zip(got, want):
            assert torch.equal(g_, w), (op, backend)
            assert not bool((g_ == POISON).any())


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", ["reference", None])
def test_idx_mapping_value_errors(op, backend):
    qsl, sl = batch_tensors([2, 1], [9, 20])
    bt = make_table([2, 2], seed=0, extra_rows=0)
    topk = torch.zeros((3, 4), dtype=torch.int32)
    for idx, name in [(torch.tensor([0, 2], dtype=torch.int32), "idx_mapping"),   # row 2 of 2
                      (torch.tensor([-1, 0], dtype=torch.int32), "idx_mapping"),
                      (torch.tensor([0], dtype=torch.int32), "idx_mapping"),      # fewer than B
                      (torch.tensor([0, 1]), "idx_mapping")]:                     # int64
        with pytest.raises(ValueError, match=name):
            _call(op, backend, qsl, sl, bt, 3, idx=idx, topk=topk, width=8)
    # a slot-indexed table may have fewer rows than B: only the mapped rows are read
    one = bt[1:]
    same = torch.tensor([0, 0], dtype=torch.int32)
    _call(op, backend, qsl, sl, one, 3, idx=same, topk=topk, width=8)


@needs_triton
def test_idx_mapping_unchecked_rows_read_nothing():
    """Kernel entries without value checks: a token whose idx_mapping row lies outside the table
    reads nothing (-1 / 0), as in the reference."""
    from dsv4_index.ops.slot_mapping import kernel as sk, naive as sn
    from dsv4_index.ops.window_indices import kernel as wk, naive as wn
    qsl, sl = batch_tensors([2, 3, 1], [9, 40, 5], DEVICE)
    bt = make_table([3, 3, 3], seed=1, extra_rows=0, device=DEVICE)
    idx = torch.tensor([5, 1, -2], dtype=torch.int32, device=DEVICE)
    rows = idx.long().cpu()
    out = poisoned((8,), torch.int64, DEVICE)
    sk.launch(qsl, sl, bt, idx, None, BS, bt.shape[1], 0, 1, 0, 1, out)
    want = sn.slot_mapping(qsl, sl, bt, BS, rows.to(DEVICE), 0, None, 1, 0, 1, 8)
    assert torch.equal(out, want) and out.tolist()[:2] == [-1, -1] and out.tolist()[5] == -1
    idx_out, lens = poisoned((8, 16), torch.int32, DEVICE), poisoned((8,), torch.int32, DEVICE)
    wk.launch(qsl, sl, bt, idx, None, BS, 16, bt.shape[1], 0, 1, 0, 1, idx_out, lens)
    w_idx, w_lens = wn.window_indices(qsl, sl, bt, BS, 16, rows.to(DEVICE), 0, None, 1, 0, 1, 8, 16)
    assert torch.equal(idx_out, w_idx) and torch.equal(lens, w_lens)
    assert lens.tolist() == [0, 0, 16, 16, 16, 0, 0, 0]


# ----------------------------------------------------------------------------------------------
# replay_end: bounded replay never writes prefix-shared blocks
# ----------------------------------------------------------------------------------------------
def _replay_end(fracs, q_lens, seq_lens):
    """replay_end[b] anywhere from 0 to past the request's last position."""
    return [int(f * (s + 2)) for f, q, s in zip(fracs, q_lens, seq_lens)]


@given(batch=batches(unit=4, max_ctx=200), seed=st.integers(0, 999), pad=st.integers(0, 3),
       fracs=st.lists(st.floats(0, 1), min_size=4, max_size=4),
       dcp=st.sampled_from([(1, 0, 1), (2, 1, 1), (4, 2, 8)]))
def test_replay_end_reference_matches_python_model(batch, seed, pad, fracs, dcp):
    q_lens, seq_lens = batch
    world, rank, inter = dcp
    qsl, sl = batch_tensors(q_lens, seq_lens)
    re = _replay_end(fracs, q_lens, seq_lens)
    ret = torch.tensor(re, dtype=torch.int32)
    bt = make_table([cdiv(s, BS) for s in seq_lens], seed=seed)
    T = sum(q_lens) + pad
    kw = dict(cp_world_size=world, cp_rank=rank, cp_interleave=inter, replay_end=ret)
    got = reference.slot_mapping(qsl, sl, bt, BS, out=poisoned((T,), torch.int64, "cpu"), **kw)
    assert got.tolist() == py_slot_mapping(q_lens, seq_lens, bt.tolist(), BS, T, world, rank, inter,
                                           replay_end=re)
    got = reference.compressed_slot_mapping(qsl, sl, bt, S, R, out=poisoned((T,), torch.int64, "cpu"),
                                            **kw)
    assert got.tolist() == py_compressed(q_lens, seq_lens, bt.tolist(), S, R, T, world, rank, inter,
                                         replay_end=re)
    n_out = T // R + len(q_lens)
    rows, cu = reference.compressed_slot_mapping(qsl, sl, bt, S, R, compact=True, num_tokens=T, **kw)
    want_rows, want_cu = py_compact(q_lens, seq_lens, bt.tolist(), S, R, n_out, world, rank, inter,
                                    replay_end=re)
    assert rows.tolist() == want_rows and cu.tolist() == want_cu
    # cu (the compact layout) depends neither on the replay nor on the rank
    _, cu0 = reference.compressed_slot_mapping(qsl, sl, bt, S, R, compact=True, num_tokens=T)
    assert torch.equal(cu, cu0)


@needs_triton
@given(batch=batches(unit=4, max_ctx=300), seed=st.integers(0, 999), pad=st.integers(0, 40),
       fracs=st.lists(st.floats(0, 1), min_size=4, max_size=4), use_idx=st.booleans(),
       dcp=st.sampled_from([(1, 0, 1), (2, 1, 1), (4, 3, 8)]))
@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
def test_replay_end_kernel_matches_reference(batch, seed, pad, fracs, use_idx, dcp):
    q_lens, seq_lens = batch
    world, rank, inter = dcp
    B = len(q_lens)
    qsl, sl = batch_tensors(q_lens, seq_lens, DEVICE)
    ret = torch.tensor(_replay_end(fracs, q_lens, seq_lens), dtype=torch.int32, device=DEVICE)
    bt = make_table([cdiv(s, BS) for s in seq_lens], seed=seed, device=DEVICE)
    idx = torch.arange(B, dtype=torch.int32, device=DEVICE).flip(0) if use_idx else None
    if use_idx:
        bt = torch.cat([bt[:B].flip(0), bt[B:]])
    T = sum(q_lens) + pad
    kw = dict(cp_world_size=world, cp_rank=rank, cp_interleave=inter, replay_end=ret, idx_mapping=idx)
    res = []
    for backend in ("triton", "reference"):
        a = dsv4_index.slot_mapping(qsl, sl, bt, BS, out=poisoned((T,), torch.int64, DEVICE),
                                    backend=backend, **kw)
        b = dsv4_index.compressed_slot_mapping(qsl, sl, bt, S, R, out=poisoned((T,), torch.int64, DEVICE),
                                               backend=backend, **kw)
        c, cu = dsv4_index.compressed_slot_mapping(
            qsl, sl, bt, S, R, compact=True, num_tokens=T, backend=backend,
            out=poisoned((T // R + B + 3,), torch.int64, DEVICE),
            out_cu=poisoned((B + 2,), torch.int32, DEVICE), **kw)
        res.append([x.cpu() for x in (a, b, c, cu)])
    for x, y in zip(*res):
        assert torch.equal(x, y) and not bool((x == POISON).any())


def test_replay_end_hand_example():
    # R = 4, S = 2, request 0 replays positions 0..7 of 0..9 (replay_end 8): rows 0, 1 (pos 3, 7) are
    # cached in shared blocks -> -1; request 1 (decode at pos 3) is not replayed
    qsl = torch.tensor([0, 10, 11], dtype=torch.int32)
    sl = torch.tensor([10, 4], dtype=torch.int32)
    bt = torch.tensor([[5, 8, 2], [7, 1, 1]], dtype=torch.int32)
    re = torch.tensor([8, 0], dtype=torch.int32)
    got = reference.compressed_slot_mapping(qsl, sl, bt, 2, 4, replay_end=re, num_tokens=11)
    assert got.tolist() == [-1] * 10 + [7 * 2]
    rows, cu = reference.compressed_slot_mapping(qsl, sl, bt, 2, 4, compact=True, replay_end=re,
                                                 num_tokens=11)
    assert cu.tolist() == [0, 2, 3] and rows.tolist()[:3] == [-1, -1, 14]
    raw = reference.slot_mapping(qsl, sl, bt, 4, replay_end=re, num_tokens=11)
    assert raw.tolist() == [-1] * 8 + [2 * 4, 2 * 4 + 1, 7 * 4 + 3]


# ----------------------------------------------------------------------------------------------
# meta-device tensors: ValueError before any read
# ----------------------------------------------------------------------------------------------
def _meta_calls(dev):
    qsl = torch.zeros(3, dtype=torch.int32, device=dev)
    sl = torch.zeros(2, dtype=torch.int32, device=dev)
    bt = torch.zeros((2, 4), dtype=torch.int32, device=dev)
    topk = torch.zeros((4, 8), dtype=torch.int32, device=dev)
    return {
        "token_to_req": lambda: dsv4_index.token_to_req(qsl, None),
        "slot_mapping": lambda: dsv4_index.slot_mapping(qsl, sl, bt, 16),
        "compressed_slot_mapping": lambda: dsv4_index.compressed_slot_mapping(qsl, sl, bt, 4, 4),
        "compact": lambda: dsv4_index.compressed_slot_mapping(qsl, sl, bt, 4, 4, compact=True),
        "window_indices": lambda: dsv4_index.window_indices(qsl, sl, bt, 16, 8),
        "causal_compressed_indices": lambda: dsv4_index.causal_compressed_indices(qsl, sl, bt, 4, 4, 8),
        "topk_to_slots": lambda: dsv4_index.topk_to_slots(topk, qsl, sl, bt, 4, 4),
        "indexer_lengths": lambda: dsv4_index.indexer_lengths(qsl, sl, 4),
    }


@pytest.mark.parametrize("op", sorted(_meta_calls("cpu")))
def test_meta_device_tensors_are_rejected(op):
    with pytest.raises(ValueError, match="meta"):
        _meta_calls("meta")[op]()


@pytest.mark.parametrize("name", ["block_table", "seq_lens", "out", "idx_mapping", "replay_end"])
def test_meta_device_single_argument(name):
    qsl, sl = batch_tensors([2, 1], [9, 20])
    args = dict(seq_lens=sl, block_table=make_table([1, 2], seed=0), out=None, idx_mapping=None,
                replay_end=None)
    meta = {"block_table": torch.zeros((3, 2), dtype=torch.int32, device="meta"),
            "seq_lens": torch.zeros(2, dtype=torch.int32, device="meta"),
            "out": torch.zeros(3, dtype=torch.int64, device="meta"),
            "idx_mapping": torch.zeros(2, dtype=torch.int32, device="meta"),
            "replay_end": torch.zeros(2, dtype=torch.int32, device="meta")}
    args[name] = meta[name]
    with pytest.raises(ValueError, match="meta"):
        dsv4_index.compressed_slot_mapping(qsl, args["seq_lens"], args["block_table"], 4, 4,
                                           out=args["out"], idx_mapping=args["idx_mapping"],
                                           replay_end=args["replay_end"])
