"""Inputs that used to give a silent wrong answer are ValueErrors naming the argument (issue 13 §5),
under value checks (CPU inputs, or validate=True): int32 overflow of index-list slots in window
lists, causal rows wider than the width or the table."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dsv4_index
from dsv4_index._common import INT32_MAX

from helpers.slot_batches import DEVICE, batch_tensors, needs_triton, poisoned

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

BS = 64
LAST = INT32_MAX // BS  # the largest block id whose slots all fit int32 with 64 slots per block


def _window(bt, backend=None, **kw):
    # request 0: 3 tokens at positions 198..200 (window 128: positions 71..200, blocks 1..3)
    # request 1: 1 token at position 5 (block 0)
    qsl, sl = batch_tensors([3, 1], [201, 6])
    return dsv4_index.window_indices(qsl, sl, bt, BS, 128, backend=backend, **kw)


@pytest.mark.parametrize("backend", ["reference", None])
@pytest.mark.parametrize("col", [1, 2, 3])
def test_window_slots_past_int32_are_rejected(backend, col):
    bt = torch.tensor([[7, 8, 9, 10, 11], [12, 13, 14, 15, 16]], dtype=torch.int32)
    bt[0, col] = LAST
    _window(bt, backend)                    # the last slot of block LAST is INT32_MAX: fits
    bt[0, col] = LAST + 1
    with pytest.raises(ValueError, match=r"block_table\[0, %d\].*int32" % col):
        _window(bt, backend)
    bt[0, col] = -(2 ** 31) // BS - 1       # below int32 too
    with pytest.raises(ValueError, match="block_table.*int32"):
        _window(bt, backend)


@pytest.mark.parametrize("backend", ["reference", None])
def test_window_int32_check_reads_only_used_blocks(backend):
    bt = torch.tensor([[7, 8, 9, 10, 2 ** 31 - 1], [12, 2 ** 31 - 1, 14, 15, 16]], dtype=torch.int32)
    bt[0, 0] = 2 ** 30                      # block 0 of request 0 is outside its window
    _window(bt, backend)
    # the same under idx_mapping: rows are the mapped ones
    _window(bt.flip(0).contiguous(), backend, idx_mapping=torch.tensor([1, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"block_table\[0, 1\]"):  # request 0 now reads row 0's block 1
        _window(bt.flip(0).contiguous(), backend, idx_mapping=torch.tensor([0, 0], dtype=torch.int32))


@pytest.mark.parametrize("backend", ["reference", None])
def test_window_ring_and_circular_int32(backend):
    # ring of 4 columns: blocks 1, 2, 3 live in columns 1, 2, 3; block 0 of request 1 in column 0
    bt = torch.tensor([[2 ** 31 - 1, 8, 9, 10], [12, 2 ** 31 - 1, 2 ** 31 - 1, 2 ** 31 - 1]],
                      dtype=torch.int32)
    _window(bt, backend, ring=True)
    bt[0, 2] = LAST + 1
    with pytest.raises(ValueError, match=r"block_table\[0, 2\].*int32"):
        _window(bt, backend, ring=True)
    qsl, sl = batch_tensors([2], [300])
    circ = torch.tensor([[INT32_MAX // 256, 5]], dtype=torch.int32)
    dsv4_index.window_indices(qsl, sl, circ, 256, 128, circular_capacity=256, backend=backend)
    circ[0, 0] += 1
    with pytest.raises(ValueError, match="block_table.*int32"):
        dsv4_index.window_indices(qsl, sl, circ, 256, 128, circular_capacity=256, backend=backend)


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
@needs_triton
@given(st.integers(LAST - 3, LAST + 3), st.integers(0, 3))
def test_window_never_returns_a_wrapped_slot(bid, col):
    """Checked inputs: either a ValueError, or every listed slot equals the exact int64 value."""
    bt = torch.tensor([[7, 8, 9, 10, 11], [12, 13, 14, 15, 16]], dtype=torch.int32)
    bt[0, col] = bid
    bt = bt.to(DEVICE)
    qsl, sl = batch_tensors([3, 1], [201, 6], DEVICE)
    try:
        idx, lens = dsv4_index.window_indices(qsl, sl, bt, BS, 128, backend="triton", validate=True)
    except ValueError as e:
        assert "int32" in str(e) and bid > LAST
        return
    assert bid <= LAST or col == 0  # column 0 of request 0 is never read
    for t, p in enumerate([198, 199, 200]):
        want = [int(bt[0, x // BS]) * BS + x % BS for x in range(p - 127, p + 1)]
        assert idx[t, :lens[t]].tolist() == want


# ----------------------------------------------------------------------------------------------
# causal_compressed_indices: rows are never cut
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["reference", None])
def test_causal_rows_wider_than_width_or_table(backend):
    # R 4, S 2: a token at pos 39 sees 10 rows (blocks 0..4 of 2 rows)
    qsl, sl = batch_tensors([1, 2], [40, 7])
    bt = torch.arange(12, dtype=torch.int32).reshape(2, 6)
    f = lambda bt, width, **kw: dsv4_index.causal_compressed_indices(  # noqa: E731
        qsl, sl, bt, 2, 4, width, backend=backend, **kw)
    idx, lens = f(bt, 10)
    assert lens.tolist() == [10, 1, 1]
    with pytest.raises(ValueError, match="width = 9 .* 10 visible"):
        f(bt, 9)
    with pytest.raises(ValueError, match="width"):   # out= decides the width
        f(bt, 4, out=torch.zeros((3, 9), dtype=torch.int32))
    f(bt[:, :5], 10)
    with pytest.raises(ValueError, match="block_table has 4 columns"):
        f(bt[:, :4].contiguous(), 10)
    # DCP: rank 1 of 2 owns 5 of the 10 rows: a width of 5 and a table of 3 columns fit
    idx, lens = f(bt[:, :3].contiguous(), 5, cp_world_size=2, cp_rank=1)
    assert lens.tolist() == [5, 0, 0]
    with pytest.raises(ValueError, match="width"):
        f(bt, 4, cp_world_size=2, cp_rank=1)


@needs_triton
def test_causal_validate_flag_on_kernel_path():
    qsl, sl = batch_tensors([1], [40], DEVICE)
    bt = torch.arange(6, dtype=torch.int32, device=DEVICE).reshape(1, 6)
    with pytest.raises(ValueError, match="width"):
        dsv4_index.causal_compressed_indices(qsl, sl, bt, 2, 4, 9, backend="triton", validate=True)
    out = poisoned((1, 12), torch.int32, DEVICE)
    dsv4_index.causal_compressed_indices(qsl, sl, bt, 2, 4, 12, out=out, backend="triton")
    assert out[0].tolist() == list(range(10)) + [-1, -1]
