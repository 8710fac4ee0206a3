"""topk_to_slots: Triton kernel == reference, reference == plain-Python formula (DESIGN §4)."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

MORE = settings(max_examples=4 * settings().max_examples)  # reference-only: cheap

import dsv4_index
from dsv4_index import reference as ref
from dsv4_index._common import interpreting

from helpers.slot_batches import COMPRESSED_SCENARIOS

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
POISON = 12345
I32, I64 = torch.iinfo(torch.int32), torch.iinfo(torch.int64)
needs_kernel = pytest.mark.skipif(DEV.type != "cuda" and not interpreting(),
                                  reason="Triton needs CUDA or TRITON_INTERPRET=1")


def make_batch(q_lens, ctx_lens, table_width, *, extra_rows=1, seed=0, device=DEV):
    """(qsl, seq_lens, block_table): request b has q_lens[b] new tokens after ctx_lens[b] cached."""
    g = torch.Generator().manual_seed(seed)
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    sl = [c + q for c, q in zip(ctx_lens, q_lens)]
    bt = torch.randint(1, 50_000, (len(q_lens) + extra_rows, table_width), generator=g,
                       dtype=torch.int32)
    return (torch.tensor(qsl, dtype=torch.int32, device=device),
            torch.tensor(sl, dtype=torch.int32, device=device), bt.to(device))


def python_topk(topk, qsl, sl, bt, S, R, T, world=1, rank=0, inter=1, compact=False):
    """DESIGN §4 written out entry by entry in plain Python (lists)."""
    qsl, sl, bt, topk = qsl.tolist(), sl.tolist(), bt.tolist(), topk.tolist()
    rows, lens = [], []
    for t in range(T):
        b = next((b for b in range(len(sl)) if qsl[b] <= t < qsl[b + 1]), None)
        row = []
        for pick in topk[t] if b is not None else [-1] * len(topk[0]):
            slot = -1
            if b is not None:
                n_c = (sl[b] - (qsl[b + 1] - qsl[b]) + (t - qsl[b]) + 1) // R
                lc = (pick // (inter * world)) * inter + pick % inter
                if 0 <= pick < n_c and (pick // inter) % world == rank and lc // S < len(bt[b]):
                    slot = bt[b][lc // S] * S + lc % S
            row.append(slot)
        valid = [s for s in row if s != -1]
        lens.append(len(valid))
        rows.append(valid + [-1] * (len(row) - len(valid)) if compact else row)
    return rows, lens


@st.composite
def cases(draw, max_reqs=4):
    R = draw(st.sampled_from([1, 2, 4, 128]))
    S = draw(st.sampled_from([1, 2, 4, 64]))
    B = draw(st.integers(0, max_reqs))
    q = [draw(st.sampled_from([0, 1, 1, 2, 3, 4, 7])) for _ in range(B)]
    ctx = [max(0, draw(st.integers(0, 6)) * R * draw(st.sampled_from([1, S])) + draw(st.integers(-2, 2)))
           for _ in range(B)]
    world = draw(st.sampled_from([1, 2, 4]))
    T, pad = sum(q), draw(st.integers(0, 3))
    K = draw(st.sampled_from([1, 5, 16, 33]))
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    big = [I32.max, I32.min, -2, -1] + ([I64.max, I64.min, 2 ** 40] if dtype == torch.int64 else [])
    hi = max(1, max(ctx, default=0) // R + 3)
    vals = st.one_of(st.integers(-1, hi), st.sampled_from(big))
    extra = draw(st.integers(0, 2))
    topk = draw(st.lists(st.lists(vals, min_size=K, max_size=K), min_size=T + pad + extra,
                         max_size=T + pad + extra))
    return dict(q=q, ctx=ctx, R=R, S=S, tw=draw(st.integers(1, 4)), world=world,
                rank=draw(st.integers(0, world - 1)), inter=draw(st.sampled_from([1, 8, 64])),
                pad=pad, compact=draw(st.booleans()), seed=draw(st.integers(0, 99)),
                topk=torch.tensor(topk, dtype=dtype).reshape(-1, K))


def args_of(c, device=DEV):
    qsl, sl, bt = make_batch(c["q"], c["ctx"], c["tw"], seed=c["seed"], device=device)
    kw = dict(cp_world_size=c["world"], cp_rank=c["rank"], cp_interleave=c["inter"],
              compact=c["compact"])
    return (c["topk"].to(device), qsl, sl, bt, c["S"], c["R"]), kw, sum(c["q"]) + c["pad"]


@needs_kernel
@given(cases())
def test_kernel_matches_reference(c):
    args, kw, T = args_of(c)
    out = torch.full((T, args[0].shape[1]), POISON, dtype=torch.int32, device=DEV)
    out_lens = torch.full((T,), POISON, dtype=torch.int32, device=DEV)
    got = dsv4_index.topk_to_slots(*args, out=out, out_lens=out_lens, backend="triton", **kw)
    want = ref.topk_to_slots(*args, num_tokens=T, **kw)
    assert got[0] is out and got[1] is out_lens
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@MORE
@given(cases())
def test_reference_matches_python_formula(c):
    args, kw, T = args_of(c, device="cpu")
    got = ref.topk_to_slots(*args, num_tokens=T, **kw)
    rows, lens = python_topk(*args, T, c["world"], c["rank"], c["inter"], c["compact"])
    assert got[0].tolist() == rows and got[1].tolist() == lens


def test_hand_example():
    # req 0: 2 tokens at pos 6, 7 -> n_c 1, 2 (R = 4); S = 2, table width 1 (rows 0, 1 only).
    qsl = torch.tensor([0, 2], dtype=torch.int32)
    sl = torch.tensor([8], dtype=torch.int32)
    bt = torch.tensor([[5]], dtype=torch.int32)
    topk = torch.tensor([[1, 0, -1, 2 ** 31 - 1], [-7, 1, 2, 0], [0, 0, 0, 0]], dtype=torch.int32)
    for fn in (ref.topk_to_slots, dsv4_index.topk_to_slots):
        out = torch.full((3, 4), POISON, dtype=torch.int32)
        s, n = fn(topk, qsl, sl, bt, 2, 4, out=out)
        assert s.tolist() == [[-1, 10, -1, -1], [-1, 11, -1, 10], [-1] * 4] and n.tolist() == [1, 2, 0]
        s, n = fn(topk, qsl, sl, bt, 2, 4, compact=True, num_tokens=2)
        assert s.tolist() == [[10, -1, -1, -1], [11, 10, -1, -1]] and n.tolist() == [1, 2]
    # DCP world 2, interleave 1: rank 1 owns row 1 -> local row 0
    s, n = ref.topk_to_slots(topk[:2], qsl, sl, bt, 2, 4, cp_world_size=2, cp_rank=1)
    assert s.tolist() == [[-1, -1, -1, -1], [-1, 10, -1, -1]] and n.tolist() == [0, 1]


@needs_kernel
@pytest.mark.parametrize("compact", [False, True])
def test_wide_k_and_extra_topk_rows(compact):
    """K = 600 (BLOCK_K 1024), topk with more rows than T: only the first T rows are read."""
    qsl, sl, bt = make_batch([1, 3], [2000, 700], 40)
    g = torch.Generator().manual_seed(3)
    topk = torch.randint(-2, 800, (9, 600), generator=g).to(DEV)
    out = torch.full((6, 600), POISON, dtype=torch.int32, device=DEV)
    dsv4_index.topk_to_slots(topk, qsl, sl, bt, 64, 4, compact=compact, out=out, backend="triton")
    want, n = ref.topk_to_slots(topk, qsl, sl, bt, 64, 4, compact=compact, num_tokens=6)
    assert torch.equal(out, want) and int(n.sum()) > 0


@needs_kernel
def test_empty_batch():
    qsl = torch.zeros(1, dtype=torch.int32, device=DEV)
    sl = torch.zeros(0, dtype=torch.int32, device=DEV)
    bt = torch.zeros(0, 2, dtype=torch.int32, device=DEV)
    topk = torch.zeros(3, 8, dtype=torch.int64, device=DEV)
    out = torch.full((3, 8), POISON, dtype=torch.int32, device=DEV)
    lens = torch.full((3,), POISON, dtype=torch.int32, device=DEV)
    dsv4_index.topk_to_slots(topk, qsl, sl, bt, 4, 4, out=out, out_lens=lens, backend="triton")
    assert (out == -1).all() and (lens == 0).all()


def test_bad_arguments():
    qsl, sl, bt = make_batch([1, 2], [4, 4], 2, device="cpu")
    topk = torch.zeros(3, 4, dtype=torch.int32)
    f = ref.topk_to_slots
    with pytest.raises(ValueError, match="topk"):
        f(topk[0], qsl, sl, bt, 2, 4)
    with pytest.raises(ValueError, match="topk"):
        f(topk.float(), qsl, sl, bt, 2, 4)
    with pytest.raises(ValueError, match="topk"):
        f(topk[:2], qsl, sl, bt, 2, 4)
    with pytest.raises(ValueError, match="topk"):
        f(topk[:2], qsl, sl, bt, 2, 4, out=torch.zeros(3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="rows_per_block"):
        f(topk, qsl, sl, bt, 0, 4)
    with pytest.raises(ValueError, match="compress_ratio"):
        f(topk, qsl, sl, bt, 2, 0)
    with pytest.raises(ValueError, match="out"):
        f(topk, qsl, sl, bt, 2, 4, out=torch.zeros(3, 5, dtype=torch.int32))
    with pytest.raises(ValueError, match="out_lens"):
        f(topk, qsl, sl, bt, 2, 4, out_lens=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="query_start_loc"):
        f(topk, torch.tensor([0, 2, 1], dtype=torch.int32), sl, bt, 2, 4)
    with pytest.raises(ValueError, match="seq_lens"):
        f(topk, qsl, torch.tensor([1, 1], dtype=torch.int32), bt, 2, 4)
    with pytest.raises(ValueError, match="int32"):
        f(topk, qsl, sl, torch.full((2, 2), 2 ** 30, dtype=torch.int32), 4, 1)


SCENARIOS = COMPRESSED_SCENARIOS  # R = 4, S = 4 (block = 16 tokens)


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
@needs_kernel
@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.parametrize("world,inter", [(1, 1), (2, 8), (4, 1)])
def test_scenarios_every_rank(name, world, inter):
    q, ctx = SCENARIOS[name]
    T = sum(q) + 2
    g = torch.Generator().manual_seed(7)
    topk = torch.randint(-2, 24, (T + 1, 20), generator=g)
    topk[:, 0] = I64.max
    for rank in range(world):
        for compact in (False, True):
            c = dict(q=q, ctx=ctx, R=4, S=4, tw=5, world=world, rank=rank, inter=inter, pad=2,
                     compact=compact, seed=rank, topk=topk)
            args, kw, T = args_of(c)
            out = torch.full((T, 20), POISON, dtype=torch.int32, device=DEV)
            got = dsv4_index.topk_to_slots(*args, out=out, backend="triton", **kw)
            want = ref.topk_to_slots(*args, num_tokens=T, **kw)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ----------------------------------------------------------------------------------------------
# the pipeline entry: per-token rows and n_c precomputed, no search (launch_rows) == public op
# ----------------------------------------------------------------------------------------------
def python_token_info(q, ctx, R, T, rows=None):
    """(token_rows, token_nc) int32 ``[T]`` as a step build precomputes them: the table row of the
    token's request (``rows[b]`` or ``b``; -1 padded) and ``n_c = (pos + 1) // R`` (0 padded)."""
    tr, nc = [-1] * T, [0] * T
    t = 0
    for b, (n, c) in enumerate(zip(q, ctx)):
        for i in range(n):
            tr[t], nc[t] = (rows[b] if rows is not None else b), (c + i + 1) // R
            t += 1
    return torch.tensor(tr, dtype=torch.int32), torch.tensor(nc, dtype=torch.int32)


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
@needs_kernel
@given(cases(), st.integers(0, 3), st.booleans())
def test_launch_rows_equals_public_op_and_reference(c, extra, use_idx):
    from dsv4_index.ops.topk_to_slots import kernel, naive, topk_to_slots_rows
    (topk, qsl, sl, bt, S, R), kw, T = args_of(c)
    B, K = len(c["q"]), topk.shape[1]
    idx = None
    if use_idx:  # slot-indexed table: request b lives in row perm[b] of a bigger table
        g = torch.Generator().manual_seed(c["seed"])
        perm = torch.randperm(bt.shape[0] + 3, generator=g)
        big = torch.randint(1, 50_000, (bt.shape[0] + 3, bt.shape[1]), generator=g, dtype=torch.int32)
        big[perm[:bt.shape[0]]] = bt.cpu()
        bt, idx = big.to(DEV), perm[:B].to(torch.int32).to(DEV)
    full = lambda *s: torch.full(s, POISON, dtype=torch.int32, device=DEV)  # noqa: E731
    a = dsv4_index.topk_to_slots(topk, qsl, sl, bt, S, R, idx_mapping=idx, out=full(T, K),
                                 out_lens=full(T), backend="triton", **kw)
    want = ref.topk_to_slots(topk, qsl, sl, bt, S, R, idx_mapping=idx, num_tokens=T, **kw)
    trow, tnc = python_token_info(c["q"], c["ctx"], R, T, idx.tolist() if use_idx else None)
    cp = (c["world"], c["rank"], c["inter"])
    out, lens = full(T + extra, K), full(T + extra)
    kernel.launch_rows(topk, trow.to(DEV), tnc.to(DEV), bt, S, R, bt.shape[1], *cp, c["compact"], out,
                       lens, T)
    assert torch.equal(a[0], want[0]) and torch.equal(a[1], want[1])
    assert torch.equal(out[:T], want[0]) and torch.equal(lens[:T], want[1])
    assert bool((out[T:] == POISON).all()) and bool((lens[T:] == POISON).all())  # rows past T_out
    s, n = naive.topk_to_slots_rows(topk, trow.to(DEV), tnc.to(DEV), bt, S, R, bt.shape[1], *cp,
                                    c["compact"], T)
    assert torch.equal(s, want[0]) and torch.equal(n, want[1])
    for backend in ("triton", "reference"):
        s, n = topk_to_slots_rows(topk, trow.to(DEV), tnc.to(DEV), bt, S, R, T, cp_world_size=cp[0],
                                  cp_rank=cp[1], cp_interleave=cp[2], compact=c["compact"],
                                  out=full(T, K), out_lens=full(T), backend=backend)
        assert torch.equal(s, want[0]) and torch.equal(n, want[1])


