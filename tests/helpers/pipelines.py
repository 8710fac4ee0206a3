"""Shared helpers of the pipeline tests (the layouts are in :mod:`helpers.layouts`): a block-id allocator for
hand-written steps, a deep copy of one step's metadata, and the poisoned three-way comparison of pipelines over a trace
(fused Triton launch == per-op kernels == PyTorch reference, bit for bit)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Dict, Iterable, Optional, Sequence

import torch

from dsv4_index import MetadataPipeline
from dsv4_index._common import cdiv, interpreting
from dsv4_index.frontend import NewRequest, RunningRequest, StepInput
from dsv4_index.validate import check_metadata, check_topk

# every per-channel output of ChannelMetadata, and the common step tensors of DSV4Metadata
CHANNEL_FIELDS = ("slot_mapping", "tail_slot_mapping", "compressed_slot_mapping", "compact_slot_mapping", "compact_cu",
                  "indices",
                  "lens", "ks", "ke", "cu", "decode_lens", "lens_clamped", "decode_lens_clamped")
COMMON_FIELDS = ("query_start_loc", "seq_lens", "idx_mapping", "positions", "token_to_req", "is_valid_token")
HOST_FIELDS = ("num_reqs", "num_tokens", "num_tokens_padded", "num_decodes", "num_prefills", "num_decode_tokens",
               "num_prefill_tokens")
HAS_TRITON = torch.cuda.is_available() or interpreting()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class Pool:
    """Hands out fresh block ids (never 0) for hand-written steps; ``blocks(n)`` covers ``n`` tokens
    in every group (``alloc_block_size`` each; steps carry allocation block ids)."""

    def __init__(self, layout, start: int = 1):
        self.layout, self.next = layout, itertools.count(start)

    def blocks(self, n_tokens: int, have=None):
        out = []
        for g, old in zip(self.layout.groups, have or [[] for _ in self.layout.groups]):
            need = 1 if g.kind == "circular" else cdiv(n_tokens, g.alloc_block_size)
            out.append([next(self.next) for _ in range(max(need - len(old), 0))])
        return tuple(out)


def two_steps(layout, pool=None):
    """Two hand-written steps: prefills, then decodes (1 and 2 tokens) + a chunked prefill + a new
    request with bounded replay (replay_start 6, floor of its swa window)."""
    pool = pool or Pool(layout)
    a, b = pool.blocks(70), pool.blocks(40)
    s1 = StepInput([NewRequest("a", a, 0), NewRequest("b", b, 0)], [], {"a": 62, "b": 20})
    d = pool.blocks(30)
    s2 = StepInput([NewRequest("d", d, 10)],
                   [RunningRequest("a", tuple([] for _ in a), 62), RunningRequest("b", tuple([] for _ in b), 20)],
                   {"a": 2, "b": 17, "d": 13}, replay_start={"d": 6})
    return s1, s2


def make_pipeline(layout, **kw):
    args = dict(max_num_reqs=4, max_num_batched_tokens=96, device="cpu", num_speculative_tokens=1)
    args.update(kw)
    return MetadataPipeline(layout, **args)


def clone_meta(meta):
    """Deep copy of the tensors of one step's metadata (corrupt the copy, not the pipeline's buffers).
    NOTE: c4a / c4i share one compressed-slot tensor in the pipeline; the copy gives each its own."""
    def c(x):
        return x.clone() if isinstance(x, torch.Tensor) else (x.copy() if hasattr(x, "copy") and
                                                                 not isinstance(x, dict) else x)

    chans = {n: dataclasses.replace(ch, **{f.name: c(getattr(ch, f.name)) for f in dataclasses.fields(ch)})
             for n, ch in meta.channels.items()}
    top = {f.name: c(getattr(meta, f.name)) for f in dataclasses.fields(meta) if f.name != "channels"}
    top["block_tables"] = [bt.clone() for bt in meta.block_tables]
    top["req_ids"] = None if meta.req_ids is None else list(meta.req_ids)
    return dataclasses.replace(meta, channels=chans, **top)


# ----------------------------------------------------------------------------------------------
# poisoned comparison of pipelines
# ----------------------------------------------------------------------------------------------
def output_buffers(pipe) -> list:
    """Every persistent buffer a ``build()`` writes, at capacity: the builders' tensors (shared ones
    once), the common per-token / per-request buffers of the build context. Never the block tables
    or the staging buffer (state, not output)."""
    ctx, seen, out = pipe.ctx, set(), []
    state = {pipe.tables.flat.untyped_storage().data_ptr(), pipe.staging.dev.untyped_storage().data_ptr()}
    cands = [v for b in pipe.builders.values() for v in vars(b).values()] + list(ctx._shared.values())
    cands += [getattr(ctx, n) for n in ("query_start_loc", "seq_lens", "idx_mapping", "replay_start", "replay_end",
                                        "token_to_req", "positions", "is_valid_token", "query_start_loc_q",
                                        "token_to_req_q", "q_to_src")]
    for t in cands:
        if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
            assert t.untyped_storage().data_ptr() not in state, "an output aliases the tables or the staging"
            seen.add(t.data_ptr())
            out.append(t)
    return out


POISONS = (7777, -5556, 3333, -1230)  # NOTE: alternate parity: bool buffers get True, False, ...


def poison(pipe, value: int) -> None:
    """Fill every output buffer (whole capacity) with ``value`` (bools: ``value`` is odd)."""
    for t in output_buffers(pipe):
        t.fill_(bool(value % 2) if t.dtype == torch.bool else value)


def meta_tensors(meta) -> Dict[str, object]:
    """Host copies of everything a step's metadata exposes (views, so rows ``[0, T_pad)``)."""
    out = {f: getattr(meta, f) for f in HOST_FIELDS}
    out["req_slots"] = meta.req_slots.tolist()
    out["req_ids"] = meta.req_ids
    for f in COMMON_FIELDS:
        out[f] = getattr(meta, f).cpu().clone()
    for name, ch in meta.channels.items():
        for f in CHANNEL_FIELDS:
            x = getattr(ch, f)
            out[f"{name}.{f}"] = None if x is None else x.cpu().clone()
    return out


