"""Layouts from the engine's own KV-cache plan (issue 28): vLLM 0.33's real grouping (fixtures made by
``make_vllm_fixtures.py`` with vLLM's own ``get_kv_cache_groups``) read by ``from_kv_cache_config``; the
``groups="vllm"`` shorthand equal to it; MTP layers left out or in a group of their own; plans the
layout cannot serve refused naming the group and layer; block lists of another group order refused."""

import copy
import json
import re
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from dsv4_index import DSV4Layout, MetadataPipeline
from dsv4_index.config import normalize_config
from dsv4_index.group_plan import vllm_plan
from dsv4_index.frontend import NewRequest, StepInput

FIX = Path(__file__).resolve().parent / "fixtures"


def fixture(name):
    return json.loads((FIX / f"vllm033_{name}.json").read_text())


def layer_sets(plan):
    """Per fixture group: the layer indices of its names (read here, independently of the library)."""
    return [sorted({int(re.search(r"layers\.(\d+)\.", n).group(1)) for n in g["layer_names"]})
            for g in plan["kv_cache_groups"]]


@pytest.mark.parametrize("name", ["flash", "pro"])
def test_shorthand_equals_vllm_033_planner(name):
    plan = fixture(f"{name}_mtp")
    lay = DSV4Layout.from_config(name, 4096, groups="vllm")
    assert [g.block_size for g in lay.groups] == [g["block_size"] for g in plan["kv_cache_groups"]]
    assert [g.window for g in lay.groups] == [g["sliding_window"] for g in plan["kv_cache_groups"]]
    compressed = [i for i, r in enumerate(lay.compress_ratios) if r]
    assert [list(g.layers) if g.layers is not None else compressed for g in lay.groups] == layer_sets(plan)
    engine = DSV4Layout.from_kv_cache_config(plan, name, 4096)
    assert engine.groups == lay.groups and engine.channels == lay.channels
    # without MTP (vLLM without speculative decoding): the plan function on the 43 / 61 main layers
    plan = fixture(name)
    cfg = normalize_config(name)
    ratios = cfg["compress_ratios"][:cfg["num_hidden_layers"]]
    r4, r128 = sorted({r for r in ratios if r})
    got = vllm_plan(ratios, r4, r128)
    assert [list(p.layers) if p.layers is not None else [i for i, r in enumerate(ratios) if r] for p in got] \
        == layer_sets(plan)


def test_vllm_033_order_is_the_issue_order():
    assert [g.name for g in DSV4Layout.from_kv_cache_config(fixture("flash"), "flash", 4096).groups] == \
        ["swa_0", "swa_1", "mla", "c4_state", "c128_state"]
    assert [g.name for g in DSV4Layout.from_kv_cache_config(fixture("pro"), "pro", 4096).groups] == \
        ["swa_0", "swa_1", "mla", "c128_state", "c4_state"]


class MLAAttentionSpec(NS):
    pass


class SlidingWindowMLASpec(NS):
    pass


class UniformTypeKVCacheSpecs(NS):
    pass


class MambaSpec(NS):
    pass


def as_objects(plan):
    """The fixture as vLLM objects look (duck-typed stand-ins with vLLM's class names)."""
    groups = []
    for g in plan["kv_cache_groups"]:
        cls = MLAAttentionSpec if g["layer_spec"] == "MLAAttentionSpec" else SlidingWindowMLASpec
        specs = {n: cls(block_size=g["block_size"], sliding_window=g["sliding_window"]) for n in g["layer_names"]}
        groups.append(NS(layer_names=g["layer_names"], is_eagle_group=False,
                         kv_cache_spec=UniformTypeKVCacheSpecs(block_size=g["block_size"], kv_cache_specs=specs)))
    return NS(kv_cache_groups=groups, num_blocks=100)


def test_objects_and_model_config_forms():
    plan = fixture("flash")
    model_config = NS(hf_config=normalize_config("flash"), max_model_len=2048)
    lay = DSV4Layout.from_kv_cache_config(as_objects(plan), model_config)
    assert lay.max_model_len == 2048
    assert lay.groups == DSV4Layout.from_kv_cache_config(plan["kv_cache_groups"], "flash", 2048).groups


def test_without_mtp_the_draft_layer_is_served_by_no_group():
    lay = DSV4Layout.from_kv_cache_config(fixture("flash"), "flash", 4096)
    assert lay.layer_channels(42) == {"swa": "swa_0", "c4a": "c4a", "c4i": "c4i", "c4_state": "c4_state"}
    with pytest.raises(ValueError, match="layer 43 is served by no group"):
        lay.layer_channels(43)
    # the explicit form in vLLM's order (refused before: "layers [43] have a swa cache but no group")
    groups = [dict(layer_names=g["layer_names"], block_size=g["block_size"])
              for g in fixture("flash")["kv_cache_groups"]]
    assert DSV4Layout.from_config("flash", 4096, groups=groups).groups == lay.groups


