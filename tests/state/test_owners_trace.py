"""Block ownership on the host (issue 26 item 4; ``state/owners.py``): every step of the reference
scheduler is accepted under ``"safe"`` and ``"full"`` (prefix hits, the vLLM pattern of a block shared in
the step its allocator fills it, bounded replay, preemption, rejected drafts, chunked prefill; ring,
full-width, circular and hybrid layouts), and the holder counts the pipeline keeps equal the
scheduler's own, step by step. Every single-id corruption that puts a block another live request holds
where a request writes in the step is rejected, and the rejected step changes nothing.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import numpy as np
import pytest

from dsv4_index import MetadataPipeline
from dsv4_index.batch import APPEND
from dsv4_index.frontend import batch_from_step
from dsv4_index.testing.scheduler import ReferenceScheduler

from helpers.layouts import trace_layout as layout
from helpers.rejections import diff as _diff, state
from helpers.vllm_stub import from_step


def truth(sched, groups) -> Counter:
    """(allocation id * G + gid) -> live holders, from the scheduler's own block lists (0 = released)."""
    G, c = len(groups), Counter()
    for rid in sched.running_req_ids:
        for g, ids in enumerate(sched.req_state(rid).alloc_block_ids):
            c.update(b * G + g for b in ids if b)
    return c


