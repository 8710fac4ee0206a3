"""Peer cases for circular groups (issue #20 "Done when"): every case found in vLLM's and vllm-ascend's
tests of the circular compressor-state ring, rebuilt on this library's API.

Sources (read through the code index; each case below names its source tag and upstream function):

* [V1] ``vllm-project/vllm`` ``tests/v1/attention/test_deepseek_v4_compressor_ring.py`` (PR #58074; revisions
  876f6a29 and 2d4dc6f2, and a later one that adds multi-block rings and the Triton ring builder);
* [V2] ``vllm-project/vllm``, the Triton-path ring test of a later revision (module docstring "Triton
  compressor kernels on the circular state"; its file path is not in the index);
* [A1] ``vllm-project/vllm-ascend`` ``tests/ut/core/test_compressor_tail_manager.py`` (PR #15452);
* [A2] ``vllm-project/vllm-ascend`` ``tests/ut/ops/a2/test_slot_mapping.py`` (its fused slot-mapping tests,
  plain groups).

Expected values are the upstream rules written here in plain Python (``block * cap + pos % cap``; the tail
is the last ``cap`` tokens of each request's chunk; window reads before the chunk start come from the
ring, reads inside it from the step), never this library's output. Window lists use the library's
documented encoding (``x >= 0`` ring slot, ``x <= -2`` in-step token row ``-2 - x``, ``-1`` padding).

Already covered elsewhere (not repeated here): the consumer emulation of vLLM's
``test_c128_reads_the_batch_before_saving_the_wrapped_tail`` (ring 128..249, chunk 250..520, ring
265..520 afterwards) is ``tests/layout/test_circular.py::test_vllm_ring_case_chunk_longer_than_capacity``;
drafts with rejections over three steps are ``test_circular.py::test_drafts_at_all_128_phases``;
the review's 512/600-token requests on 32/64/128-row rings (not found upstream: derived) are
``test_circular.py::test_vllm_ascend_long_requests_on_small_rings``. Upstream cases about vLLM's own
machinery (spec class per platform, JIT warm-up keys, builder buffers, block managers, kernel sources)
have no counterpart here.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple

import pytest
import torch

import dsv4_index
from dsv4_index import DSV4Layout, MetadataPipeline
from dsv4_index.frontend import NewRequest, RunningRequest, StepInput

POISON = 7777


def vllm_capacity(num_spec: int) -> int:
    """vLLM's ``_c128_ring_capacity``: 128 history rows plus one speculative step, in 128-row units."""
    return 128 * -(-(128 + num_spec) // 128)


@dataclass
class Case:
    """One upstream case: ``chunks`` = [(first position, tokens)] per request, ``blocks`` = ring block(s)
    per request (a list = several table columns), ``pad`` padded rows after the live tokens."""

    cap: Optional[int]                   # ring capacity (None: a plain, non-circular group)
    chunks: Sequence[Tuple[int, int]]
    blocks: Sequence
    pad: int = 0
    window: Optional[int] = None         # also check window lists of this width
    block_size: Optional[int] = None     # plain groups / multi-block rings
    floor: Optional[Sequence[int]] = None
    marks: tuple = field(default_factory=tuple)



CASES = {
    # [V1] test_c128_ring_mapping_and_tail_for_nonuniform_batch: 280- and 140-token chunks on 256-row
    # rings (blocks 11 and 3, a second table column of -1), 7 padded rows
    "vllm-nonuniform-batch": Case(256, [(120, 280), (250, 140)], [[11, -1], [3, -1]], pad=7, window=128),
    # [V1] test_c128_ring_mapping_masks_padded_actual_tokens: 4 rows, the last is padding
    "vllm-masks-padded": Case(128, [(10, 3)], [2], pad=1, window=128),
    # [V1] test_c128_null_block_keeps_all_slots_invalid
    "vllm-null-block": Case(256, [(120, 20)], [-1], pad=4),
    # [V1] test_c128_reads_the_batch_before_saving_the_wrapped_tail: its inputs (block 0), formulas only
    # (the consumer emulation is test_circular.py::test_vllm_ring_case_chunk_longer_than_capacity)
    "vllm-wrapped-tail": Case(256, [(250, 271)], [0], window=128),
    # [V1, later] test_triton_ring_builder_stages_each_chunk_with_its_history: chunks of 200 / 7 / 6 tokens,
    # each reads its window - 1 positions before the chunk from the ring
    "vllm-stage-history": Case(vllm_capacity(5), [(300, 200), (0, 7), (1000, 6)], [4, 9, 6], pad=3, window=128),
    # [V1, later] test_multi_block_ring_mapping: a 16-row ring in blocks of 4
    "vllm-multi-block": Case(16, [(0, 21), (37, 3)], [[5, 9, 2, 7], [1, 3, 4, 8]], pad=3, block_size=4),
    # [A1] test_absolute_position_maps_to_tail_ring[c4]: an 8-row ring (positions 0, 7, 8, 15)
    "ascend-tail-ring-c4": Case(8, [(0, 16)], [5], window=8),
    # [A1] test_absolute_position_maps_to_tail_ring[c128]: 128 rows in 4 blocks of 32
    "ascend-tail-ring-c128": Case(128, [(p, 1) for p in (0, 31, 32, 127, 128, 159)], [[3, 8, 1, 6]] * 6,
                                  block_size=32),
    # [A2] TestFusedSlotMapping.test_fused_matches_sequential_multi_group / test_padding_uses_pad_slot_id
    # (plain groups, block 128): two requests x 4 tokens per group,
    # and a one-block request with 4 padded rows (PAD_SLOT_ID = -1)
    "ascend-fused-group0": Case(None, [(0, 4), (0, 4)], [[0, 1, 2, 3], [8, 9, 10, 11]], block_size=128),
    "ascend-fused-group1": Case(None, [(0, 4), (0, 4)], [[4, 5, 6, 7], [12, 13, 14, 15]], block_size=128),
    "ascend-fused-padding": Case(None, [(0, 4)], [[0]], pad=4, block_size=128),
}
# [V1] test_c128_ring_survives_one_speculative_step[group_phase]: a verify step of 1 + 5 tokens at
# every phase of the open 128-row group never writes a committed row of that group
for _ph in range(128):
    CASES[f"vllm-spec-phase-{_ph}"] = Case(vllm_capacity(5), [(_ph, 6)], [0])


def _rows(blocks):
    return [list(b) if isinstance(b, (list, tuple)) else [b] for b in blocks]


def expected(case: Case):
    """(addr, tail, idx, lens) of ``case`` by the upstream rules (lists; idx / lens None without window)."""
    rows, addr, tail, idx, lens, qs = _rows(case.blocks), [], [], [], [], 0
    bs = case.block_size or case.cap

    def slot(row, p):
        if case.cap is None:                               # plain group: bt[p // bs] * bs + p % bs
            return row[p // bs] * bs + p % bs
        r = p % case.cap                                   # ring row, then its block / offset
        b = row[r // bs]
        return -1 if b < 0 else b * bs + r % bs

    for b, (s, q) in enumerate(case.chunks):
        for t, p in enumerate(range(s, s + q)):
            a = slot(rows[b], p)
            addr.append(a)
            tail.append(a if case.cap is None or t + case.cap >= q else -1)   # last cap tokens write
            if case.window:
                lo = max(p - case.window + 1, case.floor[b] if case.floor else 0)
                e = [slot(rows[b], x) if x < s else -2 - (qs + x - s) for x in range(lo, p + 1)]
                idx.append(e + [-1] * (case.window - len(e)))
                lens.append(len(e))
        qs += q
    addr += [-1] * case.pad
    tail += [-1] * case.pad
    if case.window:
        idx += [[-1] * case.window] * case.pad
        lens += [0] * case.pad
    return addr, tail, (idx if case.window else None), (lens if case.window else None)


def run_ops(case: Case, device):
    """The functional ops on ``case`` (outputs poisoned first); window lists only with ``case.window``."""
    qsl, sl = [0], []
    for s, q in case.chunks:
        qsl.append(qsl[-1] + q)
        sl.append(s + q)
    qsl = torch.tensor(qsl, dtype=torch.int32, device=device)
    sl = torch.tensor(sl, dtype=torch.int32, device=device)
    bt = torch.tensor(_rows(case.blocks), dtype=torch.int32, device=device)
    T = int(qsl[-1]) + case.pad
    bs = case.block_size or case.cap
    kw = dict(num_tokens=T, circular_capacity=case.cap) if case.cap else dict(num_tokens=T)

    def poisoned(*shape, dtype=torch.int64):
        return torch.full(shape, POISON, dtype=dtype, device=device)

    addr = dsv4_index.slot_mapping(qsl, sl, bt, bs, out=poisoned(T), **kw).cpu().tolist()
    tail = addr if not case.cap else dsv4_index.slot_mapping(qsl, sl, bt, bs, tail=True, out=poisoned(T),
                                                             **kw).cpu().tolist()
    idx = lens = None
    if case.window:
        floor = None if case.floor is None else torch.tensor(case.floor, dtype=torch.int32, device=device)
        i, n = dsv4_index.window_indices(qsl, sl, bt, bs, case.window, replay_start=floor,
                                         out=poisoned(T, case.window, dtype=torch.int32),
                                         out_lens=poisoned(T, dtype=torch.int32), **kw)
        idx, lens = i.cpu().tolist(), n.cpu().tolist()
    return addr, tail, idx, lens


@pytest.mark.parametrize("name", [pytest.param(n, marks=c.marks) for n, c in CASES.items()])
def test_peer_case(name, device):
    case = CASES[name]
    want_addr, want_tail, want_idx, want_lens = expected(case)
    addr, tail, idx, lens = run_ops(case, device)
    assert addr == want_addr, name
    assert tail == want_tail, name
    if case.cap:                                           # the write plan: distinct rows per request
        start = 0
        for _, q in case.chunks:
            live = [x for x in tail[start:start + q] if x >= 0]
            assert len(set(live)) == len(live), name
            start += q
    if case.window:
        assert lens == want_lens and idx == want_idx, name
    if name.startswith("vllm-spec-phase-"):                # the upstream property, besides the formula
        ph = case.chunks[0][0]
        committed = {p % case.cap for p in range(ph - ph % 128, ph)}
        assert committed.isdisjoint(addr), name


def test_ascend_c128_ring_as_sliding_ring(device):
    # [A1] test_absolute_position_maps_to_tail_ring[c128] through what the library has: a sliding
    # table of 4 columns used as a ring (ring=True); one decode token per position, one table row
    pos, row, bs = [0, 31, 32, 127, 128, 159], [3, 8, 1, 6], 32
    qsl = torch.arange(len(pos) + 1, dtype=torch.int32, device=device)
    sl = torch.tensor([p + 1 for p in pos], dtype=torch.int32, device=device)
    bt = torch.tensor([row], dtype=torch.int32, device=device)
    rows = torch.zeros(len(pos), dtype=torch.int32, device=device)
    got = dsv4_index.slot_mapping(qsl, sl, bt, bs, ring=True, idx_mapping=rows,
                                  out=torch.full((len(pos),), POISON, dtype=torch.int64, device=device))
    assert got.cpu().tolist() == [row[(p % 128) // bs] * bs + p % bs for p in pos]


def test_capacity_formula_layouts():
    # [V1] test_c128_capacity_covers_one_speculative_step: capacities 128/256/256/256/384 for 0/1/127/128/129
    # draft tokens; each is accepted as a circular c128_state group of that block size
    caps = [vllm_capacity(n) for n in (0, 1, 127, 128, 129)]
    assert caps == [128, 256, 256, 256, 384]
    for cap in sorted(set(caps)):
        g = DSV4Layout.from_config("flash", max_model_len=2048, circular={"c128_state": cap}).group("c128_state")
        assert (g.kind, g.block_size) == ("circular", cap)


# ----------------------------------------------------------------------------------------------
# multi-step ring emulation: every read resolves to the newest write of its position
# ----------------------------------------------------------------------------------------------
# [V2] test_ring_matches_paged_state, its STEPS: (req, first position, tokens) per
# step; chunked prefill longer than the ring, spec blocks of 6, rejected drafts rescheduled from an
# earlier position (300+6 -> 302, 43+6 -> 45), a 600-token chunk after decodes
VLLM_STEPS = [
    [(0, 0, 300), (1, 0, 37)],
    [(0, 300, 6), (1, 37, 6)],
    [(0, 302, 6), (1, 43, 6)],
    [(0, 308, 600), (1, 45, 6)],
    [(0, 908, 6), (1, 51, 250)],
    [(0, 910, 6), (1, 301, 6)],
]
# [V2] test_ring_prefix_replay_rebuilds_the_open_group: a prefix hit at 512 hands the request an empty
# ring; for C128 the replay is window - ratio = 0 tokens, so nothing below 512 is ever read
HIT = 512
REPLAY_STEPS = [[(0, HIT, 200)], [(0, HIT + 200, 6)], [(0, HIT + 203, 6)], [(0, HIT + 209, 300)]]


class RingModel:
    """The consumer: the ring stores (req, position, version) per slot; ``newest`` is what each
    position's latest schedule wrote (a rescheduled draft gets a fresh version)."""

    def __init__(self):
        self.store, self.newest = {}, {}

    def check_reads(self, idx, lens, rows, starts, floors, window, tag):
        """Resolve every window row of the step (before any write): ring slots from the store, in-step
        rows from ``rows``; each must be its positions, in-step ones at this version, older ones at the
        version their latest schedule wrote."""
        for t, (r, p, v) in enumerate(rows):
            got = []
            for x in idx[t][:lens[t]]:
                assert x != -1, (tag, t)
                got.append(rows[-2 - x] if x <= -2 else self.store.get(x, "empty"))
            lo = max(p - window + 1, floors[r])
            want = [(r, q, v if q >= starts[r] else self.newest[(r, q)]) for q in range(lo, p + 1)]
            assert got == want, (tag, t)

    def write(self, tail, rows):
        for s, row in zip(tail, rows):
            if s >= 0:
                self.store[s] = row
        for r, p, v in rows:
            self.newest[(r, p)] = v


def _ring_trace(steps, device, blocks=(7, 2), cap=256, window=128, floor=0):
    model = RingModel()
    for v, chunks in enumerate(steps):
        case = Case(cap, [(s, n) for _, s, n in chunks], [blocks[r] for r, _, _ in chunks], pad=2, window=window,
                    floor=[floor] * len(chunks))
        addr, tail, idx, lens = run_ops(case, device)
        want_addr, want_tail, _, _ = expected(case)
        assert addr == want_addr and tail == want_tail, v
        rows = [(r, p, v) for r, s, n in chunks for p in range(s, s + n)]
        model.check_reads(idx, lens, rows, {r: s for r, s, _ in chunks}, {r: floor for r, _, _ in chunks}, window, v)
        model.write(tail, rows)                            # after every read of the step
    return model


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
def test_vllm_steps_ring_emulation(device):
    # capacity 256 = vllm_capacity(5), window 128 (C128 state)
    _ring_trace(VLLM_STEPS, device)


def test_vllm_prefix_replay_ring_emulation(device):
    model = _ring_trace(REPLAY_STEPS, device, floor=HIT)
    assert all(p >= HIT for _, p, _ in model.store.values())


# ----------------------------------------------------------------------------------------------
# the same STEPS through the pipeline (layout with a circular c128_state group)
# ----------------------------------------------------------------------------------------------
def _pipeline_steps(layout, steps):
    ids, have, done = itertools.count(1), {}, set()
    for chunks in steps:
        new, run, sched = [], [], {}
        for r, s, n in chunks:
            rid, h = f"r{r}", have.setdefault(r, [0] * layout.num_groups)
            lists = []
            for g, gs in enumerate(layout.groups):
                need = 1 if gs.kind == "circular" else -(-(s + n) // gs.alloc_block_size)
                lists.append([next(ids) for _ in range(max(need - h[g], 0))])
                h[g] = max(h[g], need)
            (run.append(RunningRequest(rid, tuple(lists), s)) if rid in done
             else new.append(NewRequest(rid, tuple(lists), s)))
            done.add(rid)
            sched[rid] = n
        yield StepInput(new, run, sched)


@pytest.mark.slow  # pipeline trace in the interpreter (./dev quick skips it)
def test_vllm_steps_through_the_pipeline(device):
    lay = DSV4Layout.from_config("flash", max_model_len=2048, circular={"c128_state": vllm_capacity(5)})
    gid = lay.group("c128_state").gid
    cap, window = lay.groups[gid].block_size, lay.groups[gid].window
    pipe = MetadataPipeline(lay, max_num_reqs=4, max_num_batched_tokens=608, device=device,
                            num_speculative_tokens=5, validate=True)
    ring_block, model = {}, RingModel()
    for v, (chunks, step) in enumerate(zip(VLLM_STEPS, _pipeline_steps(lay, VLLM_STEPS))):
        for rq in list(step.new_requests) + list(step.running_requests):
            lists = rq.block_ids if isinstance(rq, NewRequest) else rq.new_block_ids
            if lists[gid]:
                ring_block[int(rq.req_id[1:])] = lists[gid][0]
        T = sum(n for _, _, n in chunks)
        pipe.update(step, pad_to=T + 2)
        meta = pipe.build()
        # which plan request each batch row is: by (seq_len, tokens), distinct in every step of the plan
        by_end = {(s + n, n): (r, s, n) for r, s, n in chunks}
        qsl, seq = meta.host_query_start_loc.tolist(), meta.host_seq_lens.tolist()
        order = [by_end[(seq[b], qsl[b + 1] - qsl[b])] for b in range(meta.num_reqs)]
        assert sorted(order) == sorted(chunks) and meta.num_tokens == T, v
        case = Case(cap, [(s, n) for _, s, n in order], [ring_block[r] for r, _, _ in order], pad=2,
                    window=window)
        want_addr, want_tail, want_idx, want_lens = expected(case)
        ch = meta.channels["c128_state"]
        assert ch.slot_mapping[:T + 2].cpu().tolist() == want_addr, v
        assert ch.tail_slot_mapping[:T + 2].cpu().tolist() == want_tail, v
        idx, lens = ch.indices[:T + 2].cpu().tolist(), ch.lens[:T + 2].cpu().tolist()
        assert lens == want_lens and [row[:window] for row in idx] == want_idx, v
        assert all(x == -1 for row in idx for x in row[window:]), v
        rows = [(r, p, v) for r, s, n in order for p in range(s, s + n)]
        model.check_reads(idx, lens, rows, {r: s for r, s, _ in order}, {r: 0 for r, _, _ in order}, window, v)
        model.write(want_tail, rows)
