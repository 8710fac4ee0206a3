"""DeepSeek-V4.1 end to end (issue 28): the shipped config through ``from_config``, and every channel of
a V4.1 layout (ratio-1 and ratio-2 compressed channels, their indexers, the C2 compressor-state ring, one
sliding group per layer, bounded replay carried by the scheduler) equal across the reference, the per-op
Triton path and the one fused launch (outputs poisoned before each build) AND equal to the DESIGN §4
formulas written here, from the scheduler's own block ids (id-keyed, independent of the library)."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4_index import DSV4Layout, MetadataPipeline
from dsv4_index.config import shipped_config
from dsv4_index.specs import ratio_kinds
from dsv4_index.testing.scheduler import ReferenceScheduler

from helpers.pipelines import HAS_TRITON, compare_step

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


# ----------------------------------------------------------------------------------------------
# the shipped config and its layout
# ----------------------------------------------------------------------------------------------
def test_shipped_v41_flash_layout():
    cfg = shipped_config("v41_flash")
    assert cfg["compress_ratios"] == [0, 0] + [2] * 18 + [1] * 20 + [0] * 3
    lay = DSV4Layout.from_config("v41_flash", max_model_len=8192)
    assert [g.name for g in lay.groups] == ["mla", "swa", "c2_state"]
    ch = {n: (c.gid, c.compress_ratio, c.rows_per_block, c.role) for n, c in lay.channels.items()}
    assert ch == {"c1a": (0, 1, 256, "c4a"), "c1i": (0, 1, 256, "c4i"), "c2a": (0, 2, 128, "c4a"),
                  "c2i": (0, 2, 128, "c4i"), "swa": (1, 1, 64, "swa"), "c2_state": (2, 1, 8, "c4_state")}
    st_ = lay.group("c2_state")
    assert (st_.kind, st_.block_size, st_.ring_capacity, st_.window, st_.ring_blocks) == ("circular", 8, 8, 4, 1)
    assert lay.index_topk == 512 and lay.sliding_window == 128 and lay.num_layers == 43
    assert lay.layer_channels(0) == {"swa": "swa"}
    assert lay.layer_channels(5) == {"swa": "swa", "c4a": "c2a", "c4i": "c2i", "c4_state": "c2_state"}
    assert lay.layer_channels(30) == {"swa": "swa", "c4a": "c1a", "c4i": "c1i"}   # ratio 1: no state
    assert lay.layer_channels(41) == {"swa": "swa"}                                 # a DSpark layer
    assert {lay.layer_kind(i) for i in range(2, 40)} == {"c4"}
    # with 3 draft tokens vLLM's state ring is pow2(3 + 2) = 8 rows, with 7: 16
    assert DSV4Layout.from_config("v41_flash", 8192, circular={"c2_state": 16}).group("c2_state").block_size == 16


def test_kv_source_is_the_nearest_source_at_or_below():
    """``kv_source(layer)``: the layer whose compressed cache a V4.1 layer reads (vLLM's ``kv_source_layer_id``,
    written out here from the shipped config); V4 layers read their own; SWA-only layers none. The sources
    survive a trace's layout JSON."""
    from dsv4_index.tools.trace import layout_from_json, layout_to_json
    cfg = shipped_config("v41_flash")
    src = cfg["kv_source_layer_ids"]
    lay = DSV4Layout.from_config("v41_flash", max_model_len=8192)
    assert lay.kv_sources == tuple(src) and len(src) >= 2
    for i, r in enumerate(cfg["compress_ratios"]):
        want = None if r == 0 else max(s for s in src if s <= i)
        assert lay.kv_source(i) == want, i
    assert lay.kv_source(src[1]) == src[1] and lay.kv_source(src[1] + 1) == src[1]
    assert layout_from_json(layout_to_json(lay)) == lay
    v4 = DSV4Layout.from_config("flash", max_model_len=8192)
    assert v4.kv_sources == () and v4.kv_source(2) == 2 and v4.kv_source(0) is None
    with pytest.raises(ValueError, match="layer"):
        lay.kv_source(lay.num_layers)