@needs_kernel
@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_launch_rows_padded_and_garbage_rows(compact, dtype):
    """Padded tokens (-1 rows), rows outside the table, n_c larger than the table: -1 / 0, no read
    outside the table; huge int64 picks never alias a small row."""
    from dsv4_index.ops.topk_to_slots import kernel, naive
    bt = torch.randint(1, 1000, (3, 4), dtype=torch.int32, device=DEV)
    trow = torch.tensor([0, 2, -1, 3, 1, -7], dtype=torch.int32, device=DEV)
    tnc = torch.tensor([5, 100, 9, 4, 2 ** 31 - 1, 3], dtype=torch.int32, device=DEV)
    picks = [0, 1, 4, 15, 16, 99, -1, I32.max, I32.min] + ([2 ** 32, 2 ** 32 + 1, I64.max, I64.min]
                                                           if dtype == torch.int64 else [])
    topk = torch.tensor(picks, dtype=dtype, device=DEV).repeat(6, 1)
    K = topk.shape[1]
    out = torch.full((6, K), POISON, dtype=torch.int32, device=DEV)
    lens = torch.full((6,), POISON, dtype=torch.int32, device=DEV)
    kernel.launch_rows(topk, trow, tnc, bt, 4, 4, 4, 1, 0, 1, compact, out, lens, 6)
    want, want_lens = naive.topk_to_slots_rows(topk, trow, tnc, bt, 4, 4, 4, 1, 0, 1, compact, 6)
    assert torch.equal(out, want) and torch.equal(lens, want_lens)
    assert lens.tolist() == [3, 4, 0, 0, 4, 0]  # picks 0 1 4 15 fit the 16 rows of a table row
    # a logical width below the buffer's columns: blocks at or past it give -1
    kernel.launch_rows(topk, trow, tnc, bt, 4, 4, 2, 1, 0, 1, compact, out, lens, 6)
    want, want_lens = naive.topk_to_slots_rows(topk, trow, tnc, bt, 4, 4, 2, 1, 0, 1, compact, 6)
    assert torch.equal(out, want) and torch.equal(lens, want_lens)
    assert lens.tolist() == [3, 3, 0, 0, 3, 0]  # picks 0 1 4 fit 8 rows, 15 does not


