"""indexer_lengths: Triton kernel == reference, reference == plain-Python formula (DESIGN §4)."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

MORE = settings(max_examples=4 * settings().max_examples)  # reference-only: cheap

import dsv4_index
from dsv4_index import reference as ref
from dsv4_index._common import interpreting
from dsv4_index.ops import IndexerLengths

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
POISON = 12345
needs_kernel = pytest.mark.skipif(DEV.type != "cuda" and not interpreting(),
                                  reason="Triton needs CUDA or TRITON_INTERPRET=1")


def make_batch(q_lens, ctx_lens, device=DEV):
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    return (torch.tensor(qsl, dtype=torch.int32, device=device),
            torch.tensor([c + q for c, q in zip(ctx_lens, q_lens)], dtype=torch.int32, device=device))


def python_indexer(qsl, sl, R, T, next_n=None, num_decodes=0, dec_rows=0, world=1, rank=0, inter=1):
    """DESIGN §4 written out in plain Python (lists)."""
    qsl, sl = qsl.tolist(), sl.tolist()

    def owned(n):                             # rows 0 .. n-1 this rank owns, counted one by one
        return sum(1 for c in range(n) if (c // inter) % world == rank)

    cu = [0]
    for s in sl:
        cu.append(cu[-1] + owned(s // R))
    lens, ks, ke = [], [], []
    for t in range(T):
        b = next((b for b in range(len(sl)) if qsl[b] <= t < qsl[b + 1]), None)
        if b is None:
            lens.append(0), ks.append(0), ke.append(0)
            continue
        pos = sl[b] - (qsl[b + 1] - qsl[b]) + (t - qsl[b])
        lens.append(owned((pos + 1) // R))
        ks.append(cu[b])
        ke.append(cu[b] + lens[-1])
    dec = None
    if next_n is not None:
        dec = [[0] * next_n for _ in range(dec_rows)]
        for b in range(num_decodes):
            q = qsl[b + 1] - qsl[b]
            for i in range(q):                # token i of request b sits in column i + next_n - q
                dec[b][i + next_n - q] = lens[qsl[b] + i]
    return lens, dec, ks, ke, cu


@st.composite
def cases(draw, max_reqs=5):
    R = draw(st.sampled_from([1, 2, 4, 128]))
    next_n = draw(st.sampled_from([None, 1, 2, 4]))
    B = draw(st.integers(0, max_reqs))
    nd = draw(st.integers(0, B)) if next_n else 0
    q = [draw(st.integers(1, next_n)) for _ in range(nd)]                  # decodes first
    q += [draw(st.sampled_from([0, 1, 2, 5, 9])) for _ in range(B - nd)]
    ctx = [max(0, draw(st.integers(0, 5)) * R + draw(st.integers(-2, 2))) for _ in range(B)]
    world = draw(st.sampled_from([1, 2, 4]))
    return dict(q=q, ctx=ctx, R=R, next_n=next_n, nd=nd if next_n else None,
                dec_extra=draw(st.integers(0, 2)), world=world,
                rank=draw(st.integers(0, world - 1)), inter=draw(st.sampled_from([1, 8, 64])),
                pad=draw(st.integers(0, 3)))


def kwargs_of(c):
    return dict(next_n=c["next_n"], num_decodes=c["nd"], cp_world_size=c["world"],
                cp_rank=c["rank"], cp_interleave=c["inter"])


@needs_kernel
@given(cases())
def test_kernel_matches_reference(c):
    qsl, sl = make_batch(c["q"], c["ctx"])
    T, B = sum(c["q"]) + c["pad"], len(c["q"])
    full = lambda *shape: torch.full(shape, POISON, dtype=torch.int32, device=DEV)  # noqa: E731
    outs = dict(out=full(T), out_ks=full(T), out_ke=full(T), out_cu=full(B + 1))
    if c["next_n"]:
        outs["out_decode"] = full(c["nd"] + c["dec_extra"], c["next_n"])
    got = dsv4_index.indexer_lengths(qsl, sl, c["R"], backend="triton", **outs, **kwargs_of(c))
    want = ref.indexer_lengths(qsl, sl, c["R"], num_tokens=T, **kwargs_of(c),
                               out_decode=full(c["nd"] + c["dec_extra"], c["next_n"])
                               if c["next_n"] else None)
    assert isinstance(got, IndexerLengths) and got.lens is outs["out"] and got.cu is outs["out_cu"]
    for g, w in zip(got, want):
        assert (g is None and w is None) or torch.equal(g, w)


@MORE
@given(cases())
def test_reference_matches_python_formula(c):
    qsl, sl = make_batch(c["q"], c["ctx"], device="cpu")
    T = sum(c["q"]) + c["pad"]
    dec_rows = (c["nd"] + c["dec_extra"]) if c["next_n"] else 0
    out_decode = torch.full((dec_rows, c["next_n"]), POISON, dtype=torch.int32) if c["next_n"] else None
    got = ref.indexer_lengths(qsl, sl, c["R"], num_tokens=T, out_decode=out_decode, **kwargs_of(c))
    want = python_indexer(qsl, sl, c["R"], T, c["next_n"], c["nd"] or 0, dec_rows, c["world"],
                          c["rank"], c["inter"])
    assert [x.tolist() if x is not None else None for x in got] == list(want)


@MORE
@given(st.sampled_from([2, 4]), st.sampled_from([1, 8, 64]), st.sampled_from([4, 128]),
       st.lists(st.integers(0, 5000), min_size=1, max_size=4))
def test_dcp_counts_sum_over_ranks(world, inter, R, ctx):
    qsl, sl = make_batch([2] * len(ctx), ctx, device="cpu")
    whole = ref.indexer_lengths(qsl, sl, R)
    parts = [ref.indexer_lengths(qsl, sl, R, cp_world_size=world, cp_rank=r, cp_interleave=inter)
             for r in range(world)]
    for field in ("lens", "cu"):
        assert torch.equal(sum(getattr(p, field) for p in parts), getattr(whole, field))


def test_hand_example():
    # R = 4; req 0 decode (q 1) at pos 8 -> n_c 2; req 1 spec (q 2) at pos 3, 4 -> 1, 1;
    # req 2 prefill (q 3) at pos 0, 1, 2 -> 0, 0, 0; one padded token.
    qsl = torch.tensor([0, 1, 3, 6], dtype=torch.int32)
    sl = torch.tensor([9, 5, 3], dtype=torch.int32)     # seq_len // 4 = 2, 1, 0 -> cu 0 2 3 3
    for fn in (ref.indexer_lengths, dsv4_index.indexer_lengths):
        r = fn(qsl, sl, 4, next_n=3, num_decodes=2, out=torch.full((7,), POISON, dtype=torch.int32))
        assert r.lens.tolist() == [2, 1, 1, 0, 0, 0, 0]
        assert r.decode_lens.tolist() == [[0, 0, 2], [0, 1, 1]]
        assert r.cu.tolist() == [0, 2, 3, 3]
        assert r.ks.tolist() == [0, 2, 2, 3, 3, 3, 0]
        assert r.ke.tolist() == [2, 3, 3, 3, 3, 3, 0]
        assert fn(qsl, sl, 4).decode_lens is None


@needs_kernel
def test_empty_batch_and_many_requests():
    qsl = torch.zeros(1, dtype=torch.int32, device=DEV)
    sl = torch.zeros(0, dtype=torch.int32, device=DEV)
    out = torch.full((4,), POISON, dtype=torch.int32, device=DEV)
    r = dsv4_index.indexer_lengths(qsl, sl, 4, out=out, backend="triton")
    assert (r.lens == 0).all() and (r.ks == 0).all() and (r.ke == 0).all() and r.cu.tolist() == [0]
    # more requests than one request tile (64) and one token tile (128): cu loop over tiles
    q = [1] * 150 + [3] * 20
    qsl, sl = make_batch(q, [(7 * i) % 300 for i in range(170)])
    got = dsv4_index.indexer_lengths(qsl, sl, 4, next_n=1, num_decodes=150, backend="triton")
    want = ref.indexer_lengths(qsl, sl, 4, next_n=1, num_decodes=150)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_bad_arguments():
    qsl, sl = make_batch([1, 3], [4, 4], device="cpu")
    f = ref.indexer_lengths
    with pytest.raises(ValueError, match="num_decodes"):
        f(qsl, sl, 4, next_n=2)
    with pytest.raises(ValueError, match="next_n"):
        f(qsl, sl, 4, num_decodes=1)
    with pytest.raises(ValueError, match="next_n"):
        f(qsl, sl, 4, next_n=2, num_decodes=2)          # q_len 3 > next_n for decode row 1
    with pytest.raises(ValueError, match="num_decodes"):
        f(qsl, sl, 4, next_n=4, num_decodes=3)
    with pytest.raises(ValueError, match="compress_ratio"):
        f(qsl, sl, 0)
    with pytest.raises(ValueError, match="query_start_loc"):
        f(torch.tensor([0, 3, 1], dtype=torch.int32), sl, 4)
    with pytest.raises(ValueError, match="seq_lens"):
        f(qsl, torch.tensor([1, 2], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="out_cu"):
        f(qsl, sl, 4, out_cu=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="out_ks"):
        f(qsl, sl, 4, out_ks=torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="out"):
        f(qsl, sl, 4, num_tokens=4, out=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="out_decode"):
        f(qsl, sl, 4, next_n=3, num_decodes=1, out_decode=torch.zeros(1, 2, dtype=torch.int32))


SCENARIOS = {   # (q_lens, contexts, num_decodes); R = 4
    "decode": ([1, 1, 1, 1], [0, 3, 15, 63], 4),
    "prefill": ([17, 5, 33], [0, 11, 31], 0),
    "mixed": ([1, 1, 20, 6], [47, 2, 0, 13], 2),
    "spec": ([2, 3, 4, 2], [14, 30, 60, 1], 4),
}


@needs_kernel
@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.parametrize("world,inter", [(1, 1), (2, 8), (4, 1)])
def test_scenarios_every_rank(name, world, inter):
    q, ctx, nd = SCENARIOS[name]
    qsl, sl = make_batch(q, ctx)
    T = sum(q) + 2
    for rank in range(world):
        kw = dict(next_n=4, num_decodes=nd, cp_world_size=world, cp_rank=rank, cp_interleave=inter)
        outs = {k: torch.full((T,), POISON, dtype=torch.int32, device=DEV)
                for k in ("out", "out_ks", "out_ke")}
        got = dsv4_index.indexer_lengths(qsl, sl, 4, backend="triton", **outs, **kw)
        want = ref.indexer_lengths(qsl, sl, 4, num_tokens=T, **kw)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
