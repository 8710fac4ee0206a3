"""Property tests over the whole pipeline: random reference-scheduler traces (arrivals, chunked
prefill, spec acceptance, preemption and resume, prefix hits with bounded replay, graph padding) over
every kind of table (rings, full-width sliding tables, circular groups, hybrid kernel blocks, compact
compressed mappings) -> update/build -> ``check_metadata`` passes and every channel equals the
reference ops recomputed from the scheduler's own view of each request (batch-ordered, logical
tables: independent of the pipeline's slots, rings and staging).

Profiles: ``ci`` (default, bounded) and ``HYPOTHESIS_PROFILE=long`` (tests/conftest.py).
"""

import contextlib
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_index import MetadataPipeline
from dsv4_index import reference as ref
from dsv4_index.testing.scheduler import random_trace
from dsv4_index.validate import check_metadata, check_topk

from helpers.layouts import tiny_layout
from helpers.pipelines import HAS_TRITON

pytestmark = pytest.mark.slow  # long fuzz (./dev quick skips it)

LAYOUTS = {"tiny": tiny_layout(), "hybrid": tiny_layout(kernel_block_size=16),
           "full": tiny_layout(sliding_tables="full"), "compact": tiny_layout(compact_compressed=True),
           "circular": tiny_layout(circular={"c4_state": 16, "c128_state": 32}, kernel_block_size={"swa": 2})}