def assert_same(a: Dict[str, object], b: Dict[str, object], tag) -> None:
    assert a.keys() == b.keys(), (tag, sorted(set(a) ^ set(b)))
    for k, x in a.items():
        y = b[k]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor), (tag, k, x, y)
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), f"{tag}: {k}\n{x}\n!=\n{y}"
        else:
            assert x == y, f"{tag}: {k}: {x} != {y}"


def tables_of(pipe) -> list:
    return [t.cpu().clone() for t in pipe.tables.tables]


def three_pipelines(layout, max_num_reqs, max_tokens, **kw) -> Dict[str, MetadataPipeline]:
    """fused (one Triton launch), unfused (``fused=False``: the per-op kernels) and reference
    (``backend="reference"``), same arguments."""
    p = {"fused": MetadataPipeline(layout, max_num_reqs, max_tokens, DEVICE, fused=True, **kw),
         "unfused": MetadataPipeline(layout, max_num_reqs, max_tokens, DEVICE, fused=False, **kw),
         "reference": MetadataPipeline(layout, max_num_reqs, max_tokens, DEVICE, backend="reference", **kw)}
    assert p["fused"].num_launches == 1 and p["fused"].fused_plan is not None, "fused: not one launch"
    assert p["unfused"].fused_plan is None and p["reference"].fused_plan is None
    return p


def topk_channels(meta) -> list:
    return [n for n in meta.channels if n in meta._converters]


