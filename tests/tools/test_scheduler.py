"""Reference scheduler: invariants over random traces, plus scripted cases with hand-derived values;
bounded replay (``replay_end``) and circular groups, also through the MetadataPipeline."""

import dataclasses
import os
import random
from collections import Counter

import pytest
import torch

from dsv4_index.geometry import GroupSpec
from dsv4_index.pipeline import MetadataPipeline
from dsv4_index.testing.scheduler import ReferenceScheduler, cache_writes, random_trace, scripted_trace

from helpers.layouts import CIRCULAR, CIRCULAR_BOTH, two_layer_layout

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def hybrid_groups():
    # mla: kernel blocks of 8, allocation blocks of 16; swa: kernel 4, allocation 8
    return (GroupSpec(0, "mla", "full", 8, None, True, 32, 2),
            GroupSpec(1, "swa", "sliding", 4, 12, False, 64, 2),
            GroupSpec(2, "c4_state", "sliding", 4, 8, False, 64, 1))


def alloc_size(g):
    return g.block_size * getattr(g, "blocks_per_kv_block", 1)


# ------------------------------------------------------------------------------------------------
# invariant checks from public views only
# ------------------------------------------------------------------------------------------------
class Mirror:
    """The pipeline's copy of the block tables, rebuilt from StepInputs alone (append-only).

    Steps carry allocation ids; the table holds kernel-block ids ``b*f + j`` (``f`` zeros for the null block)."""

    def __init__(self, groups=None):
        self.rows = {}
        self.f = [getattr(g, "blocks_per_kv_block", 1) for g in groups] if groups is not None else None

    def _expand(self, lists):
        f = self.f or [1] * len(lists)
        return [[b * k + j if b else 0 for b in ids for j in range(k)] for ids, k in zip(lists, f)]

    def apply(self, step):
        for rid in list(step.finished_req_ids) + list(step.preempted_req_ids):
            assert rid in self.rows, rid
            del self.rows[rid]
        for r in step.new_requests:
            assert r.req_id not in self.rows
            self.rows[r.req_id] = self._expand(r.block_ids)
        for r in step.running_requests:
            if r.resumed:
                assert r.req_id not in self.rows
                self.rows[r.req_id] = self._expand(r.new_block_ids)
            else:
                for row, new in zip(self.rows[r.req_id], self._expand(r.new_block_ids)):
                    row.extend(new)


def check_pool(sched, all_ids):
    groups = sched.groups
    pg = next((g.gid for g in groups if g.prefix_cacheable), None)
    holders = {}
    for rid in all_ids:
        st = sched.req_state(rid)
        if st.status != "running":
            assert all(not ids for ids in st.alloc_block_ids), rid
            continue
        for gid, ids in enumerate(st.alloc_block_ids):
            for j, b in enumerate(ids):
                if b:
                    holders.setdefault(b, []).append((rid, gid, j))
    for b, hs in holders.items():
        if len(hs) > 1:  # only prefix-cache sharing: the prefix group, same logical block
            assert {gid for _, gid, _ in hs} == {pg}, (b, hs)
            assert len({j for _, _, j in hs}) == 1, (b, hs)
            assert len({rid for rid, _, _ in hs}) == len(hs), (b, hs)
    free = sched.free_block_ids()
    assert len(free) == len(set(free))
    assert 0 not in free and 0 not in holders
    assert not set(free) & set(holders)
    assert set(free) | set(holders) == set(range(1, sched.num_blocks))
    return holders


