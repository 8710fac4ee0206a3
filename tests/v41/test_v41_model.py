"""The small attention of ``models/`` on any layout (issue 28): it reads every channel through
``layout.layer_channels(layer)`` and sizes its caches per layer, so paged == dense holds on vLLM's group
plan (``groups="vllm"``: two SWA sub-groups), with one sliding group per layer, and for the DeepSeek-V4.1
tiny model (ratio-2 layers with the C2 state ring, ratio-1 layers without state), prefix hits with
bounded replay included. A layout that lacks an option a layer needs is refused at construction."""

import pytest
import torch

from dsv4_index import DSV4Layout
from models.deepseek_v4 import DSV4Attention, PagedCaches, init_weights, load_config

from helpers.paged_model import layer_picks, run_trace

V41 = load_config("tiny_v41")


def test_v41_tiny_config():
    assert V41.compress_ratios == (0, 2, 2, 1, 1, 0)
    assert [V41.layer_kind(i) for i in range(6)] == ["swa", "c4", "c4", "c4", "c4", "swa"]
    assert [V41.compressor_span(i) for i in (1, 3)] == [4, 1]
    assert [V41.kv_source(i) for i in range(6)] == [None, 1, 1, 3, 3, None]
    assert [V41.topk_source(i) for i in range(6)] == [None, 1, 1, 3, 4, None]
    assert layer_picks(V41) == [0, 1, 2, 3, 4]  # NOTE: sources 1 and 3, and the layers reading their caches
    m = DSV4Attention(V41, 3)
    assert m.compressor.span == 1 and m.indexer.compressor.span == 1


def test_v41_kv_sharing_layers_have_no_compressor():
    """A layer reading its kv source's caches (vLLM: no compressor, the source's indexer K cache, its own
    indexer queries) computes no compressed row itself: dense needs the source's rows, paged the source's
    cache tensors (the same objects)."""
    m = DSV4Attention(V41, 2)
    assert not m.owns_kv and m.kv_source == 1 and not hasattr(m, "compressor")
    assert not any("compressor" in n for n, _ in m.named_parameters())
    m4 = DSV4Attention(V41, 4)  # NOTE: an index source that owns no K cache: its own queries, no key compressor
    assert not m4.owns_kv and m4.runs_indexer and m4.indexer.compressor is None
    assert not any("compressor" in n for n, _ in m4.named_parameters())
    x = torch.randn(12, V41.hidden_size)
    with pytest.raises(ValueError, match="source_rows: layer 2 reads the compressed rows of its kv source, layer 1"):
        m.forward_dense(x)
    src = DSV4Attention(V41, 1)
    with pytest.raises(ValueError, match="source_rows: layer 1 is its own kv source"):
        src.forward_dense(x, source_rows=src.compressed_rows(x))
    with pytest.raises(ValueError, match="layer 2 owns no compressed cache"):
        m.compressed_rows(x)
    lay = DSV4Layout.from_config(V41.to_dict(), 256, mla_block_size=32, swa_block_size=4, indexer_causal_indices=True)
    c = PagedCaches(V41, lay, 8)
    assert c[2].comp is c[1].comp and c[2].idx_comp is c[1].idx_comp and c[2].state is c[1].state
    assert c[4].comp is c[3].comp and c[4].state is None and c[2].swa is not c[1].swa


def test_v41_topk_reuse_layer_runs_no_indexer():
    """A V4.1 indexed layer that is no index source (layer 2: ``index_source_layer_ids`` [1, 3, 4]) has no
    indexer; it attends with the top-k of the nearest index source below it (layer 1) and says so when none is
    given; a layer running its own indexer refuses one. Its paged forward, fed that top-k through its own
    ``topk_to_slots``, equals its dense forward in :func:`test_v41_tiny_paged_equals_dense`."""
    m, src = DSV4Attention(V41, 2), DSV4Attention(V41, 1)
    assert m.indexer is None and not m.runs_indexer and m.topk_source == 1 and src.runs_indexer
    assert not any("indexer" in n for n, _ in m.named_parameters())
    x = torch.randn(12, V41.hidden_size)
    rows = src.compressed_rows(x)
    with pytest.raises(ValueError, match="topk: layer 2 runs no indexer .* layer 1's top-k"):
        m.forward_dense(x, source_rows=rows)
    with pytest.raises(ValueError, match="topk: layer 2 runs no indexer"):
        m.dense_topk(x, source_rows=rows)
    with pytest.raises(ValueError, match="topk: layer 1 runs its own indexer"):
        src.forward_dense(x, topk=src.dense_topk(x))
    layers = {1: src, 2: m}
    kw = m.dense_kwargs(layers, x)
    assert torch.equal(kw["topk"], src.dense_topk(x)) and kw["source_rows"].keys() == rows.keys()
    assert m.forward_dense(x, **kw).shape == x.shape and src.dense_kwargs(layers, x) == {}


