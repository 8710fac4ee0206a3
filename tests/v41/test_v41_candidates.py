"""V4.1's two-level indexer through the pipeline: the config fields in the layout, and ``meta.candidate_*``
on every step of a scheduler trace equal to the functional references on the step's own batch (the pipeline's
per-token rows never enter the expectation), on the reference and Triton paths, with the views persistent and
distinct from the top-k buffers."""

import pytest
import torch

from dsv4_index import DSV4Layout, MetadataPipeline
from dsv4_index import reference as ref
from dsv4_index.testing.scheduler import random_trace

from helpers.pipelines import HAS_TRITON

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def test_layout_carries_the_config_fields():
    lay = DSV4Layout.from_config("v41_flash", 8192)
    assert (lay.candidate_block_size, lay.candidate_topk_blocks, lay.candidate_source_layer) == (8, 2048, 20)
    tiny = DSV4Layout.from_config("tiny_v41", 256, mla_block_size=16)
    assert (tiny.candidate_block_size, tiny.candidate_topk_blocks, tiny.candidate_source_layer) == (2, 4, 3)
    for name in ("flash", "pro", "tiny"):
        v4 = DSV4Layout.from_config(name, 4096)
        assert v4.candidate_block_size is None and v4.candidate_topk_blocks is None


def _cfg(**kw):
    base = dict(num_hidden_layers=3, sliding_window=16, index_topk=8, compress_ratios=[0, 1, 2],
                candidate_block_size=8, candidate_topk_blocks=4)
    base.update(kw)
    return base


def test_config_rules():
    assert DSV4Layout.from_config(_cfg(), 1024).candidate_block_size == 8
    assert DSV4Layout.from_config(_cfg(), 1024).candidate_source_layer is None
    assert DSV4Layout.from_config(_cfg(candidate_source_layer_id=1), 1024).candidate_source_layer == 1
    for off in (dict(candidate_block_size=0), dict(candidate_topk_blocks=0), dict(candidate_source_layer_id=None),
                dict(candidate_source_layer_id=-1)):
        assert DSV4Layout.from_config(_cfg(**off), 1024).candidate_block_size is None, off
    with pytest.raises(ValueError, match="candidate_source_layer_id"):
        DSV4Layout.from_config(_cfg(candidate_source_layer_id=0), 1024)   # an SWA-only layer
    with pytest.raises(ValueError, match="candidate_topk_blocks"):
        DSV4Layout.from_config(_cfg(candidate_topk_blocks="8"), 1024)
    # C must divide the rows per cache block of every top-k channel: c2a has 16 / 2 = 8 rows here
    with pytest.raises(ValueError, match=r"candidate_block_size'\] = 16 does not divide the 8 compressed rows per "
                                         r"cache block of channel 'c2a'"):
        DSV4Layout.from_config(_cfg(candidate_block_size=16), 1024, mla_block_size=16)


def _batch_args(meta, ch):
    """The functional ops' batch arguments of this step (its own qsl / seq_lens / table / idx_mapping)."""
    s = meta.layout.channels[ch]
    return (meta.query_start_loc, meta.seq_lens, meta.block_tables[s.gid], s.rows_per_block, s.compress_ratio,
            meta.layout.candidate_block_size)


