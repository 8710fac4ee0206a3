"""An engine's own kv-cache groups (DESIGN §3 "An engine's own groups", issue #20 item 1): vLLM's plan
(``groups="vllm"``: full MLA, SWA sub-groups of strided layers, C4 state, C128 state), an explicit list
(roles / layer indices or vLLM layer names, block sizes), each SWA sub-group with its own window channel
reading its own table, ``layout.layer_channels(layer)``, and a 5-group trace through the pipeline."""

import pytest
import torch

from dsv4_index import DSV4Layout
from dsv4_index.testing.scheduler import random_trace
from dsv4_index.consumers import prefill_chunks

from dsv4_index.frontend import NewRequest, StepInput

from helpers.pipelines import HAS_TRITON, Pool, compare_over_trace, three_pipelines

FLASH_C4 = tuple(range(2, 43, 2))     # [0, 0] + [4, 128] * 20 + [4, 0]: layers 2, 4, .., 42
FLASH_C128 = tuple(range(3, 42, 2))
PRO_C128 = (0, 1) + tuple(range(3, 60, 2))  # [128, 128] + [4, 128] * 29 + [4, 0]
PRO_C4 = tuple(range(2, 61, 2))


@pytest.mark.parametrize("name,n_layers,c4,c128", [("flash", 44, FLASH_C4, FLASH_C128),
                                                   ("pro", 62, PRO_C4, PRO_C128)])
def test_vllm_plan_of_flash_and_pro(name, n_layers, c4, c128):
    lay = DSV4Layout.from_config(name, 8192, groups="vllm")
    states = ["c4_state", "c128_state"] if name == "flash" else ["c128_state", "c4_state"]  # vLLM 0.33's order
    assert [g.name for g in lay.groups] == ["swa_0", "swa_1", "mla"] + states
    assert [g.role for g in lay.groups] == ["swa", "swa", "mla"] + states
    bs = {"c4_state": (4, 8), "c128_state": (8, 128)}
    assert [(g.block_size, g.window) for g in lay.groups] == \
        [(64, 128), (64, 128), (256, None)] + [bs[s] for s in states]
    swa0, swa1 = lay.groups[0].layers, lay.groups[1].layers
    assert swa0 == tuple(range(0, n_layers, 2)) and swa1 == tuple(range(1, n_layers, 2))  # tuples[i::2]
    assert len(swa0) == len(swa1) == n_layers // 2                                        # 22/22, 31/31
    assert lay.group("c4_state").layers == c4 and lay.group("c128_state").layers == c128
    # each SWA sub-group has its own window channel; the MLA channels share group 2
    assert {n: c.gid for n, c in lay.channels.items()} == {
        "c4a": 2, "c4i": 2, "c128a": 2, "swa_0": 0, "swa_1": 1, **{s: 3 + i for i, s in enumerate(states)}}
    assert lay.channels["swa_1"].role == "swa" and lay.channels["swa_1"].index_width == 128
    # which channels each layer reads
    for layer in range(n_layers):
        want = {"swa": "swa_0" if layer % 2 == 0 else "swa_1"}
        if layer in c4:
            want.update(c4a="c4a", c4i="c4i", c4_state="c4_state")
        if layer in c128:
            want.update(c128a="c128a", c128_state="c128_state")
        assert lay.layer_channels(layer) == want, layer
    # the default layout is unchanged
    default = DSV4Layout.from_config(name, 8192)
    assert [g.name for g in default.groups] == ["mla", "swa", "c4_state", "c128_state"]
    assert default.layer_channels(c4[0]) == {"swa": "swa", "c4a": "c4a", "c4i": "c4i", "c4_state": "c4_state"}


def _vllm_names(layer, ratio):
    """vLLM's per-layer cache names of a DSV4 layer (DeepseekV4KVCachePlanner's naming)."""
    p = f"model.layers.{layer}.self_attn"
    out = {"swa": [f"{p}.swa_cache"]}
    if ratio:
        out["mla"] = [f"{p}.mla_attn"] + ([f"{p}.indexer.k_cache"] if ratio == 4 else [])
        state = "c4_state" if ratio == 4 else "c128_state"
        out[state] = [f"{p}.compressor.state_cache"] + ([f"{p}.indexer.compressor.state_cache"]
                                                         if ratio == 4 else [])
    return out


