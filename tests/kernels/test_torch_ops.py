"""The functional ops as torch.library custom ops: opcheck on each, fullgraph compiles with zero graph
breaks that equal eager (CPU, aot_eager), and on CUDA Inductor + CUDA graphs (reduce-overhead)."""

import pytest
import torch
from torch._dynamo.utils import counters

import dsv4_index.torch_ops as T
from dsv4_index import DSV4Layout, MetadataPipeline, reference
from dsv4_index.testing.scheduler import random_trace

pytestmark = pytest.mark.slow  # torch.compile (./dev quick skips it)

OPS = torch.ops.dsv4_index
I32 = torch.int32


def batch(device="cpu"):
    """3 requests (a decode, a 2-token decode, a 5-token chunk) in shuffled table rows; T_pad 12."""
    d = dict(dtype=I32, device=device)
    qsl = torch.tensor([0, 1, 3, 8], **d)
    seq = torch.tensor([21, 14, 9], **d)
    bt = (torch.randperm(40, generator=torch.Generator().manual_seed(0))[:24] + 1).view(3, 8).to(device, I32)
    idx = torch.tensor([2, 0, 1], **d)
    return qsl, seq, bt, idx


# (op, args, kwargs) for opcheck: every registered op, functional and out=, with optional tensors given
def cases(device="cpu", backend="reference"):
    qsl, seq, bt, idx = batch(device)
    rs = torch.tensor([0, 10, 2], dtype=I32, device=device)
    re = torch.tensor([0, 13, 6], dtype=I32, device=device)
    topk = torch.tensor([[0, 1, 5, -1]] * 12, dtype=I32, device=device)
    trows = torch.tensor([2, 0, 0, 1, 1, 1, 1, 1] + [-1] * 4, dtype=I32, device=device)
    tnc = torch.tensor([5, 3, 3, 1, 1, 1, 2, 2] + [0] * 4, dtype=I32, device=device)
    cblk = torch.tensor([[1, 0, -1]] * 12, dtype=I32, device=device)   # V4.1 candidate blocks (C = 2)
    kw = dict(num_tokens=12, backend=backend)

    def e(*shape, dtype=I32):
        return torch.full(shape, 99, dtype=dtype, device=device)  # NOTE: poisoned: the op must write it

    return {
        "token_to_req": (OPS.token_to_req, (qsl,), kw),
        "token_to_req_out": (OPS.token_to_req_out, (qsl, e(12)), dict(backend=backend)),
        "slot_mapping": (OPS.slot_mapping, (qsl, seq, bt, 4, idx, re), kw),
        "slot_mapping_out": (OPS.slot_mapping_out, (qsl, seq, bt, 4, e(12, dtype=torch.int64), idx),
                             dict(backend=backend)),
        "compressed_slot_mapping": (OPS.compressed_slot_mapping, (qsl, seq, bt, 2, 2, idx, re), kw),
        "compressed_slot_mapping_out": (OPS.compressed_slot_mapping_out,
                                        (qsl, seq, bt, 2, 2, e(12, dtype=torch.int64), idx), dict(backend=backend)),
        "compact_compressed_slot_mapping": (OPS.compact_compressed_slot_mapping, (qsl, seq, bt, 2, 2, idx), kw),
        "compact_compressed_slot_mapping_out": (OPS.compact_compressed_slot_mapping_out,
                                                (qsl, seq, bt, 2, 2, e(9, dtype=torch.int64), e(4), idx), kw),
        "window_indices": (OPS.window_indices, (qsl, seq, bt, 4, 6, idx, rs), kw),
        "window_indices_out": (OPS.window_indices_out, (qsl, seq, bt, 4, 6, e(12, 6), e(12), idx),
                               dict(backend=backend)),
        "causal_compressed_indices": (OPS.causal_compressed_indices, (qsl, seq, bt, 2, 2, 16, idx), kw),
        "causal_compressed_indices_out": (OPS.causal_compressed_indices_out,
                                          (qsl, seq, bt, 2, 2, 16, e(12, 16), e(12), idx), dict(backend=backend)),
        "topk_to_slots": (OPS.topk_to_slots, (topk, qsl, seq, bt, 2, 2, idx), dict(kw, compact=True)),
        "topk_to_slots_out": (OPS.topk_to_slots_out, (topk, qsl, seq, bt, 2, 2, e(12, 4), e(12), idx),
                              dict(backend=backend)),
        "topk_to_slots_rows": (OPS.topk_to_slots_rows, (topk, trows, tnc, bt, 2, 2, 12), dict(backend=backend)),
        "topk_to_slots_rows_out": (OPS.topk_to_slots_rows_out, (topk, trows, tnc, bt, 2, 2, 12, e(12, 4), e(12)),
                                   dict(backend=backend)),
        "candidate_topk_to_slots_rows": (OPS.candidate_topk_to_slots_rows, (cblk, topk, trows, tnc, bt, 2, 2, 2, 12),
                                         dict(backend=backend, compact=True)),
        "candidate_topk_to_slots_rows_out": (OPS.candidate_topk_to_slots_rows_out,
                                             (cblk, topk, trows, tnc, bt, 2, 2, 2, 12, e(12, 4), e(12)),
                                             dict(backend=backend)),
        "candidate_blocks_to_physical_rows": (OPS.candidate_blocks_to_physical_rows,
                                              (cblk, trows, tnc, bt, 2, 2, 2, 12), dict(backend=backend)),
        "candidate_blocks_to_physical_rows_out": (OPS.candidate_blocks_to_physical_rows_out,
                                                  (cblk, trows, tnc, bt, 2, 2, 2, 12, e(12, 3), e(12)),
                                                  dict(backend=backend)),
        "indexer_lengths": (OPS.indexer_lengths, (qsl, seq, 4), dict(kw, next_n=2, num_decodes=2)),
        "indexer_lengths_out": (OPS.indexer_lengths_out, (qsl, seq, 4, e(12), e(12), e(12), e(4), e(2, 2)),
                                dict(next_n=2, num_decodes=2, backend=backend)),
    }