def _random_inputs(g, Tp, nb, K, C, max_row):
    blocks = torch.randint(-1, max(2, max_row // C + 2), (Tp + 1, nb), generator=g, dtype=torch.int32)
    cols = torch.randint(-2, nb * C + 2, (Tp + 1, K), generator=g, dtype=torch.int32)
    return blocks, cols


@pytest.mark.parametrize("backend", ["reference"] + (["triton"] if HAS_TRITON else []))
def test_meta_methods_equal_the_references_over_a_trace(backend, device):
    lay = DSV4Layout.from_config("tiny_v41", 256, mla_block_size=16, swa_block_size=8)
    pipe = MetadataPipeline(lay, 6, 48, device, 1, backend=backend, fused=backend == "triton")
    pipe.warmup()
    g = torch.Generator().manual_seed(1)
    C, nb, K = lay.candidate_block_size, lay.candidate_topk_blocks, lay.index_topk
    seen = 0
    for step, _ in random_trace(lay, 14, seed=5, max_num_batched_tokens=48, max_num_seqs=6,
                                num_speculative_tokens=1):
        pipe.update(step, pad_to=48)
        meta = pipe.build()
        Tp = meta.num_tokens_padded
        for ch in ("c1a", "c2a"):
            blocks, cols = _random_inputs(g, Tp, nb, K, C, 256 // meta.layout.channels[ch].compress_ratio)
            blocks, cols = blocks.to(device), cols.to(device)
            topk = meta.topk_to_slots(ch, cols)  # NOTE: its buffers must survive the candidate calls
            keep = topk[0].clone()
            phys, cnt = meta.candidate_blocks_to_physical(ch, blocks)
            slots, lens = meta.candidate_topk_to_slots(ch, blocks, cols, compact=True)
            args = _batch_args(meta, ch)
            wp, wc = ref.candidate_blocks_to_physical(blocks.cpu(), *[a.cpu() if torch.is_tensor(a) else a
                                                                      for a in args],
                                                      idx_mapping=meta.idx_mapping.cpu(), num_tokens=Tp)
            ws, wl = ref.candidate_topk_to_slots(blocks.cpu(), cols.cpu(), *[a.cpu() if torch.is_tensor(a) else a
                                                                             for a in args],
                                                 idx_mapping=meta.idx_mapping.cpu(), num_tokens=Tp, compact=True)
            assert torch.equal(phys.cpu(), wp) and torch.equal(cnt.cpu(), wc), ch
            assert torch.equal(slots.cpu(), ws) and torch.equal(lens.cpu(), wl), ch
            assert torch.equal(topk[0], keep)
            assert phys.untyped_storage().data_ptr() != topk[0].untyped_storage().data_ptr()
            assert slots.untyped_storage().data_ptr() != topk[0].untyped_storage().data_ptr()
            seen += int(wc.sum()) + int(wl.sum())
    assert seen > 50  # NOTE: the trace converts something


def test_refusals(device):
    lay = DSV4Layout.from_config("tiny_v41", 256, mla_block_size=16, swa_block_size=8)
    pipe = MetadataPipeline(lay, 4, 16, device, 1, backend="reference", fused=False)
    for step, _ in random_trace(lay, 1, seed=2, max_num_batched_tokens=16, max_num_seqs=4):
        pipe.update(step, pad_to=16)
    meta = pipe.build()
    blocks = torch.full((16, 4), -1, dtype=torch.int32, device=device)
    cols = torch.full((16, 4), -1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="does not convert top-k"):
        meta.candidate_topk_to_slots("swa", blocks, cols)
    with pytest.raises(KeyError, match="no channel"):
        meta.candidate_blocks_to_physical("c4a", blocks)
    with pytest.raises(ValueError, match="blocks has 5 columns, channel 'c1a' was sized for candidate_topk_blocks = 4"):
        meta.candidate_blocks_to_physical("c1a", torch.full((16, 5), -1, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="blocks has 8 rows, the step has T_pad = 16"):
        meta.candidate_blocks_to_physical("c1a", blocks[:8])
    with pytest.raises(ValueError, match="blocks must be int32"):
        meta.candidate_topk_to_slots("c1a", blocks.long(), cols)
    v4 = DSV4Layout.from_config("tiny", 256, mla_block_size=16, swa_block_size=8)
    p4 = MetadataPipeline(v4, 4, 16, device, 1, backend="reference", fused=False)
    for step, _ in random_trace(v4, 1, seed=2, max_num_batched_tokens=16, max_num_seqs=4):
        p4.update(step, pad_to=16)
    with pytest.raises(ValueError, match="no two-level indexer"):
        p4.build().candidate_topk_to_slots("c4a", blocks, cols)


def test_dcp_refuses_physical_blocks_but_converts_columns(device):
    lay = DSV4Layout.from_config("tiny_v41", 256, mla_block_size=16, swa_block_size=8, cp_world_size=2)
    pipe = MetadataPipeline(lay, 4, 16, device, 1, backend="reference", fused=False, cp_world_size=2, cp_rank=1)
    for step, _ in random_trace(lay, 2, seed=2, max_num_batched_tokens=16, max_num_seqs=4):
        pipe.update(step, pad_to=16)
        meta = pipe.build()
    blocks = torch.zeros((16, 4), dtype=torch.int32, device=device)
    cols = torch.arange(4, dtype=torch.int32, device=device).repeat(16, 1)
    with pytest.raises(ValueError, match="sharded by DCP"):
        meta.candidate_blocks_to_physical("c1a", blocks)
    rows = (blocks.long().gather(1, cols.long() // 2) * 2 + cols.long() % 2)
    a = meta.candidate_topk_to_slots("c1a", blocks, cols)
    a = (a[0].clone(), a[1].clone())
    b = meta.topk_to_slots("c1a", rows)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_check_candidates_accepts_the_pipeline_and_names_a_wrong_entry(device):
    from dsv4_index.validate import MetadataError, check_candidates
    lay = DSV4Layout.from_config("tiny_v41", 256, mla_block_size=16, swa_block_size=8)
    pipe = MetadataPipeline(lay, 4, 32, device, 1)
    for step, _ in random_trace(lay, 6, seed=4, max_num_batched_tokens=32, max_num_seqs=4):
        pipe.update(step, pad_to=32)
        meta = pipe.build()
    g = torch.Generator().manual_seed(2)
    blocks, cols = (x.to(device) for x in _random_inputs(g, 32, 4, 4, 2, 64))
    phys, cnt = (x.clone() for x in meta.candidate_blocks_to_physical("c1a", blocks))
    slots, lens = (x.clone() for x in meta.candidate_topk_to_slots("c1a", blocks, cols))
    check_candidates(meta, "c1a", blocks, cols, phys, cnt, slots, lens)
    t = int(torch.nonzero(cnt)[0])
    phys[t] = torch.where(phys[t] >= 0, phys[t] + 1, phys[t])
    with pytest.raises(MetadataError, match="candidate physical blocks"):
        check_candidates(meta, "c1a", blocks, cols, phys, cnt, None, None)
    slots[t, 0] = 7
    with pytest.raises(MetadataError, match="candidate slots"):
        check_candidates(meta, "c1a", blocks, cols, None, None, slots, lens)