def compare_step(pipes: Dict[str, MetadataPipeline], step, pad_to: Optional[int] = None, *, check=None,
                 gen: Optional[torch.Generator] = None, topk_k: int = 4, tag=None):
    """Feed ``step`` to every pipeline, poison each one's outputs with its own value before its
    ``build()``, and assert that every output view, the host counts, the block tables and every top-k
    conversion (plain and compact, random picks incl. out-of-range ones) are equal across pipelines.
    ``check(meta)`` runs on the first pipeline's metadata. Returns (that metadata, valid top-k picks)."""
    names = list(pipes)
    gen = gen or torch.Generator().manual_seed(0)
    got = {}
    for k, name in enumerate(names):
        p = pipes[name]
        p.update(step, pad_to=pad_to)
        poison(p, POISONS[k])
        m = p.build()
        got[name] = (m, meta_tensors(m), tables_of(p))
    m0, v0, t0 = got[names[0]]
    for name in names[1:]:
        m, v, t = got[name]
        assert_same(v0, v, (tag, names[0], name))
        for g, (a, b) in enumerate(zip(t0, t)):
            assert torch.equal(a, b), (tag, "block table", g, names[0], name)
    if check is not None:
        check(m0)
    valid = 0
    for ch in topk_channels(m0):
        n_c = (m0.positions.long().cpu() + 1) // m0.layout.channels[ch].compress_ratio
        picks = (torch.rand(m0.num_tokens_padded, topk_k, generator=gen) * (n_c[:, None] + 3)).long() - 2
        picks = picks.to(torch.int32).to(DEVICE)
        for compact in (False, True):
            ref = None
            for name in names:
                s, ln = got[name][0].topk_to_slots(ch, picks, compact=compact)
                cur = (s.cpu().clone(), ln.cpu().clone())
                if ref is None:
                    ref = cur
                else:
                    assert torch.equal(ref[0], cur[0]) and torch.equal(ref[1], cur[1]), (tag, ch, compact, name)
            check_topk(m0, ch, picks, ref[0], ref[1], compact=compact)
            valid += int(ref[1].sum())
    return m0, valid


def compare_over_trace(pipes: Dict[str, MetadataPipeline], trace: Iterable, *, pad: Optional[Sequence[int]] = None,
                       check=None, seed: int = 0) -> dict:
    """:func:`compare_step` over every ``(step, views)`` of ``trace``; ``pad[i % len(pad)]``: extra
    padded tokens of step ``i`` (capped by capacity). Returns counters of what the trace exercised."""
    gen = torch.Generator().manual_seed(seed)
    cap = min(p.max_num_tokens for p in pipes.values())
    seen = dict(steps=0, tokens=0, padded=0, decodes=0, prefills=0, topk=0)
    for i, (step, _views) in enumerate(trace):
        T = step.total_tokens
        pad_to = None if pad is None else min(cap, T + pad[i % len(pad)])
        m0, valid = compare_step(pipes, step, pad_to, check=check, gen=gen, tag=i)
        seen["steps"] += 1
        seen["tokens"] += T
        seen["padded"] += int(m0.num_tokens_padded > T)
        seen["decodes"] += m0.num_decodes
        seen["prefills"] += m0.num_prefills
        seen["topk"] += valid
    return seen


def assert_tables_follow_views(pipe, views):
    """Independent of every other pipeline: the device tables equal the host mirror, and each
    scheduled request's row holds the scheduler's block ids (kernel ids, logical order) for every
    block the step can read (rings keep only the newest ``ring`` blocks)."""
    tb = pipe.tables
    for g in range(len(tb.tables)):
        assert torch.equal(tb.tables[g].cpu(), torch.from_numpy(tb.mirrors[g])), f"gid {g}: device != mirror"
    for v in views:
        slot = pipe.slot_of(v.req_id)
        for g, grp in enumerate(pipe.layout.groups):
            want = list(v.block_ids[g])
            row = tb.row(g, slot).tolist()
            assert len(row) == len(want), (v.req_id, g, row, want)
            lo = 0
            if grp.window is not None and grp.kind != "circular":
                lo = max(v.num_computed_tokens - grp.window + 1, v.replay_start, 0) // grp.block_size
            for i in range(lo, len(want)):
                assert row[i] == want[i], (v.req_id, grp.name, i, row, want)


