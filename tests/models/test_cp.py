"""Decode context parallelism (docs/CP.md): one pipeline per rank; per-rank partial attention over
sharded caches, merged by log-sum-exp, equals the single-rank paged model and the dense model at
every step of a trace (prefill chunks, decodes, spec tokens, preemption, prefix hits with bounded
replay); sharded groups partition the tokens, replicated (compressor-state) groups are identical on
every rank and equal the single-rank pipeline's; the fused kernel equals the reference under DCP.

Ranks are simulated by threads of this process (``ThreadComm``), and the example is also launched
for real with ``torch.distributed.run`` (gloo on CPU)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.scripts import hang_guard

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from cp_decode import CFG, Inputs, ThreadComm, cp_layouts, make_trace, run_rank, summary  # noqa: E402
from dsv4_index import MetadataPipeline  # noqa: E402
from dsv4_index._common import interpreting  # noqa: E402
from dsv4_index.testing.scheduler import ReferenceScheduler  # noqa: E402
from dsv4_index.validate import MetadataError, check_cp_partition  # noqa: E402
from models.deepseek_v4.attention import merge_partials, sink_attention, sink_attention_lse  # noqa: E402

pytestmark = pytest.mark.slow  # multi-rank runs, torchrun (./dev quick skips it)

TOL = 1e-4
STATE = ("c4_state", "c128_state")


@pytest.fixture(autouse=True)
def one_thread():
    # NOTE: 2 slow cores shared with other jobs: intra-op threads only add contention here
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ----------------------------------------------------------------------------------------------
# the merge itself
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 4])
def test_merge_partials_equals_full_softmax(world):
    g = torch.Generator().manual_seed(world)
    T, N, H, D = 5, 11, 3, 8
    q, keys = torch.randn(T, H, D, generator=g), torch.randn(T, N, D, generator=g)
    valid = torch.rand(T, N, generator=g) < 0.7
    valid[0] = False  # a token that sees nothing but the sink
    sink = torch.randn(H, generator=g)
    full = sink_attention(q, keys, valid, sink)
    owner = torch.randint(0, world, (N,), generator=g)
    owner[:3] = 0  # rank world-1 may own nothing: its lse is -inf
    parts = [sink_attention_lse(q, keys, valid & (owner == r), sink if r == 0 else None) for r in range(world)]
    merged = merge_partials(torch.stack([o for o, _ in parts]), torch.stack([lse for _, lse in parts]))
    assert not merged.isnan().any()
    assert (merged - full).abs().max() <= 1e-5
    if world > 1:  # the sink counted on every rank is wrong: the check can fail
        twice = [sink_attention_lse(q, keys, valid & (owner == r), sink) for r in range(world)]
        bad = merge_partials(torch.stack([o for o, _ in twice]), torch.stack([lse for _, lse in twice]))
        assert (bad - full).abs().max() > 1e-3


# ----------------------------------------------------------------------------------------------
# simulated ranks: merged == single-rank paged == dense over a trace
# ----------------------------------------------------------------------------------------------
# NOTE: "triton" runs the kernels (fused build included) under TRITON_INTERPRET=1 when it is set
# (slow on CPU: ~0.3 s per rank-step); "reference" forces the pure-PyTorch ops (the kernels under
# DCP are compared with them bit for bit in test_fused_equals_reference_under_dcp).
@pytest.mark.parametrize("world,interleave,backend,steps", [
    (1, 1, "reference", 20), (2, 1, "reference", 20), (2, 4, "reference", 20), (4, 1, "reference", 20),
    (4, 2, "reference", 20), (4, 4, "reference", 20), (2, 2, "triton", 6)])
def test_merged_equals_single_rank(world, interleave, backend, steps, monkeypatch):
    if backend == "triton" and not (torch.cuda.is_available() or interpreting()):
        pytest.skip("the Triton path needs CUDA or TRITON_INTERPRET=1")
    monkeypatch.setenv("DSV4_INDEX_BACKEND", backend)
    # NOTE: the Triton path runs on CUDA when there is one (the interpreter needs CPU tensors)
    dev = "cuda" if backend == "triton" and not interpreting() else "cpu"
    res = ThreadComm(world).run(lambda c: run_rank(c, interleave=interleave, steps=steps, seed=world, device=dev))
    r0 = res[0]
    assert not r0["failures"], summary(r0)
    assert r0["err_single"] <= TOL and r0["err_dense"] <= TOL, summary(r0)
    assert r0["compared"] > 0 and len(r0["build_ms_median"]) == world, summary(r0)
    if backend == "reference":  # the trace must exercise what the test is about
        assert r0["prefill_tokens"] > 0 and r0["decode_tokens"] > 0 and r0["spec_rejected"] > 0, summary(r0)
        # NOTE: virtual mla blocks of 16 * interleave * world tokens; a hit needs a prompt past one
        if 16 * interleave * world <= 128:
            assert r0["prefix_hits"] > 0 and r0["replayed"] > 0, summary(r0)


def test_interleave_must_divide_rows_per_block():
    # c16 rows per block = 32 // 16 = 2: interleave 4 would put a rank's rows past its virtual blocks
    with pytest.raises(ValueError, match="cp_interleave"):
        cp_layouts(CFG.to_dict(), 256, 2, 4, mla_block_size=32, swa_block_size=4)
    L = cp_layouts(CFG.to_dict(), 256, 2, 2, mla_block_size=32, swa_block_size=4)
    assert [(g.name, g.sharded) for g in L.rank.groups] == [
        ("mla", True), ("swa", True), ("c4_state", False), ("c128_state", False)]
    assert L.sched.group("mla").block_size == 64 and L.rank.group("mla").block_size == 32
    assert L.sched.group("swa").block_size == 8 and L.rank.group("swa").block_size == 4
    for name in STATE:  # replicated groups: the same geometry as the single-rank layout
        assert L.rank.group(name) == L.sched.group(name)


def test_partition_check_catches_wrong_rank_order():
    """Ranks' metadata of one step partition the tokens; swapping two ranks' metadata must fail."""
    L = cp_layouts(CFG.to_dict(), 256, 2, 1, mla_block_size=64, swa_block_size=4, indexer_causal_indices=True)
    sched = ReferenceScheduler(L.sched, 40, max_num_batched_tokens=64, max_num_seqs=4, enable_prefix_caching=False)
    sched.add_request("a", 50, 4)
    sched.add_request("b", 9, 4)
    step = sched.schedule()
    metas = []
    for r in range(2):
        p = MetadataPipeline(L.rank, 4, 64, "cpu", cp_world_size=2, cp_rank=r, cp_interleave=1,
                             backend="reference")
        p.update(step)
        metas.append(p.build())
    check_cp_partition(metas)
    with pytest.raises(MetadataError):
        check_cp_partition(metas[::-1])


# ----------------------------------------------------------------------------------------------
# what each rank stores: sharded groups partition, replicated groups equal the single rank
# ----------------------------------------------------------------------------------------------
def _trace(L, steps, seed=3):
    """(step, views) of the example's trace (prefix hit with bounded replay included)."""
    sched = ReferenceScheduler(L.sched, 40, max_num_batched_tokens=32, max_num_seqs=5, num_speculative_tokens=2,
                               long_prefill_threshold=16, enable_prefix_caching=True, seed=seed)
    inputs = Inputs(L.sched.group("mla").alloc_block_size, L.sched.max_model_len)
    for step, views, _ in make_trace(sched, inputs, steps, seed):
        yield step, {v.req_id: v for v in views}


