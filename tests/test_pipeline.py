"""MetadataPipeline over randomized scheduler traces: every channel, every step, equals DESIGN §4
recomputed in plain Python from the scheduler's own view of each request's blocks."""

import os
from pathlib import Path

import pytest
import torch

from dsv4_index import DSV4Layout, MetadataPipeline, StepInput
from dsv4_index.scheduler import random_trace

CONFIGS = Path(__file__).resolve().parent.parent / "dsv4_index" / "configs"


def tiny_layout(**kw):
    return DSV4Layout.from_config(CONFIGS / "tiny.json", max_model_len=kw.pop("max_model_len", 256),
                                  mla_block_size=32, swa_block_size=4, indexer_causal_indices=True, **kw)


def flash_layout():
    return DSV4Layout.from_config(CONFIGS / "flash.json", max_model_len=1024, mla_block_size=256,
                                  swa_block_size=64)


def _slot(bt, x, rows):
    b = x // rows
    return bt[b] * rows + x % rows if b < len(bt) else -1


def expected_rows(layout, view, next_n):
    """Plain-Python DESIGN §4 for one scheduled request: {channel: {field: list per token}}."""
    out = {}
    for name, ch in layout.channels.items():
        g = layout.groups[ch.gid]
        bt = view.block_ids[ch.gid]
        rows = {}
        for p in view.positions:
            if ch.compress_ratio == 1:  # raw-token window channel
                lo = max(p - ch.window + 1, view.replay_start)
                win = [_slot(bt, q, g.block_size) for q in range(lo, p + 1)]
                width = ch.index_width
                rows.setdefault("slot_mapping", []).append(_slot(bt, p, g.block_size))
                rows.setdefault("indices", []).append(win + [-1] * (width - len(win)))
                rows.setdefault("lens", []).append(len(win))
                continue
            R, S = ch.compress_ratio, ch.rows_per_block
            n_c = (p + 1) // R
            rows.setdefault("compressed_slot_mapping", []).append(
                _slot(bt, p // R, S) if (p + 1) % R == 0 else -1)
            if name == "c4i":
                rows.setdefault("lens", []).append(n_c)
            if "indices" in ch.outputs:
                width = ch.index_width
                ids = [_slot(bt, j, S) for j in range(min(n_c, width))]
                rows.setdefault("indices", []).append(ids + [-1] * (width - len(ids)))
                if name != "c4i":
                    rows.setdefault("lens", []).append(len(ids))
        out[name] = rows
    return out


def check_step(layout, meta, views, next_n):
    by_id = {v.req_id: v for v in views}
    assert sorted(meta.req_ids) == sorted(by_id), "batch holds exactly the scheduled requests"
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
                 ("slot_mapping", "compressed_slot_mapping", "indices", "lens") if getattr(meta[n], f) is not None}
             for n in meta.channels}
    cu = 0
    for b, rid in enumerate(meta.req_ids):
        v = by_id[rid]
        lo, hi = qsl[b], qsl[b + 1]
        assert hi - lo == v.num_scheduled_tokens
        assert positions[lo:hi] == list(v.positions), rid
        assert ttr[lo:hi] == [b] * (hi - lo)
        exp = expected_rows(layout, v, next_n)
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
    n = 0
    for step, views in random_trace(layout, steps, seed, max_num_batched_tokens=max_tokens,
                                    max_num_seqs=max_num_reqs, num_speculative_tokens=spec, **kw):
        pipe.update(step, pad_to=step.total_tokens + pad if pad else None)
        meta = pipe.build()
        check_step(layout, meta, views, 1 + spec)
        n += meta.num_tokens
    return n


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tiny_trace_reference_backend(monkeypatch, seed):
    monkeypatch.setenv("DSV4_INDEX_BACKEND", "reference")
    tokens = run_trace(tiny_layout(), 150, seed, pad=seed * 3, num_blocks=96)
    assert tokens > 1000


def test_flash_trace_reference_backend(monkeypatch):
    monkeypatch.setenv("DSV4_INDEX_BACKEND", "reference")
    run_trace(flash_layout(), 60, 7, num_blocks=64, max_tokens=512, prompt_len=(1, 900), max_new_tokens=(1, 8))


def test_tiny_trace_kernels(device):
    """The same trace on the Triton kernels (interpreter on CPU, compiled on CUDA)."""
    if device.type == "cpu" and not os.environ.get("TRITON_INTERPRET"):
        pytest.skip("needs TRITON_INTERPRET=1 or CUDA")
    run_trace(tiny_layout(), 25, 3, pad=4, num_blocks=96, device=device)