def test_explicit_groups_by_layer_names_equal_the_vllm_plan():
    plan = DSV4Layout.from_config("flash", 4096, groups="vllm")
    ratios = plan.compress_ratios
    names = {"swa_0": [], "swa_1": [], "mla": [], "c4_state": [], "c128_state": []}
    for layer, r in enumerate(ratios):
        for role, ns in _vllm_names(layer, r).items():
            names[role if role != "swa" else f"swa_{layer % 2}"] += ns
    given = [dict(layer_names=names[k]) for k in names]  # kv_cache_config.kv_cache_groups, in gid order
    lay = DSV4Layout.from_config("flash", 4096, groups=given)
    assert lay.groups == plan.groups and lay.channels == plan.channels
    # by roles and indices, with an engine block size
    lay2 = DSV4Layout.from_config("flash", 4096, groups=[
        dict(role="swa", layers=list(range(0, 44, 2)), block_size=32),
        dict(role="swa", layers=list(range(1, 44, 2))), dict(role="mla"), dict(role="c4_state"),
        dict(role="c128_state")])
    assert [g.block_size for g in lay2.groups] == [32, 64, 256, 4, 8]


@pytest.mark.parametrize("groups,match", [
    ("sglang", "groups must be"),
    ([dict(role="swa", layers=[0, 1]), dict(role="mla"), dict(role="c4_state"), dict(role="c128_state")],
     "have a swa cache but no group"),
    ([dict(role="swa", layers=list(range(43))), dict(role="mla"), dict(role="c4_state"), dict(role="c128_state"),
      dict(role="swa", layers=[0])], "layer 0 is in groups"),
    ([dict(role="mla"), dict(role="mla"), dict(role="swa"), dict(role="c4_state"), dict(role="c128_state")],
     "at most one mla group"),
    ([dict(role="mla"), dict(role="swa", layers=[0, 1]), dict(role="swa", layers=list(range(1, 44))),
      dict(role="c4_state"), dict(role="c128_state")], "layer 1 is in groups"),
    ([dict(role="mla"), dict(role="swa"), dict(role="c4_state", layers=[3]), dict(role="c128_state")],
     "no c4_state cache"),
    ([dict(role="mla"), dict(role="swa")], "no group serves the 'c4_state'"),
    ([dict(role="kv")], "role must be one of"),
    ([dict(role="mla", blocks=4)], "unknown key"),
    ([dict(layer_names=["model.layers.0.self_attn.swa_cache", "model.layers.2.self_attn.compressor.state_cache"])],
     "one group holds one role"),
])
def test_bad_group_lists(groups, match):
    with pytest.raises(ValueError, match=match):
        DSV4Layout.from_config("flash", 4096, groups=groups)


def test_layer_channels_errors_and_consumers_per_layer():
    lay = DSV4Layout.from_config("flash", 4096, groups="vllm")
    with pytest.raises(ValueError, match="layer must be"):
        lay.layer_channels(44)
    from dsv4_index.consumers import swa_channel
    assert swa_channel(lay, "c4", 2) == "swa_0" and swa_channel(lay, "c128", 3) == "swa_1"
    with pytest.raises(ValueError, match="several SWA channels"):
        swa_channel(lay, "swa")
    with pytest.raises(ValueError, match="differs from layer 3"):
        swa_channel(lay, "c4", 3)


def _tiny_vllm():
    return DSV4Layout.from_config("tiny", max_model_len=256, mla_block_size=32, swa_block_size=4,
                                  indexer_causal_indices=True, groups="vllm")


def test_tiny_plan():
    lay = _tiny_vllm()  # tiny: ratios [0, 4, 16, 4, 0]: counts [2, 5, 2, 1] -> d = 2: 3 SWA sub-groups
    assert [(g.name, g.layers) for g in lay.groups] == [
        ("swa_0", (0, 3)), ("swa_1", (1, 4)), ("swa_2", (2,)), ("mla", None), ("c4_state", (1, 3)),
        ("c128_state", (2,))]


