"""Malformed engine plans, configs and options that would make a layout misdescribe the engine (issue 39, cases
3-8): each refused by name, before anything is built."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from dsv4_index import DSV4Layout, MetadataPipeline
from dsv4_index.config import shipped_config
from dsv4_index.tools.replay import replay_trace
from dsv4_index.tools.trace import TraceError, record_steps

FIX = Path(__file__).resolve().parent / "fixtures"


def _plan(name):
    return json.loads((FIX / f"vllm033_{name}.json").read_text())


# ---------------------------------------------------------------------------------------------- case 3
@pytest.mark.parametrize("extra", ["model.layers.3.attn", "model.layers.3.attn.indexer.k_cache"])
def test_v41_plan_with_a_cache_of_a_layer_that_reads_its_source_is_refused(extra):
    """Layer 3 of V4.1-Flash reads layer 2's cache (``kv_source_layer_ids``): an engine holding a cache for it
    contradicts the config."""
    plan = copy.deepcopy(_plan("v41_flash"))
    mla = next(g for g in plan["kv_cache_groups"] if g["layer_spec"] == "MLAAttentionSpec")
    mla["layer_names"].append(extra)
    with pytest.raises(ValueError, match=r"kv_cache_groups\[\d+\].*layer 3.*kv_source_layer_ids.*layer 2"):
        DSV4Layout.from_kv_cache_config(plan, "v41_flash", 8192)


def test_v41_plan_with_a_state_of_a_layer_that_reads_its_source_is_refused():
    plan = copy.deepcopy(_plan("v41_flash"))
    ring = next(g for g in plan["kv_cache_groups"] if g["layer_spec"] == "CircularBufferSpec")
    ring["layer_names"].append("model.layers.5.attn.compressor.state_cache")
    with pytest.raises(ValueError, match=r"kv_cache_groups\[\d+\].*layer 5.*kv_source_layer_ids.*layer 2"):
        DSV4Layout.from_kv_cache_config(plan, "v41_flash", 8192)


# ---------------------------------------------------------------------------------------------- case 4
class SinkFullAttentionSpec(NS):
    pass


class FullAttentionSpec(NS):
    pass


class SlidingWindowMLASpec(NS):
    pass


class UniformTypeKVCacheSpecs(NS):
    pass


@pytest.mark.parametrize("kind", ["SinkFullAttentionSpec", "MLAAttentionSpecV2", "SlidingWindowFooSpec",
                                  "NotCircularBufferSpec", "mlaattentionspec"])
def test_spec_kinds_are_matched_by_their_exact_name(kind):
    plan = copy.deepcopy(_plan("flash"))
    plan["kv_cache_groups"][2]["layer_spec"] = kind
    with pytest.raises(ValueError, match=rf"kv_cache_groups\[2\] \(spec {kind}.*does not know"):
        DSV4Layout.from_kv_cache_config(plan, "flash", 4096)


def test_spec_objects_are_matched_by_their_exact_class_name():
    def groups(cls):
        out = []
        for g in _plan("flash")["kv_cache_groups"]:
            c = cls if g["layer_spec"] == "MLAAttentionSpec" else SlidingWindowMLASpec
            out.append(NS(layer_names=g["layer_names"],
                          kv_cache_spec=c(block_size=g["block_size"], sliding_window=g["sliding_window"])))
        return out
    assert DSV4Layout.from_kv_cache_config(groups(FullAttentionSpec), "flash", 4096).group("mla").kind == "full"
    with pytest.raises(ValueError, match=r"kv_cache_groups\[2\] \(spec SinkFullAttentionSpec"):
        DSV4Layout.from_kv_cache_config(groups(SinkFullAttentionSpec), "flash", 4096)


@pytest.mark.parametrize("field,other", [("sliding_window", 8), ("block_size", 32)])
def test_uniform_type_specs_whose_inner_specs_differ_are_refused(field, other):
    groups = []
    for g in _plan("flash")["kv_cache_groups"]:
        specs = {n: SlidingWindowMLASpec(block_size=g["block_size"], sliding_window=g["sliding_window"])
                 for n in g["layer_names"]}
        groups.append(NS(layer_names=g["layer_names"],
                         kv_cache_spec=UniformTypeKVCacheSpecs(block_size=g["block_size"], kv_cache_specs=specs)))
    groups = groups[:2]          # NOTE: the two SWA sub-groups (window 128) are enough to read the wrapper
    specs = groups[0].kv_cache_spec.kv_cache_specs
    last = list(specs)[-1]
    specs[last] = SlidingWindowMLASpec(**dict(vars(specs[last]), **{field: other}))
    with pytest.raises(ValueError, match=rf"kv_cache_groups\[0\].*{field}.*{last}"):
        DSV4Layout.from_kv_cache_config(groups, "flash", 4096)


def test_a_layer_listed_twice_or_a_non_bool_eagle_flag_is_refused():
    plan = copy.deepcopy(_plan("flash"))
    g = plan["kv_cache_groups"][3]
    g["layer_names"].append(g["layer_names"][0])
    with pytest.raises(ValueError, match=r"kv_cache_groups\[3\].layer_names lists .* twice"):
        DSV4Layout.from_kv_cache_config(plan, "flash", 4096)
    plan = copy.deepcopy(_plan("flash"))
    plan["kv_cache_groups"][0]["is_eagle_group"] = "yes"
    with pytest.raises(ValueError, match=r"kv_cache_groups\[0\].is_eagle_group must be a bool"):
        DSV4Layout.from_kv_cache_config(plan, "flash", 4096)


# ---------------------------------------------------------------------------------------------- case 5
@pytest.mark.parametrize("opt", [dict(mla_block_size=64), dict(swa_block_size=32), dict(c4_state_block_size=2),
                                 dict(c128_state_block_size=4), dict(swa_group_per_layer=True),
                                 dict(groups="vllm"), dict(circular={"swa": 128})])
def test_options_the_plan_owns_are_refused(opt):
    with pytest.raises(ValueError, match=rf"from_kv_cache_config.*{next(iter(opt))}.*engine plan"):
        DSV4Layout.from_kv_cache_config(_plan("flash"), "flash", 4096, **opt)


def test_unknown_options_are_refused_by_name():
    with pytest.raises(TypeError, match="mla_blocksize"):
        DSV4Layout.from_kv_cache_config(_plan("flash"), "flash", 4096, mla_blocksize=64)


# ---------------------------------------------------------------------------------------------- case 6
@pytest.mark.parametrize("key", ["kv_source_layer_ids", "index_source_layer_ids"])
@pytest.mark.parametrize("bad", [0, False, "", {}, 0.0])
def test_falsy_source_lists_are_refused(key, bad):
    cfg = dict(shipped_config("v41_flash"), **{key: bad})
    with pytest.raises(ValueError, match=rf"config\['{key}'\] must be a list"):
        DSV4Layout.from_config(cfg, 8192)


def test_absent_or_null_or_empty_source_lists_mean_every_layer_owns_its_caches():
    base = shipped_config("tiny_v41")
    for v in ([], None):
        lay = DSV4Layout.from_config(dict(base, kv_source_layer_ids=v, index_source_layer_ids=v), 256)
        assert lay.kv_sources == () and lay.kv_source(2) == 2
    lay = DSV4Layout.from_config({k: v for k, v in base.items() if not k.endswith("source_layer_ids")}, 256)
    assert lay.kv_sources == ()


# ---------------------------------------------------------------------------------------------- case 7
@pytest.mark.parametrize("sources,why", [([0, 1, 3], "layer 0"), ([3], "compressed layer 1"),
                                         ([1, 2, 3], None)])
def test_trace_header_kv_sources_follow_from_configs_rule(tmp_path, sources, why):
    lay = DSV4Layout.from_config("tiny_v41", 256)
    pipe = MetadataPipeline(lay, 4, 32, "cpu", backend="reference")
    path = tmp_path / "t.jsonl"
    with record_steps(pipe, path):
        pass
    lines = path.read_text().splitlines()
    head = json.loads(lines[0])
    head["layout"]["kv_sources"] = sources
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([json.dumps(head)] + lines[1:]) + "\n")
    if why is None:   # NOTE: layer 2 as a source of its own: a valid rule (its own cache), another layout
        assert replay_trace(bad, device="cpu", backend="reference").ok
        return
    with pytest.raises(TraceError, match=rf"bad.jsonl:1: layout.kv_sources.*{why}"):
        replay_trace(bad, device="cpu", backend="reference")


# ---------------------------------------------------------------------------------------------- case 8
def test_memory_estimate_refuses_unknown_keywords_and_what_the_constructor_refuses():
    lay = DSV4Layout.from_config("tiny", 256)
    with pytest.raises(TypeError, match="max_staged_block"):
        MetadataPipeline.memory_estimate(lay, 4, 32, max_staged_block=3)
    with pytest.raises(ValueError, match="checks"):
        MetadataPipeline.memory_estimate(lay, 4, 32, checks="paranoid")
    with pytest.raises(ValueError, match="cp_rank"):
        MetadataPipeline.memory_estimate(lay, 4, 32, cp_world_size=2, cp_rank=2)
    with pytest.raises(ValueError, match="backend"):
        MetadataPipeline.memory_estimate(lay, 4, 32, backend="cuda")
    ok = MetadataPipeline.memory_estimate(lay, 4, 32, checks="full", fused=False, validate=True,
                                          backend="reference", cuda_graphs=False)
    assert ok["device"] == MetadataPipeline.memory_estimate(lay, 4, 32)["device"] > 0
