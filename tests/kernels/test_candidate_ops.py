"""V4.1 candidate ops (``candidate_blocks_to_physical``, ``candidate_topk_to_slots``): Triton kernel == reference
bit for bit on randomized batches (outputs poisoned), the references == plain-Python loops written from the
formula of docs/DESIGN.md §4 "Candidate blocks" (not from the code), and ``candidate_topk_to_slots`` ==
``topk_to_slots`` of the expanded rows."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import dsv4_index
from dsv4_index import reference as ref
from dsv4_index._common import interpreting

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
POISON = 12345
I32 = torch.iinfo(torch.int32)
MORE = settings(max_examples=4 * settings().max_examples)
needs_kernel = pytest.mark.skipif(DEV.type != "cuda" and not interpreting(),
                                  reason="Triton needs CUDA or TRITON_INTERPRET=1")


def make_batch(q_lens, ctx_lens, table_width, *, extra_rows=1, seed=0, device=DEV, neg=False):
    g = torch.Generator().manual_seed(seed)
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    sl = [c + q for c, q in zip(ctx_lens, q_lens)]
    bt = torch.randint(1, 50_000, (len(q_lens) + extra_rows, table_width), generator=g, dtype=torch.int32)
    if neg and bt.numel():
        bt.view(-1)[0] = -1  # NOTE: vLLM's "no block" placeholder
    return (torch.tensor(qsl, dtype=torch.int32, device=device), torch.tensor(sl, dtype=torch.int32, device=device),
            bt.to(device))


def _token(qsl, sl, t):
    """(request, position) of token t, or (None, None) for a padded token."""
    b = next((b for b in range(len(sl)) if qsl[b] <= t < qsl[b + 1]), None)
    return (None, None) if b is None else (b, sl[b] - (qsl[b + 1] - qsl[b]) + (t - qsl[b]))


def _slot(bt_row, row, S):
    """DESIGN §4 top-k slot of a request-local row (no DCP): -1 outside the table or in a -1 block."""
    if row // S >= len(bt_row):
        return -1
    bid = bt_row[row // S]
    return -1 if bid < 0 else bid * S + row % S


def python_phys(blocks, qsl, sl, bt, S, R, C, T):
    qsl, sl, bt, blocks = qsl.tolist(), sl.tolist(), bt.tolist(), blocks.tolist()
    phys, counts = [], []
    for t in range(T):
        b, pos = _token(qsl, sl, t)
        row = []
        for c in blocks[t] if b is not None else [-1] * len(blocks[0]):
            v = -1
            if b is not None and c >= 0 and c * C < (pos + 1) // R:
                s = _slot(bt[b], c * C, S)
                v = -1 if s < 0 else s // C
            row.append(v)
        phys.append(row)
        counts.append(sum(v != -1 for v in row))
    return phys, counts


def python_cand(blocks, cols, qsl, sl, bt, S, R, C, T, compact):
    qsl, sl, bt, blocks, cols = qsl.tolist(), sl.tolist(), bt.tolist(), blocks.tolist(), cols.tolist()
    out, lens = [], []
    for t in range(T):
        b, pos = _token(qsl, sl, t)
        row = []
        for j in cols[t] if b is not None else [-1] * len(cols[0]):
            v = -1
            if b is not None and 0 <= j < len(blocks[t]) * C and blocks[t][j // C] >= 0:
                r = blocks[t][j // C] * C + j % C
                if r < (pos + 1) // R:
                    v = _slot(bt[b], r, S)
            row.append(v)
        valid = [v for v in row if v != -1]
        lens.append(len(valid))
        out.append(valid + [-1] * (len(row) - len(valid)) if compact else row)
    return out, lens


@st.composite
def cases(draw, max_reqs=4):
    R = draw(st.sampled_from([1, 2, 4]))
    C = draw(st.sampled_from([1, 2, 4, 8]))
    S = C * draw(st.sampled_from([1, 2, 4]))
    B = draw(st.integers(0, max_reqs))
    q = [draw(st.sampled_from([0, 1, 1, 2, 3, 5])) for _ in range(B)]
    ctx = [max(0, draw(st.integers(0, 8)) * R * draw(st.sampled_from([1, S])) + draw(st.integers(-2, 2)))
           for _ in range(B)]
    T, pad, extra = sum(q), draw(st.integers(0, 3)), draw(st.integers(0, 2))
    nb, K = draw(st.sampled_from([1, 3, 8, 17])), draw(st.sampled_from([1, 5, 16, 33]))
    hi_b = max(1, max(ctx, default=0) // (R * C) + 3)
    bvals = st.one_of(st.integers(-1, hi_b), st.sampled_from([I32.max, I32.min, -2]))
    blocks = draw(st.lists(st.lists(bvals, min_size=nb, max_size=nb), min_size=T + pad + extra,
                           max_size=T + pad + extra))
    cdtype = draw(st.sampled_from([torch.int32, torch.int64]))
    cvals = st.one_of(st.integers(-1, nb * C + 2), st.sampled_from([I32.max, I32.min, -2]
                                                                    + ([2 ** 40] if cdtype == torch.int64 else [])))
    cols = draw(st.lists(st.lists(cvals, min_size=K, max_size=K), min_size=T + pad + extra, max_size=T + pad + extra))
    return dict(q=q, ctx=ctx, R=R, S=S, C=C, tw=draw(st.integers(1, 5)), pad=pad, compact=draw(st.booleans()),
                seed=draw(st.integers(0, 99)), neg=draw(st.booleans()),
                blocks=torch.tensor(blocks, dtype=torch.int32).reshape(-1, nb),
                cols=torch.tensor(cols, dtype=cdtype).reshape(-1, K))


def batch_of(c, device=DEV):
    qsl, sl, bt = make_batch(c["q"], c["ctx"], c["tw"], seed=c["seed"], device=device, neg=c["neg"])
    return qsl, sl, bt, sum(c["q"]) + c["pad"]


@needs_kernel
@given(cases())
def test_kernels_match_references(c):
    qsl, sl, bt, T = batch_of(c)
    blocks, cols = c["blocks"].to(DEV), c["cols"].to(DEV)
    geo = (bt, c["S"], c["R"], c["C"])
    out = torch.full((T, blocks.shape[1]), POISON, dtype=torch.int32, device=DEV)
    cnt = torch.full((T,), POISON, dtype=torch.int32, device=DEV)
    got = dsv4_index.candidate_blocks_to_physical(blocks, qsl, sl, *geo, out=out, out_counts=cnt, backend="triton")
    want = ref.candidate_blocks_to_physical(blocks, qsl, sl, *geo, num_tokens=T)
    assert got[0] is out and torch.equal(out, want[0]) and torch.equal(cnt, want[1])
    out = torch.full((T, cols.shape[1]), POISON, dtype=torch.int32, device=DEV)
    lens = torch.full((T,), POISON, dtype=torch.int32, device=DEV)
    dsv4_index.candidate_topk_to_slots(blocks, cols, qsl, sl, *geo, compact=c["compact"], out=out, out_lens=lens,
                                       backend="triton")
    want = ref.candidate_topk_to_slots(blocks, cols, qsl, sl, *geo, compact=c["compact"], num_tokens=T)
    assert torch.equal(out, want[0]) and torch.equal(lens, want[1])


@MORE
@given(cases())
def test_references_match_python_formula(c):
    qsl, sl, bt, T = batch_of(c, device="cpu")
    geo = (bt, c["S"], c["R"], c["C"])
    phys, cnt = ref.candidate_blocks_to_physical(c["blocks"], qsl, sl, *geo, num_tokens=T)
    assert (phys.tolist(), cnt.tolist()) == python_phys(c["blocks"], qsl, sl, *geo, T)
    slots, lens = ref.candidate_topk_to_slots(c["blocks"], c["cols"], qsl, sl, *geo, compact=c["compact"],
                                              num_tokens=T)
    assert (slots.tolist(), lens.tolist()) == python_cand(c["blocks"], c["cols"], qsl, sl, *geo, T, c["compact"])


@MORE
@given(cases(), st.sampled_from([(1, 0, 1), (2, 1, 1), (2, 0, 8), (4, 3, 2)]))
def test_equals_topk_to_slots_of_the_expanded_rows(c, cp):
    """The definition: candidate_topk_to_slots == topk_to_slots(rows), rows expanded here from the formula
    (int64, so out-of-range blocks give rows no token sees), DCP included."""
    qsl, sl, bt, T = batch_of(c, device="cpu")
    blocks, cols, C = c["blocks"], c["cols"], c["C"]
    rows = torch.full((max(T, 1), cols.shape[1]), -1, dtype=torch.int64)
    for t in range(min(T, cols.shape[0])):
        for k, j in enumerate(cols[t].tolist()):
            if 0 <= j < blocks.shape[1] * C and int(blocks[t, j // C]) >= 0:
                rows[t, k] = int(blocks[t, j // C]) * C + j % C
    kw = dict(cp_world_size=cp[0], cp_rank=cp[1], cp_interleave=cp[2], compact=c["compact"], num_tokens=T)
    got = ref.candidate_topk_to_slots(blocks, cols, qsl, sl, bt, c["S"], c["R"], C, **kw)
    want = ref.topk_to_slots(rows, qsl, sl, bt, c["S"], c["R"], **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if DEV.type == "cuda" or interpreting():
        d = DEV if DEV.type == "cuda" else "cpu"  # NOTE: the Triton backend takes CUDA tensors on a GPU machine
        args = (x.to(d) for x in (blocks, cols, qsl, sl, bt))
        out = dsv4_index.candidate_topk_to_slots(*args, c["S"], c["R"], C, backend="triton", **kw)
        assert torch.equal(out[0].cpu(), want[0]) and torch.equal(out[1].cpu(), want[1])


def test_hand_example():
    # one request, 3 tokens at positions 9, 10, 11 (R = 1: n_c 10, 11, 12); S = 4, C = 2
    qsl, sl = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([12], dtype=torch.int32)
    bt = torch.tensor([[4, 9, 7]], dtype=torch.int32)
    blocks = torch.tensor([[5, 0, -1]] * 3 + [[1, 1, 1]], dtype=torch.int32)   # row 3: a padded token
    cols = torch.tensor([[0, 1, 2, 5, 6, -1]] * 4, dtype=torch.int32)
    for backend in ("reference", "triton") if interpreting() or DEV.type == "cuda" else ("reference",):
        d = DEV if backend == "triton" else "cpu"
        args = (qsl.to(d), sl.to(d), bt.to(d), 4, 1, 2)
        phys, cnt = dsv4_index.candidate_blocks_to_physical(blocks.to(d), *args, num_tokens=4, backend=backend)
        # block 5 = rows 10-11: invisible at position 9 (n_c 10), slot 30 / 2 = 15 after; block 0: slot 16 / 2
        assert phys.tolist() == [[-1, 8, -1], [15, 8, -1], [15, 8, -1], [-1, -1, -1]] and cnt.tolist() == [1, 2, 2, 0]
        s, n = dsv4_index.candidate_topk_to_slots(blocks.to(d), cols.to(d), *args, num_tokens=4, backend=backend)
        # cols 0, 1 -> rows 10, 11; 2 -> row 0; 5 -> block 2 (-1); 6 -> past nb
        assert s.tolist() == [[-1, -1, 16, -1, -1, -1], [30, -1, 16, -1, -1, -1], [30, 31, 16, -1, -1, -1],
                              [-1] * 6] and n.tolist() == [1, 2, 3, 0]


def test_bad_arguments():
    qsl, sl, bt = make_batch([1, 2], [4, 4], 2, device="cpu")
    blocks, cols = torch.zeros(3, 2, dtype=torch.int32), torch.zeros(3, 4, dtype=torch.int32)
    f, g = ref.candidate_topk_to_slots, ref.candidate_blocks_to_physical
    with pytest.raises(ValueError, match="candidate_block_size = 3 does not divide rows_per_block = 4"):
        f(blocks, cols, qsl, sl, bt, 4, 1, 3)
    with pytest.raises(ValueError, match="candidate_block_size = 8 does not divide rows_per_block = 4"):
        g(blocks, qsl, sl, bt, 4, 1, 8)
    with pytest.raises(ValueError, match="blocks"):
        g(blocks.long(), qsl, sl, bt, 4, 1, 2)
    with pytest.raises(ValueError, match="blocks"):
        g(blocks[:2], qsl, sl, bt, 4, 1, 2)
    with pytest.raises(ValueError, match="cols"):
        f(blocks, cols[:2], qsl, sl, bt, 4, 1, 2)
    with pytest.raises(ValueError, match="cols"):
        f(blocks, cols.float(), qsl, sl, bt, 4, 1, 2)
    with pytest.raises(ValueError, match="int32"):
        g(blocks, qsl, sl, torch.full((2, 2), 2 ** 30, dtype=torch.int32), 4, 1, 2)