def _slot(row, p, bs):
    return row[p // bs] * bs + p % bs


@pytest.mark.parametrize("model,n_groups,n_swa", [("tiny", 6, 3), ("flash", 5, 2)])
@pytest.mark.slow  # ./dev quick skips it
def test_trace_with_one_block_list_per_engine_group(model, n_groups, n_swa):
    """Random trace (chunks, spec decode, preemption, prefix hits) with one block list per engine group
    (5 for V4-Flash): fused == unfused == reference; every SWA channel reads its own group's table
    (slots from the scheduler's view of that group, not another's)."""
    if model == "tiny":
        lay, kw = _tiny_vllm(), dict(num_blocks=64, prompt_len=(1, 90))
    else:
        lay = DSV4Layout.from_config("flash", 2048, groups="vllm")
        kw = dict(num_blocks=200, prompt_len=(1, 300))
    swa = [c for c in lay.channels.values() if c.role == "swa"]
    assert lay.num_groups == n_groups and len(swa) == n_swa and len({c.gid for c in swa}) == n_swa
    trace = list(random_trace(lay, 24, seed=3, max_num_batched_tokens=40, max_num_seqs=4,
                              num_speculative_tokens=2, max_new_tokens=(2, 10), **kw))
    assert all(len(r.block_ids) == n_groups for s, _ in trace for r in s.new_requests)
    if HAS_TRITON:
        pipes = three_pipelines(lay, 6, 48, num_speculative_tokens=2)
    else:
        from dsv4_index import MetadataPipeline
        pipes = {"reference": MetadataPipeline(lay, 6, 48, "cpu", 2, backend="reference", validate=True)}
    differ = 0

    def check(meta):
        nonlocal differ
        views = {v.req_id: v for v in current}
        qsl = meta.query_start_loc.cpu().tolist()
        for c in swa:
            ch = meta[c.name]
            assert ch.block_table.data_ptr() == meta.block_tables[c.gid].data_ptr()
            sm = ch.slot_mapping.cpu().tolist()
            for b, rid in enumerate(meta.req_ids):
                v = views[rid]
                want = [_slot(v.block_ids[c.gid], p, lay.groups[c.gid].block_size) for p in v.positions]
                assert sm[qsl[b]:qsl[b + 1]] == want, (c.name, rid)
                others = [g for g in (x.gid for x in swa) if g != c.gid]
                differ += any(v.block_ids[g] != v.block_ids[c.gid] for g in others)

    current = []

    def steps():
        for step, views in trace:
            current[:] = views
            yield step, views

    seen = compare_over_trace(pipes, steps(), pad=[0, 3], check=check)
    assert seen["steps"] == 24 and seen["prefills"] and seen["decodes"]
    assert differ > 0  # the SWA groups really hold different blocks


def test_consumers_per_layer_on_the_vllm_plan():
    lay = _tiny_vllm()
    from dsv4_index import MetadataPipeline
    pipe = MetadataPipeline(lay, 4, 64, "cpu", 1, backend="reference")
    pool = Pool(lay)
    pipe.update(StepInput([NewRequest("a", pool.blocks(30), 0), NewRequest("b", pool.blocks(20), 0)], [],
                          {"a": 30, "b": 20}))
    meta = pipe.build()
    for layer in range(lay.num_layers):
        kind = lay.layer_kind(layer)
        topk = torch.zeros(meta.num_tokens_padded, 4, dtype=torch.int32) if kind == "c4" else None
        chunks = prefill_chunks(meta, kind, topk, layer=layer)
        sw = meta[lay.layer_channels(layer)["swa"]]
        assert chunks and int(chunks[0].topk_length[-1]) >= int(sw.lens[chunks[0].tok_end - 1])
        args = meta.sparse_decode_args(kind, layer=layer, padded=True) if kind != "c4" else None
        if args is not None:
            assert args["indices"].data_ptr() == sw.indices.data_ptr()
    with pytest.raises(ValueError, match="several SWA channels"):
        prefill_chunks(meta, "swa")