def check_step(sched, step, views, pre, pre_order, mirror, stats):
    groups = sched.groups
    step.validate_static(num_groups=len(groups))
    nst = step.num_scheduled_tokens
    assert [v.req_id for v in views] == list(nst)
    assert sum(nst.values()) <= sched.max_num_batched_tokens
    assert len(sched.running_req_ids) <= sched.max_num_seqs
    reqs = list(step.new_requests) + list(step.running_requests)
    computed = {r.req_id: r.num_computed_tokens for r in reqs}
    # decodes first; decode classification from the state before the step
    flags = [v.is_decode for v in views]
    assert flags == sorted(flags, reverse=True)
    for v in views:
        assert v.num_scheduled_tokens >= 1 and computed[v.req_id] == v.num_computed_tokens
        st = pre.get(v.req_id)
        dec = st is not None and st.num_output_tokens > 0 and \
            st.prompt_len + st.num_output_tokens - st.num_computed_tokens == 1
        assert v.is_decode == dec
        if dec:
            assert v.num_scheduled_tokens <= 1 + sched.num_speculative_tokens
            assert v.num_computed_tokens == st.num_computed_tokens
        else:
            after = sched.req_state(v.req_id)
            assert v.seq_len <= after.prompt_len + after.num_output_tokens
            if sched.long_prefill_threshold:
                assert v.num_scheduled_tokens <= sched.long_prefill_threshold
    if not all(flags):  # some prefill scheduled: every running decode got its turn (or was preempted)
        for rid, st in pre.items():
            if st.prompt_len + st.num_output_tokens - st.num_computed_tokens == 1 and st.num_output_tokens:
                assert rid in nst or rid in step.preempted_req_ids
    # preemption: victims were running, are newer than anything left unscheduled, hold nothing
    for rid in step.preempted_req_ids:
        assert rid in pre and rid not in nst
        assert all(o in nst or o in step.preempted_req_ids for o in pre_order[pre_order.index(rid) + 1:])
        st = sched.req_state(rid)
        assert st.status == "waiting" and all(not x for x in st.block_ids)
    assert set(step.replay_end) <= set(nst)
    # circular groups: [b] when a request enters the batch (new or resumed), [] while it runs
    for gid, g in enumerate(groups):
        if g.kind == "circular":
            assert all(len(r.block_ids[gid]) == 1 for r in step.new_requests)
            assert all(len(r.new_block_ids[gid]) == (1 if r.resumed else 0) for r in step.running_requests)
    if step.preempted_req_ids:
        assert not step.new_requests and not any(r.resumed for r in step.running_requests)
    for rid in step.finished_req_ids:
        assert sched.req_state(rid).status == "finished"
    # the pipeline's view (append-only) agrees with the scheduler's wherever the scheduler holds a block
    mirror.apply(step)
    for v in views:
        row = mirror.rows[v.req_id]
        st = sched.req_state(v.req_id)
        assert [list(x) for x in st.block_ids] == [list(x) for x in v.block_ids]
        for g, mine, theirs in zip(groups, v.block_ids, row):
            assert len(mine) == len(theirs)
            for a, b in zip(mine, theirs):
                assert a == b or (a == 0 and g.kind == "sliding")
        # blocks cover every position the step writes or reads; sliding blocks below the window are gone
        c, end = v.num_computed_tokens, v.seq_len
        for g, table, alloc in zip(groups, v.block_ids, st.alloc_block_ids):
            if g.kind == "circular":  # one block for life; chunks may be longer than the ring (vLLM)
                assert len(alloc) == 1 and alloc[0] != 0 and table == alloc, (v, g)
                stats["circular_long"] += g.window - 1 + v.num_scheduled_tokens > g.block_size
                continue
            f = getattr(g, "blocks_per_kv_block", 1)
            assert len(table) == len(alloc) * f and len(table) <= g.table_width
            assert [b // f if b else 0 for b in table[::f]] == alloc
            heads = [table[k - k % f] for k in range(len(table))]  # kernel blocks of one allocation block
            assert all(t == (h + k % f if h else 0) for k, (t, h) in enumerate(zip(table, heads)))
            lo = 0 if g.kind == "full" else max(0, v.replay_start, c - g.window + 1)
            assert len(table) * g.block_size >= end
            assert all(table[p // g.block_size] != 0 for p in range(lo, end))
            if g.kind == "sliding":
                first_needed = max(0, c - g.window + 1) // alloc_size(g)
                assert all(b == 0 for b in alloc[:first_needed])
        if v.replay_start or v.req_id in step.replay_start:
            assert step.replay_start[v.req_id] == v.replay_start == st.replay_start
            assert st.prefix_hit_tokens > 0
            assert v.replay_start == max(0, st.prefix_hit_tokens - max(
                g.window for g in groups if g.kind != "full"))
        # replay_end: exactly on the steps that schedule positions below the hit, equal to the hit
        if c < st.prefix_hit_tokens:
            assert step.replay_end[v.req_id] == v.replay_end == st.prefix_hit_tokens, (v, st)
            pg = next(g for g in groups if g.prefix_cacheable)
            assert v.req_id in step.replay_start and st.prefix_hit_tokens % alloc_size(pg) == 0
            stats["replay_end"] += 1
            stats["replay_end_straddles"] += end > st.prefix_hit_tokens
        else:
            assert v.req_id not in step.replay_end and v.replay_end == 0, (v, st)
            stats["hit_past_replay"] += v.req_id in step.replay_start
        stats["tokens"] += v.num_scheduled_tokens
        stats["decode" if v.is_decode else "prefill"] += 1
        stats["chunked"] += (not v.is_decode and v.seq_len < st.prompt_len + st.num_output_tokens)
    stats["new_hit"] += sum(1 for r in step.new_requests if r.req_id in step.replay_start)
    stats["resumed"] += sum(r.resumed for r in step.running_requests)
    stats["preempted"] += len(step.preempted_req_ids)
    stats["finished"] += len(step.finished_req_ids)


def drive(sched, num_steps, seed, *, arrival_prob=0.5, prompt_hi=200, max_new_hi=24, prefix_prob=0.5):
    """Random arrivals (some sharing an earlier request's prompt), random acceptance, all checks."""
    rng = random.Random(seed)
    mirror, stats, ids = Mirror(sched.groups), Counter(), []
    cap = sched.max_request_len()
    for _ in range(num_steps):
        if rng.random() < arrival_prob:
            new = rng.randint(1, min(max_new_hi, cap - 1))
            plen = rng.randint(1, min(prompt_hi, cap - new))
            kw = {}
            if ids and rng.random() < prefix_prob:
                parent = sched.req_state(rng.choice(ids[-6:]))
                plen = min(max(plen, parent.prompt_len + rng.randint(0, 16)), cap - new)
                kw = dict(prefix_of=parent.req_id, prefix_len=min(plen, parent.prompt_len))
            rid = f"q{len(ids)}"
            sched.add_request(rid, plen, new, **kw)
            ids.append(rid)
        pre_order = sched.running_req_ids
        pre = {rid: sched.req_state(rid) for rid in pre_order}
        step = sched.schedule()
        views = sched.batch_view(step)
        check_step(sched, step, views, pre, pre_order, mirror, stats)
        check_pool(sched, ids)
        acc = sched.random_acceptance(step)
        stats["partial_accept"] += sum(0 < a < v.num_scheduled_tokens - 1 for v in views
                                       for a in [acc.get(v.req_id, -1)])
        before = {v.req_id: sched.req_state(v.req_id) for v in views}
        sched.update_after_step(acc)
        for v in views:  # how far each request advanced
            st, b = sched.req_state(v.req_id), before[v.req_id]
            left = b.prompt_len + b.num_output_tokens - v.num_computed_tokens
            if v.num_scheduled_tokens < left:
                assert (st.num_computed_tokens, st.num_output_tokens) == (v.seq_len, b.num_output_tokens)
            else:
                grown = min(1 + acc.get(v.req_id, 0), b.max_new_tokens - b.num_output_tokens)
                assert st.num_output_tokens == b.num_output_tokens + grown
                assert st.num_computed_tokens == v.num_computed_tokens + left + grown - 1
                assert (st.status == "finished") == (st.num_output_tokens == b.max_new_tokens)
        check_pool(sched, ids)
    return stats


# ------------------------------------------------------------------------------------------------
# random traces
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_trace_invariants(seed):
    sched = ReferenceScheduler(two_layer_layout(), 56, max_num_batched_tokens=32, max_num_seqs=5,
                               num_speculative_tokens=3, long_prefill_threshold=24, seed=seed)
    stats = drive(sched, 400, seed, arrival_prob=0.6)
    # the trace exercised every feature (so the checks above were not vacuous)
    for k in ("decode", "prefill", "chunked", "new_hit", "resumed", "preempted", "finished",
              "partial_accept", "replay_end", "replay_end_straddles", "hit_past_replay"):
        assert stats[k] > 0, (k, stats)


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
@pytest.mark.parametrize("circular", [CIRCULAR, CIRCULAR_BOTH], ids=["c128_state", "both_states"])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_trace_invariants_circular(seed, circular):
    """Circular state groups: one block per request for life, chunks longer than the ring, same invariants."""
    sched = ReferenceScheduler(two_layer_layout(circular=circular), 40, max_num_batched_tokens=32,
                               max_num_seqs=5, num_speculative_tokens=2, long_prefill_threshold=24,
                               seed=seed)
    stats = drive(sched, 400, seed, arrival_prob=0.6)
    for k in ("decode", "chunked", "new_hit", "resumed", "preempted", "finished", "replay_end",
              "circular_long"):
        assert stats[k] > 0, (k, stats)


def test_random_trace_hybrid_blocks_no_prefix_cache():
    sched = ReferenceScheduler(hybrid_groups(), 40, max_num_batched_tokens=20, max_num_seqs=4,
                               num_speculative_tokens=1, enable_prefix_caching=False, seed=3)
    stats = drive(sched, 300, 3, prompt_hi=120, max_new_hi=16)
    assert stats["preempted"] > 0 and stats["finished"] > 0 and stats["new_hit"] == 0


def test_random_trace_generator_deterministic_and_valid():
    layout = two_layer_layout()

    def run(seed):
        return [(s, [vars(v) for v in vs]) for s, vs in random_trace(layout, 150, seed, num_blocks=64,
                                                                       max_num_batched_tokens=32)]

    a, b, c = run(5), run(5), run(6)
    assert a == b and a != c
    mirror, stats = Mirror(layout.groups), Counter()
    for step, views in a:
        step.validate_static(num_groups=len(layout.groups))
        mirror.apply(step)
        assert sum(step.num_scheduled_tokens.values()) <= 32
        stats["hit"] += len(step.replay_start)
        stats["fin"] += len(step.finished_req_ids)
        stats["spec"] += sum(v["is_decode"] and v["num_scheduled_tokens"] > 1 for v in views)
        for v in views:
            for g, mine, theirs in zip(layout.groups, v["block_ids"], mirror.rows[v["req_id"]]):
                assert all(x == y or (x == 0 and g.kind == "sliding") for x, y in zip(mine, theirs))
    assert stats["hit"] and stats["fin"] and stats["spec"]


# ------------------------------------------------------------------------------------------------
# scripted cases (expected values derived by hand from the rules)
# ------------------------------------------------------------------------------------------------
def small(num_blocks=64, **kw):
    kw.setdefault("max_num_batched_tokens", 64)
    kw.setdefault("max_num_seqs", 4)
    return ReferenceScheduler(two_layer_layout(), num_blocks, **kw)


def test_chunked_prefill_then_decode_and_finish():
    s = small(max_num_batched_tokens=16)
    steps = list(scripted_trace(s, [{"add": [("a", 50, 3)]}], drain=True))
    got = [(v.num_computed_tokens, v.num_scheduled_tokens, v.is_decode) for _, vs in steps for v in vs]
    assert got == [(0, 16, False), (16, 16, False), (32, 16, False), (48, 2, False),
                   (50, 1, True), (51, 1, True)]
    assert isinstance(steps[0][0].new_requests[0].block_ids, tuple) and not steps[1][0].new_requests
    assert list(steps[-1][0].finished_req_ids) == []
    assert s.req_state("a").status == "finished" and not s.has_unfinished()
    final = s.schedule()
    assert list(final.finished_req_ids) == ["a"] and final.num_scheduled_tokens == {}
    assert sorted(s.free_block_ids()) == list(range(1, 64))


def test_spec_decode_partial_acceptance_and_cap():
    s = small(num_speculative_tokens=3)
    s.add_request("a", 10, 4)
    st = s.schedule()
    assert st.num_scheduled_tokens == {"a": 10}
    s.update_after_step()
    assert (s.req_state("a").num_computed_tokens, s.req_state("a").num_output_tokens) == (10, 1)
    st = s.schedule()
    assert st.num_scheduled_tokens == {"a": 4} and st.running_requests[0].num_computed_tokens == 10
    s.update_after_step({"a": 1})  # keeps 2 tokens: positions 10, 11
    assert (s.req_state("a").num_computed_tokens, s.req_state("a").num_output_tokens) == (12, 3)
    st = s.schedule()
    assert st.num_scheduled_tokens == {"a": 4} and st.running_requests[0].num_computed_tokens == 12
    s.update_after_step({"a": 3})  # only 1 more token allowed (max_new_tokens=4)
    assert s.req_state("a").num_output_tokens == 4 and s.req_state("a").status == "finished"
    assert list(s.schedule().finished_req_ids) == ["a"]
    with pytest.raises(ValueError, match="accepted"):
        s.update_after_step({"a": 1})  # not a decode of the last step


def test_sliding_window_release():
    s = small(max_num_batched_tokens=8)
    s.add_request("a", 60, 2)
    for _ in range(5):
        s.schedule()
        s.update_after_step()
    step = s.schedule()
    v = s.batch_view(step)[0]
    assert (v.num_computed_tokens, v.num_scheduled_tokens) == (40, 8)
    st = s.req_state("a")
    # swa (bs 8, W 16): positions >= 25 are read -> blocks 0..2 (positions 0..23) released, 3..5 held
    assert st.block_ids[1][:3] == [0, 0, 0] and all(st.block_ids[1][3:6]) and len(st.block_ids[1]) == 6
    # c4_state (bs 4, W 8): positions >= 33 -> blocks 0..7 released, 8..11 held
    assert st.block_ids[2][:8] == [0] * 8 and all(st.block_ids[2][8:12]) and len(st.block_ids[2]) == 12
    # mla (bs 32, full): positions [0, 48) -> 2 blocks
    assert len(st.block_ids[0]) == 2 and all(st.block_ids[0])
    # the pipeline's copy keeps stale ids: nothing new is sent for released blocks
    new = step.running_requests[0].new_block_ids
    assert [len(x) for x in new] == [0, 1, 2, 1]


def test_preemption_newest_and_resume_full_blocks():
    # 25 usable blocks; three decoding requests; when the older ones grow, the newest one goes
    s = small(num_blocks=26, max_num_batched_tokens=24, enable_prefix_caching=False)
    for rid in "ABC":
        s.add_request(rid, 8, 40)
    seen_pre, resumed = None, None
    for i in range(200):
        step = s.schedule()
        if i == 0:
            assert list(step.num_scheduled_tokens) == ["A", "B", "C"]
        if step.preempted_req_ids and seen_pre is None:
            seen_pre = (i, list(step.preempted_req_ids))
            assert list(step.num_scheduled_tokens) == ["A", "B"]
            st = s.req_state("C")
            assert st.status == "waiting" and st.num_computed_tokens == 0 and not any(st.alloc_block_ids)
        for r in step.running_requests:
            if r.resumed and resumed is None:
                resumed = (i, r)
                assert r.num_computed_tokens == 0
                assert list(r.new_block_ids) == list(s.req_state(r.req_id).block_ids)
                assert all(r.new_block_ids[0]) and sum(map(len, r.new_block_ids)) > 0
        s.update_after_step()
        if not s.has_unfinished():
            break
    assert seen_pre is not None and seen_pre[1] == ["C"]
    assert resumed is not None and resumed[0] > seen_pre[0] and resumed[1].req_id == "C"
    assert not s.has_unfinished() and sorted(s.free_block_ids()) == list(range(1, 26))


def test_prefix_hit_bounded_replay_and_refcount():
    s = small(num_blocks=160, max_num_batched_tokens=128)
    s.add_request("a", 100, 30)  # mla blocks 0..2 are full prompt blocks (positions < 96)
    s.schedule()
    s.update_after_step()
    a_mla = s.req_state("a").alloc_block_ids[0]
    s.add_request("b", 120, 60, prefix_of="a", prefix_len=100)
    step = s.schedule()
    [nb] = step.new_requests
    # hit = 3 blocks = 96 tokens (< prompt 120); max sliding window 16 -> replay from 80
    assert nb.req_id == "b" and nb.num_computed_tokens == 80 and step.replay_start == {"b": 80}
    assert nb.block_ids[0][:3] == a_mla[:3] and nb.block_ids[0][3] not in a_mla
    # sliding rows: null below the replay floor, real blocks from there on
    assert nb.block_ids[1][:10] == [0] * 10 and all(nb.block_ids[1][10:15])
    assert step.num_scheduled_tokens["b"] == 40
    s.update_after_step()
    # "a" finishes while "b" still holds the shared blocks: they must not be freed
    for _ in range(40):
        s.schedule()
        s.update_after_step()
        if s.req_state("a").status == "finished":
            break
    assert s.req_state("a").status == "finished" and s.req_state("b").status == "running"
    assert not set(a_mla[:3]) & set(s.free_block_ids())
    assert set(a_mla[3:]) <= set(s.free_block_ids())
    # a later request with the same prefix hits the same blocks again
    s.add_request("c", 97, 1, prefix_of="a", prefix_len=97)
    step = s.schedule()
    [nc] = step.new_requests
    assert nc.block_ids[0][:3] == a_mla[:3] and nc.num_computed_tokens == 80
    # named prefix: two requests sharing "sys" (the second hits what the first computed)
    s.update_after_step()
    s.add_request("d", 70, 1, prefix_of="sys", prefix_len=64)
    d_mla = next(r for r in s.schedule().new_requests if r.req_id == "d").block_ids[0]
    s.update_after_step()
    s.add_request("e", 66, 1, prefix_of="sys", prefix_len=66)
    step = s.schedule()
    ne = next(r for r in step.new_requests if r.req_id == "e")
    assert ne.block_ids[0][:2] == d_mla[:2] and ne.block_ids[0][2] != d_mla[2]
    assert step.replay_start["e"] == 48 and ne.num_computed_tokens == 48


def test_prefix_hit_is_capped_below_prompt_and_evicted_blocks_miss():
    s = small(num_blocks=40, max_num_batched_tokens=32)
    s.add_request("a", 64, 1)
    a_mla = []
    while s.has_unfinished():
        step = s.schedule()
        a_mla = s.batch_view(step)[0].block_ids[0]
        s.update_after_step()  # then finished; its 2 full blocks stay cached on the free queue
    assert set(a_mla) <= set(s.free_block_ids())
    s.add_request("b", 64, 1, prefix_of="a", prefix_len=64)
    step = s.schedule()
    # whole prompt cached, but at least one token must be computed: hit 1 block (32), replay from 16
    assert step.new_requests[0].num_computed_tokens == 16 and step.replay_start == {"b": 16}
    assert step.new_requests[0].block_ids[0][0] == a_mla[0]
    s.update_after_step()
    while s.has_unfinished():
        s.schedule()
        s.update_after_step()
    # churn until the pool has handed out a's first block again (evicting it from the cache)
    taken, n = set(), 0
    while a_mla[0] not in taken:
        assert n < 40
        if not s.has_unfinished():
            s.add_request(f"x{n}", 150, 1)
        step = s.schedule()
        taken |= {b for v in s.batch_view(step) if v.req_id[0] == "x" for t in v.block_ids for b in t}
        s.update_after_step()
        n += 1
    while s.has_unfinished():
        s.schedule()
        s.update_after_step()
    s.add_request("c", 64, 1, prefix_of="a", prefix_len=64)
    step = s.schedule()
    assert step.new_requests[0].num_computed_tokens == 0 and step.replay_start == {}


def test_hybrid_table_entries():
    s = ReferenceScheduler(hybrid_groups(), 32, max_num_batched_tokens=64, max_num_seqs=2)
    s.add_request("a", 20, 1)
    [r] = s.schedule().new_requests
    st = s.req_state("a")
    b0, b1 = st.alloc_block_ids[0]  # mla: 20 tokens / 16 per allocation block
    assert r.block_ids[0] == [b0, b1]  # the step carries allocation ids ...
    [v] = s.batch_view(s._last[0])
    assert v.block_ids[0] == [2 * b0, 2 * b0 + 1, 2 * b1, 2 * b1 + 1]  # ... the table kernel-block ids
    assert len(v.block_ids[1]) == 6 and len(v.block_ids[2]) == 5  # swa 3 alloc blocks x 2; c4_state 5


def test_bad_arguments():
    layout = two_layer_layout()
    with pytest.raises(ValueError, match="num_blocks"):
        ReferenceScheduler(layout, 1, max_num_batched_tokens=8, max_num_seqs=1)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        ReferenceScheduler(layout, 8, max_num_batched_tokens=0, max_num_seqs=1)
    with pytest.raises(ValueError, match="max_num_seqs"):
        ReferenceScheduler(layout, 8, max_num_batched_tokens=8, max_num_seqs=0)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        ReferenceScheduler(layout, 8, max_num_batched_tokens=8, max_num_seqs=1, num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="long_prefill_threshold"):
        ReferenceScheduler(layout, 8, max_num_batched_tokens=8, max_num_seqs=1, long_prefill_threshold=0)
    with pytest.raises(ValueError, match="groups"):
        ReferenceScheduler((), 8, max_num_batched_tokens=8, max_num_seqs=1)
    s = small()
    s.add_request("a", 4, 1)
    for args, kw, name in [(("a", 4, 1), {}, "req_id"), (("b", 0, 1), {}, "prompt_len"),
                           (("b", 4, 0), {}, "max_new_tokens"), (("b", 250, 10), {}, "max_model_len"),
                           (("b", 4, 1), {"prefix_len": 5, "prefix_of": "a"}, "prefix_len")]:
        with pytest.raises(ValueError, match=name):
            s.add_request(*args, **kw)
    with pytest.raises(ValueError, match="num_blocks"):
        small(num_blocks=8).add_request("z", 200, 1)
    step = s.schedule()
    with pytest.raises(RuntimeError):
        s.schedule()
    with pytest.raises(ValueError, match="step"):
        s.batch_view(object())
    with pytest.raises(ValueError, match="req_id"):
        s.req_state("nope")
    assert s.batch_view(step)[0].req_id == "a"


# ------------------------------------------------------------------------------------------------
# bounded replay: replay_end
# ------------------------------------------------------------------------------------------------
def test_replay_end_scripted_chunks():
    """replay_end = hit length on every step that schedules positions below it (here: chunked
    replay), absent once the request is past it; replay_start stays."""
    s = small(num_blocks=160, max_num_batched_tokens=64, long_prefill_threshold=8)
    s.add_request("a", 100, 30)
    while s.req_state("a").num_computed_tokens < 100:
        s.schedule()
        s.update_after_step()
    s.add_request("b", 120, 4, prefix_of="a", prefix_len=100)
    got = []
    while s.req_state("b").num_computed_tokens < 120:
        step = s.schedule()
        v = next(v for v in s.batch_view(step) if v.req_id == "b")
        got.append((v.num_computed_tokens, v.num_scheduled_tokens, step.replay_start.get("b"),
                    step.replay_end.get("b"), v.replay_end))
        assert "a" not in step.replay_end and "a" not in step.replay_start
        s.update_after_step()
    # hit 96 tokens (3 blocks of 32), max window 16: replay [80, 96) in chunks of 8, then past it
    assert got == [(80, 8, 80, 96, 96), (88, 8, 80, 96, 96), (96, 8, 80, None, 0), (104, 8, 80, None, 0),
                   (112, 8, 80, None, 0)]


def test_replay_end_on_new_requests():
    s = small(num_blocks=160, max_num_batched_tokens=128)
    s.add_request("a", 100, 30)
    step = s.schedule()
    assert step.replay_end == {} and step.replay_start == {}
    s.update_after_step()
    s.add_request("b", 120, 60, prefix_of="a", prefix_len=100)
    s.add_request("c", 97, 1, prefix_of="a", prefix_len=97)
    s.add_request("d", 40, 1, prefix_of="a", prefix_len=40)
    step = s.schedule()
    # b: hit 96, replays [80, 96) in a chunk [80, 120); c: hit 96 (< its prompt 97); d: hit 32 (< 40),
    # replay from 16; a (decode) has no hit
    assert step.replay_start == {"b": 80, "c": 80, "d": 16}
    assert step.replay_end == {"b": 96, "c": 96, "d": 32}
    s.update_after_step()
    step = s.schedule()
    assert step.replay_end == {} and set(step.replay_start) == {"b"}


def _replay_trace(layout, seed, steps, *, validate=True):
    """A random trace with many prefix hits through two reference pipelines: one gets the steps,
    the other the same steps without replay_end. Counts writes by kind."""
    sched = ReferenceScheduler(layout, 80, max_num_batched_tokens=32, max_num_seqs=6,
                               num_speculative_tokens=2, long_prefill_threshold=24, seed=seed)
    pipe = MetadataPipeline(layout, 8, 32, "cpu", 2, backend="reference", validate=validate)
    bare = MetadataPipeline(layout, 8, 32, "cpu", 2, backend="reference")
    pc = [n for n, c in layout.channels.items() if layout.groups[c.gid].prefix_cacheable]
    n = Counter()
    for step, views in sched.random_trace(steps, seed, prompt_len=(1, 160), max_new_tokens=(1, 16),
                                          prefix_prob=0.7, arrival_prob=0.4):
        holders = sched.block_holders()
        pipe.update(step)
        try:
            bare.update(dataclasses.replace(step, replay_end={}))
        except ValueError as e:  # NOTE: the host's ownership check refuses what would write shared blocks
            assert "another live request holds" in str(e), e
            n["bare_refused"] += 1
            bare.update(step)
        writes, bare_writes = cache_writes(pipe.build(), holders), cache_writes(bare.build(), holders, pc)
        n["shared"] += sum(bool(w.others) for w in writes)
        n["unowned"] += sum(not w.owned for w in writes)
        n["writes"] += len(writes)
        n["replayed_tokens"] += sum(max(0, min(v.seq_len, v.replay_end) - v.num_computed_tokens) for v in views)
        n["bare_shared"] += sum(bool(w.others) for w in bare_writes)
        n["hits"] += sum(r.req_id in step.replay_start for r in step.new_requests)
    return n


@pytest.mark.parametrize("circular", [None, CIRCULAR, CIRCULAR_BOTH], ids=["rings", "c128_state", "both_states"])
@pytest.mark.slow  # ./dev quick skips it
def test_replay_never_writes_blocks_another_request_holds(circular):
    """Through the pipeline (check_metadata after every build): no token of any step writes into a
    block that another live request holds (slot and compressed slot mappings of every channel), nor
    into a block the writer does not hold. Without replay_end the same steps would: the host refuses them."""
    n = _replay_trace(two_layer_layout(circular=circular), 0, 200)
    assert n["hits"] >= 5 and n["replayed_tokens"] > 80 and n["writes"] > 1000, n
    assert n["shared"] == 0 and n["unowned"] == 0, n
    # NOTE: without replay_end the steps would write shared blocks: update() refuses each such step
    assert n["bare_refused"] > 0 and n["bare_shared"] == 0, n


# ------------------------------------------------------------------------------------------------
# circular groups
# ------------------------------------------------------------------------------------------------
def test_circular_block_per_request_no_token_cap():
    layout = two_layer_layout(circular={"c128_state": 18})  # W 16: chunks are not capped by the ring
    gid = layout.group("c128_state").gid
    s = ReferenceScheduler(layout, 64, max_num_batched_tokens=64, max_num_seqs=4, num_speculative_tokens=3)
    assert not hasattr(s, "circular_token_cap")
    s.add_request("a", 30, 2)
    steps, held = [], []
    for step, views in scripted_trace(s, [{}, {"accept": {"a": 1}}]):
        steps.append((step, views))
        held.append(s.req_state("a").alloc_block_ids[gid])
    got = [(v.num_computed_tokens, v.num_scheduled_tokens, v.is_decode) for _, vs in steps for v in vs]
    # the whole 30-token prompt in one chunk (longer than the capacity 18), then a decode with 3 spec tokens
    assert got == [(0, 30, False), (30, 4, True)]
    [new] = steps[0][0].new_requests
    b = new.block_ids[gid]
    assert len(b) == 1 and b[0] != 0 and held == [b] * 2
    assert all(r.new_block_ids[gid] == [] for st, _ in steps[1:] for r in st.running_requests)
    assert all(v.block_ids[gid] == b for _, vs in steps for v in vs)


def test_circular_worst_need_and_admission():
    layout = two_layer_layout(circular={"c128_state": 24})  # chunks of at most 9 tokens (long_prefill_threshold)
    s = ReferenceScheduler(layout, 18, max_num_batched_tokens=64, max_num_seqs=4, long_prefill_threshold=9)
    # mla cdiv(200, 32) = 7; swa (bs 8, W 16) cdiv(15 + 9, 8) + 1 = 4; c4_state (bs 4, W 8)
    # cdiv(7 + 9, 4) + 1 = 5; c128_state: 1 block
    assert s._worst_need(200) == 17
    assert s.max_request_len() == 224  # 7 mla blocks + 10
    with pytest.raises(ValueError, match="num_blocks"):
        s.add_request("x", 225, 1)
    s.add_request("a", 223, 1)  # runs alone to the end in 17 blocks
    while s.has_unfinished():
        step = s.schedule()
        assert all(n <= 9 for n in step.num_scheduled_tokens.values())
        s.update_after_step()
    assert sorted(s.free_block_ids()) == list(range(1, 18))


@pytest.mark.parametrize("circular", [CIRCULAR, CIRCULAR_BOTH], ids=["c128_state", "both_states"])
@pytest.mark.slow  # ./dev quick skips it
def test_circular_traces_through_pipeline_validate(circular):
    """Random traces (chunks, spec decode, preemption and resume, prefix hits) with circular state
    groups: the pipeline accepts every step and check_metadata passes after every build."""
    layout = two_layer_layout(circular=circular)
    for seed in (1, 2):
        sched = ReferenceScheduler(layout, 30, max_num_batched_tokens=32, max_num_seqs=5,
                                   num_speculative_tokens=2, long_prefill_threshold=24, seed=seed)
        pipe = MetadataPipeline(layout, 6, 40, "cpu", 2, backend="reference", validate=True)
        seen = Counter()
        for i, (step, _views) in enumerate(sched.random_trace(150, seed, prompt_len=(1, 160),
                                                             max_new_tokens=(1, 16), prefix_prob=0.5)):
            pipe.update(step, pad_to=min(40, step.total_tokens + i % 5))
            meta = pipe.build()
            seen["preempted"] += len(step.preempted_req_ids)
            seen["resumed"] += sum(r.resumed for r in step.running_requests)
            seen["replay"] += len(step.replay_end)
            seen["tokens"] += meta.num_tokens
        assert seen["preempted"] and seen["resumed"] and seen["replay"], seen


_FIELDS = ("slot_mapping", "compressed_slot_mapping", "indices", "lens", "ks", "ke", "cu", "decode_lens",
           "compact_slot_mapping", "compact_cu", "lens_clamped", "decode_lens_clamped")


@pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRETING),
                    reason="the Triton path needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.slow  # ./dev quick skips it
def test_circular_fused_triton_equals_reference(device):
    """The fused Triton launch (interpreter on CPU) equals the PyTorch reference field by field on a
    short trace with both state groups circular, prefix hits with replay, and padding."""
    layout = two_layer_layout(circular=CIRCULAR_BOTH)
    sched = ReferenceScheduler(layout, 40, max_num_batched_tokens=24, max_num_seqs=4,
                               num_speculative_tokens=2, long_prefill_threshold=12, seed=4)
    fused = MetadataPipeline(layout, 5, 28, device, 2)
    ref = MetadataPipeline(layout, 5, 28, device, 2, backend="reference")
    assert fused.fused_plan is not None and ref.fused_plan is None
    seen = Counter()
    # a prefix owner, then requests that hit it while it runs
    script = [{"add": [dict(req_id="a", prompt_len=70, max_new_tokens=12)]}, {}, {}, {}, {}, {},
              {"add": [dict(req_id="b", prompt_len=80, max_new_tokens=3, prefix_of="a", prefix_len=70)]},
              {}, {"add": [dict(req_id="c", prompt_len=40, max_new_tokens=4, prefix_of="a", prefix_len=40)]}]
    for i, (step, _views) in enumerate(scripted_trace(sched, script + [{}] * 5)):
        pad = min(28, step.total_tokens + i % 4)
        fused.update(step, pad_to=pad)
        ref.update(step, pad_to=pad)
        mf, mr = fused.build(), ref.build()
        seen["replay"] += len(step.replay_end)
        for name in ("query_start_loc", "seq_lens", "idx_mapping", "positions", "token_to_req", "is_valid_token"):
            assert torch.equal(getattr(mf, name), getattr(mr, name)), (i, name)
        for ch in mf.channels:
            for f in _FIELDS:
                a, b = getattr(mf[ch], f, None), getattr(mr[ch], f, None)
                assert (a is None) == (b is None), (i, ch, f)
                assert a is None or torch.equal(a, b), (i, ch, f, a, b)
        for g in range(len(layout.groups)):
            assert torch.equal(fused.tables.tables[g], ref.tables.tables[g]), (i, g)
        topk = torch.randint(-2, 24, (mf.num_tokens_padded, 4), dtype=torch.int32, device=device)
        a, b = mf.topk_to_slots("c4a", topk), mr.topk_to_slots("c4a", topk)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), i
    assert seen["replay"] >= 2, seen
