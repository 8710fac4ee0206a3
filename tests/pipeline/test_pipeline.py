"""MetadataPipeline over randomized scheduler traces: every channel, every step, equals DESIGN §4
recomputed in plain Python from the scheduler's own view of each request's blocks."""

import pytest
import torch

from dsv4_index import MetadataPipeline, StepInput, batch_from_step
from dsv4_index.channels.base import _REGISTRY
from dsv4_index.testing.scheduler import random_trace

from helpers.expected import expected_rows
from helpers.layouts import flash_layout as _flash, tiny_layout
from helpers.pipelines import HAS_TRITON, eventful_trace


def flash_layout():
    return _flash(max_model_len=1024, mla_block_size=256, swa_block_size=64)


@pytest.fixture
def registry():
    saved = dict(_REGISTRY)
    yield
    _REGISTRY.clear()
    _REGISTRY.update(saved)


def check_step(layout, meta, views, next_n, pipe=None):
    by_id = {v.req_id: v for v in views}
    assert sorted(meta.req_ids) == sorted(by_id), "batch holds exactly the scheduled requests"
    if pipe is not None:  # the batch reads each request's own slot
        slots = [pipe.slot_of(r) for r in meta.req_ids]
        assert meta.req_slots.tolist() == slots == meta.idx_mapping.cpu().tolist()
    qsl = meta.query_start_loc.cpu().tolist()
    # decode-first: decodes (<= next_n tokens) then prefills, counts consistent
    q = [qsl[i + 1] - qsl[i] for i in range(meta.num_reqs)]
    assert all(x <= next_n for x in q[:meta.num_decodes]) and all(x > next_n for x in q[meta.num_decodes:])
    assert meta.num_decode_tokens == sum(q[:meta.num_decodes]) and meta.num_tokens == qsl[-1]
    positions = meta.positions.cpu().tolist()
    valid = meta.is_valid_token.cpu().tolist()
    ttr = meta.token_to_req.cpu().tolist()
    T, Tp = meta.num_tokens, meta.num_tokens_padded
    assert valid == [True] * T + [False] * (Tp - T)
    chans = {n: {f: getattr(meta[n], f).cpu().tolist() for f in
                 ("slot_mapping", "tail_slot_mapping", "compressed_slot_mapping", "indices", "lens")
                 if getattr(meta[n], f) is not None}
             for n in meta.channels}
    cu = 0
    for b, rid in enumerate(meta.req_ids):
        v = by_id[rid]
        rs = 0 if meta.replay_start is None else int(meta.replay_start[b])
        re_ = 0 if meta.replay_end is None else int(meta.replay_end[b])
        assert (rs, re_) == (v.replay_start, v.replay_end), rid
        lo, hi = qsl[b], qsl[b + 1]
        assert hi - lo == v.num_scheduled_tokens
        assert positions[lo:hi] == list(v.positions), rid
        assert ttr[lo:hi] == [b] * (hi - lo)
        exp = expected_rows(layout, v, next_n, lo)
        for name, fields in exp.items():
            for field, rows in fields.items():
                got = chans[name][field][lo:hi]
                assert got == rows, f"step channel {name}.{field} request {rid} (row {b})"
        if "c4i" in meta:
            R = layout.channels["c4i"].compress_ratio
            ks = meta["c4i"].ks.cpu().tolist()[lo:hi]
            ke = meta["c4i"].ke.cpu().tolist()[lo:hi]
            assert ks == [cu] * (hi - lo)
            assert ke == [cu + (p + 1) // R for p in v.positions]
            assert meta["c4i"].cu.cpu().tolist()[b] == cu
            cu += v.seq_len // R
    # padded tokens: sentinels everywhere
    for name, fields in chans.items():
        for field, vals in fields.items():
            for t in range(T, Tp):
                sentinel = 0 if field == "lens" else -1
                row = vals[t] if isinstance(vals[t], list) else [vals[t]]
                assert all(x == sentinel for x in row), f"padded token {t} {name}.{field}"


def run_trace(layout, steps, seed, *, pad=0, device="cpu", max_num_reqs=6, max_tokens=64, spec=2, **kw):
    pipe = MetadataPipeline(layout, max_num_reqs=max_num_reqs, max_num_batched_tokens=max_tokens + pad,
                            device=device, num_speculative_tokens=spec)
    n, slot_of = 0, {}
    for step, views in random_trace(layout, steps, seed, max_num_batched_tokens=max_tokens,
                                    max_num_seqs=max_num_reqs, num_speculative_tokens=spec, **kw):
        for r in step.running_requests:  # NOTE: a request keeps its slot from arrival to finish
            if not r.resumed:
                assert pipe.slot_of(r.req_id) == slot_of[r.req_id], r.req_id
        pipe.update(step, pad_to=step.total_tokens + pad if pad else None)
        meta = pipe.build()
        check_step(layout, meta, views, 1 + spec, pipe)
        slot_of.update(zip(meta.req_ids, meta.req_slots.tolist()))
        n += meta.num_tokens
    return n


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.slow  # ./dev quick skips it
def test_tiny_trace_reference_backend(monkeypatch, seed):
    monkeypatch.setenv("DSV4_INDEX_BACKEND", "reference")
    tokens = run_trace(tiny_layout(), 100, seed, pad=seed * 3, num_blocks=96)
    assert tokens > 1000


@pytest.mark.parametrize("kw", [dict(sliding_tables="full"), dict(circular={"c4_state": 16, "c128_state": 32}),
                                dict(kernel_block_size={"mla": 16, "swa": 2})], ids=["full", "circular", "hybrid"])
@pytest.mark.slow  # ./dev quick skips it
def test_tiny_trace_other_tables_reference_backend(monkeypatch, kw):
    monkeypatch.setenv("DSV4_INDEX_BACKEND", "reference")
    assert run_trace(tiny_layout(**kw), 80, 4, pad=2, num_blocks=64) > 500


@pytest.mark.slow  # ./dev quick skips it
def test_flash_trace_reference_backend(monkeypatch):
    monkeypatch.setenv("DSV4_INDEX_BACKEND", "reference")
    run_trace(flash_layout(), 60, 7, num_blocks=64, max_tokens=512, prompt_len=(1, 900), max_new_tokens=(1, 8))


@pytest.mark.skipif(not HAS_TRITON, reason="needs TRITON_INTERPRET=1 or CUDA")
@pytest.mark.slow  # ./dev quick skips it
def test_tiny_trace_kernels(device):
    """The same trace on the Triton kernels (interpreter on CPU, compiled on CUDA)."""
    run_trace(tiny_layout(), 12, 3, pad=4, num_blocks=96, device=device)


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
def test_custom_channel_registered_outside_the_package(monkeypatch, registry):
    """A ratio-2 cache on the MLA group, added without touching dsv4_index."""
    from dsv4_index import ChannelSpec, register_channel
    from dsv4_index.channels import CausalCompressedChannel

    class C2Channel(CausalCompressedChannel):
        """User channel: compressed slots + causal list, ratio 2."""

    register_channel("c2_test", C2Channel, replace=True)
    base = tiny_layout()
    mla = base.group("mla")
    spec = ChannelSpec(name="c2_test", gid=mla.gid, compress_ratio=2, rows_per_block=mla.block_size // 2,
                       index_width=128, outputs=frozenset({"compressed_slot_mapping", "indices", "lens"}))
    layout = base.with_channel(spec)
    monkeypatch.setenv("DSV4_INDEX_BACKEND", "reference")
    run_trace(layout, 40, 11, num_blocks=96)


def test_bad_step_leaves_state_unchanged(monkeypatch):
    monkeypatch.setenv("DSV4_INDEX_BACKEND", "reference")
    layout = tiny_layout()
    trace = list(random_trace(layout, 12, 5, num_blocks=96, max_num_batched_tokens=64, max_num_seqs=6))
    a = MetadataPipeline(layout, 6, 64, "cpu", num_speculative_tokens=2)
    b = MetadataPipeline(layout, 6, 64, "cpu", num_speculative_tokens=2)
    for i, (step, views) in enumerate(trace):
        if i == 6:
            bad = StepInput(new_requests=[], running_requests=[], num_scheduled_tokens={"nope": 1},
                            finished_req_ids=[], preempted_req_ids=[])
            with pytest.raises(ValueError, match="nope"):
                a.update(bad)
        a.update(step)
        b.update(step)
        ma, mb = a.build(), b.build()
        assert ma.req_ids == mb.req_ids and ma.req_slots.tolist() == mb.req_slots.tolist()
        for name in ma.channels:
            for f in ("slot_mapping", "compressed_slot_mapping", "indices", "lens"):
                x, y = getattr(ma[name], f), getattr(mb[name], f)
                assert (x is None and y is None) or torch.equal(x, y)
        for x, y in zip(a.tables.tables, b.tables.tables):
            assert torch.equal(x, y), i


@pytest.mark.skipif(not HAS_TRITON, reason="needs TRITON_INTERPRET=1 or CUDA")
@pytest.mark.slow  # ./dev quick skips it
def test_scheduler_trace_fused_vs_unfused_vs_python(device):
    """A reference-scheduler trace (prefix hits with replay, preemption and resume, spec decode)
    through the fused pipeline (block writes applied in the launch), the unfused one (applied by
    torch ops) and the plain-Python expectation; one H2D per step, the same bytes on both paths."""
    layout = tiny_layout()
    spec, R = 2, 4
    fused = MetadataPipeline(layout, R, 32 + 4, device, num_speculative_tokens=spec)
    plain = MetadataPipeline(layout, R, 32 + 4, device, num_speculative_tokens=spec, fused=False)
    assert fused.fused_plan is not None and plain.fused_plan is None
    assert fused.num_launches == 1 and plain.num_launches == len(layout.channels)
    writes = 0
    trace = eventful_trace(layout, 8, num_blocks=40, max_num_seqs=R, seeds=range(200))
    for i, (step, views) in enumerate(trace):
        pad = step.total_tokens + (i % 3) * 2
        fused.update(step, pad_to=pad)
        plain.update(step, pad_to=pad)
        mf, mp = fused.build(), plain.build()
        check_step(layout, mf, views, 1 + spec, fused)
        check_step(layout, mp, views, 1 + spec, plain)
        sf, sp = fused.last_step_stats, plain.last_step_stats
        assert (sf.num_h2d_copies, sf.num_launches, sf.num_applies) == (1, 1, 0)
        assert sf.h2d_bytes == sp.h2d_bytes and sf.num_writes == sp.num_writes
        writes += sf.num_writes
        for gid, (a, b) in enumerate(zip(fused.tables.tables, plain.tables.tables)):
            assert torch.equal(a.cpu(), b.cpu()), (i, gid)
    assert writes > 0


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
def test_step_input_path_stages_what_the_step_batch_path_stages(monkeypatch):
    """``update(StepInput)`` converts through the pipeline's slot map; the same step converted by
    hand (``batch_from_step`` + commit) and given as a ``StepBatch`` stages the same bytes and builds
    the same metadata (the array-form step is the one path underneath)."""
    monkeypatch.setenv("DSV4_INDEX_BACKEND", "reference")
    layout = tiny_layout()
    G = len(layout.groups)
    ids = MetadataPipeline(layout, 6, 64, "cpu", num_speculative_tokens=2)
    arrays = MetadataPipeline(layout, 6, 64, "cpu", num_speculative_tokens=2)
    for step, views in random_trace(layout, 40, 21, num_blocks=96, max_num_batched_tokens=64, max_num_seqs=6,
                                    num_speculative_tokens=2):
        batch, delta = batch_from_step(step, arrays.slot_map, G)
        ids.update(step)
        arrays.update(batch)
        arrays.slot_map.commit(delta)
        n = ids.last_step_stats.h2d_bytes // 4
        assert n == arrays.last_step_stats.h2d_bytes // 4
        assert torch.equal(ids.staging.dev[:n], arrays.staging.dev[:n])
        mi, ma = ids.build(), arrays.build()
        check_step(layout, mi, views, 3, ids)
        assert ma.req_ids is None and ma.req_slots.tolist() == mi.req_slots.tolist()
        for name in mi.channels:
            for f in ("slot_mapping", "compressed_slot_mapping", "indices", "lens"):
                x, y = getattr(mi[name], f), getattr(ma[name], f)
                assert (x is None and y is None) or torch.equal(x, y)


def test_warmup_compiles_topk_conversion(monkeypatch):
    monkeypatch.setenv("DSV4_INDEX_BACKEND", "reference")
    layout = tiny_layout()
    pipe = MetadataPipeline(layout, 4, 32, "cpu")
    calls = []
    for name, b in pipe.builders.items():
        orig = b.topk_to_slots
        monkeypatch.setattr(b, "topk_to_slots", lambda ctx, topk, compact=False, orig=orig, name=name:
                            calls.append((name, topk)) or orig(ctx, topk, compact=compact))
    pipe.warmup(pad_sizes=(1, 4))
    assert "c4a" in layout.channels and [n for n, _ in calls] == ["c4a"]  # the only channel with top-k
    for _, topk in calls:
        assert topk.dtype == torch.int32 and topk.shape[1] == layout.index_topk and (topk == -1).all()
        assert topk.shape[0] >= 4  # NOTE: as many rows as the last warm-up size
    with pytest.raises(RuntimeError, match="warmup"):
        pipe.update(StepInput([], [], {}))
        pipe.warmup()


# ----------------------------------------------------------------------------------------------
# a vLLM-style SchedulerOutput (duck-typed), and the direct launch checked at warm-up
# ----------------------------------------------------------------------------------------------
class _NS:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _scheduler_output(step: StepInput):
    """``step`` as the lists a vLLM ``SchedulerOutput`` holds."""
    new = [_NS(req_id=r.req_id, block_ids=tuple(r.block_ids), num_computed_tokens=r.num_computed_tokens)
           for r in step.new_requests]
    run = step.running_requests
    cached = _NS(req_ids=[r.req_id for r in run], new_block_ids=[tuple(r.new_block_ids) for r in run],
                 num_computed_tokens=[r.num_computed_tokens for r in run],
                 resumed_req_ids={r.req_id for r in run if r.resumed})
    return _NS(scheduled_new_reqs=new, scheduled_cached_reqs=cached,
               num_scheduled_tokens=dict(step.num_scheduled_tokens), finished_req_ids=set(step.finished_req_ids),
               preempted_req_ids=set(step.preempted_req_ids))


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
def test_scheduler_output_path_equals_step_input(monkeypatch):
    """``update(SchedulerOutput)`` converts with ``batch_from_scheduler_output``, commits the slot map
    only once the step is accepted, and fills ``meta.req_ids``; a rejected one changes nothing."""
    monkeypatch.setenv("DSV4_INDEX_BACKEND", "reference")
    layout = tiny_layout()
    a = MetadataPipeline(layout, 6, 64, "cpu", num_speculative_tokens=2)
    b = MetadataPipeline(layout, 6, 64, "cpu", num_speculative_tokens=2)
    used = 0
    for i, (step, views) in enumerate(random_trace(layout, 30, 7, num_blocks=96, max_num_batched_tokens=64,
                                                   max_num_seqs=6, num_speculative_tokens=2,
                                                   enable_prefix_caching=False)):
        plain = not (step.replay_start or getattr(step, "replay_end", None))  # NOTE: replays are not in the lists
        if plain and i and step.num_scheduled_tokens:
            bad = _scheduler_output(step)
            bad.num_scheduled_tokens = {**bad.num_scheduled_tokens, "nope": 1}
            before = (dict(a.slot_map.slot_of), a.occupied.tobytes(), a.tables.num_blocks.tobytes())
            with pytest.raises(ValueError, match="nope"):
                a.update(bad)
            assert before == (dict(a.slot_map.slot_of), a.occupied.tobytes(), a.tables.num_blocks.tobytes())
        a.update(_scheduler_output(step) if plain else step)
        b.update(step)
        used += plain
        n = a.last_step_stats.h2d_bytes // 4
        assert n == b.last_step_stats.h2d_bytes // 4 and torch.equal(a.staging.dev[:n], b.staging.dev[:n])
        ma, mb = a.build(), b.build()
        assert ma.req_ids == mb.req_ids and ma.req_ids is not None
        check_step(layout, ma, views, 3, a)
    assert used >= 20


class _Launcher:
    """Stands in for triton's CompiledKernel: ``run`` does nothing (a changed private layout) or raises."""

    function = packed_metadata = None

    def __init__(self, fail: bool):
        self.fail = fail

    def run(self, *args):
        if self.fail:
            raise TypeError("run() takes 12 positional arguments")


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
@pytest.mark.skipif(not HAS_TRITON, reason="needs TRITON_INTERPRET=1 or CUDA")
@pytest.mark.parametrize("fail", [False, True], ids=["writes-nothing", "raises"])
def test_direct_launch_that_differs_falls_back_to_jit(device, fail):
    layout = tiny_layout()
    pipe = MetadataPipeline(layout, 4, 16, device)
    pipe.warmup()
    plan = pipe.fused_plan
    for v in plan._variants:  # NOTE: a broken direct launcher (the check must catch it)
        v["kernel"] = _Launcher(fail)
    plan._compiled, plan._direct = plan._variants[0]["kernel"], True
    pipe.update(StepInput([], [], {}), pad_to=4)
    with pytest.warns(RuntimeWarning, match="does not match the JIT launch"):
        assert plan.check_direct_launch(pipe.stage_layout) is False
    assert not plan.direct
    meta = pipe.build()  # NOTE: the JIT path from now on
    assert (meta.positions == 0).all() and not meta.is_valid_token.any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_direct_launch_matches_jit_on_this_triton():
    import warnings
    layout = tiny_layout()
    pipe = MetadataPipeline(layout, 4, 16, "cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        pipe.warmup()
    assert pipe.fused_plan.direct