def test_mtp_draft_layers_in_a_group_of_their_own():
    plan = fixture("flash_mtp")
    g1 = plan["kv_cache_groups"][1]
    g1["layer_names"] = [n for n in g1["layer_names"] if ".43." not in n]
    plan["kv_cache_groups"].append(dict(layer_names=["model.layers.43.self_attn.swa_cache"], block_size=64,
                                        sliding_window=128, layer_spec="SlidingWindowMLASpec", is_eagle_group=True))
    lay = DSV4Layout.from_kv_cache_config(plan, "flash", 4096)
    assert [g.name for g in lay.groups] == ["swa_0", "swa_1", "mla", "c4_state", "c128_state", "swa_mtp"]
    assert lay.group("swa_mtp").layers == (43,) and lay.layer_channels(43) == {"swa": "swa_mtp"}
    assert lay.layer_channels(41) == {"swa": "swa_1", "c128a": "c128a", "c128_state": "c128_state"}


def _edit(fn):
    plan = copy.deepcopy(fixture("flash"))
    fn(plan["kv_cache_groups"])
    return plan


@pytest.mark.parametrize("edit,match", [
    (lambda gs: gs[0]["layer_names"].append("model.embed.swa_cache"), r"kv_cache_groups\[0\].*no 'layers.<i>'"),
    (lambda gs: gs[2]["layer_names"].append("model.layers.0.self_attn"),
     r"kv_cache_groups\[2\] \(MLAAttentionSpec.*layer 0, which is SWA-only"),
    (lambda gs: gs[2]["layer_names"].append("model.layers.0.self_attn.swa_cache"),
     r"kv_cache_groups\[2\] \(MLAAttentionSpec.*holds 'model.layers.0.self_attn.swa_cache'.*full group"),
    (lambda gs: gs[3].update(sliding_window=16), r"kv_cache_groups\[3\].*sliding_window 16.*layer 2 \(window 8\)"),
    (lambda gs: gs[4].update(layer_spec="MambaSpec"), r"kv_cache_groups\[4\] \(spec MambaSpec.*does not know"),
    (lambda gs: gs[2]["layer_names"].remove("model.layers.5.self_attn"), r"MLA cache of compressed layer\(s\) \[5\]"),
    # a V4.1-style C2 ring (window 4) for a layer this config calls C4: refused, naming group, spec and layer
    (lambda gs: gs.append(dict(layer_names=["model.layers.2.self_attn.c2_compressor.state_cache"], block_size=2,
                               sliding_window=4, layer_spec="SlidingWindowMLASpec")),
     r"kv_cache_groups\[5\] \(SlidingWindowMLASpec, block_size 2\).*layer 2 \(window 8\)"),
    (lambda gs: gs[0]["layer_names"].append("model.layers.3.self_attn.compressor.state_cache"),
     "several kinds"),
    # vllm-ascend style: the C128 main caches in a group of their own
    (lambda gs: gs.append(dict(layer_names=[gs[2]["layer_names"].pop()], block_size=4096,
                               layer_spec="MLAAttentionSpec")),
     r"kv_cache_groups\[5\] .*'model.layers.42.self_attn'.*second full MLA group beside kv_cache_groups\[2\]"),
])
def test_plans_the_layout_cannot_serve(edit, match):
    with pytest.raises(ValueError, match=match):
        DSV4Layout.from_kv_cache_config(_edit(edit), "flash", 4096)


