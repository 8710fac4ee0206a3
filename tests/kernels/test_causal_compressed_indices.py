"""causal_compressed_indices: Triton kernel == reference, reference == plain-Python formula (DESIGN §4)."""

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


def python_causal(qsl, sl, bt, S, R, width, T, world=1, rank=0, inter=1):
    """DESIGN §4 written out token by token in plain Python (lists); None when a row does not fit
    the width or the table (the op must raise: rows are never cut)."""
    qsl, sl, bt = qsl.tolist(), sl.tolist(), bt.tolist()
    rows, lens = [], []
    for t in range(T):
        b = next((b for b in range(len(sl)) if qsl[b] <= t < qsl[b + 1]), None)
        entries = []
        if b is not None:
            pos = sl[b] - (qsl[b + 1] - qsl[b]) + (t - qsl[b])
            for c in range((pos + 1) // R):
                if (c // inter) % world != rank:
                    continue
                lc = (c // (inter * world)) * inter + c % inter
                if lc // S >= len(bt[b]) or len(entries) == width:
                    return None
                entries.append(bt[b][lc // S] * S + lc % S)
        lens.append(len(entries))
        rows.append(entries + [-1] * (width - len(entries)))
    return rows, lens


def _owned_rows(pos, R, world, rank, inter):
    return sum(1 for c in range((pos + 1) // R) if (c // inter) % world == rank)


@st.composite
def cases(draw, max_reqs=4):
    R = draw(st.sampled_from([1, 2, 4, 128]))
    S = draw(st.sampled_from([1, 2, 4, 64]))
    B = draw(st.integers(0, max_reqs))
    q = [draw(st.sampled_from([0, 1, 1, 2, 3, 4, 9])) for _ in range(B)]
    # contexts around ratio and block boundaries: k * R * S' + d
    ctx = [max(0, draw(st.integers(0, 6)) * R * draw(st.sampled_from([1, S])) + draw(st.integers(-2, 2)))
           for _ in range(B)]
    tw = draw(st.integers(1, 5))
    world = draw(st.sampled_from([1, 2, 4]))
    rank = draw(st.integers(0, world - 1))
    inter = draw(st.sampled_from([1, 8, 64]))
    width = draw(st.sampled_from([1, 3, 16, 40, 300]))
    pad = draw(st.integers(0, 3))
    if draw(st.integers(0, 3)):  # NOTE: mostly batches that fit; the rest must be rejected
        most = max([_owned_rows(c + i, R, world, rank, inter) for c, n in zip(ctx, q) for i in range(n)],
                   default=0)
        width, tw = max(width, most), max(tw, -(-most // S))
    return dict(q=q, ctx=ctx, R=R, S=S, tw=tw, world=world, rank=rank, inter=inter, width=width,
                pad=pad, seed=draw(st.integers(0, 99)))


def run_both(c, **extra):
    qsl, sl, bt = make_batch(c["q"], c["ctx"], c["tw"], seed=c["seed"])
    T = sum(c["q"]) + c["pad"]
    kw = dict(cp_world_size=c["world"], cp_rank=c["rank"], cp_interleave=c["inter"], **extra)
    out = torch.full((T, c["width"]), POISON, dtype=torch.int32, device=DEV)
    out_lens = torch.full((T,), POISON, dtype=torch.int32, device=DEV)
    got = dsv4_index.causal_compressed_indices(qsl, sl, bt, c["S"], c["R"], c["width"], out=out,
                                               out_lens=out_lens, backend="triton", validate=True, **kw)
    want = ref.causal_compressed_indices(qsl, sl, bt, c["S"], c["R"], c["width"], num_tokens=T, **kw)
    assert got[0] is out and got[1] is out_lens
    return got, want, (qsl, sl, bt, T)


def _fits(c):
    qsl, sl, bt = make_batch(c["q"], c["ctx"], c["tw"], seed=c["seed"], device="cpu")
    return python_causal(qsl, sl, bt, c["S"], c["R"], c["width"], sum(c["q"]), c["world"], c["rank"],
                         c["inter"]) is not None


@needs_kernel
@given(cases())
def test_kernel_matches_reference(c):
    if not _fits(c):  # a row wider than width or the table: both backends refuse, naming it
        for backend in ("triton", "reference"):
            with pytest.raises(ValueError, match="width|block_table"):
                qsl, sl, bt = make_batch(c["q"], c["ctx"], c["tw"], seed=c["seed"])
                dsv4_index.causal_compressed_indices(qsl, sl, bt, c["S"], c["R"], c["width"],
                                                     cp_world_size=c["world"], cp_rank=c["rank"],
                                                     cp_interleave=c["inter"], backend=backend,
                                                     validate=True)
        return
    got, want, _ = run_both(c)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@MORE
@given(cases())
def test_reference_matches_python_formula(c):
    qsl, sl, bt = make_batch(c["q"], c["ctx"], c["tw"], seed=c["seed"], device="cpu")
    T = sum(c["q"]) + c["pad"]
    kw = dict(cp_world_size=c["world"], cp_rank=c["rank"], cp_interleave=c["inter"], num_tokens=T)
    want = python_causal(qsl, sl, bt, c["S"], c["R"], c["width"], T, c["world"], c["rank"], c["inter"])
    if want is None:
        with pytest.raises(ValueError, match="width|block_table"):
            ref.causal_compressed_indices(qsl, sl, bt, c["S"], c["R"], c["width"], **kw)
        return
    idx, lens = ref.causal_compressed_indices(qsl, sl, bt, c["S"], c["R"], c["width"], **kw)
    assert idx.tolist() == want[0] and lens.tolist() == want[1]


def test_hand_example():
    # req 0: 1 token at pos 4 -> n_c = 1; req 1: 2 tokens at pos 7, 8 -> n_c = 2, 2; 1 padded token.
    qsl = torch.tensor([0, 1, 3], dtype=torch.int32)
    sl = torch.tensor([5, 9], dtype=torch.int32)
    bt = torch.tensor([[7, 3], [5, 9]], dtype=torch.int32)
    for fn in (ref.causal_compressed_indices, dsv4_index.causal_compressed_indices):
        out = torch.full((4, 3), POISON, dtype=torch.int32)
        idx, lens = fn(qsl, sl, bt, 2, 4, 3, out=out)
        assert idx.tolist() == [[14, -1, -1], [10, 11, -1], [10, 11, -1], [-1, -1, -1]]
        assert lens.tolist() == [1, 2, 2, 0]
    # DCP world 2, interleave 1: rank 1 owns rows 1, 3, ... -> local rows 0, 1, ...
    sl2 = torch.tensor([5, 16], dtype=torch.int32)     # req 1 tokens at pos 14, 15 -> n_c 3, 4
    idx, lens = ref.causal_compressed_indices(qsl, sl2, bt, 2, 4, 3, cp_world_size=2, cp_rank=1)
    assert idx.tolist() == [[-1, -1, -1], [10, -1, -1], [10, 11, -1]] and lens.tolist() == [0, 1, 2]


@MORE
@given(st.sampled_from([2, 4]), st.sampled_from([1, 8, 64]), st.sampled_from([4, 128]),
       st.lists(st.integers(0, 3000), min_size=1, max_size=4))
def test_dcp_ranks_partition_rows(world, inter, R, ctx):
    """Identity table (slot = local row): over the ranks every visible row appears exactly once."""
    q = [1] * len(ctx)
    S, width = 8, 1024
    qsl, sl, _ = make_batch(q, ctx, 1, device="cpu")
    bt = torch.arange(width // S, dtype=torch.int32).repeat(len(ctx), 1)
    n_c = ((sl.long()) // R).tolist()                  # token pos = seq_len - 1
    seen = [[] for _ in ctx]
    total = [0] * len(ctx)
    for rank in range(world):
        idx, lens = ref.causal_compressed_indices(qsl, sl, bt, S, R, width, cp_world_size=world,
                                                  cp_rank=rank, cp_interleave=inter)
        for t in range(len(ctx)):
            total[t] += int(lens[t])
            for lc in idx[t, : int(lens[t])].tolist():
                seen[t].append(((lc // inter) * world + rank) * inter + lc % inter)
            assert (idx[t, int(lens[t]):] == -1).all()
    assert total == n_c
    assert [sorted(s) for s in seen] == [list(range(n)) for n in n_c]


@needs_kernel
@pytest.mark.parametrize("R,ctx", [(4, [0, 3, 2, 6]), (128, [127, 126, 0, 255])])
def test_boundaries_pos0_and_ratio_edges(R, ctx):
    """pos 0, pos = R - 1 (first row completes), and wide rows spanning two column tiles."""
    c = dict(q=[1, 1, 2, 1], ctx=ctx, R=R, S=2, tw=200, world=1, rank=0, inter=1, width=300,
             pad=2, seed=1)
    got, want, (_, sl, _, _) = run_both(c)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    n_c = [(p + 1) // R for p in (ctx[0], ctx[1], ctx[2], ctx[2] + 1, ctx[3])] + [0, 0]
    assert got[1].tolist() == n_c


@needs_kernel
def test_empty_batch_and_tail_sentinel():
    qsl = torch.zeros(1, dtype=torch.int32, device=DEV)
    sl = torch.zeros(0, dtype=torch.int32, device=DEV)
    bt = torch.zeros(0, 4, dtype=torch.int32, device=DEV)
    out = torch.full((5, 8), POISON, dtype=torch.int32, device=DEV)
    lens = torch.full((5,), POISON, dtype=torch.int32, device=DEV)
    dsv4_index.causal_compressed_indices(qsl, sl, bt, 4, 4, 8, out=out, out_lens=lens,
                                         backend="triton")
    assert (out == -1).all() and (lens == 0).all()
    idx, n = dsv4_index.causal_compressed_indices(qsl, sl, bt, 4, 4, 8)
    assert idx.shape == (0, 8) and n.shape == (0,)


@needs_kernel
def test_out_wider_than_width_is_filled():
    qsl, sl, bt = make_batch([1, 3], [40, 9], 6)  # 24 rows of table; token 0 sees 20
    out = torch.full((6, 24), POISON, dtype=torch.int32, device=DEV)
    dsv4_index.causal_compressed_indices(qsl, sl, bt, 4, 2, 20, out=out, backend="triton")
    want, _ = ref.causal_compressed_indices(qsl, sl, bt, 4, 2, 24, num_tokens=6)
    assert torch.equal(out, want)


@needs_kernel
@pytest.mark.parametrize("width,tw", [(3, 8), (64, 2), (2, 1)])
def test_unchecked_rows_are_clamped_in_bounds(width, tw):
    """No value checks (the kernel entry, as on unvalidated CUDA inputs): rows wider than the width or
    the table are clamped to min(width, cols * S), never read past the table; kernel == reference."""
    from dsv4_index.ops.causal_compressed_indices import kernel, naive
    qsl, sl, bt = make_batch([1, 3, 2], [40, 9, 70], tw)
    out = torch.full((8, width), POISON, dtype=torch.int32, device=DEV)
    lens = torch.full((8,), POISON, dtype=torch.int32, device=DEV)
    kernel.launch(qsl, sl, bt, None, 4, 2, 1, 0, 1, out, lens)
    want, want_lens = naive.causal_compressed_indices(qsl, sl, bt, 4, 2, torch.arange(3, device=DEV), 1, 0, 1, 8,
                                                     width)
    assert torch.equal(out, want) and torch.equal(lens, want_lens)
    assert int(lens.max()) == min(width, tw * 4)


def test_bad_arguments():
    qsl, sl, bt = make_batch([1, 2], [4, 4], 2, device="cpu")
    f = ref.causal_compressed_indices
    for kw, name in [(dict(width=0), "width"), (dict(rows_per_block=0), "rows_per_block"),
                     (dict(compress_ratio=0), "compress_ratio")]:
        args = dict(rows_per_block=2, compress_ratio=4, width=4) | kw
        with pytest.raises(ValueError, match=name):
            f(qsl, sl, bt, **args)
    with pytest.raises(ValueError, match="query_start_loc"):
        f(torch.tensor([0, 2, 1], dtype=torch.int32), sl, bt, 2, 4, 4)
    with pytest.raises(ValueError, match="seq_lens"):
        f(qsl, torch.tensor([1, 1], dtype=torch.int32), bt, 2, 4, 4)
    with pytest.raises(ValueError, match="out"):
        f(qsl, sl, bt, 2, 4, 4, out=torch.zeros(3, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="out"):
        f(qsl, sl, bt, 2, 4, 4, num_tokens=3, out=torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="out"):
        f(qsl, sl, bt, 2, 4, 4, out=torch.zeros(3, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="out_lens"):
        f(qsl, sl, bt, 2, 4, 4, out_lens=torch.zeros(3, dtype=torch.float32))
    with pytest.raises(ValueError, match="cp_rank"):
        f(qsl, sl, bt, 2, 4, 4, cp_world_size=2, cp_rank=2)
    big = torch.full((2, 2), 2 ** 30, dtype=torch.int32)     # 2**30 * 4 overflows int32
    with pytest.raises(ValueError, match="int32"):
        f(qsl, sl, big, 4, 1, 8)
    # a width or a table narrower than the visible rows is an error: rows are never cut (DESIGN §4)
    with pytest.raises(ValueError, match="width"):
        f(qsl, torch.tensor([40, 40], dtype=torch.int32), bt, 2, 1, 3)
    with pytest.raises(ValueError, match="block_table"):
        f(qsl, torch.tensor([40, 40], dtype=torch.int32), bt, 2, 1, 64)


SCENARIOS = COMPRESSED_SCENARIOS  # R = 4, S = 4 (block = 16 tokens)


@needs_kernel
@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.parametrize("world,inter", [(1, 1), (2, 8), (4, 1)])
def test_scenarios_every_rank(name, world, inter):
    q, ctx = SCENARIOS[name]
    for rank in range(world):
        c = dict(q=q, ctx=ctx, R=4, S=4, tw=6, world=world, rank=rank, inter=inter, width=24,
                 pad=3, seed=rank)
        got, want, _ = run_both(c)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
