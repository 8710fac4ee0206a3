"""Fused per-step build (dsv4_index.kernels.fused) == the unfused builders, bit for bit.

Two pipelines see the same steps; one builds with ``fused=True`` (one launch), the other with
``fused=False`` (the per-op kernels). Their buffers are poisoned with different values before each
build, so any entry one path leaves unwritten fails ``torch.equal``.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from dsv4_index._common import cdiv, interpreting
from dsv4_index.channels import register_channel
from dsv4_index.channels.builtin import WindowChannel
from dsv4_index.geometry import ChannelSpec, DSV4Layout
from dsv4_index.pipeline import MetadataPipeline
from dsv4_index.step import NewRequest, RunningRequest, StepInput

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or interpreting()),
                                reason="needs CUDA or TRITON_INTERPRET=1")

CONFIGS = Path(__file__).resolve().parents[1] / "dsv4_index" / "configs"
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def tiny_layout(**kw):
    return DSV4Layout.from_config(CONFIGS / "tiny.json", max_model_len=kw.pop("max_model_len", 256),
                                  mla_block_size=16, swa_block_size=8, indexer_causal_indices=True, **kw)


def flash_layout(**kw):
    return DSV4Layout.from_config(CONFIGS / "flash.json", max_model_len=kw.pop("max_model_len", 2048), **kw)


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def buffers(pipe):
    """(name, tensor, per_token) for every buffer a build writes."""
    out = [("token_to_req", pipe.token_to_req, True), ("positions", pipe.positions, True),
           ("is_valid_token", pipe.is_valid_token, True)]
    seen = set()
    for name, b in pipe._builders.items():
        for attr, per_token in (("slots", True), ("indices", True), ("lens", True), ("compressed", True),
                                ("ks", True), ("ke", True), ("index_lens", True), ("cu", False),
                                ("decode_lens", False)):
            t = getattr(b, attr, None)
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                out.append((f"{name}.{attr}", t, per_token))
    return out


def poison(pipe, value):
    for _, t, _ in buffers(pipe):
        t.fill_(bool(value) if t.dtype == torch.bool else value)


def assert_same(fused, plain, Tp):
    fb, pb = buffers(fused), buffers(plain)
    assert [n for n, _, _ in fb] == [n for n, _, _ in pb]
    for (name, a, per_token), (_, b, _) in zip(fb, pb):
        if per_token:
            a, b = a[:Tp], b[:Tp]
        assert torch.equal(a, b), f"{name} differs:\nfused {a}\nplain {b}"


def step_both(fused, plain, step, pad_to=None):
    assert fused._fused is not None and plain._fused is None
    for p, v in ((fused, 7777), (plain, -5555)):
        p.update(step, pad_to=pad_to)
    poison(fused, 7777)
    poison(plain, -5555)
    mf, mp = fused.build(), plain.build()
    assert_same(fused, plain, mf.num_tokens_padded)
    for name in mf.channels:
        for f in ("slot_mapping", "compressed_slot_mapping", "indices", "lens", "ks", "ke", "cu", "decode_lens"):
            x, y = getattr(mf[name], f), getattr(mp[name], f)
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), (name, f)
    return mf


class Blocks:
    """Distinct random block ids from a big pool (id 0 is the null block)."""

    def __init__(self, layout, rng, cp=(1, 0, 1)):
        self.layout, self.rng = layout, rng
        self.pool = list(range(1, 200_000))
        rng.shuffle(self.pool)
        self.world, self.rank, self.inter = cp

    def owned(self, n):
        cyc = self.inter * self.world
        return (n // cyc) * self.inter + min(max(n % cyc - self.rank * self.inter, 0), self.inter)

    def count(self, g, seq_len):
        return min(cdiv(self.owned(seq_len), g.alloc_block_size) + 1, cdiv(g.table_width, g.blocks_per_kv_block))

    def take(self, n):
        return [self.pool.pop() for _ in range(n)]

    def lists(self, seq_len, have=None):
        have = have or [0] * len(self.layout.groups)
        return tuple(self.take(max(self.count(g, seq_len) - h, 0)) for g, h in zip(self.layout.groups, have))


def random_step(layout, rng, blocks, kind, *, n_reqs, max_ctx, spec=0, replay=False, prefix="r"):
    """A step of new requests only: (StepInput, {req: (ctx, q)})."""
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


def pipelines(layout, max_reqs=6, max_tokens=160, **kw):
    return (MetadataPipeline(layout, max_reqs, max_tokens, DEV, fused=True, **kw),
            MetadataPipeline(layout, max_reqs, max_tokens, DEV, fused=False, **kw))


# ----------------------------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,spec,pad,replay", [
    ("decode", 0, 0, False), ("prefill", 0, 7, False), ("mixed", 0, 0, True), ("decode", 1, 5, True),
    ("mixed", 1, 0, False),
])
def test_tiny_matches_unfused(kind, spec, pad, replay):
    layout = tiny_layout()
    rng = random.Random(hash((kind, spec, pad, replay)) & 0xFFFF)
    fused, plain = pipelines(layout, num_speculative_tokens=spec)
    assert fused._fused.covered == set(layout.channels)
    blocks = Blocks(layout, rng)
    step = random_step(layout, rng, blocks, kind, n_reqs=rng.randint(1, 4), max_ctx=200, spec=spec,
                       replay=replay)
    T = step.total_tokens
    step_both(fused, plain, step, pad_to=min(T + pad, 160) if pad else None)


@pytest.mark.parametrize("seed", range(6))
def test_tiny_random_batches(seed):
    rng = random.Random(100 + seed)
    spec = rng.randint(0, 2)
    layout = tiny_layout()
    fused, plain = pipelines(layout, num_speculative_tokens=spec)
    blocks = Blocks(layout, rng)
    step = random_step(layout, rng, blocks, rng.choice(["decode", "prefill", "mixed"]),
                       n_reqs=rng.randint(1, 6), max_ctx=220, spec=spec, replay=rng.random() < 0.5)
    step_both(fused, plain, step, pad_to=min(160, step.total_tokens + rng.randint(0, 40)))


def test_no_plan_without_triton(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("DSV4_INDEX_BACKEND", raising=False)
    pipe = MetadataPipeline(tiny_layout(), 2, 16, "cpu")
    assert pipe._fused is None  # the reference path: nothing to fuse


def test_tiny_multi_step_running_and_finish():
    """Persistent rows: running requests append blocks, some finish, zero-length rows past the batch."""
    layout = tiny_layout()
    rng = random.Random(3)
    fused, plain = pipelines(layout, num_speculative_tokens=1)
    blocks = Blocks(layout, rng)
    step = random_step(layout, rng, blocks, "mixed", n_reqs=4, max_ctx=120, spec=1)
    step_both(fused, plain, step, pad_to=step.total_tokens + 3)
    state = {r.req_id: (r.num_computed_tokens + step.num_scheduled_tokens[r.req_id], [len(b) for b in r.block_ids])
             for r in step.new_requests}
    for it in range(2):
        done = sorted(state)[:1] if it == 1 else []
        running, sched, rs = [], {}, {}
        for rid, (c, have) in sorted(state.items()):
            if rid in done:
                continue
            q = rng.randint(1, 2)
            new = blocks.lists(c + q, have)
            running.append(RunningRequest(rid, new, c))
            state[rid] = (c + q, [h + len(n) for h, n in zip(have, new)])
            sched[rid] = q
            if rng.random() < 0.5:
                rs[rid] = rng.randint(0, c)
        for rid in done:
            state.pop(rid)
        step = StepInput([], running, sched, set(done), set(), rs)
        step_both(fused, plain, step, pad_to=step.total_tokens + 2 * it)


@pytest.mark.parametrize("kind,pad", [("mixed", 4), ("prefill", 0)])
def test_flash_matches_unfused(kind, pad):
    layout = flash_layout()
    rng = random.Random(11 if kind == "mixed" else 12)
    fused, plain = pipelines(layout, max_reqs=5, max_tokens=128, num_speculative_tokens=1)
    assert fused._fused.covered == set(layout.channels)
    blocks = Blocks(layout, rng)
    step = random_step(layout, rng, blocks, kind, n_reqs=3, max_ctx=1900, spec=1, replay=True)
    step_both(fused, plain, step, pad_to=step.total_tokens + pad)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("make", [tiny_layout, flash_layout])
def test_dcp_rank1_interleave(make, backend, monkeypatch):
    inter = 4
    layout = make(cp_world_size=2, cp_interleave=inter)
    rng = random.Random(5)
    fused, plain = pipelines(layout, max_reqs=4, max_tokens=128, cp_world_size=2, cp_rank=1,
                             cp_interleave=inter)
    monkeypatch.setenv("DSV4_INDEX_BACKEND", backend)  # the unfused side: per-op kernels or references
    blocks = Blocks(layout, rng, cp=(2, 1, inter))
    step = random_step(layout, rng, blocks, "mixed", n_reqs=3, max_ctx=min(layout.max_model_len // 2 - 60, 900),
                       replay=True)
    step_both(fused, plain, step, pad_to=step.total_tokens + 3)


def test_user_channel_keeps_its_own_launch():
    class MyWindow(WindowChannel):
        pass

    register_channel("test_fused_win", MyWindow, replace=True)
    base = tiny_layout()
    swa = base.group("swa")
    layout = base.with_channel(ChannelSpec("test_fused_win", swa.gid, 1, swa.block_size, window=4,
                                           index_width=4, outputs={"slot_mapping", "indices", "lens"}))
    rng = random.Random(9)
    fused, plain = pipelines(layout)
    assert "test_fused_win" not in fused._fused.covered
    assert fused._fused.covered == set(base.channels)
    step = random_step(layout, rng, Blocks(layout, rng), "mixed", n_reqs=3, max_ctx=150, replay=True)
    step_both(fused, plain, step, pad_to=step.total_tokens + 1)


def test_warmup_then_empty_and_padded_only_steps():
    layout = tiny_layout()
    fused, plain = pipelines(layout)
    fused.warmup()
    plain.warmup()
    rng = random.Random(2)
    step = random_step(layout, rng, Blocks(layout, rng), "decode", n_reqs=2, max_ctx=60)
    step_both(fused, plain, step, pad_to=step.total_tokens + 9)
    # a step that schedules nothing, padded to a graph size: every row is a sentinel
    m = step_both(fused, plain, StepInput([], [], {}, set(), set()), pad_to=5)
    assert m.num_tokens == 0 and not bool(m.is_valid_token.any())
    assert torch.equal(m["swa"].indices, torch.full_like(m["swa"].indices, -1))


def test_plan_grid_is_host_sized():
    layout = flash_layout()
    fused, _ = pipelines(layout)
    plan = fused._fused
    n1, n2 = plan.num_programs(1), plan.num_programs(1 + plan._block_t)
    assert n2 - n1 == plan._num_tasks  # one more token tile: one more program per task
    assert plan._consts["NUM_TASKS"] == 1 + 3 + cdiv(layout.channels["c128a"].index_width, 128)


@pytest.mark.gpu
def test_varying_tokens_compile_once():
    layout = flash_layout()
    fused, _ = pipelines(layout, max_reqs=8, max_tokens=512, num_speculative_tokens=1)
    fused.warmup()
    n0 = fused._fused.num_compiled()
    assert n0 >= 1
    rng = random.Random(0)
    blocks = Blocks(layout, rng)
    for i, kind in enumerate(["decode", "prefill", "mixed", "decode"]):
        step = random_step(layout, rng, blocks, kind, n_reqs=1 + i, max_ctx=1500, spec=1, prefix=f"s{i}_")
        fused.update(step, pad_to=step.total_tokens + i)
        fused.build()
        fused.update(StepInput([], [], {}, {r.req_id for r in step.new_requests}, set()))
    assert fused._fused.num_compiled() == n0


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager():
    """build() captured once in a CUDA graph at a padded size, then replayed on a scheduler trace with only
    update() in between: every buffer equals an eager fused build and an eager per-channel build."""
    from dsv4_index.scheduler import random_trace

    layout = tiny_layout()
    PAD = 80
    graph_pipe, eager = (MetadataPipeline(layout, 6, PAD, "cuda", num_speculative_tokens=2) for _ in range(2))
    plain = MetadataPipeline(layout, 6, PAD, "cuda", num_speculative_tokens=2, fused=False)
    for p in (graph_pipe, eager, plain):
        p.warmup()
    graph, steps = None, 0
    for step, _ in random_trace(layout, 80, 9, num_blocks=96, max_num_batched_tokens=64, max_num_seqs=6,
                                num_speculative_tokens=2):
        for p in (graph_pipe, eager, plain):
            p.update(step, pad_to=PAD)
        if graph is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                graph_pipe.build()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                graph_pipe.build()
        poison(graph_pipe, 4321)
        graph.replay()
        eager.build()
        plain.build()
        torch.cuda.synchronize()
        assert_same(graph_pipe, eager, PAD)
        assert_same(graph_pipe, plain, PAD)
        steps += 1
    assert steps == 80


@pytest.mark.gpu
def test_fast_launch_matches(monkeypatch):
    monkeypatch.setenv("DSV4_INDEX_FAST_LAUNCH", "1")
    layout = flash_layout()
    fused, plain = pipelines(layout, max_reqs=6, max_tokens=256, num_speculative_tokens=1)
    assert fused._fused._fast
    rng = random.Random(4)
    blocks = Blocks(layout, rng)
    for i, kind in enumerate(["decode", "mixed", "prefill"]):
        step = random_step(layout, rng, blocks, kind, n_reqs=2, max_ctx=1500, spec=1, prefix=f"f{i}_")
        step_both(fused, plain, step, pad_to=step.total_tokens + i)
        assert i == 0 or fused._fused._compiled is not None  # the direct launcher is in use
        done = {r.req_id for r in step.new_requests}
        for p in (fused, plain):
            p.update(StepInput([], [], {}, done, set()))


# ----------------------------------------------------------------------------------------------
# block-table segments applied inside the launch (one H2D + one launch per step)
# ----------------------------------------------------------------------------------------------
def assert_tables_current(pipe):
    """The device tables hold every row's valid prefix (the launch wrote the staged segments)."""
    for t in pipe.tables.tables:
        dev = t.device_table.cpu()
        for r in range(t.max_num_reqs):
            n = int(t.num_blocks[r])
            assert torch.equal(dev[r, :n], t.host[r, :n]), f"row {r} of a table is stale"