@needs_kernel
def test_int64_picks_beyond_int32_never_alias():
    """A pick 2**32 + l must not act like l after the int32 narrowing (compares run on the input dtype)."""
    qsl, sl, bt = make_batch([2], [4000], 64)
    topk = torch.tensor([[5, 2 ** 32 + 5, -2 ** 32 + 5, 2 ** 31 + 5, I64.max],
                         [6, 2 ** 32 + 6, 2 ** 40, -1, I64.min]], dtype=torch.int64, device=DEV)
    for backend in ("triton", "reference"):
        s, n = dsv4_index.topk_to_slots(topk, qsl, sl, bt, 64, 4, backend=backend)
        assert n.tolist() == [1, 1] and bool((s[:, 1:] == -1).all())
        assert s[:, 0].tolist() == [int(bt[0, 0]) * 64 + 5, int(bt[0, 0]) * 64 + 6]


def test_tile_config_shapes():
    from dsv4_index.ops.topk_to_slots.kernel import tile_config
    assert tile_config(512) == (1, 512, 4)
    for K in (1, 5, 16, 33, 512, 600, 1024, 2048, 4096):
        bt, bk, nw = tile_config(K)
        assert bk >= K and bk & (bk - 1) == 0 and bt >= 1 and nw in (4, 8)
        assert bt * bk <= 512 or bt == 1