# ----------------------------------------------------------------------------------------------
# scheduler traces
# ----------------------------------------------------------------------------------------------
def trace_events(trace) -> Dict[str, int]:
    """What a list of ``(step, views)`` exercises: preemptions, resumes, bounded replay, finishes,
    speculative decodes, prefill rows."""
    ev = dict(preempted=0, resumed=0, replay=0, finished=0, spec=0, prefill=0, new=0)
    for step, views in trace:
        ev["preempted"] += len(step.preempted_req_ids)
        ev["resumed"] += sum(r.resumed for r in step.running_requests)
        ev["replay"] += len(step.replay_end)
        ev["finished"] += len(step.finished_req_ids)
        ev["spec"] += sum(v.is_decode and v.num_scheduled_tokens > 1 for v in views)
        ev["prefill"] += sum(not v.is_decode for v in views)
        ev["new"] += len(step.new_requests)
    return ev


TRACE_KW = dict(num_blocks=40, max_num_batched_tokens=32, max_num_seqs=4, num_speculative_tokens=2,
                prompt_len=(1, 80), max_new_tokens=(1, 8), arrival_prob=0.8)


def eventful_trace(groups, steps: int, *, need=("preempted", "resumed", "replay", "finished", "spec"),
                   seeds=range(64), **kw) -> list:
    """The first reference-scheduler trace (over ``seeds``) of ``steps`` steps that exercises every
    event in ``need`` (scanning costs only the scheduler). ``groups``: a layout or its groups."""
    from dsv4_index.testing.scheduler import random_trace

    args = {**TRACE_KW, **kw}
    for seed in seeds:
        trace = list(random_trace(groups, steps, seed, **args))
        ev = trace_events(trace)
        if all(ev[k] for k in need):
            return trace
    raise AssertionError(f"no seed in {seeds} gives a {steps}-step trace with {need} ({args})")


def dcp_groups(layout):
    """The groups as a DCP-unaware scheduler must see them so that its block lists are valid on
    every rank: sharded groups with ``block_size * cp_world_size`` tokens per block (scheduler block
    ``i`` then covers exactly the positions of every rank's local block ``i``; needs the interleave
    to divide the rows per block of the compressed channels)."""
    w = layout.cp_world_size
    return [dataclasses.replace(g, block_size=g.block_size * w) if g.sharded else g for g in layout.groups]