@pytest.mark.parametrize("seed", range(3))
def test_multi_step_trace_rows_appended_swapped_cleared_readded(seed):
    """Requests append blocks, switch between prefill and decode (decode-first swaps), finish, get
    preempted and resume, new ones reuse freed rows; fused (overlay reads + writers) == unfused."""
    layout = tiny_layout()
    rng = random.Random(500 + seed)
    spec = 1
    fused, plain = pipelines(layout, max_reqs=6, max_tokens=160, num_speculative_tokens=spec)
    blocks = Blocks(layout, rng)
    state, preempted, nid = {}, {}, 0
    for it in range(7):
        new, running, sched, rs = [], [], {}, {}
        done = {r for r in state if rng.random() < 0.2}
        pre = {r for r in state if r not in done and rng.random() < 0.15}
        for r in done | pre:
            c, have = state.pop(r)
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
                rs[rid] = rng.randint(0, c)
        for rid in sorted(preempted):
            if len(state) < 6 and rid not in pre and rng.random() < 0.5:
                c = preempted.pop(rid)
                q = rng.randint(1, 8)
                lists = blocks.lists(c + q)
                running.append(RunningRequest(rid, lists, c, resumed=True))
                state[rid] = (c + q, [len(x) for x in lists])
                sched[rid] = q
        while len(state) < 6 and rng.random() < 0.7:
            rid, nid = f"n{nid}", nid + 1
            c, q = rng.randint(0, 150), rng.randint(1, 24)
            lists = blocks.lists(c + q)
            new.append(NewRequest(rid, lists, c))
            state[rid] = (c + q, [len(x) for x in lists])
            sched[rid] = q
        step = StepInput(new, running, sched, done, pre, rs)
        pad = rng.choice([0, 0, 5])
        step_both(fused, plain, step, pad_to=min(160, step.total_tokens + pad) if pad else None)
        st = fused.last_step_stats
        assert st.num_h2d_copies == 1 and st.num_launches == 1 and st.num_applies == 0
        staged = sum(1 for g in range(len(layout.groups)) if plain._host_np[plain._hdr + 3 * g] > 0)
        assert plain.last_step_stats.num_applies == staged  # unfused: one device apply per staged group
        assert st.h2d_bytes == plain.last_step_stats.h2d_bytes
        assert_tables_current(fused)
        assert_tables_current(plain)