def test_every_op_is_registered_with_an_out_twin():
    names = set(cases())
    assert set(T.OP_NAMES) == {n for n in names if not n.endswith("_out")}
    assert all(f"{n}_out" in names for n in T.OP_NAMES)
    schema = str(OPS.window_indices_out.default._schema)
    assert "Tensor(a" in schema and "!) out" in schema and "-> ()" in schema, schema   # declared mutation
    assert "SymInt num_tokens" in str(OPS.window_indices.default._schema)


@pytest.mark.parametrize("name", sorted(cases()))
def test_opcheck(name):
    op, args, kwargs = cases()[name]
    torch.library.opcheck(op, args, kwargs)


def test_ops_equal_the_public_ops():
    """Independent values: the registered ops against dsv4_index.reference (and the out= twins write
    every row of their poisoned buffers)."""
    qsl, seq, bt, idx = batch()
    c = cases()
    i, wl = OPS.window_indices(qsl, seq, bt, 4, 6, idx, num_tokens=12)
    ri, rl = reference.window_indices(qsl, seq, bt, 4, 6, idx_mapping=idx, num_tokens=12)
    assert torch.equal(i, ri) and torch.equal(wl, rl)
    op, args, kw = c["window_indices_out"]
    assert op(*args, **kw) is None
    assert torch.equal(args[5], ri) and torch.equal(args[6], rl)
    s = OPS.slot_mapping(qsl, seq, bt, 4, idx, num_tokens=12)
    assert torch.equal(s, reference.slot_mapping(qsl, seq, bt, 4, idx_mapping=idx, num_tokens=12))
    assert s[8:].eq(-1).all() and (s[:8] >= 0).all()
    lens, dec, ks, ke, cu = OPS.indexer_lengths(qsl, seq, 4, num_tokens=12, next_n=2, num_decodes=2)
    r = reference.indexer_lengths(qsl, seq, 4, next_n=2, num_decodes=2, num_tokens=12)
    want = (r.lens, r.decode_lens, r.ks, r.ke, r.cu)
    assert all(torch.equal(a, b) for a, b in zip((lens, dec, ks, ke, cu), want, strict=True))
    assert OPS.indexer_lengths(qsl, seq, 4, num_tokens=12)[1].shape == (0, 0)
    slots, n = OPS.topk_to_slots(c["topk_to_slots"][1][0], qsl, seq, bt, 2, 2, idx, num_tokens=12)
    rs, rn = reference.topk_to_slots(c["topk_to_slots"][1][0], qsl, seq, bt, 2, 2, idx_mapping=idx, num_tokens=12)
    assert torch.equal(slots, rs) and torch.equal(n, rn) and int(n.sum()) > 0


