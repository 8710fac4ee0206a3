"""DeepSeek-V4.1 layouts from vLLM 0.33's own KV-cache plan (issue 28): only ``kv_source_layer_ids`` own a
compressed (MLA) cache and a compressor state in vLLM's ``models/deepseek_v41`` (the other compressed layers read
their source's), and the ratio-2 state is ``c2_state``. Fixtures: vLLM's ``get_kv_cache_groups`` on the specs
vLLM's V4.1 modules declare (``make_vllm_fixtures.py``, ``plan_v41``). Before the fix, ``from_kv_cache_config``
refused every such plan ("no group holds the MLA cache of compressed layer(s) [3, 4, 5, ...]")."""

import copy
import json
from pathlib import Path

import pytest

from dsv4_index import DSV4Layout, MetadataPipeline
from dsv4_index.config import shipped_config
from dsv4_index.engine_plan import kv_owners
from dsv4_index.frontend import NewRequest, StepInput

FIX = Path(__file__).resolve().parent / "fixtures"


def fixture(name):
    return json.loads((FIX / f"vllm033_{name}.json").read_text())


def test_kv_owners_is_vllms_nearest_source_below():
    cfg = shipped_config("v41_flash")
    own = kv_owners(cfg["compress_ratios"], cfg["kv_source_layer_ids"])
    assert sorted(own) == list(range(2, 40))  # NOTE: the compressed layers
    assert [own[i] for i in (2, 3, 7, 8, 13, 14, 19, 20, 39)] == [2, 2, 2, 8, 8, 14, 14, 20, 20]
    assert kv_owners([0, 2, 2], ()) == {1: 1, 2: 2}  # NOTE: without sources every layer owns its caches


