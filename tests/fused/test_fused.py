"""The fused per-step build (one launch) == the per-op kernels (``fused=False``) == the PyTorch
reference (``backend="reference"``), bit for bit.

Pipelines see the same steps; before each ``build()`` every output buffer of each pipeline is
poisoned at capacity with its own value (``helpers.pipelines.poison``), so any entry in ``[0, T_pad)``
that one path leaves unwritten fails ``torch.equal``. Block tables, top-k conversions and the host
counts are compared too, and the fused metadata goes through ``check_metadata``.
"""

from __future__ import annotations

import random

import pytest
import torch

from dsv4_index._common import cdiv
from dsv4_index.pipeline import MetadataPipeline
from dsv4_index.frontend import NewRequest, RunningRequest, StepInput
from dsv4_index.validate import check_metadata

from helpers.layouts import flash_layout, tiny_layout
from helpers.pipelines import (DEVICE, HAS_TRITON, Blocks, assert_same, assert_tables_follow_views, compare_over_trace,
                               compare_step, dcp_groups, eventful_trace, hand_session, meta_tensors, poison,
                               random_step, step_all, tables_of, three_pipelines)

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")

SPEC = 2


def _check(num_blocks):
    return lambda m: check_metadata(m, num_blocks=num_blocks)


# ----------------------------------------------------------------------------------------------
# reference-scheduler traces, one per geometry
# ----------------------------------------------------------------------------------------------
CASES = {
    # name: (layout kwargs, pipeline kwargs, extra padding per step, pool size)
    "tiny_ring_indexer_causal": (dict(), dict(), (0, 5, 2), 40),
    "full_sliding_tables_graph_padding": (dict(sliding_tables="full"), dict(), (40,), 40),  # padded to capacity
    "compact_compressed": (dict(compact_compressed=True), dict(), (0, 4), 40),
    "circular_state_groups": (dict(circular={"c4_state": 16, "c128_state": 32}), dict(), (2, 0), 24),
    "hybrid_kernel_blocks": (dict(kernel_block_size={"mla": 16, "swa": 2}), dict(), (0, 3), 40),
    "dcp_rank1": (dict(cp_world_size=2, cp_interleave=2),
                  dict(cp_world_size=2, cp_rank=1, cp_interleave=2), (1, 0), 40),
}
STEPS = 7
NUM_BLOCKS = 40


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow  # ./dev quick skips it
def test_fused_equals_unfused_equals_reference_over_a_trace(case):
    _trace_case(case)