def _listed_positions(meta, views, name, world, rank, inter):
    """Per valid token, the global positions (raw channels) or row ids (compressed) its index list
    names, recovered from the scheduler's block ids (independent of the library's slot formulas)."""
    c = meta[name]
    gid, unit = c.gid, (c.rows_per_block if c.compress_ratio > 1 else c.block_size)
    idx, lens, ttr = c.indices.cpu(), c.lens.cpu(), meta.token_to_req.cpu()
    out = []
    for t in range(meta.num_tokens):
        ids = views[meta.req_ids[int(ttr[t])]].block_ids[gid]
        logical = {bid: j for j, bid in enumerate(ids) if bid}
        got = set()
        for s in idx[t, :int(lens[t])].tolist():
            lp = logical[s // unit] * unit + s % unit
            got.add((lp // inter) * inter * world + rank * inter + lp % inter)  # NOTE: DESIGN §4, inverted
        out.append(got)
    return out


@pytest.mark.parametrize("world,interleave", [(2, 1), (4, 2)])
def test_replicated_and_sharded_groups(world, interleave):
    L = cp_layouts(CFG.to_dict(), 256, world, interleave, mla_block_size=16 * interleave, swa_block_size=4,
                   indexer_causal_indices=True)
    kw = dict(backend="reference")
    ranks = [MetadataPipeline(L.rank, 8, 40, "cpu", 2, cp_world_size=world, cp_rank=r, cp_interleave=interleave, **kw)
             for r in range(world)]
    single = MetadataPipeline(L.sched, 8, 40, "cpu", 2, **kw)
    replayed = 0
    for step, views in _trace(L, 22):
        T = step.total_tokens
        for p in ranks + [single]:
            p.update(step, pad_to=T + 3)
        metas, m1 = [p.build() for p in ranks], single.build()
        replayed += bool(step.replay_end)
        if T == 0:
            continue
        assert all(m.req_ids == m1.req_ids for m in metas)
        for name in STATE:  # replicated: every rank writes and lists exactly what one GPU would
            for f in ("slot_mapping", "indices", "lens"):
                want = getattr(m1[name], f)
                for r, m in enumerate(metas):
                    assert torch.equal(getattr(m[name], f), want), (name, f, r)
            assert (m1[name].slot_mapping[:T] >= 0).all()
        check_cp_partition(metas)  # sharded: each write on its owner only
        for name in ("swa", "c128a"):  # sharded lists: owned entries, their union is the one-GPU list
            want = _listed_positions(m1, views, name, 1, 0, 1)
            parts = [_listed_positions(m, views, name, world, r, interleave) for r, m in enumerate(metas)]
            for t in range(T):
                pos, rs = int(m1.positions[t]), views[m1.req_ids[int(m1.token_to_req[t])]].replay_start
                exp = range(max(pos - CFG.sliding_window + 1, rs), pos + 1) if name == "swa" else \
                    range((pos + 1) // L.sched.c128_ratio)
                assert want[t] == set(exp), (name, t)  # DESIGN §4 on one GPU
                assert sorted(p for r in range(world) for p in parts[r][t]) == sorted(exp), (name, t)
                for r in range(world):
                    assert all((p // interleave) % world == r for p in parts[r][t]), (name, t, r)
    assert replayed > 0  # the trace had a prefix hit with bounded replay


# ----------------------------------------------------------------------------------------------
# the fused kernel == the PyTorch reference under DCP (bit for bit, poisoned buffers)
# ----------------------------------------------------------------------------------------------
_CTX = ("query_start_loc", "seq_lens", "idx_mapping", "replay_start", "replay_end", "token_to_req",
        "positions", "is_valid_token")
_FIELDS = ("slot_mapping", "compressed_slot_mapping", "compact_slot_mapping", "compact_cu", "indices", "lens",
           "ks", "ke", "cu", "decode_lens", "lens_clamped", "decode_lens_clamped")


def _poison(pipe, meta, value):
    """Fill every output buffer (whole storage) that the next build must rewrite."""
    ts = [getattr(pipe.ctx, n) for n in _CTX]
    if meta is not None:
        ts += [getattr(c, f) for c in meta.channels.values() for f in _FIELDS if getattr(c, f) is not None]
    for t in ts:
        base = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())
        base.fill_(bool(value) if t.dtype == torch.bool else value)


@pytest.mark.skipif(not (torch.cuda.is_available() or interpreting()), reason="needs CUDA or TRITON_INTERPRET=1")
def test_fused_equals_reference_under_dcp():
    world, inter = 2, 2
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    L = cp_layouts(CFG.to_dict(), 256, world, inter, mla_block_size=32, swa_block_size=4, indexer_causal_indices=True)
    fused = [MetadataPipeline(L.rank, 8, 40, dev, 2, cp_world_size=world, cp_rank=r, cp_interleave=inter)
             for r in range(world)]
    ref = [MetadataPipeline(L.rank, 8, 40, dev, 2, cp_world_size=world, cp_rank=r, cp_interleave=inter,
                            backend="reference") for r in range(world)]
    assert all(p.num_launches == 1 for p in fused) and all(p.fused_plan is None for p in ref)
    last, g, replayed = [None] * (2 * world), torch.Generator().manual_seed(0), 0
    for i, (step, _) in enumerate(_trace(L, 9, seed=5)):
        replayed += bool(step.replay_end)
        for k, (pf, pr) in enumerate(zip(fused, ref)):
            for p, j, v in ((pf, k, 7777), (pr, world + k, -5555)):
                p.update(step, pad_to=step.total_tokens + i % 3)
                _poison(p, last[j], v)
            mf, mr = pf.build(), pr.build()
            last[k], last[world + k] = mf, mr
            for n in _CTX[:3] + _CTX[5:]:
                assert torch.equal(getattr(mf, n), getattr(mr, n)), (i, k, n)
            for name in mf.channels:
                for f in _FIELDS:
                    a, b = getattr(mf[name], f), getattr(mr[name], f)
                    assert (a is None) == (b is None), (i, k, name, f)
                    assert a is None or torch.equal(a, b), (i, k, name, f, a, b)
            for gid, (a, b) in enumerate(zip(pf.tables.tables, pr.tables.tables)):
                assert torch.equal(a, b), (i, k, gid)
            topk = torch.randint(-2, 40, (mf.num_tokens_padded, 4), dtype=torch.int32, generator=g).to(dev)
            for compact in (False, True):
                a, b = mf.topk_to_slots("c4a", topk, compact=compact), mr.topk_to_slots("c4a", topk, compact=compact)
                assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (i, k, compact)
    assert replayed > 0


# ----------------------------------------------------------------------------------------------
# the example under torch.distributed.run
# ----------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("nproc,interleave", [(2, 1), (4, 2)])
def test_torchrun_example(nproc, interleave):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(_free_port()), str(ROOT / "examples" / "cp_decode.py"),
           "--steps", "14", "--interleave", str(interleave)]
    # NOTE: the distributed plumbing is under test here; the kernels are covered above
    env = dict(os.environ, OMP_NUM_THREADS="1", DSV4_INDEX_BACKEND="reference")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=hang_guard())
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert f"DCP world={nproc} interleave={interleave}" in out and "  OK" in out, out[-4000:]