@pytest.mark.parametrize("name,swa", [("v41_flash", 7), ("v41_flash_dspark3", 8)])
def test_v41_plan_of_vllm_033(name, swa):
    plan = fixture(name)
    lay = DSV4Layout.from_kv_cache_config(plan, "v41_flash", 8192)
    assert [g.name for g in lay.groups] == [f"swa_{i}" for i in range(swa)] + ["mla", "c2_state"]
    assert [g.block_size for g in lay.groups] == [g["block_size"] for g in plan["kv_cache_groups"]]
    ring = lay.group("c2_state")
    assert (ring.kind, ring.ring_capacity, ring.window) == ("circular", 8, 4)
    assert ring.layers == tuple(range(2, 20))  # NOTE: sources 2, 8, 14 and the ratio-2 layers reading them
    assert lay.group("mla").kind == "full" and lay.group("mla").block_size == 64
    assert {c: lay.channels[c].rows_per_block for c in ("c1a", "c2a")} == {"c1a": 64, "c2a": 32}
    assert lay.layer_channels(5)["c4_state"] == "c2_state" and "c4_state" not in lay.layer_channels(30)
    holds_9 = next(i for i, g in enumerate(plan["kv_cache_groups"])
                   if "model.layers.9.attn.swa_cache" in g["layer_names"])
    assert lay.layer_channels(9)["swa"] == f"swa_{holds_9}" == f"swa_{9 % swa}"  # NOTE: sub-group i: layers i::k
    # NOTE: a first step of one request on this plan passes (one list per engine group, vLLM's block counts)
    lists = tuple([100 * g.gid + j + 1 for j in range(1 if g.kind == "circular" else -(-300 // g.block_size))]
                  for g in lay.groups)
    pipe = MetadataPipeline(lay, 4, 512, "cpu", 0, backend="reference", fused=False)
    pipe.update(StepInput([NewRequest("a", lists, 0)], [], {"a": 300}))
    assert pipe.build().num_tokens == 300


def test_a_plan_without_the_sources_mla_cache_is_refused():
    plan = copy.deepcopy(fixture("v41_flash"))
    mla = next(g for g in plan["kv_cache_groups"] if g["layer_spec"] == "MLAAttentionSpec")
    mla["layer_names"] = [n for n in mla["layer_names"] if not n.startswith("model.layers.8.")]
    with pytest.raises(ValueError, match=r"compressed layer\(s\) \[8, 9, 10, 11, 12, 13\].*kv source"):
        DSV4Layout.from_kv_cache_config(plan, "v41_flash", 8192)


@pytest.mark.parametrize("bad", [[2, 40], [0], ["2"], 2])
def test_bad_kv_source_layer_ids_are_refused(bad):
    """Not a list of compressed backbone layers."""
    cfg = dict(shipped_config("v41_flash"), kv_source_layer_ids=bad)
    with pytest.raises(ValueError, match="kv_source_layer_ids"):
        DSV4Layout.from_kv_cache_config(fixture("v41_flash"), cfg, 8192)


@pytest.mark.parametrize("bad, layer", [([2, 8, 14], 20), ([8, 20], 2), ([2, 8, 14, 21], 20)])
def test_a_source_of_another_ratio_is_refused(bad, layer):
    """Every compressed layer reads the nearest source at or below it (vLLM's ``kv_source_layer_id``): with
    ``[2, 8, 14]`` the ratio-1 layer 20 would read ratio-2 layer 14's cache; with ``[8, 20]`` layers 2-7 have
    no source. Refused by ``from_config`` and ``from_kv_cache_config``, naming the layer."""
    cfg = dict(shipped_config("v41_flash"), kv_source_layer_ids=bad)
    with pytest.raises(ValueError, match=rf"kv_source_layer_ids.*compressed layer {layer} "):
        DSV4Layout.from_config(cfg, 8192)
    with pytest.raises(ValueError, match=rf"kv_source_layer_ids.*compressed layer {layer} "):
        DSV4Layout.from_kv_cache_config(fixture("v41_flash"), cfg, 8192)


@pytest.mark.parametrize("bad, layer, why", [
    ([8, 20], 2, "has no index source below it"),           # layers 2-7 run no indexer and have none below
    ([2, 8, 14], 20, "layer 14's top-k, rows of ratio 2"),  # ratio-1 layer 20 would reuse ratio-2 row ids
])
def test_an_index_source_of_another_ratio_is_refused(bad, layer, why):
    """An indexed V4.1 layer that is no index source attends with the top-k of the nearest index source below
    it (its row ids then go through its own ratio's ``topk_to_slots``): a source of another ratio, or none, is
    refused by ``from_config`` and ``from_kv_cache_config``, naming the layer."""
    cfg = dict(shipped_config("v41_flash"), index_source_layer_ids=bad)
    with pytest.raises(ValueError, match=rf"index_source_layer_ids.*indexed layer {layer} .*{why}"):
        DSV4Layout.from_config(cfg, 8192)
    with pytest.raises(ValueError, match=rf"index_source_layer_ids.*indexed layer {layer} "):
        DSV4Layout.from_kv_cache_config(fixture("v41_flash"), cfg, 8192)
    with pytest.raises(ValueError, match="index_source_layer_ids"):
        DSV4Layout.from_config(dict(cfg, index_source_layer_ids=[2, 40]), 8192)


def test_topk_source_is_the_nearest_index_source_at_or_below():
    """The shipped V4.1-Flash config: layers 3-7 reuse layer 2's top-k, 21-23 layer 20's, 25 layer 24's (the rule
    written out); V4 layers run their own indexer; SWA-only and causal layers have none."""
    from dsv4_index.engine_plan import topk_owners
    cfg = shipped_config("v41_flash")
    src, ratios = cfg["index_source_layer_ids"], cfg["compress_ratios"]
    got = topk_owners(ratios, src)
    for i, r in enumerate(ratios):
        assert got.get(i) == (None if r == 0 else max(s for s in src if s <= i)), i
    assert [got[i] for i in (3, 7, 19, 21, 25, 39)] == [2, 2, 14, 20, 24, 36]
    v4 = shipped_config("flash")["compress_ratios"]
    c4 = [i for i, r in enumerate(v4) if r == 4]
    assert topk_owners(v4) == {i: i for i in c4} and c4