def _expected(layout, views, order, next_n, num_decodes):
    """Reference outputs of every channel from the scheduler's view (batch in ``order``)."""
    by_id = {v.req_id: v for v in views}
    vs = [by_id[r] for r in order]
    B = len(vs)
    qsl = torch.zeros(B + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor([v.num_scheduled_tokens for v in vs], dtype=torch.int64), 0)
    sl = torch.tensor([v.seq_len for v in vs], dtype=torch.int32)
    rs = torch.tensor([v.replay_start for v in vs], dtype=torch.int32)
    re = torch.tensor([v.replay_end for v in vs], dtype=torch.int32)
    T = int(qsl[-1])
    tables = []
    for g in layout.groups:
        bt = torch.zeros(B, max(g.table_width, 1), dtype=torch.int32)
        for b, v in enumerate(vs):
            ids = v.block_ids[g.gid]
            bt[b, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        tables.append(bt)
    out = {}
    for name, c in layout.channels.items():
        g, bt = layout.groups[c.gid], tables[c.gid]
        floor = re if g.prefix_cacheable else None
        e = {}
        if "slot_mapping" in c.outputs:
            cap = g.block_size if g.kind == "circular" else None
            e["slot_mapping"] = ref.slot_mapping(qsl, sl, bt, g.block_size, circular_capacity=cap, replay_end=floor,
                                                 num_tokens=T)
            e["indices"], e["lens"] = ref.window_indices(qsl, sl, bt, g.block_size, c.window, replay_start=rs,
                                                         circular_capacity=cap, num_tokens=T)
        if "compressed_slot_mapping" in c.outputs:
            args = (qsl, sl, bt, c.rows_per_block, c.compress_ratio)
            e["compressed_slot_mapping"] = ref.compressed_slot_mapping(*args, replay_end=floor, num_tokens=T)
            if c.compact:
                e["compact_slot_mapping"], e["compact_cu"] = ref.compressed_slot_mapping(
                    *args, replay_end=floor, compact=True, num_tokens=T)
        if "ks" in c.outputs:
            il = ref.indexer_lengths(qsl, sl, c.compress_ratio, next_n=next_n, num_decodes=num_decodes,
                                     num_tokens=T)
            e.update(lens=il.lens, ks=il.ks, ke=il.ke, cu=il.cu, decode_lens=il.decode_lens)
        if "indices" in c.outputs and c.window is None:
            e["indices"], lens = ref.causal_compressed_indices(qsl, sl, bt, c.rows_per_block, c.compress_ratio,
                                                               c.index_width, num_tokens=T)
            if "ks" not in c.outputs:
                e["lens"] = lens
        out[name] = e
    return qsl, sl, tables, out


def run_trace(layout_name, seed, *, steps, num_blocks, max_tokens, max_seqs, spec, threshold, prefix, pad,
              topk=True):
    layout = LAYOUTS[layout_name]
    pipe = MetadataPipeline(layout, max_seqs, max_tokens + 8, "cpu", num_speculative_tokens=spec)
    gen = torch.Generator().manual_seed(seed)
    trace = random_trace(layout, steps, seed, num_blocks=num_blocks, max_num_batched_tokens=max_tokens,
                         max_num_seqs=max_seqs, num_speculative_tokens=spec, long_prefill_threshold=threshold,
                         enable_prefix_caching=prefix, prompt_len=(1, 90), max_new_tokens=(1, 12))
    for i, (step, views) in enumerate(trace):
        T = step.total_tokens
        pipe.update(step, pad_to=min(-(-T // 8) * 8 + (8 if pad and i % 2 else 0), max_tokens + 8) if pad else None)
        m = pipe.build()
        check_metadata(m, num_blocks=num_blocks)
        qsl, sl, tables, exp = _expected(layout, views, m.req_ids, 1 + spec, m.num_decodes)
        assert torch.equal(m.query_start_loc, qsl) and torch.equal(m.seq_lens, sl)
        assert m.req_slots.tolist() == [pipe.slot_of(r) for r in m.req_ids]
        for name, fields in exp.items():
            for f, want in fields.items():
                got = getattr(m[name], f)
                if f == "compact_slot_mapping":  # NOTE: [T_pad]: the step's rows, then -1
                    n = int(exp[name]["compact_cu"][-1])
                    assert n <= m.num_tokens_padded and bool((got[n:] == -1).all()), (i, name, f)
                    got, want = got[:n], want[:n]
                elif f not in ("cu", "decode_lens", "compact_cu"):
                    got = got[:m.num_tokens]
                assert torch.equal(got, want), (i, name, f)
        if topk and "c4a" in m and m.num_tokens:
            n_c = (m.positions.long() + 1) // layout.channels["c4a"].compress_ratio
            picks = (torch.rand(m.num_tokens_padded, 4, generator=gen) * (n_c[:, None] + 2)).long() - 1
            slots, lens = m.topk_to_slots("c4a", picks.to(torch.int32))
            check_topk(m, "c4a", picks, slots, lens, num_blocks=num_blocks)
            c = layout.channels["c4a"]
            ws, wl = ref.topk_to_slots(picks[:m.num_tokens], qsl, sl, tables[c.gid], c.rows_per_block,
                                       c.compress_ratio, num_tokens=m.num_tokens)
            assert torch.equal(slots[:m.num_tokens], ws) and torch.equal(lens[:m.num_tokens], wl), i


TRACE = dict(
    layout_name=st.sampled_from(sorted(LAYOUTS)),
    seed=st.integers(0, 2**16),
    steps=st.integers(3, 10),
    num_blocks=st.integers(32, 90),       # small pools: preemption and eviction happen
    max_tokens=st.sampled_from([8, 16, 32, 48]),
    max_seqs=st.integers(1, 4),
    spec=st.integers(0, 2),
    threshold=st.sampled_from([None, 4, 13]),
    prefix=st.booleans(),
    pad=st.booleans(),
)


@contextlib.contextmanager
def _env(name, value):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


@given(**TRACE)
def test_fuzz_pipeline_reference_backend(**kw):
    # NOTE: the kernels are not the subject here; the per-op kernel tests and test_fused compare them
    with _env("DSV4_INDEX_BACKEND", "reference"):
        run_trace(**kw)


@pytest.mark.skipif(not HAS_TRITON, reason="needs TRITON_INTERPRET=1 or CUDA")
@settings(max_examples=3)
@given(**TRACE)
def test_fuzz_pipeline_triton_interpreter(**kw):
    run_trace(**{**kw, "steps": min(kw["steps"], 4), "max_tokens": min(kw["max_tokens"], 32)})


# regression cases (named): traces that once broke something
@pytest.mark.parametrize("kw", [
    # seed-1 trace of the smoke run: prefix hit with bounded replay (replay_start 16) next to decodes
    dict(layout_name="tiny", seed=1, steps=26, num_blocks=48, max_tokens=64, max_seqs=6, spec=2,
         threshold=None, prefix=True, pad=False),
], ids=["replay_floor_next_to_decodes"])
def test_regression_traces(kw, monkeypatch):
    monkeypatch.setenv("DSV4_INDEX_BACKEND", "reference")
    run_trace(**kw)


@pytest.mark.parametrize("name", ["hybrid", "circular"])
def test_regression_hybrid_block_ids(name, monkeypatch):
    """Steps carry allocation block ids; only the block table expands them to kernel blocks (b*f + j),
    appended runs included (an append once landed at twice its logical block)."""
    monkeypatch.setenv("DSV4_INDEX_BACKEND", "reference")
    run_trace(name, 0, steps=12, num_blocks=40, max_tokens=8, max_seqs=2, spec=0, threshold=None,
              prefix=False, pad=False)