def test_step_stats_count_exact_bytes():
    """Steady decode: only the appended columns of the appended rows travel, with the step arrays."""
    layout = tiny_layout()
    R, G = 6, len(layout.groups)
    fused, plain = pipelines(layout, max_reqs=R, max_tokens=64)
    rng = random.Random(8)
    blocks = Blocks(layout, rng)
    ctxs = {"r0": 20, "r1": 33, "r2": 41, "r3": 7}
    new = [NewRequest(r, blocks.lists(c + 2), c) for r, c in ctxs.items()]  # NOTE: a spare block each
    step_both(fused, plain, StepInput(new, [], {r: 1 for r in ctxs}, set(), set()))
    assert fused.last_step_stats.num_segments >= 4 and all(not t.dirty_hi.any() for t in fused.tables.tables)
    swa = layout.group("swa")
    running = [RunningRequest(r, tuple([blocks.pool.pop()] if (g.gid == swa.gid and r in ("r0", "r2")) else []
                                       for g in layout.groups), c + 1) for r, c in ctxs.items()]
    m = step_both(fused, plain, StepInput([], running, {r: 1 for r in ctxs}, set(), set()))
    st = fused.last_step_stats
    f = swa.blocks_per_kv_block
    assert m.num_reqs == 4 and st.num_segments == 2 and st.table_bytes == 4 * 2 * (4 + f)
    assert st.h2d_bytes == 4 * (3 * R + 1 + 3 * G) + st.table_bytes + 4 * 3 * m.num_reqs  # one overlay
    assert st.num_h2d_copies == 1 and st.num_launches == 1 and st.num_applies == 0
    assert plain.last_step_stats.h2d_bytes == st.h2d_bytes and plain.last_step_stats.num_applies == 1
    assert_tables_current(fused)
    # a step that changes no table: the step arrays and headers only
    running = [RunningRequest(r, tuple([] for _ in layout.groups), c + 2) for r, c in ctxs.items()]
    step_both(fused, plain, StepInput([], running, {r: 1 for r in ctxs}, set(), set()))
    assert fused.last_step_stats.h2d_bytes == 4 * (3 * R + 1 + 3 * G)
    assert fused.last_step_stats.num_segments == 0