def forward(x, qsl, seq, bt, idx, topk):
    """A toy attention-side consumer of every functional op (T_pad = x.shape[0], a host int)."""
    T_pad = x.shape[0]
    i, wl = OPS.window_indices(qsl, seq, bt, 4, 6, idx, num_tokens=T_pad)
    c, cl = OPS.causal_compressed_indices(qsl, seq, bt, 2, 2, 16, idx, num_tokens=T_pad)
    s = OPS.slot_mapping(qsl, seq, bt, 4, idx, num_tokens=T_pad)
    cs = OPS.compressed_slot_mapping(qsl, seq, bt, 2, 2, idx, num_tokens=T_pad)
    ks, kl = OPS.topk_to_slots(topk, qsl, seq, bt, 2, 2, idx, num_tokens=T_pad)
    lens, dec, kss, ke, cu = OPS.indexer_lengths(qsl, seq, 4, num_tokens=T_pad)
    r = OPS.token_to_req(qsl, num_tokens=T_pad)
    keys = x[i.clamp(min=0).long() % T_pad] * (i >= 0)[..., None]
    comp = x[c.clamp(min=0).long() % T_pad] * (c >= 0)[..., None]
    return (keys.sum(1) + comp.sum(1) + (s + cs + ks.sum(1) + kl + wl + cl + lens + ke + r)[:, None]
            + cu.sum() + kss.sum())


def _graph_breaks(fn, *args) -> int:
    torch._dynamo.reset()
    return torch._dynamo.explain(fn)(*args).graph_break_count


def test_forward_compiles_fullgraph_without_graph_breaks():
    qsl, seq, bt, idx = batch()
    x = torch.randn(12, 3)
    topk = cases()["topk_to_slots"][1][0]
    assert _graph_breaks(forward, x, qsl, seq, bt, idx, topk) == 0
    counters.clear()
    cf = torch.compile(forward, fullgraph=True, backend="aot_eager")
    assert torch.equal(cf(x, qsl, seq, bt, idx, topk), forward(x, qsl, seq, bt, idx, topk))
    assert sum(counters["graph_break"].values()) == 0


def test_the_break_counter_sees_the_plain_python_ops():
    """Control: the same forward through the plain Python ops does break the graph (their host
    checks read device values), so the counter above can fail."""
    from dsv4_index import token_to_req

    def plain(x, qsl):
        return x + token_to_req(qsl, x.shape[0], backend="reference")[:, None]

    def registered(x, qsl):
        return x + OPS.token_to_req(qsl, num_tokens=x.shape[0], backend="reference")[:, None]

    qsl = batch()[0]
    assert _graph_breaks(plain, torch.randn(12, 3), qsl) > 0
    assert _graph_breaks(registered, torch.randn(12, 3), qsl) == 0


def _pipeline(device, **kw):
    layout = DSV4Layout.from_config("tiny", max_model_len=256, mla_block_size=16, swa_block_size=8)
    return layout, MetadataPipeline(layout, 6, 32, device, 1, **kw)


def meta_forward(x, meta, topk):
    """A forward that reads the built metadata and converts one layer's top-k inside the graph."""
    swa, c128 = meta["swa"], meta["c128a"]
    slots, lens = T.topk_to_slots(meta, "c4a", topk)
    w = torch.where((swa.indices >= 0)[..., None], x[swa.indices.clamp(min=0).long() % x.shape[0]], 0.0).sum(1)
    c = torch.where(c128.indices >= 0, c128.indices, 0).sum(1, keepdim=True)
    return w + c + slots.sum(1, keepdim=True) + lens[:, None] + swa.slot_mapping[:, None]


def _trace_steps(layout, device, n, pad):
    for step, _ in random_trace(layout, n, seed=3, max_num_batched_tokens=32, max_num_seqs=6,
                                num_speculative_tokens=1):
        yield step, pad