def test_custom_channel_registered_outside_the_package(monkeypatch):
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
        assert ma.req_ids == mb.req_ids
        for name in ma.channels:
            for f in ("slot_mapping", "compressed_slot_mapping", "indices", "lens"):
                x, y = getattr(ma[name], f), getattr(mb[name], f)
                assert (x is None and y is None) or torch.equal(x, y)


def test_scheduler_trace_fused_vs_unfused_vs_python(device):
    """Regression: a reference-scheduler trace (prefix hits, preemption, spec decode) through the fused
    pipeline (segments applied in the launch), the unfused one (segments applied by torch ops) and the
    plain-Python expectation; one H2D per step, the same bytes on both paths."""
    if device.type == "cpu" and not os.environ.get("TRITON_INTERPRET"):
        pytest.skip("needs TRITON_INTERPRET=1 or CUDA")
    layout = tiny_layout()
    spec, R = 2, 6
    fused = MetadataPipeline(layout, R, 64 + 4, device, num_speculative_tokens=spec)
    plain = MetadataPipeline(layout, R, 64 + 4, device, num_speculative_tokens=spec, fused=False)
    assert fused._fused is not None and plain._fused is None
    segs = 0
    for i, (step, views) in enumerate(random_trace(layout, 30, 13, num_blocks=96, max_num_batched_tokens=64,
                                                   max_num_seqs=R, num_speculative_tokens=spec)):
        pad = step.total_tokens + (i % 3) * 2
        fused.update(step, pad_to=pad)
        plain.update(step, pad_to=pad)
        mf, mp = fused.build(), plain.build()
        check_step(layout, mf, views, 1 + spec)
        check_step(layout, mp, views, 1 + spec)
        sf, sp = fused.last_step_stats, plain.last_step_stats
        assert sf.num_h2d_copies == 1 and sf.num_launches == 1 and sf.h2d_bytes == sp.h2d_bytes
        segs += sf.num_segments
        for gid, (a, b) in enumerate(zip(mf.block_tables, mp.block_tables)):
            t = fused.tables[gid]
            for r in range(mf.num_reqs):
                n = int(t.num_blocks[r])
                assert torch.equal(a[r, :n].cpu(), b[r, :n].cpu()), (i, gid, r)
    assert segs > 0


def test_bulk_path_equals_one_by_one_path(monkeypatch):
    """The bulk checks + appends (_plan_step) stage exactly what the one-by-one path stages."""
    monkeypatch.setenv("DSV4_INDEX_BACKEND", "reference")
    layout = tiny_layout()
    bulk = MetadataPipeline(layout, 6, 64, "cpu", num_speculative_tokens=2)
    slow = MetadataPipeline(layout, 6, 64, "cpu", num_speculative_tokens=2)
    monkeypatch.setattr(slow, "_plan_step", lambda step, sm: None)
    planned = []
    orig = bulk._plan_step
    monkeypatch.setattr(bulk, "_plan_step", lambda step, sm: planned.append(orig(step, sm)) or planned[-1])
    for step, views in random_trace(layout, 80, 21, num_blocks=96, max_num_batched_tokens=64, max_num_seqs=6,
                                    num_speculative_tokens=2):
        bulk.update(step)
        slow.update(step)
        assert bulk.req_ids == slow.req_ids
        n = bulk.last_step_stats.h2d_bytes // 4
        assert n == slow.last_step_stats.h2d_bytes // 4
        assert (bulk._host_np[:n] == slow._host_np[:n]).all()
        check_step(layout, bulk.build(), views, 3)
        slow.build()
    assert sum(p is not None for p in planned) > 40


def test_warmup_compiles_topk_conversion(monkeypatch):
    monkeypatch.setenv("DSV4_INDEX_BACKEND", "reference")
    layout = tiny_layout()
    pipe = MetadataPipeline(layout, 4, 32, "cpu")
    calls = []
    for name, b in pipe._builders.items():
        orig = b.topk_to_slots
        monkeypatch.setattr(b, "topk_to_slots",
                            lambda ctx, topk, orig=orig, name=name: calls.append((name, topk)) or orig(ctx, topk))
    pipe.warmup()
    assert "c4a" in layout.channels and [n for n, _ in calls] == ["c4a"]  # the only channel with top-k
    for _, topk in calls:
        assert topk.dtype == torch.int32 and topk.shape == (1, layout.index_topk) and (topk == -1).all()
