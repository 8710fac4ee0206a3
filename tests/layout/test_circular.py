"""Circular groups as vLLM runs them (DESIGN §4 "circular group", issue #20 item 2; vLLM PR #58074 and
its ring test, vllm-ascend's fused slot-mapping tests).

``slot_mapping`` is the address map of every token, ``tail_slot_mapping`` the write plan (the last
``capacity`` tokens of each request's chunk), window lists split at the chunk start: ``x >= 0`` a ring
slot, ``x <= -2`` the step's token row ``-2 - x``. The consumer is emulated here with a ring that stores
positions: every window must resolve to exactly its positions, reads before the tail is written.
"""

import random

import pytest
import torch

import dsv4_index
from dsv4_index import DSV4Layout
from dsv4_index._common import cdiv
from dsv4_index.frontend import NewRequest, RunningRequest, StepInput

from helpers.pipelines import DEVICE, HAS_TRITON, compare_step, three_pipelines

BACKENDS = ["reference"] + (["triton"] if HAS_TRITON else [])
W = 128


def _batch(chunks, device):
    """chunks: [(first position, q)] per request -> (query_start_loc, seq_lens)."""
    qsl, sl = [0], []
    for s, q in chunks:
        qsl.append(qsl[-1] + q)
        sl.append(s + q)
    return (torch.tensor(qsl, dtype=torch.int32, device=device),
            torch.tensor(sl, dtype=torch.int32, device=device))


def _ops(chunks, blocks, cap, backend, validate=False, window=W):
    qsl, sl = _batch(chunks, DEVICE)
    bt = torch.tensor([[b] for b in blocks], dtype=torch.int32, device=DEVICE)
    T = int(qsl[-1])
    kw = dict(circular_capacity=cap, backend=backend, num_tokens=T, validate=validate)
    addr = dsv4_index.slot_mapping(qsl, sl, bt, cap, out=torch.full((T,), 7777, dtype=torch.int64, device=DEVICE), **kw)
    tail = dsv4_index.slot_mapping(qsl, sl, bt, cap, tail=True,
                                   out=torch.full((T,), 7777, dtype=torch.int64, device=DEVICE), **kw)
    idx, lens = dsv4_index.window_indices(qsl, sl, bt, cap, window,
                                          out=torch.full((T, window), 7777, dtype=torch.int32, device=DEVICE),
                                          out_lens=torch.full((T,), 7777, dtype=torch.int32, device=DEVICE), **kw)
    return addr.cpu(), tail.cpu(), idx.cpu(), lens.cpu()


class Ring:
    """The consumer: ``store[slot]`` holds (position, draft?) of what was written there."""

    def __init__(self):
        self.store = {}

    def read(self, idx_row, n, step_rows):
        """Resolve one window row: ring slots from the store, in-step rows from this step's tokens."""
        out = []
        for x in idx_row[:n]:
            x = int(x)
            assert x != -1
            out.append(step_rows[-2 - x] if x <= -2 else self.store.get(x, ("empty", None)))
        return out

    def write(self, plan, step_rows):
        for t, s in enumerate(plan.tolist()):
            if s >= 0:
                self.store[s] = step_rows[t]


@pytest.mark.parametrize("backend", BACKENDS)
def test_vllm_ring_case_chunk_longer_than_capacity(backend):
    # vLLM's ring test: capacity 256, the ring holds 128..249, the chunk is 250..520 (271 tokens)
    cap, bid, s, e = 256, 3, 250, 521
    ring = Ring()
    ring.store = {bid * cap + p % cap: (p, False) for p in range(128, 250)}
    addr, tail, idx, lens = _ops([(s, e - s)], [bid], cap, backend)
    pos = list(range(s, e))
    assert addr.tolist() == [bid * cap + p % cap for p in pos]           # every token: two share a slot
    assert tail.tolist() == [bid * cap + p % cap if p >= e - cap else -1 for p in pos]
    live = [x for x in tail.tolist() if x >= 0]
    assert len(set(live)) == len(live) == cap                            # the plan: distinct rows
    rows = [(p, False) for p in pos]
    for p in (255, 383, 511):                                            # the test's boundaries
        t = p - s
        got = ring.read(idx[t], int(lens[t]), rows)
        assert [q for q, _ in got] == list(range(p - W + 1, p + 1)), p
        assert all((x <= -2) == (q >= s) for x, q in zip(idx[t].tolist(), range(p - W + 1, p + 1)))
    for t, p in enumerate(pos[W - 2:], W - 2):                           # every window the ring covers
        assert [q for q, _ in ring.read(idx[t], int(lens[t]), rows)] == list(range(max(p - W + 1, 0), p + 1))
    ring.write(tail, rows)                                               # after the reads
    assert sorted(q for q, _ in ring.store.values()) == list(range(265, 521))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.slow  # ./dev quick skips it
