"""The consumer views find a layer's channels by role, on any layout (issue 28 leftovers): V4's one ``c4a``
and ``c128a``, vLLM's engine plan (``groups="vllm"``), and V4.1, whose ratio-2 and ratio-1 layers read ``c2a``
and ``c1a`` (both of role ``c4a``): the prefill workspace of a V4.1 layer gathers its own compressed rows."""

from __future__ import annotations

import pytest
import torch

from dsv4_index import DSV4Layout
from dsv4_index.consumers import compressed_channel, prefill_chunk, prefill_workspace_size
from dsv4_index.frontend import NewRequest, StepInput

from helpers.pipelines import Pool, make_pipeline

FLASH = DSV4Layout.from_config("flash", 4096)
VLLM = DSV4Layout.from_config("flash", 4096, groups="vllm")
V41 = DSV4Layout.from_config("tiny_v41", 256, mla_block_size=32, swa_block_size=4, indexer_causal_indices=True)


@pytest.mark.parametrize("layout", [FLASH, VLLM], ids=["flash", "flash-vllm"])
def test_v4_layouts_have_one_channel_per_role(layout):
    assert compressed_channel(layout, "c4") == "c4a" and compressed_channel(layout, "c128") == "c128a"
    c4 = layout.compress_ratios.index(4)
    c128 = layout.compress_ratios.index(128)
    assert compressed_channel(layout, "c4", c4) == "c4a" and compressed_channel(layout, "c128", c128) == "c128a"
    with pytest.raises(ValueError, match=f"differs from layer {c4}'s kind 'c4'"):
        compressed_channel(layout, "c128", c4)


def test_v41_needs_the_layer_and_gives_its_own_channel():
    assert list(V41.compress_ratios[:5]) == [0, 2, 2, 1, 1]
    with pytest.raises(ValueError, match=r"several 'c4a' channels \['c1a', 'c2a'\]; pass the layer"):
        compressed_channel(V41, "c4")
    assert [compressed_channel(V41, "c4", i) for i in (1, 2, 3, 4)] == ["c2a", "c2a", "c1a", "c1a"]
    with pytest.raises(ValueError, match="no channel of role 'c128a'"):
        compressed_channel(V41, "c128")
    with pytest.raises(ValueError, match="layer_kind must be 'c4' or 'c128'"):
        compressed_channel(V41, "swa", 0)


@pytest.mark.parametrize("layer, R", [(1, 2), (3, 1)])
def test_v41_prefill_workspace_reads_the_layers_channel(layer, R):
    pool = Pool(V41)
    L = 40
    blocks = pool.blocks(L)
    pipe = make_pipeline(V41, backend="reference", fused=False)
    pipe.update(StepInput([NewRequest("a", blocks, 0)], [], {"a": L}))
    meta = pipe.build()
    K = V41.index_topk
    topk = torch.full((meta.num_tokens_padded, K), -1, dtype=torch.int32)
    assert prefill_workspace_size(meta, "c4", layer=layer)[0] == L // R
    ch = prefill_chunk(meta, "c4", 0, 1, topk, layer=layer)
    mla = [g.role for g in V41.groups].index("mla")
    per_block = V41.groups[mla].block_size // R  # NOTE: compressed rows of ratio R in one mla block
    want = [blocks[mla][j // per_block] * per_block + j % per_block for j in range(L // R)]
    assert ch.N == L // R and ch.comp_slots[0].tolist() == want