def test_update_without_build_applies_the_skipped_step():
    """A staged step that is never built is applied by the next update (tables stay current)."""
    layout = tiny_layout()
    fused, plain = pipelines(layout)
    rng = random.Random(21)
    blocks = Blocks(layout, rng)
    s1 = random_step(layout, rng, blocks, "mixed", n_reqs=3, max_ctx=100)
    fused.update(s1)  # never built
    s2 = random_step(layout, rng, blocks, "decode", n_reqs=2, max_ctx=100, prefix="x")
    plain.update(s1)
    step_both(fused, plain, s2, pad_to=s2.total_tokens + 2)
    assert fused.last_step_stats.num_applies == 1
    assert_tables_current(fused)


def test_many_requests_several_lookup_chunks():
    """~600 requests (ten binary-search steps; trailing capacity rows are zero-length) and a second
    step that appends blocks: fused == unfused."""
    layout = tiny_layout()
    rng = random.Random(600)
    fused, plain = pipelines(layout, max_reqs=640, max_tokens=700)
    blocks = Blocks(layout, rng)
    step = random_step(layout, rng, blocks, "decode", n_reqs=600, max_ctx=200, replay=True)
    step_both(fused, plain, step)
    ctx = {r.req_id: r.num_computed_tokens + step.num_scheduled_tokens[r.req_id] for r in step.new_requests}
    running, sched2 = [], {}
    for i, (rid, c) in enumerate(ctx.items()):
        if i % 3 == 0:
            continue  # NOTE: unscheduled this step: leaves gaps in the batch
        q = 1 + (i % 2)
        running.append(RunningRequest(rid, blocks.lists(c + q, [blocks.count(g, c) for g in layout.groups]), c))
        sched2[rid] = q
    finished = {rid for i, rid in enumerate(ctx) if i % 3 == 0}
    step_both(fused, plain, StepInput([], running, sched2, finished, set()))