def _trace_case(case):
    lay_kw, pipe_kw, pad, num_blocks = CASES[case]
    layout = tiny_layout(**lay_kw)
    # geometry really is what the case says
    kinds = {g.name: (g.kind, g.ring, g.blocks_per_kv_block) for g in layout.groups}
    if case.startswith("full_sliding"):
        assert not any(g.ring for g in layout.groups)
    elif case == "circular_state_groups":
        assert kinds["c4_state"][0] == kinds["c128_state"][0] == "circular" and kinds["swa"][1]
    elif case == "hybrid_kernel_blocks":
        assert kinds["mla"][2] == 2 and kinds["swa"][2] == 2
    elif case == "compact_compressed":
        assert all(layout.channels[c].compact for c in ("c4a", "c4i", "c128a"))
    else:
        assert kinds["swa"][1] and kinds["c4_state"][1] and "indices" in layout.channels["c4i"].outputs
    dcp = pipe_kw.get("cp_world_size", 1) > 1
    groups = dcp_groups(layout) if dcp else layout
    # NOTE: DCP traces have no prefix hit (the scheduler's virtual blocks are not the rank's blocks)
    need = ("preempted", "resumed", "finished", "spec") + (() if dcp else ("replay",))
    trace = eventful_trace(groups, STEPS, need=need, num_blocks=num_blocks, seeds=range(200))
    pipes = three_pipelines(layout, 4, 40, num_speculative_tokens=SPEC, **pipe_kw)
    seen = compare_over_trace(pipes, trace, pad=pad, check=_check(num_blocks))
    assert seen["steps"] == STEPS and seen["decodes"] and seen["prefills"] and seen["padded"] and seen["topk"]
    if case == "compact_compressed":
        m = pipes["fused"].build()
        assert m["c4a"].compact_slot_mapping is not None and m["c128a"].compact_cu is not None


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
def test_dcp_rank0_and_the_partition_of_writes():
    """Rank 0 of a DCP trace (rank 1 is a case above): fused == reference, and at every step the two
    ranks' outputs partition every write of the sharded groups (``check_cp_partition``)."""
    from dsv4_index.validate import check_cp_partition

    layout = tiny_layout(cp_world_size=2, cp_interleave=2)
    trace = eventful_trace(dcp_groups(layout), 5, need=("finished", "spec"), num_blocks=NUM_BLOCKS)
    kw = dict(num_speculative_tokens=SPEC, cp_world_size=2, cp_interleave=2)
    rank0 = {"fused": MetadataPipeline(layout, 4, 40, DEVICE, cp_rank=0, **kw),
             "reference": MetadataPipeline(layout, 4, 40, DEVICE, cp_rank=0, backend="reference", **kw)}
    rank1 = MetadataPipeline(layout, 4, 40, DEVICE, cp_rank=1, backend="reference", **kw)
    for i, (step, _) in enumerate(trace):
        pad_to = step.total_tokens + i % 2
        rank1.update(step, pad_to=pad_to)
        m1 = rank1.build()
        compare_step(rank0, step, pad_to, tag=i,
                     check=lambda m0: (check_metadata(m0, num_blocks=NUM_BLOCKS), check_cp_partition([m0, m1])))


# ----------------------------------------------------------------------------------------------
# build() is idempotent; a staged step that is never built is applied by the next update()
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["fused", "unfused"])
@pytest.mark.slow  # ./dev quick skips it
def test_build_twice_is_idempotent(kind):
    layout = tiny_layout()
    trace = eventful_trace(layout, 5, need=("finished", "spec"), num_blocks=NUM_BLOCKS)
    pipe = three_pipelines(layout, 4, 32, num_speculative_tokens=SPEC)[kind]
    for i, (step, _) in enumerate(trace):
        pipe.update(step, pad_to=min(32, step.total_tokens + i % 3))
        first = meta_tensors(pipe.build())
        tables = tables_of(pipe)
        poison(pipe, 999 + i)
        second = meta_tensors(pipe.build())
        assert_same(first, second, (kind, i))
        for a, b in zip(tables, tables_of(pipe)):
            assert torch.equal(a, b), (kind, i, "tables changed by a second build")


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
@pytest.mark.parametrize("kind", ["fused", "unfused"])
def test_update_without_build_still_leaves_tables_right(kind):
    """Step ``k`` is staged but never built; the next ``update()`` applies its writes (one extra
    apply), and from then on the pipeline equals one that built every step."""
    layout = tiny_layout()
    trace = eventful_trace(layout, 6, need=("finished", "spec"), num_blocks=NUM_BLOCKS)
    skip = next(i for i, (s, _) in enumerate(trace) if i >= 2 and any(len(x) for r in s.running_requests
                                                                     for x in r.new_block_ids))
    a = three_pipelines(layout, 4, 32, num_speculative_tokens=SPEC)[kind]
    b = MetadataPipeline(layout, 4, 32, DEVICE, SPEC, backend="reference")
    for i, (step, views) in enumerate(trace):
        a.update(step)
        b.update(step)
        assert a.last_step_stats.num_applies == (1 if i == skip + 1 else 0), i
        if i == skip:
            continue  # never built
        ma, mb = a.build(), b.build()
        assert_same(meta_tensors(ma), meta_tensors(mb), (kind, i))
        assert_tables_follow_views(a, views)
        for x, y in zip(tables_of(a), tables_of(b)):
            assert torch.equal(x, y), i
    assert b.last_step_stats.num_applies == 0