def _lists(layout_of_engine, tokens, start=1):
    """Block lists of one new request of ``tokens`` tokens, one per group of the engine's plan."""
    out, nxt = [], start
    for g in layout_of_engine.groups:
        n = -(-tokens // g.alloc_block_size)
        out.append(list(range(nxt, nxt + n)))
        nxt += n
    return tuple(out)


OUR_OLD_ORDER = ["mla", "swa_0", "swa_1", "c4_state", "c128_state"]


def _old_order_layout(name):
    eng = DSV4Layout.from_kv_cache_config(fixture(f"{name}_mtp"), name, 2048)
    by = {g.name: g for g in eng.groups}
    groups = [dict(role=by[n].role, layers=by[n].layers) for n in OUR_OLD_ORDER]
    return eng, DSV4Layout.from_config(name, 2048, groups=groups)


@pytest.mark.parametrize("name,tokens", [("flash", 100), ("pro", 64), ("pro", 8)])
def test_lists_of_another_group_order_are_refused_on_the_first_step(name, tokens):
    eng, wrong = _old_order_layout(name)
    pipe = MetadataPipeline(wrong, 4, 256, "cpu", backend="reference")
    step = StepInput([NewRequest("a", _lists(eng, tokens), 0)], [], {"a": tokens})
    with pytest.raises(ValueError, match="cannot belong to these groups" if tokens > 8 else "block ids missing"):
        pipe.update(step)
    # the same step on the engine's own layout is accepted, each SWA sub-group writing its own blocks
    right = MetadataPipeline(eng, 4, 256, "cpu", backend="reference")
    right.update(step)
    meta = right.build()
    lists = step.new_requests[0].block_ids
    for c in ("swa_0", "swa_1"):
        g = eng.channels[c].gid
        want = [lists[g][p // 64] * 64 + p % 64 for p in range(tokens)]
        assert meta[c].slot_mapping[:tokens].tolist() == want


def test_consistent_lists_with_lookahead_pass():
    eng = DSV4Layout.from_kv_cache_config(fixture("flash_mtp"), "flash", 2048)
    pipe = MetadataPipeline(eng, 4, 256, "cpu", 1, backend="reference")
    pipe.update(StepInput([NewRequest("a", _lists(eng, 65), 0)], [], {"a": 64}))  # vLLM: T = n + lookahead
    assert pipe.build().num_tokens == 64


@pytest.mark.parametrize("name", ["flash_mtp", "pro"])
def test_reference_scheduler_trace_on_the_engine_plan(name):
    """Random trace (chunks, speculative decoding, preemption, prefix hits) on the layout read from vLLM
    0.33's plan: every step passes the count rule and the validator."""
    from dsv4_index.testing.scheduler import random_trace

    lay = DSV4Layout.from_kv_cache_config(fixture(name), name.split("_")[0], 1024)
    pipe = MetadataPipeline(lay, 6, 48, "cpu", 2, backend="reference", validate=True)
    steps = 0
    for step, _ in random_trace(lay, 20, seed=5, num_blocks=300, prompt_len=(1, 300), max_num_batched_tokens=40,
                                max_num_seqs=4, num_speculative_tokens=2, max_new_tokens=(2, 10)):
        pipe.update(step)
        pipe.build()
        steps += 1
    assert steps == 20


def _alloc_steps(eng, alloc):
    """One StepInput per new request of vLLM's own allocations: lists of vLLM's lengths (fresh ids, its
    null blocks as 0 in front), the previous request finished."""
    nxt, prev = 1, None
    for i, c in enumerate(alloc["new_requests"]):
        lists = []
        for n, nulls in zip(c["lens"], c["nulls"]):
            lists.append([0] * nulls + list(range(nxt, nxt + n - nulls)))
            nxt += n - nulls
        rid = f"r{i}"
        yield c, StepInput([NewRequest(rid, tuple(lists), c["num_computed_tokens"])], [],
                           {rid: c["num_scheduled_tokens"]}, finished_req_ids={prev} if prev else set())
        prev = rid


@pytest.mark.parametrize("name", ["flash_mtp", "flash", "pro_mtp", "pro"])
def test_vllm_033_allocations_pass_the_count_rule_and_the_old_order_does_not(name):
    """vLLM 0.33's KVCacheManager's own block lists (fixture): all accepted on the layout of its plan; on the
    old order ``[mla, swa_0, swa_1, ...]`` every request whose tokens (with the lookahead) exceed one 64-token
    SWA block is refused."""
    alloc = fixture(f"alloc_{name}")
    model = name.split("_")[0]
    eng = DSV4Layout.from_kv_cache_config(fixture(name), model, 4096)
    k = alloc["lookahead"]
    right = MetadataPipeline(eng, 4, 2100, "cpu", k, backend="reference")
    for _, step in _alloc_steps(eng, alloc):
        right.update(step)
        right.build()
    by = {g.name: g for g in eng.groups}
    wrong_lay = DSV4Layout.from_config(model, 4096, groups=[dict(role=by[n].role, layers=by[n].layers)
                                                             for n in OUR_OLD_ORDER])
    refused = 0
    for c, step in _alloc_steps(eng, alloc):
        wrong = MetadataPipeline(wrong_lay, 4, 2100, "cpu", k, backend="reference")
        try:
            wrong.update(step)
        except ValueError as e:
            assert "cannot belong" in str(e) or "block ids missing" in str(e)
            refused += 1
        else:
            assert c["num_computed_tokens"] + c["num_scheduled_tokens"] + k <= 64, c
    big = sum(c["num_computed_tokens"] + c["num_scheduled_tokens"] + k > 64 for c in alloc["new_requests"])
    assert refused >= big >= len(alloc["new_requests"]) // 2