def test_drafts_at_all_128_phases(backend):
    # capacity = 128 * cdiv(128 + k, 128) (vLLM): a verify step's writes never reach the rows the next
    # step reads after a rejection; 128 requests, one per phase of the open 128-row group
    k = 3
    cap = 128 * cdiv(128 + k, 128)
    rng = random.Random(0)
    blocks = list(range(1, 129))
    nc = [1000 + ph for ph in range(128)]
    ring = Ring()
    for b, n in zip(blocks, nc):  # committed history
        for p in range(n - cap, n):
            ring.store[b * cap + p % cap] = (p, False)
    for step in range(3):
        chunks = [(n, 1 + k) for n in nc]
        addr, tail, idx, lens = _ops(chunks, blocks, cap, backend)
        rows = [(n + j, j > 0) for n in nc for j in range(1 + k)]  # token 0 is real, drafts after it
        for b, n in enumerate(nc):
            for j in range(1 + k):
                t = b * (1 + k) + j
                got = ring.read(idx[t], int(lens[t]), rows)
                want = [(q, q > n) for q in range(n + j - W + 1, n + j + 1)]
                assert got == want, (step, b, j)  # committed rows from the ring, this step's from the step
        assert torch.equal(tail, addr)  # q <= capacity: every token is in the tail
        ring.write(tail, rows)
        new = [n + 1 + rng.randint(0, k) for n in nc]  # rejections: the drafts' rows stay stale, unread
        for b, n, m in zip(blocks, nc, new):  # accepted drafts are real tokens now
            for p in range(n, m):
                assert ring.store[b * cap + p % cap] == (p, p > n)
                ring.store[b * cap + p % cap] = (p, False)
        nc = new


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_requests_and_padding(backend):
    cap = 16
    qsl, sl = _batch([(5, 40), (30, 3)], DEVICE)
    bt = torch.tensor([[2], [5]], dtype=torch.int32, device=DEVICE)
    out = torch.full((50,), 7777, dtype=torch.int64, device=DEVICE)
    tail = dsv4_index.slot_mapping(qsl, sl, bt, cap, circular_capacity=cap, tail=True, out=out, backend=backend)
    pos = [(0, p) for p in range(5, 45)] + [(1, p) for p in range(30, 33)]
    want = [int(bt[b, 0]) * cap + p % cap if p >= int(sl[b]) - cap else -1 for b, p in pos] + [-1] * 7
    assert tail.cpu().tolist() == want


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cap", [32, 64, 128])
def test_vllm_ascend_long_requests_on_small_rings(backend, cap):
    # vllm-ascend's fused slot-mapping cases: 512- and 600-token requests on 32/64/128-row rings, one
    # block per request, beside a decode and a short chunk; plain-Python formulas (window 8: C4 state)
    chunks, blocks, w = [(0, 512), (40, 600), (700, 1), (90, 7)], [7, 3, 11, 5], 8
    addr, tail, idx, lens = _ops(chunks, blocks, cap, backend, validate=True, window=w)
    want_a, want_t = [], []
    for (s, q), b in zip(chunks, blocks):
        for p in range(s, s + q):
            want_a.append(b * cap + p % cap)
            want_t.append(b * cap + p % cap if p >= s + q - cap else -1)
    assert addr.tolist() == want_a and tail.tolist() == want_t
    qs = 0
    for (s, q), b in zip(chunks, blocks):
        for p in range(s, s + q):
            row = [b * cap + x % cap if x < s else -2 - (qs + x - s) for x in range(max(p - w + 1, 0), p + 1)]
            assert idx[qs + p - s].tolist() == row + [-1] * (w - len(row)) and int(lens[qs + p - s]) == len(row)
        qs += q