def test_missing_option_is_named_at_construction():
    for name in ("tiny", "tiny_v41"):
        cfg = load_config(name)
        lay = DSV4Layout.from_config(cfg.to_dict(), 256, mla_block_size=32, swa_block_size=4)
        with pytest.raises(ValueError, match=r"layer 1 \(c4\) .* indexer_causal_indices=True"):
            PagedCaches(cfg, lay, 8)
    other = DSV4Layout.from_config("tiny", 256, mla_block_size=32, indexer_causal_indices=True)
    with pytest.raises(ValueError, match="compress_ratios .* differ from the model config"):
        PagedCaches(V41, other, 8)


def test_caches_sized_per_layer():
    lay = DSV4Layout.from_config(V41.to_dict(), 256, mla_block_size=32, swa_block_size=4,
                                 indexer_causal_indices=True, swa_group_per_layer=True)
    c = PagedCaches(V41, lay, 8)
    assert c[1].state.shape == (8 * 8, 2 * V41.head_dim)       # c2_state: one ring block of 8 rows
    assert c[3].state is None and c[3].idx_state is None        # ratio 1: no compressor state
    assert c[1].comp.shape[0] == 8 * 16 and c[3].comp.shape[0] == 8 * 32  # S = 32 // R
    assert c[0].swa.shape[0] == 8 * 4


@pytest.mark.slow  # model equivalence
@pytest.mark.parametrize("layout_kw", [dict(groups="vllm"), dict(swa_group_per_layer=True)],
                         ids=["vllm_groups", "swa_per_layer"])
def test_v4_tiny_on_engine_layouts(layout_kw):
    seen = run_trace(1, 24, num_blocks=60, budget=24, chunk=12, prefix=True, prefix_prob=0.8, prompt_hi=120,
                     **layout_kw)
    assert seen["hits"] >= 1 and seen["replayed"] > 0, seen


@pytest.mark.slow
@pytest.mark.parametrize("seed, layout_kw", [(0, {}), (1, dict(swa_group_per_layer=True))],
                         ids=["v41", "v41_swa_per_layer"])
def test_v41_tiny_paged_equals_dense(seed, layout_kw):
    seen = run_trace(seed, 30, num_blocks=60, budget=24, chunk=7, prefix=True, prefix_prob=0.6, prompt_hi=120,
                     cfg=V41, **layout_kw)
    assert seen["rejected"] > 0 and seen["finished"] > 0 and seen["hits"] > 0 and seen["replayed"] > 0, seen


def test_v41_candidate_layers():
    """The two-level indexer of the tiny model: layer 3 is the candidate source (2-row blocks, 4 of them), layer 4
    a consumer scoring only their columns. The candidates matter: on a long sequence the consumer's top-k differs
    from the top-k over every row, and each of its picks lies in one of its token's candidate blocks."""
    assert V41.candidate == (3, 2, 4)
    assert [V41.candidate_role(i) for i in range(6)] == [None, None, None, "source", "consumer", None]
    src, con = DSV4Attention(V41, 3), DSV4Attention(V41, 4)
    init_weights(src, 13), init_weights(con, 14)
    x = torch.randn(60, V41.hidden_size, generator=torch.Generator().manual_seed(0))
    rows = src.compressed_rows(x)
    blocks = src.dense_candidates(x)
    assert blocks.shape == (60, 4) and blocks.dtype == torch.int32
    assert ((blocks < 0) | (blocks * 2 <= torch.arange(60)[:, None])).all()   # a block's first row is visible
    topk = con.dense_topk(x, source_rows=rows, candidates=blocks)
    ok = topk >= 0
    assert ok.sum() > 100 and ((topk // 2)[..., None] == blocks[:, None, :]).any(-1)[ok].all()
    everything = con._scores(x, rows["idx"]).topk(4, dim=1).indices.to(torch.int32)
    assert not torch.equal(topk[30:], everything[30:])
    with pytest.raises(ValueError, match="candidates: layer 4 is a candidate consumer"):
        con.dense_topk(x, source_rows=rows)
    with pytest.raises(ValueError, match="layer 4 is no candidate source"):
        con.dense_candidates(x, source_rows=rows)
    assert "candidates" in con.dense_kwargs({3: src, 4: con}, x) and "candidates" not in src.dense_kwargs({3: src}, x)
