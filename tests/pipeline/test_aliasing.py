"""Buffers that never alias (issue 38): every shipped layout (V4 flash / pro / tiny, V4.1 v41_flash / tiny_v41,
``groups="vllm"``, one SWA group per layer, DCP, fused and unfused, CUDA graphs on CUDA) builds a pipeline whose
persistent buffers are pairwise disjoint and whose step outputs overlap only as documented identical views; a
deliberately aliased buffer is caught, by the constructor and by ``validate=True`` builds."""

import pytest
import torch

from dsv4_index import DSV4Layout, MetadataPipeline
from dsv4_index.aliasing import (AliasError, Buffer, check_pipeline_buffers, check_step_outputs, find_overlaps,
                                 pipeline_buffers, step_outputs)
from dsv4_index.channels.compressed import CompressedChannel
from dsv4_index.testing.scheduler import random_trace

from helpers.pipelines import HAS_TRITON

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

LAYOUTS = {
    "flash": dict(config="flash"), "pro": dict(config="pro"), "tiny": dict(config="tiny", mla_block_size=16),
    "v41_flash": dict(config="v41_flash"), "tiny_v41": dict(config="tiny_v41", mla_block_size=16),
    "flash_vllm_groups": dict(config="flash", groups="vllm"),
    "tiny_v41_swa_per_layer": dict(config="tiny_v41", mla_block_size=16, swa_group_per_layer=True),
    "v41_flash_swa_per_layer": dict(config="v41_flash", swa_group_per_layer=True),
    "tiny_dcp2": dict(config="tiny", mla_block_size=16, cp_world_size=2),
    "tiny_v41_compact": dict(config="tiny_v41", mla_block_size=16, compact_compressed=True,
                             indexer_causal_indices=True),
}
PIPES = [("unfused", dict(fused=False, backend="reference"))] + \
    ([("fused", dict(fused=True, backend="triton"))] if HAS_TRITON else []) + \
    ([("cuda_graphs", dict(fused=True, backend="triton", cuda_graphs=True))] if torch.cuda.is_available() else [])


def _pipe(name, device, **kw):
    spec = dict(LAYOUTS[name])
    cfg, cp = spec.pop("config"), spec.get("cp_world_size", 1)
    lay = DSV4Layout.from_config(cfg, 1024, **spec)
    return lay, MetadataPipeline(lay, 4, 32, device, 1, cp_world_size=cp, cp_rank=cp - 1, **kw)


@pytest.mark.parametrize("mode,kw", PIPES, ids=[p[0] for p in PIPES])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_shipped_layout_has_disjoint_buffers(name, mode, kw, device):
    lay, pipe = _pipe(name, device, validate=True, **kw)   # NOTE: the constructor ran check_pipeline_buffers
    bufs = pipeline_buffers(pipe)
    assert not find_overlaps(bufs)
    # NOTE: every builder buffer is listed (the check sees them all), and the shared ones under their shared name
    assert len(bufs) >= len(lay.channels) + len(lay.groups)
    n = 0
    for step, _ in random_trace(lay, 4, seed=1, num_blocks=400, max_num_batched_tokens=32, max_num_seqs=4,
                                num_speculative_tokens=1):
        pipe.update(step, pad_to=32)
        meta = pipe.build()                                  # NOTE: validate=True: check_step_outputs every step
        outs = step_outputs(meta)
        assert not find_overlaps(outs)
        n += 1
    assert n == 4
    shared = [o for o in outs if o.shared is not None]
    assert any(o.shared.startswith("table[") for o in shared) and any(o.shared == "ctx.idx_mapping" for o in shared)
    for a, b in (("c4a", "c4i"), ("c2a", "c2i")):        # NOTE: the documented sharing: one compressed geometry
        if a in meta.channels:
            x, y = meta[a].compressed_slot_mapping, meta[b].compressed_slot_mapping
            assert x.data_ptr() == y.data_ptr() and find_overlaps([Buffer("x", x, "s"), Buffer("y", y, "s")]) == []


def test_overlap_rules():
    base = torch.zeros(64, dtype=torch.int32)
    a, b = Buffer("a", base[:32]), Buffer("b", base[16:48])
    assert find_overlaps([a, b]) == [(a, b)]
    assert find_overlaps([Buffer("a", base[:16]), Buffer("b", base[16:32])]) == []       # adjacent: disjoint
    assert find_overlaps([Buffer("a", base[:16], "s"), Buffer("b", base[:16], "s")]) == []   # documented
    assert len(find_overlaps([Buffer("a", base[:16], "s"), Buffer("b", base[:16])])) == 1   # undocumented
    assert len(find_overlaps([Buffer("a", base[:16], "s"), Buffer("b", base[:8], "s")])) == 1  # not identical
    wide, narrow = Buffer("w", base[:60]), Buffer("n", base[40:44])
    far = Buffer("f", base[2:4])
    assert {(p[0].name, p[1].name) for p in find_overlaps([far, narrow, wide])} == {("w", "f"), ("w", "n")}
    rows = base.view(8, 8)
    # NOTE: strided views are compared by extent (first to last element): interleaved columns count as overlapping
    assert len(find_overlaps([Buffer("c0", rows[:, 0]), Buffer("c1", rows[:, 1])])) == 1
    assert len(find_overlaps([Buffer("c0", rows[:, 0]), Buffer("r", rows[3])])) == 1


def test_an_aliased_builder_buffer_is_caught_at_construction(monkeypatch, device):
    real = CompressedChannel.allocate

    def aliased(self, ctx):
        real(self, ctx)
        self.topk_lens = self.token_nc[: self.topk_lens.numel()]   # NOTE: the bug: lens written over n_c
    monkeypatch.setattr(CompressedChannel, "allocate", aliased)
    with pytest.raises(AliasError, match=r"pipeline buffers: c4a\.token_nc .* and c4a\.topk_lens .* share storage"):
        _pipe("tiny", device, fused=False, backend="reference")


def test_an_aliased_step_output_is_caught(device):
    lay, pipe = _pipe("tiny_v41", device, fused=False, backend="reference", validate=True)
    for step, _ in random_trace(lay, 1, seed=1, max_num_batched_tokens=32, max_num_seqs=4):
        pipe.update(step, pad_to=32)
    meta = pipe.build()
    check_step_outputs(meta)
    swa = meta["swa"]
    meta.channels["swa"] = type(swa)(**{**swa.__dict__, "lens": swa.indices.view(-1)[:swa.lens.numel()]})
    with pytest.raises(AliasError, match=r"step outputs: meta\['swa'\]\.indices .* and meta\['swa'\]\.lens"):
        check_step_outputs(meta)
    b = pipe._builders["c1a"]
    b.cand_lens = b.topk_lens                                   # NOTE: candidate lens written over the top-k lens
    with pytest.raises(AliasError, match="c1a.topk_lens .* c1a.cand_lens|c1a.cand_lens .* c1a.topk_lens"):
        check_pipeline_buffers(pipe)
