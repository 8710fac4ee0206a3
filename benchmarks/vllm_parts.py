"""The vLLM side of ``vllm_scheduler_loop.py`` (not a script): vLLM 0.33's KV-cache plan and scheduler
configuration on CPU for the shipped DeepSeek-V4 configs, the script's own replay of every request's block
lists (shared writes, and every output against docs/DESIGN.md §4), the fake model runner and the prompts.
Imports vLLM only inside functions (``--help`` of the script works without it)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import random
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Dict, List, Optional, Tuple

__all__ = ["STOP", "fixture_specs", "v41_specs", "MTPSpec", "model_runner_v2", "vllm_setup", "Owners",
           "check_outputs", "model_output", "prompts"]

ROOT = Path(__file__).resolve().parents[1]  # NOTE: the repository
STOP = 7  # NOTE: the fake model's stop token


def fixture_specs():
    """``_specs`` of ``tests/layout/make_vllm_fixtures.py`` (vLLM's per-layer specs, written once there)."""
    path = ROOT / "tests" / "layout" / "make_vllm_fixtures.py"
    spec = importlib.util.spec_from_file_location("_make_vllm_fixtures", path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod._specs


def v41_specs(cfg: dict, k: int, replay: bool, block_size: int = 64) -> dict:
    """vLLM 0.33's per-layer KV-cache specs of DeepSeek-V4.1 (``cfg``: our shipped ``v41_flash.json``) with
    ``k`` DSpark drafts (``k = 0``: no draft layers), built with vLLM's spec classes and the arguments its
    ``models/deepseek_v41`` modules pass on an H200 (SM90: no MXFP8 records, ``_use_v41_mxfp8_kv_record``
    attention.py:137; ``--kv-cache-dtype auto`` resolves to ``fp8_ds_mla``, attention.py:159-161), in the order
    they register their layers (attention.py:432-599: the attention layer, its indexer K cache, its SWA cache,
    its compressor's state). Only ``kv_source_layer_ids`` own a compressed cache and a compressor state
    (attention.py:343, :446, :588), and only ``index_source_layer_ids`` among them an indexer K cache.
    ``block_size``: ``cache_config.block_size``, 64 on SM90 (the smallest size every V4.1 backend takes,
    platforms/interface.py:700: FlashMLA sparse sparse_mla.py:115-116 and the V4.1 indexer
    v1/attention/backends/mla/indexer.py:366-367 want 64 on SM90, the SWA cache a multiple of 32, the compressor
    any). ``replay``: ``SlidingWindowMLASpec.bounded_replay`` of the SWA caches (attention.py:538-579)."""
    import torch
    from vllm.v1.kv_cache_interface import (CircularBufferSpec, MLAAttentionSpec, SlidingWindowMLASpec,
                                            get_kv_quant_mode)

    ratios = cfg["compress_ratios"] if k else cfg["compress_ratios"][: cfg["num_hidden_layers"]]
    hidden, dtype, quant = cfg["num_hidden_layers"], "fp8_ds_mla", get_kv_quant_mode("fp8_ds_mla")
    ring = max(8, 1 << (k + 1).bit_length())  # NOTE: compressor.py:219-221, max(8, pow2(k + 2))
    specs = {}
    for i, r in enumerate(ratios):
        p = f"model.layers.{i}.attn"  # NOTE: nvidia/model.py:352
        source = i < hidden and i in cfg["kv_source_layer_ids"]
        if source:  # NOTE: DeepseekV4Attention.get_kv_cache_spec, attention.py:1206-1235
            specs[p] = MLAAttentionSpec(
                block_size=block_size, num_kv_heads=1, head_size=512, dtype=torch.uint8, tokens_per_state=r,
                cache_dtype_str=dtype, alignment=576, model_version="deepseek_v4", kv_quant_mode=quant,
                state_content_bytes=584)
        if source and i in cfg["index_source_layer_ids"]:  # NOTE: DeepseekV4IndexerCache, attention.py:1274-1308
            specs[f"{p}.indexer.k_cache"] = MLAAttentionSpec(  # NOTE: head 128 fp8 + 4 fp32 scale bytes (:109)
                block_size=block_size, num_kv_heads=1, head_size=132, dtype=torch.uint8, tokens_per_state=r,
                alignment=576, block_stride_alignment=None)  # NOTE: indexer_sparse_logits defaults to False
        specs[f"{p}.swa_cache"] = SlidingWindowMLASpec(  # NOTE: DeepseekV4SWACache (block 32, attention.py:562-580;
            bounded_replay=replay, block_size=32, num_kv_heads=1, max_tp_shards=1, head_size=512,  # spec:
            dtype=torch.uint8, sliding_window=cfg["sliding_window"], cache_dtype_str=dtype,  # sparse_swa.py:120-147)
            state_content_bytes=584, alignment=576, block_stride_alignment=None, model_version="deepseek_v4",
            kv_quant_mode=quant)
        if source and r > 1:  # NOTE: CompressorStateCache.get_kv_cache_spec, compressor.py:229-236
            specs[f"{p}.compressor.state_cache"] = CircularBufferSpec(
                block_size=ring, num_kv_heads=1, head_size=2 * 512, head_size_v=0, dtype=torch.float32)
    # NOTE: the draft (DSpark / MTP) layers' specs are tagged is_draft, as model runner V2 does
    # (v1/worker/gpu/attn_utils.py:150-151: `replace(spec, is_draft=True)` for a module's is_draft_layer)
    return {n: dataclasses.replace(s, is_draft=True) if int(n.split(".")[2]) >= hidden else s
            for n, s in specs.items()}


class MTPSpec:
    """vLLM's ``SpeculativeConfig`` for MTP (DSpark for V4.1: ``method="dspark"``, its anchor-sampling
    drafts) as the scheduler reads it: these fields, every method and property vLLM's own (looked up on its
    class)."""

    def __init__(self, k: int, method: str = "mtp"):
        self.method, self.num_speculative_tokens = method, k
        self.num_speculative_tokens_per_batch_size = None
        self.disable_eagle_block_drop = False
        self.disable_lookahead_block_hashes = False
        self.parallel_drafting = False
        self.draft_model_config = NS(hf_config=NS(num_nextn_predict_layers=1))

    def __getattr__(self, name: str):
        from vllm.config import SpeculativeConfig
        attr = getattr(SpeculativeConfig, name)
        if isinstance(attr, property):
            return attr.fget(self)  # type: ignore[misc]
        return attr.__get__(self) if callable(attr) else attr


@contextlib.contextmanager
def model_runner_v2(on: bool):
    """``VLLM_USE_V2_MODEL_RUNNER=1`` while the scheduler reads ``VllmConfig.use_v2_model_runner`` (its
    ``__init__``: v1/core/sched/scheduler.py:320, :387), when ``on``. The env var wins over vLLM's own choice
    (config/vllm.py:748-750), which picks runner V1 on a host without Triton (:752-756). On the H200 V4.1 runs on
    runner V2: DSpark is V2-only (:3111-3113) and so is SWA bounded replay (models/deepseek_v41/attention.py:
    538-545). With it the scheduler sends a resumed request as a new one (scheduler.py:1642-1653)."""
    import os
    old = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if on:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    try:
        yield
    finally:
        if on and old is None:
            os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
        elif on:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = old  # type: ignore[assignment]


def vllm_setup(name: str, k: int, num_blocks: int, max_model_len: int, max_tokens: int, max_seqs: int,
               replay: bool = True):
    """(vllm_config, kv_cache_config, scheduler_block, hash_block, model config dict) for config ``name`` with
    ``k`` MTP drafts (``k = 0``: no MTP layer, no speculative decoding). ``name="v41"``: DeepSeek-V4.1-Flash
    (:func:`v41_specs`, DSpark drafts, ``replay``: SWA bounded replay)."""
    from vllm.config import CacheConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, resolve_kv_cache_block_sizes
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.kv_cache_layout import KVCacheLayout

    v41 = name == "v41"
    cfg = json.loads((ROOT / "dsv4_index" / "configs" / f"{'v41_flash' if v41 else name}.json").read_text())
    ratios = cfg["compress_ratios"] if k else cfg["compress_ratios"][: cfg["num_hidden_layers"]]
    plan_cfg = NS(scheduler_config=NS(disable_hybrid_kv_cache_manager=False),
                  cache_config=NS(get_resolved_kv_cache_layout=lambda: KVCacheLayout.BLHNC),
                  attention_config=None, speculative_config=None)
    specs = v41_specs(cfg, k, replay) if v41 else fixture_specs()(ratios, cfg["sliding_window"])
    groups = get_kv_cache_groups(plan_cfg, specs)
    kcc = generate_scheduler_kv_cache_config([KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                                            kv_cache_groups=groups)])
    vc = VllmConfig()
    vc.scheduler_config = SchedulerConfig(max_num_batched_tokens=max_tokens, max_num_seqs=max_seqs,
                                          max_model_len=max_model_len, enable_chunked_prefill=True,
                                          is_encoder_decoder=False)
    cc = CacheConfig(block_size=64 if v41 else min(g.kv_cache_spec.block_size for g in groups
                                                   if g.kv_cache_spec.prefix_cacheable), enable_prefix_caching=True)
    cc.num_gpu_blocks = num_blocks
    vc.cache_config = cc
    object.__setattr__(vc, "model_config", NS(
        uses_mrope=False, is_encoder_decoder=False, max_model_len=max_model_len, runner_type="generate",
        is_diffusion=False, supports_multimodal_inputs=False, multimodal_config=None, skip_tokenizer_init=True,
        architectures=["DeepseekV41ForCausalLM" if v41 else "DeepseekV4ForCausalLM"],
        original_max_model_len=max_model_len, return_sampling_mask=False, hf_config=NS(**cfg)))
    object.__setattr__(vc, "speculative_config", MTPSpec(k, "dspark" if v41 else "mtp") if k else None)
    sched_block, hash_block = resolve_kv_cache_block_sizes(kcc, vc)
    return vc, kcc, sched_block, hash_block, cfg


class Owners:
    """The script's own count of writes into blocks another live request holds: every request's block
    lists replayed from the SchedulerOutputs (new requests: ``block_ids``; running: ``new_block_ids``
    appended; resumed: replaced), checked against vLLM's ``KVCacheManager.get_block_ids`` (equal, except
    that vLLM has put the null block where a sliding group released a block behind the window)."""

    def __init__(self, block_sizes: List[int], circular: List[bool], full: Optional[List[bool]] = None):
        self.bs, self.circular, self.full = block_sizes, circular, full or [False] * len(block_sizes)
        self.lists: Dict[str, List[List[int]]] = {}

    def apply(self, so) -> None:
        """Replay one SchedulerOutput's block lists."""
        for rid in list(so.finished_req_ids) + list(so.preempted_req_ids or ()):
            self.lists.pop(rid, None)
        c = so.scheduled_cached_reqs
        for rid, nb in zip(c.req_ids, c.new_block_ids):
            if rid in c.resumed_req_ids:
                self.lists[rid] = [list(x) for x in nb]
            elif nb is not None:
                for g, ids in enumerate(nb):
                    self.lists[rid][g].extend(ids)
        for r in so.scheduled_new_reqs:
            self.lists[r.req_id] = [list(x) for x in r.block_ids]

    def sync(self, block_ids_of) -> None:
        """Check the replayed lists against vLLM's (``block_ids_of(rid)``) and take its released blocks."""
        for rid, lists in self.lists.items():
            theirs = [list(x) for x in block_ids_of(rid)]
            for g, (mine, real) in enumerate(zip(lists, theirs, strict=True)):
                if len(mine) != len(real) or any(r and r != m for m, r in zip(mine, real)):
                    raise AssertionError(f"request {rid!r} gid {g}: replayed {mine} != vLLM's {real}")
            self.lists[rid] = theirs

    def shared_writes(self, so, replay_end: Optional[Dict[str, int]] = None) -> Tuple[int, int]:
        """``(blocks, tokens)``: the (request, group, block) writes of ``so`` into a block another live request
        holds, and the (token, group) writes among them (circular groups: a fixed ring per request, never
        shared, not counted; ``replay_end``: a replaying request writes no full group below it)."""
        replay_end = replay_end or {}
        holders: List[Dict[int, int]] = [{} for _ in self.bs]
        for lists in self.lists.values():
            for g, ids in enumerate(lists):
                for b in ids:
                    holders[g][b] = holders[g].get(b, 0) + 1
        c = so.scheduled_cached_reqs
        nc = dict(zip(c.req_ids, c.num_computed_tokens))
        nc.update({r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs})
        blocks = tokens = 0
        for rid, n in so.num_scheduled_tokens.items():
            lo, hi = nc[rid], nc[rid] + n
            for g, ids in enumerate(self.lists[rid]):
                bs, lo = self.bs[g], max(nc[rid], replay_end.get(rid, 0)) if self.full[g] else nc[rid]
                if self.circular[g] or lo >= hi:
                    continue
                for j in range(lo // bs, (hi - 1) // bs + 1):
                    if j < len(ids) and ids[j] and holders[g].get(ids[j], 0) > 1:
                        blocks += 1
                        tokens += min(hi, (j + 1) * bs) - max(lo, j * bs)
        return blocks, tokens


def _slots(bt, x, unit: int):
    """DESIGN §4 ``slot``: ``bt[x // unit] * unit + x % unit`` (``bt`` a block list, ``x`` int64 positions)."""
    return bt[x // unit] * unit + x % unit


def check_outputs(meta, layout, lists: Dict[str, List[List[int]]], req_ids,
                  replay: Optional[Dict[str, Tuple[int, int]]] = None) -> Tuple[int, List[str]]:
    """The step's outputs against docs/DESIGN.md §4 computed from the replayed block lists (vLLM's): per
    channel and valid token, the raw slot (``slot_mapping``), the compressed slot (``compressed_slot_mapping``:
    row ``pos // R`` when ``(pos + 1) % R == 0``), the window list (``indices`` / ``lens`` of a windowed
    channel: positions ``[max(pos - W + 1, floor), pos]``), the causal compressed list (``c128a``) and the
    indexer lengths (``c4i``: ``(pos + 1) // R``). Circular groups (§4 "circular group", one block of
    ``capacity`` rows): ``bt[0] * capacity + pos % capacity``, the write plan ``tail_slot_mapping`` (the last
    ``capacity`` tokens of the request's chunk) and window entries ``-2 - row`` for positions in the step.
    ``replay``: ``{req_id: (replay_start, replay_end)}`` (§4 "bounded replay": ``floor = replay_start``, no
    write into the full group below ``replay_end``). Returns (tokens checked, the first differences)."""
    import numpy as np

    T, replay = meta.num_tokens, replay or {}
    pos = meta.positions[:T].cpu().numpy().astype(np.int64)
    row = meta.token_to_req[:T].cpu().numpy().astype(np.int64)
    bad: List[str] = []
    for name, spec in layout.channels.items():
        grp = layout.groups[spec.gid]
        ch, bs, R, cap = meta[name], grp.block_size, spec.compress_ratio, grp.ring_capacity if grp.kind == \
            "circular" else None
        got = {k: None if getattr(ch, k, None) is None else getattr(ch, k)[:T].cpu().numpy().astype(np.int64)
               for k in ("slot_mapping", "tail_slot_mapping", "compressed_slot_mapping", "indices", "lens")}
        for b, rid in enumerate(req_ids):
            sel = np.flatnonzero(row == b)
            p, bt = pos[sel], np.asarray(lists[rid][spec.gid], dtype=np.int64)
            floor, end = replay.get(rid, (0, 0))
            want = _expected(got, spec, p, bt, bs, R, cap, floor, end, int(sel[0]) if sel.size else 0, grp.role)
            for k, w in want.items():
                g = got[k][sel]
                if not np.array_equal(g, w):
                    t = int(np.flatnonzero((g != w).reshape(len(sel), -1).any(1))[0])
                    bad.append(f"{name}.{k} of request {rid!r} at position {int(p[t])}: {g[t].tolist()} != "
                               f"DESIGN §4 {w[t].tolist()}")
                    break
    return T, bad


def _expected(got, spec, p, bt, bs: int, R: int, cap, floor: int, end: int, row0: int, role) -> dict:
    """DESIGN §4 for one channel and one request's tokens ``p`` (:func:`check_outputs`): the outputs the
    channel has (``got``), ``row0`` the request's first token row of the step."""
    import numpy as np

    def slot(x):
        return bt[0] * cap + x % cap if cap else _slots(bt, x, bs)

    want: Dict[str, np.ndarray] = {}
    if got["slot_mapping"] is not None:
        want["slot_mapping"] = slot(p)
    if got["tail_slot_mapping"] is not None:
        want["tail_slot_mapping"] = np.where(p > p.max() - cap, slot(p), -1)
    if got["compressed_slot_mapping"] is not None:
        done = ((p + 1) % R == 0) & ((p >= end) | (role != "mla"))
        want["compressed_slot_mapping"] = np.where(done, _slots(bt, np.where(done, p // R, 0), bs // R), -1)
    if got["indices"] is not None:
        lo = np.maximum(p - spec.window + 1, floor) if spec.window else np.zeros_like(p)
        n = p - lo + 1 if spec.window else (p + 1) // R
        j = np.arange(got["indices"].shape[1])[None, :]
        x = (lo[:, None] + j) if spec.window else np.broadcast_to(j, (p.size, j.shape[1]))
        ok, xs = j < n[:, None], np.where(j < n[:, None], x, 0)
        if cap:  # NOTE: positions of this step are in-step rows, -2 - row
            vals = np.where(xs >= p.min(), -2 - (row0 + xs - p.min()), slot(xs))
        else:
            vals = _slots(bt, xs, bs if spec.window else bs // R)
        want["indices"], want["lens"] = np.where(ok, vals, -1), n
    elif got["lens"] is not None:  # NOTE: the indexer's visible compressed rows (c4i)
        want["lens"] = (p + 1) // R
    return want


def model_output(sched, so, rng: random.Random, accept: float, stop: float, k: int, late: bool = False):
    """The fake runner: sampled tokens per scheduled request, and its drafts for the next step. ``late``: the
    output of a step the scheduler has already scheduled past (async scheduling): a chunk is a partial prefill
    when it ends before the prompt's end."""
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

    c = so.scheduled_cached_reqs
    end = {rid: nc + so.num_scheduled_tokens[rid] for rid, nc in zip(c.req_ids, c.num_computed_tokens)}
    end.update({r.req_id: r.num_computed_tokens + so.num_scheduled_tokens[r.req_id] for r in so.scheduled_new_reqs})
    ids, sampled, drafted, drafts, rejected = [], [], [], [], 0
    for rid in so.num_scheduled_tokens:
        req = sched.requests.get(rid)
        ids.append(rid)
        spec = so.scheduled_spec_decode_tokens.get(rid, [])
        if req is None or (end[rid] < req.num_prompt_tokens if late else req.num_computed_tokens < req.num_tokens):
            sampled.append([])  # a prefill chunk that does not end the prompt samples nothing
            continue
        a = 0
        while a < len(spec) and rng.random() < accept:
            a += 1
        rejected += len(spec) - a
        toks = [rng.randrange(100, 1000) for _ in range(a + 1)]
        if rng.random() < stop:
            toks[-1] = STOP
        sampled.append(toks)
        drafted.append(rid)
        drafts.append([rng.randrange(100, 1000) for _ in range(k)])
    out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                            sampled_token_ids=sampled)
    return out, DraftTokenIds(drafted, drafts) if k else None, rejected


def prompts(rng: random.Random, n: int, shared: int, max_prompt: int, burst: int) -> List[List[int]]:
    """``n`` prompts, ``burst`` at a time sharing a prefix, each with a random tail: one of ``shared`` prefixes
    (80 % of the bursts; prefix-cache hits on blocks written before), or with ``shared = 0`` a fresh one per
    burst (its requests hit the blocks the first one fills in the same step)."""
    def fresh() -> List[int]:
        return [rng.randrange(100, 1000) for _ in range(max_prompt)]
    prefixes = [fresh() for _ in range(shared)]
    out: List[List[int]] = []
    while len(out) < n:
        prefix = (rng.choice(prefixes) if shared else fresh()) if rng.random() < 0.8 else []
        for _ in range(burst):
            head = prefix[: rng.randrange(max_prompt // 4, max_prompt)]
            out.append(head + [rng.randrange(100, 1000) for _ in range(rng.randrange(1, max_prompt // 2))])
    return out[:n]