def test_metadata_forward_compiles_and_equals_meta_topk_to_slots():
    """build() outside, the per-layer top-k conversion inside: zero graph breaks, one graph for every
    step of a trace padded to one size, values equal to meta.topk_to_slots."""
    layout, pipe = _pipeline("cpu")
    g = torch.Generator().manual_seed(0)
    cf = torch.compile(meta_forward, fullgraph=True, backend="aot_eager")
    torch._dynamo.reset()
    counters.clear()
    for step, pad in _trace_steps(layout, "cpu", 6, 32):
        pipe.update(step, pad_to=pad)
        meta = pipe.build()
        topk = torch.randint(-2, 12, (32, 4), generator=g, dtype=I32)
        x = torch.randn(32, 3, generator=g)
        assert torch.equal(cf(x, meta, topk), meta_forward(x, meta, topk))
        a, b = T.topk_to_slots(meta, "c4a", topk), meta.topk_to_slots("c4a", topk)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1
    with pytest.raises(ValueError, match="does not convert top-k"):
        T.topk_to_slots(meta, "swa", topk)


# ----------------------------------------------------------------------------------------------
# GPU: Inductor, and CUDA graphs through mode="reduce-overhead"
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_inductor_cuda_fullgraph():
    qsl, seq, bt, idx = batch("cuda")
    x = torch.randn(12, 3, device="cuda")
    topk = cases("cuda")["topk_to_slots"][1][0]
    assert _graph_breaks(forward, x, qsl, seq, bt, idx, topk) == 0
    cf = torch.compile(forward, fullgraph=True, backend="inductor")
    torch.testing.assert_close(cf(x, qsl, seq, bt, idx, topk), forward(x, qsl, seq, bt, idx, topk))
    for _name, (op, args, kwargs) in cases("cuda", backend=None).items():
        torch.library.opcheck(op, args, kwargs)


@pytest.mark.gpu
def test_reduce_overhead_uses_cuda_graphs_with_build_outside():
    """The supported pattern: update() + build() (itself a CUDA-graph replay) outside the compiled
    region, the forward (with the per-layer top-k conversion) compiled with reduce-overhead. CUDA graphs
    must really be recorded (no "skipping cudagraphs") and replays must equal eager at every step."""
    from torch._inductor import cudagraph_trees

    layout, pipe = _pipeline("cuda", cuda_graphs=True)
    pipe.warmup(pad_sizes=(32,))
    torch._dynamo.reset()
    counters.clear()
    cf = torch.compile(meta_forward, fullgraph=True, mode="reduce-overhead")
    g = torch.Generator(device="cuda").manual_seed(0)
    n = 0
    for step, pad in _trace_steps(layout, "cuda", 8, 32):
        pipe.update(step, pad_to=pad)
        meta = pipe.build()
        topk = torch.randint(-2, 12, (32, 4), generator=g, dtype=I32, device="cuda")
        x = torch.randn(32, 3, generator=g, device="cuda")
        got = cf(x, meta, topk).clone()
        torch.testing.assert_close(got, meta_forward(x, meta, topk))
        n += 1
    assert n == 8
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert sum(counters["graph_break"].values()) == 0
    mgr = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    assert mgr is not None and len(mgr.roots) > 0   # NOTE: a CUDA graph was recorded


def test_candidate_meta_methods_compile_and_equal_eager():
    """V4.1's candidate conversions inside a fullgraph compile: zero graph breaks, values equal to the eager
    meta methods (which the pipeline tests hold against the references)."""
    layout = DSV4Layout.from_config("tiny_v41", max_model_len=256, mla_block_size=16, swa_block_size=8)
    pipe = MetadataPipeline(layout, 6, 32, "cpu", 1)

    def fwd(meta, blocks, cols):
        phys, cnt = meta.candidate_blocks_to_physical("c1a", blocks)
        slots, lens = meta.candidate_topk_to_slots("c1a", blocks, cols, compact=True)
        return phys.sum(1) + cnt + slots.sum(1) + lens

    cf = torch.compile(fwd, fullgraph=True, backend="aot_eager")
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(0)
    n = 0
    for step, _ in random_trace(layout, 5, seed=3, max_num_batched_tokens=32, max_num_seqs=6,
                                num_speculative_tokens=1):
        pipe.update(step, pad_to=32)
        meta = pipe.build()
        blocks = torch.randint(-1, 40, (32, 4), generator=g, dtype=I32)
        cols = torch.randint(-1, 9, (32, 4), generator=g, dtype=I32)
        want = fwd(meta, blocks, cols).clone()
        assert torch.equal(cf(meta, blocks, cols), want)
        n += int(want.abs().sum() > 0)
        a = T.candidate_topk_to_slots(meta, "c1a", blocks, cols)
        b = meta.candidate_topk_to_slots("c1a", blocks, cols)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert n > 0 and sum(counters["graph_break"].values()) == 0
