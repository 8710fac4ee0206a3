"""slot_mapping: Triton kernel == reference == plain-Python DESIGN §4 model."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dsv4_index

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning")  # Triton interpreter noise
from dsv4_index import reference
from dsv4_index._common import cp_owned_count
from dsv4_index.ops.slot_mapping import kernel as K, naive as Rm

from helpers.slot_batches import (DEVICE, POISON, batch_tensors, batches, cdiv, make_table, needs_triton, poisoned,
                                  py_slot_mapping)


def _needed(seq_lens, unit, world=1, rank=0, interleave=1):
    n = cp_owned_count(torch.tensor(seq_lens, dtype=torch.long), world, rank, interleave)
    return [cdiv(int(x), unit) for x in n]


def _both(device, qsl, sl, bt, bs, T_out, **kw):
    """(kernel, reference) outputs, each into a poisoned out= buffer of T_out rows."""
    res = []
    for backend in ("triton", "reference"):
        out = poisoned((T_out,), torch.int64, device)
        got = dsv4_index.slot_mapping(qsl, sl, bt, bs, out=out, backend=backend, **kw)
        assert got is out
        res.append(out.cpu())
    return res


# ----------------------------------------------------------------------------------------------
# reference vs the independent plain-Python model (cheap, many examples)
# ----------------------------------------------------------------------------------------------
def test_hand_examples():
    # bs=4, row [7, 3, 9]: request 0 (ctx 7, q 3) -> positions 7, 8, 9; request 1: position 0
    qsl = torch.tensor([0, 3, 4], dtype=torch.int32)
    sl = torch.tensor([10, 1], dtype=torch.int32)
    bt = torch.tensor([[7, 3, 9], [5, -8, -8]], dtype=torch.int32)
    got = reference.slot_mapping(qsl, sl, bt, 4, num_tokens=6)
    assert got.tolist() == [3 * 4 + 3, 9 * 4 + 0, 9 * 4 + 1, 5 * 4, -1, -1]
    # DCP world 2, interleave 2, rank 1 owns positions 2,3, 6,7, 10,11 -> local 0,1, 2,3, 4,5
    got = reference.slot_mapping(qsl, sl, bt, 4, cp_world_size=2, cp_rank=1, cp_interleave=2,
                                 num_tokens=4)
    assert got.tolist() == [7 * 4 + 3, -1, -1, -1]
    # circular ring of 4 rows: slot = bt[0] * 4 + pos % 4
    got = reference.slot_mapping(qsl, sl, bt, 4, circular_capacity=4, num_tokens=4)
    assert got.tolist() == [7 * 4 + 3, 7 * 4 + 0, 7 * 4 + 1, 5 * 4]


@given(batch=batches(unit=16), seed=st.integers(0, 2 ** 16), pad=st.integers(0, 3),
       dcp=st.sampled_from([(1, 0, 1), (2, 0, 1), (2, 1, 8), (4, 3, 8), (4, 2, 16)]))
def test_reference_matches_python_model(batch, seed, pad, dcp):
    q_lens, seq_lens = batch
    world, rank, inter = dcp
    bs = 16
    qsl, sl = batch_tensors(q_lens, seq_lens)
    bt = make_table(_needed(seq_lens, bs, world, rank, inter), seed=seed)
    T_out = sum(q_lens) + pad
    got = reference.slot_mapping(qsl, sl, bt, bs, cp_world_size=world, cp_rank=rank,
                                 cp_interleave=inter, out=poisoned((T_out,), torch.int64, "cpu"))
    want = py_slot_mapping(q_lens, seq_lens, bt.tolist(), bs, T_out, world, rank, inter)
    assert got.tolist() == want


@given(batch=batches(unit=64), world=st.sampled_from([2, 4]), inter=st.sampled_from([1, 8, 64]))
def test_dcp_union_covers_each_token_once(batch, world, inter):
    q_lens, seq_lens = batch
    qsl, sl = batch_tensors(q_lens, seq_lens)
    owners = torch.zeros(sum(q_lens), dtype=torch.long)
    for rank in range(world):
        bt = make_table(_needed(seq_lens, 64, world, rank, inter), seed=rank, base=1)
        got = reference.slot_mapping(qsl, sl, bt, 64, cp_world_size=world, cp_rank=rank,
                                     cp_interleave=inter, num_tokens=sum(q_lens))
        assert bool((got >= -1).all())
        owners += (got >= 0).long()
    assert bool((owners == 1).all())


@given(batch=batches(unit=16), f=st.sampled_from([2, 4]), seed=st.integers(0, 99),
       dcp=st.sampled_from([(1, 0, 1), (2, 1, 8), (4, 2, 32)]))
def test_hybrid_blocks_give_the_physical_slot(batch, f, seed, dcp):
    # kernel-block table (ids a*f + j) with block_size 16 == allocation table with 16*f
    q_lens, seq_lens = batch
    world, rank, inter = dcp
    qsl, sl = batch_tensors(q_lens, seq_lens)
    alloc = make_table(_needed(seq_lens, 16 * f, world, rank, inter), seed=seed, extra_cols=0)
    kern = (alloc.long()[:, :, None] * f + torch.arange(f)).reshape(alloc.shape[0], -1)
    kern = kern.to(torch.int32)
    kw = dict(cp_world_size=world, cp_rank=rank, cp_interleave=inter, num_tokens=sum(q_lens))
    a = reference.slot_mapping(qsl, sl, kern, 16, blocks_per_kv_block=f, **kw)
    b = reference.slot_mapping(qsl, sl, alloc, 16 * f, **kw)
    assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------
# kernel vs reference
# ----------------------------------------------------------------------------------------------
@needs_triton
@settings(max_examples=15)
@given(batch=batches(unit=64), seed=st.integers(0, 2 ** 16), pad=st.integers(0, 300),
       dcp=st.sampled_from([(1, 0, 1), (2, 0, 1), (2, 1, 8), (4, 3, 64), (4, 0, 8)]))
def test_kernel_matches_reference(batch, seed, pad, dcp):
    device = DEVICE
    q_lens, seq_lens = batch
    world, rank, inter = dcp
    qsl, sl = batch_tensors(q_lens, seq_lens, device)
    bt = make_table(_needed(seq_lens, 64, world, rank, inter), seed=seed, device=device)
    a, b = _both(device, qsl, sl, bt, 64, sum(q_lens) + pad, cp_world_size=world,
                 cp_rank=rank, cp_interleave=inter)
    assert torch.equal(a, b)
    assert not bool((a == POISON).any())


@needs_triton
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("inter", [1, 8, 64])
def test_kernel_dcp_every_rank(device, world, inter):
    q_lens, seq_lens = [1, 3, 0, 20, 7], [300, 130, 64, 20, 140]
    qsl, sl = batch_tensors(q_lens, seq_lens, device)
    owners = torch.zeros(sum(q_lens), dtype=torch.long)
    for rank in range(world):
        bt = make_table(_needed(seq_lens, 64, world, rank, inter), seed=rank, device=device)
        a, b = _both(device, qsl, sl, bt, 64, 40, cp_world_size=world, cp_rank=rank,
                     cp_interleave=inter)
        assert torch.equal(a, b)
        assert a.tolist() == py_slot_mapping(q_lens, seq_lens, bt.tolist(), 64, 40, world, rank,
                                             inter)
        owners += (a[:sum(q_lens)] >= 0).long()
    assert bool((owners == 1).all())


@needs_triton
def test_kernel_hybrid_and_circular(device):
    # NOTE: a circular group of capacity 8 holds at most 8 positions written in one step
    q_lens, seq_lens = [1, 4, 8], [33, 8, 9]
    qsl, sl = batch_tensors(q_lens, seq_lens, device)
    bt = make_table(_needed(seq_lens, 4), seed=3, device=device)
    a, b = _both(device, qsl, sl, bt, 4, 16, blocks_per_kv_block=4, cp_world_size=2,
                 cp_rank=1, cp_interleave=16)
    assert torch.equal(a, b)
    ring = make_table([1, 1, 1], seed=4, extra_cols=3, device=device)
    a, b = _both(device, qsl, sl, ring, 8, 16, circular_capacity=8)
    assert torch.equal(a, b)
    assert a.tolist() == py_slot_mapping(q_lens, seq_lens, ring.tolist(), 8, 16, circular=8)


@needs_triton
def test_kernel_empty_batch_and_position_zero(device):
    qsl, sl = batch_tensors([], [], device)
    bt = torch.zeros((0, 4), dtype=torch.int32, device=device)
    a, b = _both(device, qsl, sl, bt, 64, 5)
    assert a.tolist() == b.tolist() == [-1] * 5
    qsl, sl = batch_tensors([1, 0], [1, 0], device)
    bt = torch.tensor([[6, -1], [-5, -5]], dtype=torch.int32, device=device)
    a, b = _both(device, qsl, sl, bt, 64, 3)
    assert a.tolist() == b.tolist() == [6 * 64, -1, -1]


@needs_triton
def test_kernel_slots_beyond_int32(device):
    bs = 256
    q_lens, seq_lens = [2, 5], [600, 5]
    qsl, sl = batch_tensors(q_lens, seq_lens, device)
    base = 2 ** 31 // bs - 2
    bt = make_table([3, 1], seed=5, base=base, device=device)
    a, b = _both(device, qsl, sl, bt, bs, 8)
    assert torch.equal(a, b)
    assert a.tolist() == py_slot_mapping(q_lens, seq_lens, bt.tolist(), bs, 8)
    assert int(a.max()) >= 2 ** 31


@needs_triton
def test_kernel_garbage_inputs_stay_in_bounds(device):
    # no value checks: seq_lens < q_len (negative positions) and a table too narrow
    q_lens, seq_lens = [3, 4, 2], [1, 900, 2]
    qsl, sl = batch_tensors(q_lens, seq_lens, device)
    bt = make_table([1, 2, 1], seed=6, extra_cols=0, device=device)
    for kw in (dict(), dict(cp_world_size=2, cp_rank=1, cp_interleave=2)):
        out = poisoned((12,), torch.int64, device)
        cp = (kw.get("cp_world_size", 1), kw.get("cp_rank", 0), kw.get("cp_interleave", 1))
        K.launch(qsl, sl, bt, None, None, 64, bt.shape[1], 0, *cp, out)
        want = Rm.slot_mapping(qsl, sl, bt, 64, torch.arange(3, device=device), 0, None, *cp, 12)
        assert torch.equal(out.cpu(), want.cpu())
    assert out[:2].tolist() == [-1, -1]  # positions -2, -1


@needs_triton
def test_no_host_read_with_num_tokens(device):
    # num_tokens given: output length is num_tokens even when qsl[-1] is smaller (padding)
    qsl, sl = batch_tensors([2], [5], device)
    bt = make_table([1], seed=1, device=device)
    got = dsv4_index.slot_mapping(qsl, sl, bt, 64, num_tokens=7, backend="triton")
    assert got.shape == (7,) and got[2:].tolist() == [-1] * 5


# ----------------------------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["reference", None])
def test_value_errors(backend):
    qsl, sl = batch_tensors([2, 1], [5, 70], "cpu")
    bt = make_table([1, 2], seed=0)
    call = lambda **kw: dsv4_index.slot_mapping(  # noqa: E731
        kw.pop("qsl", qsl), kw.pop("sl", sl), kw.pop("bt", bt), kw.pop("bs", 64),
        backend=backend, **kw)
    cases = [
        (dict(qsl=torch.tensor([0, 2, 1], dtype=torch.int32)), "query_start_loc"),
        (dict(sl=torch.tensor([1, 70], dtype=torch.int32)), "seq_lens"),
        (dict(bt=bt[:, :1]), "block_table"),
        (dict(circular_capacity=32), "circular_capacity"),
        (dict(circular_capacity=64, cp_world_size=2), "circular_capacity"),
        (dict(cp_world_size=2, cp_interleave=48), "cp_interleave"),
        (dict(blocks_per_kv_block=2, cp_world_size=2, cp_interleave=256), "cp_interleave"),
        (dict(cp_world_size=2, cp_rank=2), "cp_rank"),
        (dict(bs=0), "block_size"),
        (dict(out=torch.zeros(3, dtype=torch.int32)), "out"),
        (dict(out=torch.zeros(2, dtype=torch.int64)), "out"),
        (dict(out=torch.zeros(3, dtype=torch.int64, device="meta")), "out"),
        (dict(num_tokens=2), "num_tokens"),
        (dict(sl=sl.long()), "seq_lens"),
    ]
    for kw, name in cases:
        with pytest.raises(ValueError, match=name):
            call(**kw)
    # allowed: interleave 128 divides the allocation block 64 * 2
    call(blocks_per_kv_block=2, cp_world_size=2, cp_interleave=128, bt=make_table([1, 2], seed=0))


# ----------------------------------------------------------------------------------------------
# GPU: CUDA-graph capture of all four ops, and no recompilation when the batch changes
# ----------------------------------------------------------------------------------------------
def _compiled_variants(jit_fn):
    caches = getattr(jit_fn, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps no device_caches")
    return sum(len(v[0]) for v in caches.values())


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_matches_reference():
    from dsv4_index.ops.compressed_slot_mapping.kernel import _compressed_slot_mapping_kernel
    from dsv4_index.ops.token_to_req.kernel import _token_to_req_kernel
    from dsv4_index.ops.window_indices.kernel import _window_indices_kernel
    dev = torch.device("cuda")
    B_pad, T_pad, width = 6, 48, 16
    qsl = torch.zeros(B_pad + 1, dtype=torch.int32, device=dev)
    sl = torch.zeros(B_pad, dtype=torch.int32, device=dev)
    bt = torch.zeros(B_pad, width, dtype=torch.int32, device=dev)
    rs = torch.zeros(B_pad, dtype=torch.int32, device=dev)
    bufs = dict(t2r=torch.empty(T_pad, dtype=torch.int32, device=dev),
                slot=torch.empty(T_pad, dtype=torch.int64, device=dev),
                comp=torch.empty(T_pad // 4 + B_pad, dtype=torch.int64, device=dev),
                cu=torch.empty(B_pad + 1, dtype=torch.int32, device=dev),
                win=torch.empty(T_pad, 128, dtype=torch.int32, device=dev),
                lens=torch.empty(T_pad, dtype=torch.int32, device=dev))

    def step(backend, b):
        kw = dict(num_tokens=T_pad, backend=backend)
        dsv4_index.token_to_req(qsl, T_pad, out=b["t2r"], backend=backend)
        dsv4_index.slot_mapping(qsl, sl, bt, 64, cp_world_size=2, cp_rank=1, cp_interleave=8,
                                out=b["slot"], **kw)
        dsv4_index.compressed_slot_mapping(qsl, sl, bt, 64, 4, compact=True, out=b["comp"],
                                           out_cu=b["cu"], **kw)
        dsv4_index.window_indices(qsl, sl, bt, 64, 128, replay_start=rs, out=b["win"],
                                  out_lens=b["lens"], **kw)

    def load(q_lens, seq_lens, seed):
        q_lens = q_lens + [0] * (B_pad - len(q_lens))
        seq_lens = seq_lens + [0] * (B_pad - len(seq_lens))
        a, s = batch_tensors(q_lens, seq_lens)
        qsl.copy_(a)
        sl.copy_(s)
        bt.copy_(make_table([width] * B_pad, seed=seed, extra_cols=0, extra_rows=0))
        rs.copy_(torch.tensor([max(x - q - 100, 0) for q, x in zip(q_lens, seq_lens)]))

    load([3, 1], [300, 70], 0)
    step("triton", bufs)
    n_before = [_compiled_variants(k) for k in (_token_to_req_kernel, _compressed_slot_mapping_kernel,
                                                _window_indices_kernel)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step("triton", bufs)
    for i, (q_lens, seq_lens) in enumerate([([1, 1, 4, 20], [900, 5, 260, 20]), ([], []),
                                            ([2] * 6, [64, 65, 66, 127, 128, 129]), ([40], [40])]):
        load(q_lens, seq_lens, i + 1)
        for v in bufs.values():
            v.fill_(POISON)
        graph.replay()
        want = {k: torch.full_like(v, POISON) for k, v in bufs.items()}
        step("reference", want)
        for k in bufs:
            assert torch.equal(bufs[k], want[k]), k
    # eager calls with other batch sizes / token counts compile nothing new
    for B in (1, 2, 3, 5, 17, 33):
        q = torch.arange(B, dtype=torch.int32, device=dev) % 3
        a = torch.zeros(B + 1, dtype=torch.int32, device=dev)
        a[1:] = torch.cumsum(q, 0)
        s = q + 7
        tb = torch.ones(B, 4, dtype=torch.int32, device=dev)
        T = int(a[-1]) + B
        dsv4_index.token_to_req(a, T)
        dsv4_index.compressed_slot_mapping(a, s, tb, 64, 4, compact=True, num_tokens=T)
        dsv4_index.window_indices(a, s, tb, 64, 128, num_tokens=T,
                                  replay_start=torch.zeros(B, dtype=torch.int32, device=dev))
    n_after = [_compiled_variants(k) for k in (_token_to_req_kernel, _compressed_slot_mapping_kernel,
                                               _window_indices_kernel)]
    assert n_after == n_before