def test_one_sliding_group_per_layer():
    lay = DSV4Layout.from_config("v41_flash", max_model_len=8192, swa_group_per_layer=True)
    names = [g.name for g in lay.groups]
    assert names == ["mla"] + [f"swa_{i}" for i in range(43)] + ["c2_state"]
    assert all(lay.group(f"swa_{i}").layers == (i,) for i in range(43))
    assert [lay.layer_channels(i)["swa"] for i in range(43)] == [f"swa_{i}" for i in range(43)]
    with pytest.raises(ValueError, match="swa_group_per_layer=True builds the default plan"):
        DSV4Layout.from_config("v41_flash", 8192, swa_group_per_layer=True, groups="vllm")


@pytest.mark.skipif(not HAS_TRITON, reason="the fused launch needs Triton (CUDA or TRITON_INTERPRET=1)")
def test_dozens_of_sliding_groups_stay_one_launch(device):
    lay = DSV4Layout.from_config("v41_flash", max_model_len=4096, swa_group_per_layer=True)
    pipe = MetadataPipeline(lay, 4, 64, device, 1, fused=True, backend="triton")
    assert lay.num_groups == 45 and pipe.num_launches == 1


def test_ratio_kinds_families():
    v4 = ratio_kinds([0, 4, 128, 4])
    assert [(k.ratio, k.kind, k.main, k.indexer, k.state) for k in v4] == \
        [(4, "c4", "c4a", "c4i", "c4_state"), (128, "c128", "c128a", None, "c128_state")]
    assert [k.main for k in ratio_kinds([0, 4, 16])] == ["c4a", "c128a"]           # V4: names by kind
    mix = ratio_kinds([0, 1, 2, 4, 128])                                            # V4.1 family: by ratio
    assert [(k.main, k.indexer, k.state, k.state_window) for k in mix] == \
        [("c1a", "c1i", None, 2), ("c2a", "c2i", "c2_state", 4), ("c4a", "c4i", "c4_state", 8),
         ("c128a", None, "c128_state", 128)]
    lay = DSV4Layout.from_config(dict(num_hidden_layers=5, sliding_window=16, index_topk=8,
                                      compress_ratios=[0, 1, 2, 4, 128]), 1024)
    assert sorted(lay.channels) == sorted(["c1a", "c1i", "c2a", "c2i", "c4a", "c4i", "c128a", "swa", "c2_state",
                                           "c4_state", "c128_state"])
    assert lay.layer_channels(4) == {"swa": "swa", "c128a": "c128a", "c128_state": "c128_state"}