def counts(pipe, certain: bool = False) -> Counter:
    """The same from the pipeline's ownership state (``BlockOwners.held``): an allocation block is held as long
    as one of its kernel blocks is (a sliding row releases kernel blocks as its window passes them, vLLM whole
    blocks); ``certain``: only where the holder certainly reads the block next."""
    o, G = pipe.requests.owners, len(pipe.layout.groups)
    out = Counter()
    for (g, kid), n in o.held(certain).items():
        k = (kid // int(o.t.f[g])) * G + g
        out[k] = max(out[k], n)
    return out


def agrees(pipe, sched, groups) -> None:
    """The pipeline never takes a block for held (let alone certainly read) that the scheduler freed; full and
    circular groups, which release nothing early, hold exactly the scheduler's blocks. (The pipeline releases a
    sliding block once the lower bound of its row's next position passes it, the scheduler when it next
    schedules the row.)"""
    t, h, c = truth(sched, groups), counts(pipe), counts(pipe, certain=True)
    G = len(groups)
    assert all(c[k] <= h[k] <= t[k] for k in set(h) | set(c)), (c, h, t)
    exact = [g.gid for g in groups if g.kind != "sliding"]
    assert {k: n for k, n in h.items() if k % G in exact} == {k: n for k, n in t.items() if k % G in exact}


def shared_writes(sched, views, groups) -> int:
    """Scheduled blocks of the prefix group written in this step while another live request holds them."""
    pg = next(g.gid for g in groups if g.prefix_cacheable)
    holders, bs, f, n = sched.block_holders(), groups[pg].block_size, groups[pg].blocks_per_kv_block, 0
    for v in views:
        lo = max(v.num_computed_tokens, v.replay_end)
        for j in range(lo // bs, -(-v.seq_len // bs)) if v.seq_len > lo else ():
            n += bool(holders.get(v.block_ids[pg][j] // f, set()) - {v.req_id})
    return n


def drive(kind, seed, checks, form="step", steps=160, prefix=True):
    lay = layout(kind)
    sched = ReferenceScheduler(lay, 36, max_num_batched_tokens=24, max_num_seqs=5, num_speculative_tokens=2,
                               long_prefill_threshold=16, seed=seed, cache_when_scheduled=True,
                               enable_prefix_caching=prefix)
    pipe = MetadataPipeline(lay, 6, 32, "cpu", 2, backend="reference", checks=checks)
    seen = Counter()
    for step, views in sched.random_trace(steps, seed, prompt_len=(1, 120), max_new_tokens=(1, 20),
                                          prefix_prob=0.6):
        pipe.update(from_step(step) if form == "scheduler_output" else step)
        agrees(pipe, sched, lay.groups)
        seen["shared_writes"] += shared_writes(sched, views, lay.groups)
        seen["replay"] += len(step.replay_end)
        seen["preempted"] += len(step.preempted_req_ids)
        seen["rewinds"] += sum(1 for v in views if v.is_decode and v.num_scheduled_tokens > 1)
        seen["chunks"] += sum(1 for v in views if not v.is_decode and v.num_computed_tokens > 0)
    return seen


@pytest.mark.parametrize("kind", ["rings", "full_tables", "circular", "hybrid"])
@pytest.mark.parametrize("checks", ["safe", "full"])
def test_reference_scheduler_steps_are_accepted(kind, checks):
    seen = Counter()
    for seed in (0, 1):
        seen += drive(kind, seed, checks)
    assert seen["replay"] and seen["preempted"] and seen["rewinds"] and seen["chunks"], seen
    # NOTE: the vLLM pattern (a request admitted in the step that fills a block shares it) really happens
    assert seen["shared_writes"] > 0, seen


def test_scheduler_output_form_is_accepted():
    """vLLM's SchedulerOutput carries no replay bounds: no prefix caching here."""
    seen = drive("rings", 3, "full", form="scheduler_output", steps=120, prefix=False)
    assert seen["preempted"] and seen["rewinds"] and seen["chunks"], seen


# ----------------------------------------------------------------------------------------------
# mutations: one id of a step's write runs replaced by a block another live request holds
# ----------------------------------------------------------------------------------------------
def _written_positions(b, slot_row, g, grp, nc, seq, re):
    """Block positions of group ``g`` the row writes in this step (kernel blocks)."""
    lo = max(nc, re) if grp.kind == "full" else nc
    if grp.kind == "circular":
        return set(range(grp.ring_blocks))
    return set(range(lo // grp.block_size, -(-seq // grp.block_size))) if seq > lo else set()


def _held(sched) -> dict:
    """(gid, pool id) -> live requests holding it there."""
    held = {}
    for rid in sched.running_req_ids:
        for g, ids in enumerate(sched.req_state(rid).alloc_block_ids):
            for x in ids:
                if x:
                    held.setdefault((g, x), set()).add(rid)
    return held


def _mutations(pipe, sched, step, rng, before):
    """(bad StepBatch, where) for single-id corruptions of ``step``: an id of a run, at a block the row
    writes in the step, replaced by one another request held before this step and still holds (a block
    shared only by requests admitted in this step is, on the host, the vLLM same-step pattern)."""
    b, delta = batch_from_step(step, pipe.slot_map, len(pipe.layout.groups))
    if b.write_gids is None or not len(b.write_gids):
        return []
    groups = pipe.layout.groups
    resumed = {r.req_id for r in step.running_requests if r.resumed} | {r.req_id for r in step.new_requests}
    now = _held(sched)
    held = {k: (hs & before.get(k, set())) - resumed for k, hs in now.items()}
    row_of = {int(s): i for i, s in enumerate(b.req_slots.tolist())}
    rid_of = dict(zip(b.req_slots.tolist(), delta.order))
    out = []
    for r in range(len(b.write_gids)):
        g, slot, start = int(b.write_gids[r]), int(b.write_slots[r]), int(b.write_starts[r])
        grp = groups[g]
        i = row_of.get(slot)
        if i is None or not b.num_scheduled_tokens[i]:
            continue
        nc, q = int(b.num_computed_tokens[i]), int(b.num_scheduled_tokens[i])
        re = 0 if b.replay_end is None else int(b.replay_end[i])
        have = int(pipe.tables.num_blocks[g, slot]) // grp.blocks_per_kv_block if not (b.is_new is not None and
                                                                                  b.is_new[i]) else 0
        first = have if start == APPEND else start
        written = _written_positions(b, i, g, grp, nc, nc + q, re)
        f = grp.blocks_per_kv_block
        for k in range(int(b.write_cu[r + 1]) - int(b.write_cu[r])):
            kernel = {(first + k) * f + j for j in range(f)}
            if not kernel & written:
                continue
            me, cur = rid_of[slot], int(b.write_ids[int(b.write_cu[r]) + k])
            others = [x for (h, x), hs in held.items() if h == g and hs - {me} and x != cur]
            if not others:
                continue
            ids = b.write_ids.copy()
            ids[int(b.write_cu[r]) + k] = rng.choice(sorted(others))
            out.append((dataclasses.replace(b, write_ids=ids), (r, k, g)))
    return out


def _short_lists(pipe) -> None:
    """The compiled ownership pass's lists (released / acquired records, the count filter's log) cut to 4
    entries: every step of any size overflows them at least once and the pass must run again on longer ones."""
    pipe.requests.owners.L = np.zeros((3, 4), dtype=np.int64)


def _every_write_rejected(kind, seeds, steps, short=False, every=3):
    lay = layout(kind)
    rng = random.Random(7)
    tried = 0
    for seed in seeds:
        sched = ReferenceScheduler(lay, 36, max_num_batched_tokens=24, max_num_seqs=5, num_speculative_tokens=2,
                                   long_prefill_threshold=16, seed=seed, cache_when_scheduled=True)
        pipe = MetadataPipeline(lay, 6, 32, "cpu", 2, backend="reference", checks="safe")
        if short:
            _short_lists(pipe)
        before: dict = {}
        for n, (step, _) in enumerate(sched.random_trace(steps, seed, prompt_len=(1, 120), max_new_tokens=(1, 20),
                                                         prefix_prob=0.6)):
            if n % every == 0:
                for bad, where in _mutations(pipe, sched, step, rng, before)[:4]:
                    before = state(pipe)
                    with pytest.raises(ValueError, match="another live request holds|twice"):
                        pipe.update(bad)
                    assert not _diff(before, state(pipe)), where
                    tried += 1
            pipe.update(step)
            agrees(pipe, sched, lay.groups)
            before = _held(sched)
    return tried


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
@pytest.mark.parametrize("kind", ["rings", "circular", "hybrid"])
def test_every_write_into_another_holders_block_is_rejected(kind):
    assert _every_write_rejected(kind, (0, 1), 120) > 30


def test_a_pass_whose_lists_overflow_runs_again():
    """The kernel's lists start at 4 entries (a serving step of vLLM's scheduler overflows the default ones
    the same way: 48 prefills in its first step): the pass runs again on longer lists, and its verdicts and
    holder counts are still the scheduler's (every corruption rejected; full and circular groups hold exactly
    the scheduler's blocks). h37o's wrapper left the loop on the overflowed run's void lists: holder counts
    lost, later writes into a held block accepted."""
    assert _every_write_rejected("hybrid", (0,), 60, short=True, every=1) > 20


# ----------------------------------------------------------------------------------------------
# mutations: a running row rewound and its sliding rows cut back; a read of a lost ring column
# ----------------------------------------------------------------------------------------------
class RingShadow:
    """Which logical block each ring column of each (gid, slot) holds, from the accepted StepBatches alone
    (DESIGN §4: a ring row keeps its newest blocks, from the lowest block its request can still read)."""

    def __init__(self, pipe):
        self.lay, self.ring = pipe.layout, [int(r) for r in pipe.tables.ring]
        self.cols, self.nb = {}, {}

    def apply(self, b):
        for s in (b.free_slots if b.free_slots is not None else []):
            self._clear(int(s))
        new = b.is_new if b.is_new is not None else np.zeros(len(b.req_slots), bool)
        for s, n in zip(b.req_slots.tolist(), new.tolist()):
            if n:
                self._clear(s)
        row = {int(s): i for i, s in enumerate(b.req_slots.tolist()) if b.num_scheduled_tokens[i]}
        for r in range(0 if b.write_gids is None else len(b.write_gids)):
            g, s, start = int(b.write_gids[r]), int(b.write_slots[r]), int(b.write_starts[r])
            n = int(b.write_cu[r + 1] - b.write_cu[r])
            first = self.nb.get((g, s), 0) if start == APPEND else start
            e, ring = first + n, self.ring[g]
            self.nb[(g, s)] = e
            if not ring or self.lay.groups[g].kind != "sliding":
                continue
            keep = max(first, e - ring)
            if s in row:
                i = row[s]
                lo = max(int(b.num_computed_tokens[i]) - self.lay.groups[g].window + 1, 0)
                if b.replay_start is not None:
                    lo = max(lo, int(b.replay_start[i]))
                keep = max(keep, lo // self.lay.groups[g].block_size)
            cols = self.cols.setdefault((g, s), {})
            for p in range(keep, e):
                cols[p % ring] = p

    def _clear(self, s):
        for k in [k for k in self.cols if k[1] == s] + [k for k in self.nb if k[1] == s]:
            self.cols.pop(k, None)
            self.nb.pop(k, None)

    def stale(self, b) -> bool:
        """Does a batch row of ``b`` (applied to a copy) read a ring column holding another block?"""
        cp = RingShadow.__new__(RingShadow)
        cp.lay, cp.ring = self.lay, self.ring
        cp.cols, cp.nb = {k: dict(v) for k, v in self.cols.items()}, dict(self.nb)
        cp.apply(b)
        for i, s in enumerate(b.req_slots.tolist()):
            nc, q = int(b.num_computed_tokens[i]), int(b.num_scheduled_tokens[i])
            for g, grp in enumerate(self.lay.groups):
                if not q or grp.kind != "sliding" or not self.ring[g]:
                    continue
                lo = max(nc - grp.window + 1, 0)
                if b.replay_start is not None:
                    lo = max(lo, int(b.replay_start[i]))
                cols = cp.cols.get((g, s), {})
                read = range(lo // grp.block_size, -(-(nc + q) // grp.block_size))
                if any(cols.get(p % self.ring[g]) != p for p in read):
                    return True
        return False


def test_every_read_of_a_lost_ring_column_is_rejected():
    lay = layout("rings")
    rng = random.Random(11)
    stale = fine = 0
    for seed in (0, 1, 2):
        sched = ReferenceScheduler(lay, 60, max_num_batched_tokens=24, max_num_seqs=4, num_speculative_tokens=2,
                                   long_prefill_threshold=16, seed=seed, enable_prefix_caching=False)
        pipe = MetadataPipeline(lay, 6, 32, "cpu", 2, backend="reference", checks="safe")
        shadow, fresh_id = RingShadow(pipe), 50_000
        for n, (step, _) in enumerate(sched.random_trace(150, seed, prompt_len=(20, 160), max_new_tokens=(10, 60))):
            b, _ = batch_from_step(step, pipe.slot_map, 4)
            rows = [i for i in range(len(b.req_slots)) if b.num_scheduled_tokens[i] and not
                    (b.is_new is not None and b.is_new[i]) and b.num_computed_tokens[i] > 24]
            if rows and n % 2:
                i = rng.choice(rows)
                slot, nc, q = int(b.req_slots[i]), int(b.num_computed_tokens[i]), int(b.num_scheduled_tokens[i])
                nc2 = rng.randint(max(nc - 120, 1), nc - 1)
                runs = [(int(g), int(s), int(st), b.write_ids[b.write_cu[r]:b.write_cu[r + 1]].tolist())
                        for r, (g, s, st) in enumerate(zip(b.write_gids, b.write_slots, b.write_starts))
                        if not (int(s) == slot and lay.groups[int(g)].kind == "sliding")]
                for g, grp in enumerate(lay.groups):
                    if grp.kind == "sliding":
                        e = -(-(nc2 + q) // grp.block_size)
                        k = rng.randint(1, 3)
                        runs.append((g, slot, max(e - k, 0), list(range(fresh_id, fresh_id + min(k, e)))))
                        fresh_id += 3
                cu = np.cumsum([0] + [len(r[3]) for r in runs])
                nc_all = b.num_computed_tokens.copy()
                nc_all[i] = nc2
                bad = dataclasses.replace(
                    b, num_computed_tokens=nc_all, write_gids=np.array([r[0] for r in runs]),
                    write_slots=np.array([r[1] for r in runs]), write_starts=np.array([r[2] for r in runs]),
                    write_cu=cu, write_ids=np.array([x for r in runs for x in r[3]], dtype=np.int64))
                if shadow.stale(bad):
                    stale += 1
                    before = state(pipe)
                    with pytest.raises(ValueError):
                        pipe.update(bad)
                    assert not _diff(before, state(pipe))
                else:
                    fine += 1
            pipe.update(step)
            shadow.apply(b)
    assert stale > 20, (stale, fine)