def test_collisions_only_under_validate():
    # two requests sharing a ring block: the write plan collides; checked only with validate=True, the
    # same on every device (no value check without it, CPU included)
    qsl, sl = _batch([(0, 20), (0, 20)], DEVICE)
    bt = torch.tensor([[4], [4]], dtype=torch.int32, device=DEVICE)
    for backend in BACKENDS:
        dsv4_index.slot_mapping(qsl, sl, bt, 16, circular_capacity=16, backend=backend, num_tokens=40)
        with pytest.raises(ValueError, match="block_table: requests 0 and 1 both write slot"):
            dsv4_index.slot_mapping(qsl, sl, bt, 16, circular_capacity=16, backend=backend, validate=True)
    ok = torch.tensor([[4], [5]], dtype=torch.int32, device=DEVICE)
    dsv4_index.slot_mapping(qsl, sl, ok, 16, circular_capacity=16, validate=True)  # one long chunk: no collision
    with pytest.raises(ValueError, match="tail"):
        dsv4_index.slot_mapping(qsl, sl, ok, 16, tail=True)


# ----------------------------------------------------------------------------------------------
# the pipeline: long chunks accepted, fused == unfused == reference, the ring emulated over a trace
# ----------------------------------------------------------------------------------------------
def _steps(layout, plan):
    """plan: [{req: q}] per step, one request stream each; vLLM-style whole allocation blocks."""
    import itertools
    ids, have, done = itertools.count(1), {}, {}
    for nst in plan:
        new, run = [], []
        for r, q in nst.items():
            h = have.setdefault(r, [0] * layout.num_groups)
            c = done.get(r, 0)
            lists = []
            for g, gs in enumerate(layout.groups):
                n = 1 if gs.kind == "circular" else cdiv(c + q, gs.alloc_block_size)
                lists.append([next(ids) for _ in range(max(n - h[g], 0))])
                h[g] = max(h[g], n)
            (run if r in done else new).append((r, tuple(lists), c))
            done[r] = c + q
        yield StepInput([NewRequest(*x) for x in new], [RunningRequest(*x) for x in run], dict(nst))


@pytest.mark.slow  # ./dev quick skips it
def test_pipeline_long_chunks_on_a_ring():
    lay = DSV4Layout.from_config("flash", max_model_len=2048, circular={"c128_state": 256})
    cg = lay.group("c128_state")
    assert cg.kind == "circular" and "tail_slot_mapping" in lay.channels["c128_state"].outputs
    if HAS_TRITON:
        pipes = three_pipelines(lay, 4, 600, num_speculative_tokens=3, validate=True)
    else:
        pipes = {"reference": dsv4_index.MetadataPipeline(lay, 4, 600, "cpu", 3, backend="reference",
                                                          validate=True)}
    # a 600-token chunk on a 256-row ring ("at most 129 fit with its window" before), then mixed steps
    plan = [{"a": 600}, {"a": 300, "b": 290}, {"a": 4, "b": 4, "c": 500}, {"a": 1, "b": 4, "c": 4}]
    ring = Ring()
    for i, step in enumerate(_steps(lay, plan)):
        meta, _ = compare_step(pipes, step, pad_to=min(600, step.total_tokens + 3), tag=i)
        ch = meta["c128_state"]
        pos = meta.positions.cpu().tolist()
        T = meta.num_tokens
        rows = [(meta.req_slots[b], p) for b, p in zip(meta.token_to_req.cpu().tolist()[:T], pos[:T])]
        # the consumer: every window resolves to its positions of its own request, reads before the write
        idx, lens = ch.indices.cpu(), ch.lens.cpu()
        for t in range(T):
            got = ring.read(idx[t], int(lens[t]), rows)
            r, p = rows[t]
            assert got == [(r, q) for q in range(max(p - cg.window + 1, 0), p + 1)], (i, t)
        tail = ch.tail_slot_mapping.cpu()
        assert (tail[T:] == -1).all() and (ch.slot_mapping.cpu()[T:] == -1).all()
        live = tail[tail >= 0]
        assert live.unique().numel() == live.numel()
        ring.write(tail[:T], rows)