# ----------------------------------------------------------------------------------------------
# a V4.1 trace: every output against DESIGN §4, written here
# ----------------------------------------------------------------------------------------------
def _slot(ids, p, bs):
    return ids[p // bs] * bs + p % bs


def _expected(meta, views, lay):
    """Every channel's outputs from the scheduler's block ids (logical order), per DESIGN §4."""
    Tp = meta.num_tokens_padded
    qsl = meta.query_start_loc.cpu().tolist()
    by_id = {v.req_id: v for v in views}
    exp = {}
    rows = [(b, by_id[rid]) for b, rid in enumerate(meta.req_ids)]
    for name, c in lay.channels.items():
        g = lay.groups[c.gid]
        R, S, bs = c.compress_ratio, c.rows_per_block, g.block_size
        out = {}
        if c.role in ("swa", "c4_state", "c128_state"):
            W, cap = c.window, g.ring_capacity
            sm, tail = [-1] * Tp, [-1] * Tp
            idx, lens = [[-1] * W for _ in range(Tp)], [0] * Tp
            for b, v in rows:
                ids, s, q = v.block_ids[g.gid], v.num_computed_tokens, v.num_scheduled_tokens
                for j in range(q):
                    t, p = qsl[b] + j, s + j
                    lo = max(p - W + 1, v.replay_start, 0)
                    if g.kind == "circular":
                        sm[t] = ids[0] * cap + p % cap
                        tail[t] = sm[t] if p >= s + q - cap else -1
                        row = [ids[0] * cap + x % cap if x < s else -2 - (qsl[b] + x - s) for x in range(lo, p + 1)]
                    else:
                        sm[t] = _slot(ids, p, bs)
                        row = [_slot(ids, x, bs) for x in range(lo, p + 1)]
                    idx[t], lens[t] = row + [-1] * (W - len(row)), len(row)
            out = dict(slot_mapping=sm, indices=idx, lens=lens)
            if g.kind == "circular":
                out["tail_slot_mapping"] = tail
        else:
            cm = [-1] * Tp
            n_c = [0] * Tp
            ks, ke = [0] * Tp, [0] * Tp
            width = c.index_width or 0
            causal = [[-1] * width for _ in range(Tp)]
            cu = 0
            for b, v in rows:
                ids, s, q = v.block_ids[g.gid], v.num_computed_tokens, v.num_scheduled_tokens
                for j in range(q):
                    t, p = qsl[b] + j, s + j
                    if (p + 1) % R == 0 and p >= v.replay_end:   # full group: replayed rows are not written
                        cm[t] = _slot(ids, p // R, S)
                    n_c[t] = (p + 1) // R
                    ks[t], ke[t] = cu, cu + n_c[t]
                    if width:
                        causal[t] = [_slot(ids, x, S) for x in range(n_c[t])] + [-1] * (width - n_c[t])
                cu += (s + q) // R
            out = dict(compressed_slot_mapping=cm)
            if c.role == "c4i":
                out.update(lens=n_c, ks=ks, ke=ke)
            if c.role == "c128a":
                out.update(lens=n_c)
            if width:
                out["indices"] = causal
        exp[name] = out
    return exp


def _run_trace(lay, device, steps, seed, budget=96):
    pipes = {"reference": MetadataPipeline(lay, 4, budget, device, 3, backend="reference", validate=True)}
    if HAS_TRITON:
        pipes["triton"] = MetadataPipeline(lay, 4, budget, device, 3, fused=False, backend="triton", validate=True)
        pipes["fused"] = MetadataPipeline(lay, 4, budget, device, 3, fused=True, backend="triton", validate=True)
        assert pipes["fused"].num_launches == 1
    sched = ReferenceScheduler(lay, 900, max_num_batched_tokens=budget, max_num_seqs=4, num_speculative_tokens=3,
                               seed=seed)
    seen = dict(replays=0, long=0, tokens=0)
    for i, (step, views) in enumerate(sched.random_trace(steps, seed, arrival_prob=0.6, prompt_len=(10, 200),
                                                         max_new_tokens=(2, 8))):
        meta, _ = compare_step(pipes, step, pad_to=min(budget, step.total_tokens + 3), tag=i)
        for name, fields in _expected(meta, views, lay).items():
            for f, want in fields.items():
                assert getattr(meta[name], f).cpu().tolist() == want, (i, name, f)
        seen["replays"] += sum(v.replay_start > 0 for v in views)
        seen["long"] = max([seen["long"]] + [v.num_scheduled_tokens for v in views])
        seen["tokens"] += meta.num_tokens
    return seen


@pytest.mark.slow  # pipeline traces in the interpreter
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), per_layer=st.booleans())
def test_v41_trace_equals_design_formulas(device, seed, per_layer):
    lay = DSV4Layout.from_config("tiny_v41", max_model_len=512, mla_block_size=16, swa_block_size=8,
                                 indexer_causal_indices=True, swa_group_per_layer=per_layer)
    assert {"c1a", "c1i", "c2a", "c2i", "c2_state"} <= set(lay.channels)
    seen = _run_trace(lay, device, 8, seed)
    assert seen["long"] > lay.group("c2_state").ring_capacity      # chunks longer than the state ring ran


MIXED = dict(num_hidden_layers=6, num_nextn_predict_layers=1, sliding_window=8, index_topk=4,
             compress_ratios=[0, 1, 2, 4, 16, 2, 0])


