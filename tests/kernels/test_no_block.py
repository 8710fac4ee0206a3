"""A negative block id is no block (vLLM's ``-1`` placeholder, e.g. its ring test
``test_c128_null_block_keeps_all_slots_invalid``): every op gives ``-1`` where it would give a slot of
that block, and the rest of its output is unchanged.

The expected values do not come from the code under test's handling of ``-1``: each call is compared
with the same call on a table where every ``-1`` is replaced by a marker block ``M`` (an ordinary id),
whose slots are ``[M * S, (M + 1) * S)``. Entries in that range must become ``-1`` (and, for top-k,
stop counting as valid); every other entry must be equal. Both backends, outputs poisoned first.
"""

import pytest
import torch
from hypothesis import given, strategies as st

import dsv4_index
from dsv4_index._triton import HAVE_TRITON

POISON = -7777
MARKER = 4000
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BACKENDS = ["reference"] + (["triton"] if HAVE_TRITON else [])


@st.composite
def batches(draw):
    """(qsl, seq_lens, table with some -1 entries) on the CPU: a few requests, block size 4."""
    B = draw(st.integers(1, 3))
    q = [draw(st.integers(1, 6)) for _ in range(B)]
    ctx = [draw(st.integers(0, 20)) for _ in range(B)]
    cols = 8
    table = [[draw(st.one_of(st.just(-1), st.integers(0, 50))) for _ in range(cols)] for _ in range(B)]
    qsl = [0]
    for n in q:
        qsl.append(qsl[-1] + n)
    return (torch.tensor(qsl, dtype=torch.int32), torch.tensor([c + n for c, n in zip(ctx, q)], dtype=torch.int32),
            torch.tensor(table, dtype=torch.int32))


def marked(bt):
    return torch.where(bt < 0, torch.full_like(bt, MARKER), bt)


def masked(out, unit):
    """``out`` with the marker block's slots turned into ``-1`` (what a ``-1`` block must give)."""
    hit = (out >= MARKER * unit) & (out < (MARKER + 1) * unit)
    return torch.where(hit, torch.full_like(out, -1), out), hit


def poison(shape, dtype, device):
    return torch.full(shape, POISON, dtype=dtype, device=device)


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
@pytest.mark.parametrize("backend", BACKENDS)
@given(batches())
def test_slot_mapping_window_and_ring(backend, batch):
    device = DEVICE
    qsl, sl, bt = (x.to(device) for x in batch)
    T = int(qsl[-1]) + 2
    bs = 4
    for kw in (dict(), dict(ring=True), dict(circular_capacity=32)):   # plain, ring, 8-block circular
        args = dict(num_tokens=T, backend=backend, **kw)
        got = dsv4_index.slot_mapping(qsl, sl, bt, bs, out=poison((T,), torch.int64, device), **args)
        ref = dsv4_index.slot_mapping(qsl, sl, marked(bt), bs, out=poison((T,), torch.int64, device), **args)
        assert torch.equal(got, masked(ref, bs)[0]), kw
        got_i, got_n = dsv4_index.window_indices(qsl, sl, bt, bs, 8, out=poison((T, 8), torch.int32, device),
                                                 out_lens=poison((T,), torch.int32, device), **args)
        ref_i, ref_n = dsv4_index.window_indices(qsl, sl, marked(bt), bs, 8,
                                                 out=poison((T, 8), torch.int32, device),
                                                 out_lens=poison((T,), torch.int32, device), **args)
        assert torch.equal(got_i, masked(ref_i, bs)[0]), kw
        assert torch.equal(got_n, ref_n), kw      # NOTE: lens count window positions, masked or not


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
@pytest.mark.parametrize("backend", BACKENDS)
@given(batches())
def test_compressed_ops_and_topk(backend, batch):
    device = DEVICE
    qsl, sl, bt = (x.to(device) for x in batch)
    T = int(qsl[-1]) + 2
    S, R = 2, 4       # 2 compressed rows per block, one row per 4 tokens
    got = dsv4_index.compressed_slot_mapping(qsl, sl, bt, S, R, num_tokens=T, backend=backend,
                                             out=poison((T,), torch.int64, device))
    ref = dsv4_index.compressed_slot_mapping(qsl, sl, marked(bt), S, R, num_tokens=T, backend=backend,
                                             out=poison((T,), torch.int64, device))
    assert torch.equal(got, masked(ref, S)[0])
    got_i, got_n = dsv4_index.causal_compressed_indices(qsl, sl, bt, S, R, 16, num_tokens=T, backend=backend,
                                                        out=poison((T, 16), torch.int32, device),
                                                        out_lens=poison((T,), torch.int32, device))
    ref_i, ref_n = dsv4_index.causal_compressed_indices(qsl, sl, marked(bt), S, R, 16, num_tokens=T,
                                                        backend=backend, out=poison((T, 16), torch.int32, device),
                                                        out_lens=poison((T,), torch.int32, device))
    assert torch.equal(got_i, masked(ref_i, S)[0])
    assert torch.equal(got_n, ref_n)
    g = torch.Generator().manual_seed(int(sl.sum()))
    topk = torch.randint(-1, 8, (T, 6), generator=g, dtype=torch.int32).to(device)
    for compact in (False, True):
        got_s, got_l = dsv4_index.topk_to_slots(topk, qsl, sl, bt, S, R, num_tokens=T, backend=backend,
                                                compact=compact, out=poison((T, 6), torch.int32, device),
                                                out_lens=poison((T,), torch.int32, device))
        ref_s, ref_l = dsv4_index.topk_to_slots(topk, qsl, sl, marked(bt), S, R, num_tokens=T, backend=backend,
                                                out=poison((T, 6), torch.int32, device),
                                                out_lens=poison((T,), torch.int32, device))
        want, hit = masked(ref_s, S)
        # NOTE: a pick in no block is not valid: one fewer per hit; compact keeps the valid ones in order
        assert torch.equal(got_l, ref_l - hit.sum(1).to(torch.int32)), compact
        if compact:
            rows = [[x for x in r if x >= 0] for r in want.cpu().tolist()]
            want = torch.tensor([r + [-1] * (6 - len(r)) for r in rows], dtype=torch.int32)
        assert torch.equal(got_s.cpu(), want.cpu()), compact