# ----------------------------------------------------------------------------------------------
# hand-written steps with large random block ids
# ----------------------------------------------------------------------------------------------
class Blocks:
    """Distinct random allocation block ids from a big pool (id 0 is the null block); counts per
    group cover a rank's share under DCP (``cp``), plus one spare block."""

    def __init__(self, layout, rng, cp=(1, 0, 1)):
        self.layout, self.rng = layout, rng
        self.pool = list(range(1, 200_000))
        rng.shuffle(self.pool)
        self.world, self.rank, self.inter = cp

    def owned(self, n):
        cyc = self.inter * self.world
        return (n // cyc) * self.inter + min(max(n % cyc - self.rank * self.inter, 0), self.inter)

    def count(self, g, seq_len):
        if g.kind == "circular":
            return 1
        n = self.owned(seq_len) if g.sharded else seq_len
        return min(cdiv(n, g.alloc_block_size) + 1, cdiv(g.table_width, g.blocks_per_kv_block))

    def take(self, n):
        return [self.pool.pop() for _ in range(n)]

    def lists(self, seq_len, have=None):
        have = have or [0] * len(self.layout.groups)
        return tuple(self.take(max(self.count(g, seq_len) - h, 0)) for g, h in zip(self.layout.groups, have))


def random_step(rng, blocks: Blocks, kind: str, *, n_reqs: int, max_ctx: int, spec: int = 0, replay: bool = False,
                prefix: str = "r") -> StepInput:
    """A step of new requests only (``kind``: "decode", "prefill" or "mixed"), with random bounded
    replay floors when ``replay``."""
    new, sched, rs = [], {}, {}
    for i in range(n_reqs):
        k = kind if kind != "mixed" else rng.choice(["decode", "prefill"])
        q = rng.randint(1, 1 + spec) if k == "decode" else rng.randint(2 + spec, 40)
        ctx = rng.randint(0, max_ctx)
        rid = f"{prefix}{i}"
        new.append(NewRequest(rid, blocks.lists(ctx + q), ctx))
        sched[rid] = q
        if replay and ctx and rng.random() < 0.7:
            rs[rid] = rng.randint(0, ctx)
    return StepInput(new, [], sched, set(), set(), rs)


def step_all(pipes: Dict[str, MetadataPipeline], step, pad_to: Optional[int] = None):
    """:func:`compare_step` with ``check_metadata`` on the first pipeline; returns its metadata."""
    return compare_step(pipes, step, pad_to, check=check_metadata)[0]


def hand_session(layout, rng, steps: int, *, spec: int, max_reqs: int, events: dict):
    """Hand-written steps over ``steps`` iterations, yielding ``(step, pad_to)``: running requests append
    blocks and switch between prefill and decode (some held unscheduled), some finish, some are
    preempted (one forced in the second step) and come back as resumed or as new, new ones take freed
    slots; replay floors are sent every step once set and never lowered. ``events`` counts
    "resumed", "renewed" (back as a NewRequest) and "done"."""
    blocks = Blocks(layout, rng)
    state, preempted, floor, nid = {}, {}, {}, 0
    for it in range(steps):
        new, running, sched = [], [], {}
        done = {r for r in state if rng.random() < 0.2}
        pre = {r for r in state if r not in done and (rng.random() < 0.25 or (it == 1 and r == max(state)))}
        for r in done | pre:
            c, _ = state.pop(r)
            floor.pop(r, None)
            if r in pre:
                preempted[r] = c
        for rid, (c, have) in sorted(state.items()):
            if rng.random() < 0.15:
                continue  # held, not scheduled this step
            q = rng.randint(1, 1 + spec) if rng.random() < 0.6 else rng.randint(2 + spec, 20)
            add = blocks.lists(c + q, have)
            running.append(RunningRequest(rid, add, c))
            state[rid] = (c + q, [h + len(a) for h, a in zip(have, add)])
            sched[rid] = q
            if rng.random() < 0.3:
                floor[rid] = max(floor.get(rid, 0), rng.randint(0, c))
        for rid in sorted(preempted):
            if len(state) < max_reqs and rid not in pre and rng.random() < 0.7:
                c = preempted.pop(rid)
                q = rng.randint(1, 8)
                lists = blocks.lists(c + q)
                as_new = rng.random() < 0.5  # NOTE: a preempted request may come back either way
                (new.append(NewRequest(rid, lists, c)) if as_new else
                 running.append(RunningRequest(rid, lists, c, resumed=True)))
                events["renewed" if as_new else "resumed"] += 1
                state[rid] = (c + q, [len(x) for x in lists])
                sched[rid] = q
        while len(state) < max_reqs and rng.random() < 0.7:
            rid, nid = f"n{nid}", nid + 1
            c, q = rng.randint(0, 150), rng.randint(1, 24)
            lists = blocks.lists(c + q)
            new.append(NewRequest(rid, lists, c))
            state[rid] = (c + q, [len(x) for x in lists])
            sched[rid] = q
        events["done"] += len(done)
        step = StepInput(new, running, sched, done, pre, {r: floor[r] for r in sched if r in floor})
        pad = rng.choice([0, 0, 5])
        yield step, (step.total_tokens + pad if pad else None)