@pytest.mark.slow
def test_mixed_ratios_trace(device):
    # R in {1, 2, 4, 16} in one layout: c1a/c1i, c2a/c2i + c2_state ring, c4a/c4i + c4_state, c16a + c16_state
    # NOTE: the c16 ring sized for 3 speculative tokens (capacity >= W - 1 + 3 = 18; the default is 16)
    lay = DSV4Layout.from_config(MIXED, max_model_len=512, mla_block_size=16, swa_block_size=8,
                                 indexer_causal_indices=True, circular={"c16_state": 32})
    assert {"c1a", "c1i", "c2a", "c2i", "c2_state", "c4a", "c4i", "c4_state", "c16a", "c16_state"} <= set(lay.channels)
    assert lay.layer_channels(4) == {"swa": "swa", "c128a": "c16a", "c128_state": "c16_state"}
    _run_trace(lay, device, 6, 3)


@pytest.mark.slow
def test_v41_trace_with_prefix_hits_replays(device):
    # a fixed seed that hits prefixes: bounded replay (replay_start > 0) is exercised and checked
    lay = DSV4Layout.from_config("tiny_v41", max_model_len=512, mla_block_size=16, swa_block_size=8,
                                 indexer_causal_indices=True, swa_group_per_layer=True)
    seen = _run_trace(lay, device, 10, 1)
    assert seen["replays"] > 0, seen


def test_engine_groups_by_layer_names():
    # an engine's own plan in vLLM's layer names: one sliding group per layer, the mla caches, the C2 state
    names = [f"model.layers.{i}.attn.swa_cache" for i in range(6)]
    groups = [{"layer_names": [n]} for n in names] + [
        {"layer_names": [f"model.layers.{i}.attn.kv_cache" for i in (1, 2, 3, 4)]},
        {"layer_names": [f"model.layers.{i}.attn.compressor.state_cache" for i in (1, 2)]
         + [f"model.layers.{i}.attn.indexer.compressor.state_cache" for i in (1, 2)]}]
    lay = DSV4Layout.from_config("tiny_v41", 512, mla_block_size=16, groups=groups)
    assert [(g.name, g.role, g.kind) for g in lay.groups][5:] == \
        [("swa_5", "swa", "sliding"), ("mla", "mla", "full"), ("c2_state", "c2_state", "circular")]
    assert lay.layer_channels(2) == {"swa": "swa_2", "c4a": "c2a", "c4i": "c2i", "c4_state": "c2_state"}
    assert lay.layer_channels(3) == {"swa": "swa_3", "c4a": "c1a", "c4i": "c1i"}
    bad = groups[:-1] + [{"layer_names": ["model.layers.3.attn.compressor.state_cache"]}]
    with pytest.raises(ValueError, match=r"layer 3 \(ratio 1\) has none"):
        DSV4Layout.from_config("tiny_v41", 512, mla_block_size=16, groups=bad)


@pytest.mark.slow  # NOTE: among the heaviest of the quick subset (./dev quick: about a minute); CI runs it
def test_trace_record_and_replay(tmp_path):
    from dsv4_index.testing.scheduler import scripted_trace
    from dsv4_index.tools.replay import replay_trace
    from dsv4_index.tools.trace import record_steps

    lay = DSV4Layout.from_config("tiny_v41", 256, mla_block_size=16, swa_group_per_layer=True)
    pipe = MetadataPipeline(lay, 4, 64, "cpu", 1, backend="reference")
    sched = ReferenceScheduler(lay, 300, max_num_batched_tokens=64, max_num_seqs=4, num_speculative_tokens=1)
    script = [{"add": [dict(req_id="a", prompt_len=60, max_new_tokens=4)]},
              {"add": [dict(req_id="b", prompt_len=50, max_new_tokens=3)]}, {"accept": {"a": 1}}, {}, {}]
    path = tmp_path / "v41.jsonl"
    with record_steps(pipe, path):
        for step, _ in scripted_trace(sched, script):
            pipe.update(step)
            pipe.build()
    res = replay_trace(path, device="cpu")
    assert res.ok and res.num_steps == len(script), res.report()