# ----------------------------------------------------------------------------------------------
# hand-written steps: large random block ids, replay floors, padding
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,spec,pad,replay,tables", [
    ("decode", 0, 0, False, "ring"), ("prefill", 0, 7, False, "ring"), ("mixed", 0, 0, True, "full"),
    ("decode", 1, 5, True, "ring"), ("mixed", 1, 0, False, "ring"), ("random", 2, 30, True, "full"),
])
def test_tiny_one_step(kind, spec, pad, replay, tables):
    layout = tiny_layout(mla_block_size=16, swa_block_size=8, sliding_tables=tables)
    rng = random.Random(f"{kind}{spec}{pad}{replay}{tables}")  # NOTE: str seeds are deterministic
    pipes = three_pipelines(layout, 6, 160, num_speculative_tokens=spec)
    kind = rng.choice(["decode", "prefill", "mixed"]) if kind == "random" else kind
    step = random_step(rng, Blocks(layout, rng), kind, n_reqs=rng.randint(1, 6), max_ctx=220, spec=spec,
                       replay=replay)
    step_all(pipes, step, pad_to=min(step.total_tokens + pad, 160) if pad else None)


def test_no_fused_plan_without_triton(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("DSV4_INDEX_BACKEND", raising=False)
    layout = tiny_layout()
    pipe = MetadataPipeline(layout, 2, 16, "cpu")
    assert pipe.fused_plan is None and pipe.num_launches == len(layout.channels)  # the reference path


@pytest.mark.slow  # ./dev quick skips it
def test_multi_step_running_and_finish():
    """Running requests append blocks, one finishes, the others keep their slots."""
    layout = tiny_layout(mla_block_size=16, swa_block_size=8)
    rng = random.Random(3)
    pipes = three_pipelines(layout, 6, 160, num_speculative_tokens=1)
    blocks = Blocks(layout, rng)
    step = random_step(rng, blocks, "mixed", n_reqs=4, max_ctx=120, spec=1)
    step_all(pipes, step, pad_to=step.total_tokens + 3)
    state = {r.req_id: (r.num_computed_tokens + step.num_scheduled_tokens[r.req_id], [len(b) for b in r.block_ids])
             for r in step.new_requests}
    slots = {r: pipes["fused"].slot_of(r) for r in state}
    floor = {}  # NOTE: replay floors: once sent, sent every step, never lowered (scheduler contract)
    for it in range(2):
        done = sorted(state)[:1] if it == 1 else []
        running, sched = [], {}
        for rid, (c, have) in sorted(state.items()):
            if rid in done:
                continue
            q = rng.randint(1, 2)
            new = blocks.lists(c + q, have)
            running.append(RunningRequest(rid, new, c))
            state[rid] = (c + q, [h + len(n) for h, n in zip(have, new)])
            sched[rid] = q
            if rng.random() < 0.5:
                floor[rid] = max(floor.get(rid, 0), rng.randint(0, c))
        for rid in done:
            state.pop(rid)
        rs = {r: floor[r] for r in sched if r in floor}
        step_all(pipes, StepInput([], running, sched, set(done), set(), rs), pad_to=sum(sched.values()) + 2 * it)
        assert {r: pipes["fused"].slot_of(r) for r in state} == {r: slots[r] for r in state}  # slots are stable


@pytest.mark.parametrize("kind,pad", [("mixed", 4), ("prefill", 0)])
def test_flash_one_step(kind, pad):
    layout = flash_layout()
    rng = random.Random(11 if kind == "mixed" else 12)
    pipes = three_pipelines(layout, 5, 128, num_speculative_tokens=1)
    step = random_step(rng, Blocks(layout, rng), kind, n_reqs=3, max_ctx=1900, spec=1, replay=True)
    step_all(pipes, step, pad_to=step.total_tokens + pad)


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
@pytest.mark.parametrize("make", [tiny_layout, flash_layout])
def test_dcp_rank1_interleave_hand_written(make):
    inter = 4
    layout = make(cp_world_size=2, cp_interleave=inter)
    rng = random.Random(5)
    pipes = three_pipelines(layout, 4, 128, cp_world_size=2, cp_rank=1, cp_interleave=inter)
    step = random_step(rng, Blocks(layout, rng, cp=(2, 1, inter)), "mixed", n_reqs=3,
                       max_ctx=min(layout.max_model_len // 2 - 60, 900), replay=True)
    step_all(pipes, step, pad_to=step.total_tokens + 3)


@pytest.mark.slow  # ./dev quick skips it
def test_warmup_then_empty_and_padded_only_steps():
    layout = tiny_layout()
    pipes = three_pipelines(layout, 6, 160)
    for p in pipes.values():
        p.warmup(pad_sizes=(1, 8))
    rng = random.Random(2)
    step = random_step(rng, Blocks(layout, rng), "decode", n_reqs=2, max_ctx=60)
    step_all(pipes, step, pad_to=step.total_tokens + 9)
    # a step that schedules nothing, padded to a graph size: every row is a sentinel
    m = step_all(pipes, StepInput([], [], {}, set(), set()), pad_to=5)
    assert m.num_tokens == 0 and m.num_reqs == 0 and not bool(m.is_valid_token.any())
    assert torch.equal(m["swa"].indices, torch.full_like(m["swa"].indices, -1))
    assert torch.equal(m["c4i"].lens, torch.zeros_like(m["c4i"].lens))


def test_plan_grid_is_host_sized_and_shares_identical_geometry():
    layout = flash_layout()
    pipe = MetadataPipeline(layout, 4, 256, DEVICE)
    plan = pipe.fused_plan
    n_req, n_tok = plan.num_units
    small = plan.configs[1]
    t_super = plan._variants[1]["t_super"]
    more_req = n_req * (cdiv(t_super + 2 + plan.small_from, plan.block_r) - cdiv(2 + plan.small_from, plan.block_r))
    t0 = plan.small_from
    assert plan.grid(t0 + 1 + t_super) - plan.grid(t0 + 1) == n_tok + more_req  # one more super tile
    # NOTE: c4a and c4i have one geometry: one compressed-slot task (DESIGN §10), one per geometry
    geoms = {(c.gid, c.compress_ratio, c.rows_per_block) for c in layout.channels.values() if c.compress_ratio > 1}
    assert sum(t.kind == "compressed" for t in plan.tasks) == len(geoms) == 2
    # every token task runs T_SUPER / rows-per-program programs per super tile (and one per column chunk)
    progs = 0
    for t in plan.tasks:
        if t.kind in ("window", "causal"):
            bc = min(small.bc, 1 << (t.width - 1).bit_length())
            progs += cdiv(t.width, bc) * (t_super // min(small.bt2 * (small.bc // bc), max(small.bt1, small.bt2)))
        elif t.kind in ("common", "compressed", "indexer", "token_rows", "query_map"):
            progs += t_super // small.bt1
    assert n_tok == progs
    # the large variant: whole index-list rows per program, far fewer programs for a long step
    assert plan.variant(plan.large_from) == 2 and plan.variant(plan.large_from - 1) == 1 and plan.variant(1) == 0
    from dsv4_index.fused.plan import LARGE, SMALL, TINY, FusedPlan
    gpu = FusedPlan(plan.tasks, pipe.tables, pipe.ctx.group_cp, pipe.staging.dev, 1, tiny=TINY, small=SMALL,
                    large=LARGE)
    small_8k = gpu._variants[1]["p_super"] * cdiv(8192, gpu._variants[1]["t_super"])
    assert gpu.grid(8192) < small_8k


@pytest.mark.parametrize("case", ["tiny_ring_indexer_causal", "compact_compressed", "circular_state_groups",
                                  "dcp_rank1"])
@pytest.mark.slow  # ./dev quick skips it
def test_large_tile_variant_equals_reference(case, monkeypatch):
    """The whole-row variant (chunks past every token's length stored as -1 without table work)
    computes the same outputs: every step of the trace runs on it."""
    monkeypatch.setenv("DSV4_INDEX_LARGE_FROM", "1")
    assert MetadataPipeline(tiny_layout(), 4, 40, DEVICE)._fused.variant(1) == 2
    _trace_case(case)


@pytest.mark.slow  # ./dev quick skips it
def test_multi_step_rows_appended_cleared_readded():
    """Requests append blocks, switch between prefill and decode, finish, get preempted and come back
    (as resumed or as new), new ones reuse freed slots: all three paths agree, one H2D and one
    launch per fused step, the same staged bytes on every path, tables current on the device."""
    layout = tiny_layout(mla_block_size=16, swa_block_size=8)
    pipes = three_pipelines(layout, 6, 160, num_speculative_tokens=1)
    events = {"resumed": 0, "renewed": 0, "done": 0}
    for step, pad in hand_session(layout, random.Random(502), 6, spec=1, max_reqs=6, events=events):
        step_all(pipes, step, pad_to=pad)
        f, u = pipes["fused"].last_step_stats, pipes["unfused"].last_step_stats
        assert (f.num_h2d_copies, f.num_launches, f.num_applies) == (1, 1, 0)
        assert u.num_launches == len(layout.channels) and u.h2d_bytes == f.h2d_bytes
        assert u.num_writes == f.num_writes == pipes["reference"].last_step_stats.num_writes
        for p in pipes.values():
            for g, t in enumerate(p.tables.tables):
                assert torch.equal(t.cpu(), torch.from_numpy(p.tables.mirrors[g])), g
    assert events["resumed"] and events["renewed"] and events["done"]


@pytest.mark.slow  # ./dev quick skips it
def test_step_stats_count_staged_ids():
    """Steady decode: only the appended ids travel; a step with no new block stages none, and its
    copy is smaller by exactly those (value, destination) pairs."""
    layout = tiny_layout(mla_block_size=16, swa_block_size=8)
    pipes = three_pipelines(layout, 6, 64)
    rng = random.Random(8)
    blocks = Blocks(layout, rng)
    ctxs = {"r0": 20, "r1": 33, "r2": 41, "r3": 7}
    new = [NewRequest(r, blocks.lists(c + 2), c) for r, c in ctxs.items()]  # NOTE: a spare block each
    step_all(pipes, StepInput(new, [], {r: 1 for r in ctxs}, set(), set()))
    # NOTE: rings store only the blocks a request can still read: from its first window block on,
    # at most ring_cols of them (DESIGN §4); full groups store every id
    want = 0
    for r in new:
        for g, ids in zip(layout.groups, r.block_ids):
            n = len(ids)
            if g.ring:
                ring = cdiv(g.window - 1 + 64, g.block_size) + 1
                lo = max(r.num_computed_tokens - g.window + 1, 0) // g.block_size
                n -= max(lo, n - ring, 0)
            want += n
    assert want < sum(len(x) for r in new for x in r.block_ids)
    assert pipes["fused"].last_step_stats.num_writes == want
    swa = layout.group("swa")
    running = [RunningRequest(r, tuple([blocks.pool.pop()] if (g.gid == swa.gid and r in ("r0", "r2")) else []
                                       for g in layout.groups), c + 1) for r, c in ctxs.items()]
    step_all(pipes, StepInput([], running, {r: 1 for r in ctxs}, set(), set()))
    with_ids = pipes["fused"].last_step_stats
    assert with_ids.num_writes == 2 and with_ids.num_h2d_copies == 1 and with_ids.num_launches == 1
    running = [RunningRequest(r, tuple([] for _ in layout.groups), c + 2) for r, c in ctxs.items()]
    step_all(pipes, StepInput([], running, {r: 1 for r in ctxs}, set(), set()))
    none = pipes["fused"].last_step_stats
    assert none.num_writes == 0 and with_ids.h2d_bytes - none.h2d_bytes == 2 * 2 * 4  # int32 (id, dest)
    assert all(p.last_step_stats.h2d_bytes == none.h2d_bytes for p in pipes.values())


@pytest.mark.slow  # ./dev quick skips it
def test_many_requests():
    """120 requests (trailing capacity rows are zero-length) and a second step
    that appends blocks and leaves gaps (unscheduled requests)."""
    layout = tiny_layout(mla_block_size=16, swa_block_size=8)
    rng = random.Random(600)
    pipes = three_pipelines(layout, 128, 200)
    blocks = Blocks(layout, rng)
    step = random_step(rng, blocks, "decode", n_reqs=120, max_ctx=200, replay=True)
    step_all(pipes, step)
    ctx = {r.req_id: r.num_computed_tokens + step.num_scheduled_tokens[r.req_id] for r in step.new_requests}
    running, sched2 = [], {}
    for i, (rid, c) in enumerate(ctx.items()):
        if i % 3 == 0:
            continue  # NOTE: unscheduled this step
        q = 1 + (i % 2)
        running.append(RunningRequest(rid, blocks.lists(c + q, [blocks.count(g, c) for g in layout.groups]), c))
        sched2[rid] = q
    finished = {rid for i, rid in enumerate(ctx) if i % 3 == 0 and i % 2 == 0}
    floors = {r: f for r, f in step.replay_start.items() if r in sched2}  # NOTE: floors are sent every step
    assert floors
    step_all(pipes, StepInput([], running, sched2, finished, set(), floors))


# ----------------------------------------------------------------------------------------------
# GPU only
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_varying_tokens_reuse_one_compiled_launcher():
    layout = flash_layout()
    pipe = MetadataPipeline(layout, 8, 512, "cuda", num_speculative_tokens=1)
    pipe.warmup()
    rng = random.Random(0)
    blocks = Blocks(layout, rng)
    compiled = None
    for i, kind in enumerate(["decode", "prefill", "mixed", "decode"]):
        step = random_step(rng, blocks, kind, n_reqs=1 + i, max_ctx=1500, spec=1, prefix=f"s{i}_")
        pipe.update(step, pad_to=step.total_tokens + i)
        pipe.build()
        compiled = compiled or pipe.fused_plan._compiled
        assert compiled is not None and pipe.fused_plan._compiled is compiled  # counts are runtime arguments
        pipe.update(StepInput([], [], {}, {r.req_id for r in step.new_requests}, set()))


@pytest.mark.gpu
def test_cuda_graph_build_matches_eager():
    """``cuda_graphs=True``: build() replays a graph per padded size; every output equals eager."""
    from dsv4_index.testing.scheduler import random_trace

    layout = tiny_layout()
    PAD = 80
    graphs = MetadataPipeline(layout, 6, PAD, "cuda", num_speculative_tokens=2, cuda_graphs=True)
    eager = MetadataPipeline(layout, 6, PAD, "cuda", num_speculative_tokens=2)
    graphs.warmup(pad_sizes=(PAD,))
    eager.warmup()
    steps = 0
    for step, _ in random_trace(layout, 60, 9, num_blocks=96, max_num_batched_tokens=64, max_num_seqs=6,
                                num_speculative_tokens=2):
        for p in (graphs, eager):
            p.update(step, pad_to=PAD)
        poison(graphs, 4321)
        mg, me = graphs.build(), eager.build()
        torch.cuda.synchronize()
        assert_same(meta_tensors(mg), meta_tensors(me), steps)
        steps += 1
    assert steps == 60


@pytest.mark.gpu
def test_direct_launch_matches_triton_launch(monkeypatch):
    layout = flash_layout()
    monkeypatch.setenv("DSV4_INDEX_DIRECT_LAUNCH", "0")
    slow = MetadataPipeline(layout, 6, 256, "cuda", num_speculative_tokens=1)
    monkeypatch.setenv("DSV4_INDEX_DIRECT_LAUNCH", "1")
    fast = MetadataPipeline(layout, 6, 256, "cuda", num_speculative_tokens=1)
    rng = random.Random(4)
    blocks = Blocks(layout, rng)
    for i, kind in enumerate(["decode", "mixed", "prefill"]):
        step = random_step(rng, blocks, kind, n_reqs=2, max_ctx=1500, spec=1, prefix=f"f{i}_")
        step_all({"fast": fast, "slow": slow}, step, pad_to=step.total_tokens + i)
        assert slow.fused_plan._compiled is None and fast.fused_plan._compiled is not None
        done = {r.req_id for r in step.new_requests}
        for p in (fast, slow):
            p.update(StepInput([], [], {}, done, set()))


@pytest.mark.gpu
def test_every_variant_compiled_at_construction_none_while_serving():
    """Both tile variants are compiled when the plan is built (before warmup); steps of any size,
    on either side of the variant threshold, then add nothing to the JIT cache."""
    from dsv4_index.fused.kernel import fused_step_kernel
    layout = flash_layout()
    pipe = MetadataPipeline(layout, 8, 4096, "cuda", num_speculative_tokens=1)
    plan = pipe._fused
    assert all(v["kernel"] is not None for v in plan._variants)
    pipe.warmup()
    cache = fused_step_kernel.device_caches[torch.cuda.current_device()][0]
    n = len(cache)
    rng = random.Random(5)
    blocks = Blocks(layout, rng)
    for i, kind in enumerate(["decode", "prefill", "mixed", "decode"]):
        step = random_step(rng, blocks, kind, n_reqs=1 + i, max_ctx=1500, spec=1, prefix=f"c{i}_")
        pad = plan.large_from + 7 if i % 2 else step.total_tokens + i
        pipe.update(step, pad_to=pad)
        pipe.build()
        assert (plan.variant(pad) == 2) == bool(i % 2)
        pipe.update(StepInput([], [], {}, {r.req_id for r in step.new_requests}, set()))
    torch.cuda.synchronize()
    assert len(cache) == n


@pytest.mark.parametrize("block_loads", [True, False])
@pytest.mark.slow  # ./dev quick skips it
def test_long_causal_rows_block_loads(block_loads, monkeypatch):
    """Causal rows longer than a chunk, on the whole-row variant: chunks of cached blocks and chunks
    holding this step's staged blocks, with one table read per block (``block_loads``, the default of
    that variant) or per column: the same outputs as the unfused and reference paths.

    NOTE: the interpreter runs the writer programs first, so a missing overlay read cannot fail here
    (``benchmarks/gpu_check.py`` covers that on a GPU)."""
    import dataclasses

    from dsv4_index.fused import plan as plan_mod
    monkeypatch.setenv("DSV4_INDEX_LARGE_FROM", "1")
    monkeypatch.setattr(plan_mod, "INTERP_LARGE", dataclasses.replace(plan_mod.INTERP_LARGE, block_loads=block_loads))
    layout = flash_layout(max_model_len=24576)
    rng = random.Random(21)
    pipes = three_pipelines(layout, 3, 384)
    blocks = Blocks(layout, rng)
    ctx = {"a": 9000, "b": 16380, "c": 700}
    step = StepInput([NewRequest(r, blocks.lists(c + 2), c) for r, c in ctx.items()], [], {r: 2 for r in ctx},
                     set(), set(), {})
    step_all(pipes, step, pad_to=8)
    have = {r.req_id: [len(b) for b in r.block_ids] for r in step.new_requests}
    ctx = {r: c + 2 for r, c in ctx.items()}
    for q in (40, 1):  # NOTE: "b" crosses C128A block boundaries (256 tokens a block) in the first
        sched = {r: q + 256 if r == "b" and q == 40 else q for r in ctx}
        running = []
        for rid, c in sorted(ctx.items()):
            new = blocks.lists(c + sched[rid], have[rid])
            have[rid] = [h + len(n) for h, n in zip(have[rid], new)]
            running.append(RunningRequest(rid, new, c))
            ctx[rid] = c + sched[rid]
        step_all(pipes, StepInput([], running, sched, set(), set(), {}), pad_to=sum(sched.values()) + 3)
