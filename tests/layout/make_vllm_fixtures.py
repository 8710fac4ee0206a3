"""Regenerate ``tests/layout/fixtures/vllm033_*.json`` (vLLM 0.33.x) or ``vllm034_*.json`` (0.34.x: the file
prefix follows the vLLM that runs it; 0.34.0's were written with ``PYTHONPATH`` at a ``pip install --no-deps
--target DIR vllm==0.34.0`` beside the 0.33 environment): vLLM's own KV-cache grouping
(``vllm.v1.core.kv_cache_planning.get_kv_cache_groups``) run on CPU for DeepSeek-V4 Flash and Pro, with
and without the MTP layer, and for DeepSeek-V4.1-Flash with 0 and 3 DSpark drafts (:func:`plan_v41`).

Not a test (needs vLLM, which the suite does not): run it with a venv that has ``vllm==0.33.0``
installed (``VLLM_TARGET_DEVICE=cpu pip install --no-deps vllm==0.33.0`` plus its light deps)::

    /work/venv-vllm/bin/python tests/layout/make_vllm_fixtures.py

It also writes ``vllm033_alloc_*.json``: the block-list lengths vLLM 0.33's own ``KVCacheManager`` hands
out on that plan (``generate_scheduler_kv_cache_config``, prefix caching on, ``get_computed_blocks`` then
``allocate_slots`` with the MTP lookahead) for 24 new requests (random prompts, some sharing a prefix, chunks
of 64 / 300 / 2048 tokens): per request ``num_computed_tokens``, ``num_scheduled_tokens``, the list length and
the null blocks per group. The suite feeds lists of those lengths to a pipeline on the same plan.

The per-layer specs are built with vLLM's own spec classes and the arguments its DeepSeek-V4 modules
pass (``models/deepseek_v4/attention.py``: ``DeepseekV4Attention.get_kv_cache_spec``,
``DeepseekV4IndexerCache.get_kv_cache_spec``; ``compressor.py``: ``CompressorStateCache``;
``v1/attention/backends/mla/sparse_swa.py``: ``DeepseekV4SWACache``), in the order those modules
register their layers (per layer: indexer K cache, indexer compressor state, SWA cache, the attention
layer, its compressor state), with the ``fp8_ds_mla`` cache dtype and the block-outermost ``BLHNC``
layout that mixed-shape specs resolve to. The config objects are stand-ins holding only the fields the
grouping reads; the grouping itself is vLLM's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import torch

ROOT = Path(__file__).resolve().parents[2]


def _specs(ratios, window, block_size=256):
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

    specs = {}
    for i, r in enumerate(ratios):
        p = f"model.layers.{i}.self_attn"
        if r == 4:  # indexer (only C4 layers): K cache (128 fp8 + 4 fp32 scale bytes), then its compressor
            specs[f"{p}.indexer.k_cache"] = MLAAttentionSpec(
                block_size=block_size, num_kv_heads=1, max_tp_shards=1, head_size=132, dtype=torch.uint8,
                tokens_per_state=4, alignment=576)
            specs[f"{p}.indexer.compressor.state_cache"] = SlidingWindowMLASpec(
                block_size=4, num_kv_heads=1, max_tp_shards=1, head_size=2 * 2 * 128, dtype=torch.float32,
                sliding_window=8, alignment=576)
        specs[f"{p}.swa_cache"] = SlidingWindowMLASpec(
            block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=512, dtype=torch.uint8,
            sliding_window=window, cache_dtype_str="fp8_ds_mla", state_content_bytes=584, alignment=576,
            model_version="deepseek_v4")
        if r > 1:
            specs[p] = MLAAttentionSpec(
                block_size=block_size, num_kv_heads=1, max_tp_shards=1, head_size=512, dtype=torch.uint8,
                tokens_per_state=r, cache_dtype_str="fp8_ds_mla", alignment=576, model_version="deepseek_v4",
                state_content_bytes=584)
            coff = 1 + (r == 4)
            specs[f"{p}.compressor.state_cache"] = SlidingWindowMLASpec(
                block_size=4 if r == 4 else 8, num_kv_heads=1, max_tp_shards=1, head_size=2 * coff * 512,
                dtype=torch.float32, sliding_window=coff * r, alignment=576)
    return specs


def _kind(spec) -> str:
    return type(spec.first_spec if hasattr(spec, "first_spec") else spec).__name__


def plan(name: str, mtp: bool) -> dict:
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups

    cfg = json.loads((ROOT / "dsv4_index" / "configs" / f"{name}.json").read_text())
    ratios = cfg["compress_ratios"]
    if not mtp:
        ratios = ratios[: cfg["num_hidden_layers"]]
    vllm_config = NS(scheduler_config=NS(disable_hybrid_kv_cache_manager=False),
                     cache_config=NS(get_resolved_kv_cache_layout=lambda: __import__(
                         "vllm.v1.kv_cache_layout", fromlist=["KVCacheLayout"]).KVCacheLayout.BLHNC),
                     attention_config=None, speculative_config=None)
    groups = get_kv_cache_groups(vllm_config, _specs(ratios, cfg["sliding_window"]))
    out = []
    for g in groups:
        spec = g.kv_cache_spec
        first = spec.first_spec if hasattr(spec, "first_spec") else spec
        out.append({"layer_names": list(g.layer_names), "spec": _kind(spec), "layer_spec": type(first).__name__,
                    "block_size": spec.block_size, "sliding_window": getattr(first, "sliding_window", None)})
    return {"vllm": __import__("vllm").__version__, "config": name, "mtp": mtp,
            "num_layers": len(ratios), "kv_cache_groups": out}


def allocations(name: str, mtp: bool, n: int = 24) -> dict:
    """Block-list lengths vLLM's KVCacheManager gives new requests on the plan (module docstring)."""
    import math
    import random

    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import (generate_scheduler_kv_cache_config, get_request_block_hasher,
                                             init_none_hash)
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    cfg = json.loads((ROOT / "dsv4_index" / "configs" / f"{name}.json").read_text())
    ratios = cfg["compress_ratios"] if mtp else cfg["compress_ratios"][: cfg["num_hidden_layers"]]
    layout = __import__("vllm.v1.kv_cache_layout", fromlist=["KVCacheLayout"]).KVCacheLayout.BLHNC
    vllm_config = NS(scheduler_config=NS(disable_hybrid_kv_cache_manager=False),
                     cache_config=NS(get_resolved_kv_cache_layout=lambda: layout),
                     attention_config=None, speculative_config=None)
    groups = get_kv_cache_groups(vllm_config, _specs(ratios, cfg["sliding_window"]))
    kcc = generate_scheduler_kv_cache_config([KVCacheConfig(num_blocks=20000, kv_cache_tensors=[],
                                                            kv_cache_groups=groups)])
    sched_block = math.lcm(*(g.kv_cache_spec.block_size for g in groups))
    hash_block = min(g.kv_cache_spec.block_size for g in groups)
    init_none_hash(sha256)
    k = 1 if mtp else 0
    mgr = KVCacheManager(kcc, max_model_len=4096, scheduler_block_size=sched_block, hash_block_size=hash_block,
                         enable_caching=True, use_eagle=bool(k), num_prefill_lookahead=k)
    hasher = get_request_block_hasher(hash_block, sha256)
    rng = random.Random(0)
    prefixes = [[rng.randrange(1000) for _ in range(m)] for m in (600, 1000)]
    cases = []
    for i in range(n):
        base = prefixes[i % 2][: rng.randrange(0, 1000)] if i % 3 else []
        prompt = base + [rng.randrange(1000) for _ in range(rng.randrange(1, 700))]
        req = Request(f"r{i}", prompt, SamplingParams(max_tokens=4), None, block_hasher=hasher)
        blocks, nc, _ = mgr.get_computed_blocks(req)
        chunk = min(len(prompt) - nc, rng.choice([64, 300, 2048]))
        assert mgr.allocate_slots(req, chunk, nc, blocks, num_lookahead_tokens=k) is not None
        lists = mgr.get_block_ids(req.request_id)
        cases.append({"num_computed_tokens": nc, "num_scheduled_tokens": chunk, "lens": [len(x) for x in lists],
                      "nulls": [sum(b == 0 for b in x) for x in lists]})
    return {"vllm": __import__("vllm").__version__, "config": name, "mtp": mtp, "scheduler_block": sched_block,
            "lookahead": k, "new_requests": cases}


def plan_v41(k: int, replay: bool) -> dict:
    """vLLM 0.33's grouping of DeepSeek-V4.1-Flash's specs (``benchmarks/vllm_parts.py``'s ``v41_specs``: vLLM's
    spec classes with the arguments its ``models/deepseek_v41`` modules pass on SM90) with ``k`` DSpark drafts."""
    import importlib.util

    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec = importlib.util.spec_from_file_location("_vllm_parts", ROOT / "benchmarks" / "vllm_parts.py")
    parts = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(parts)  # type: ignore[union-attr]
    cfg = json.loads((ROOT / "dsv4_index" / "configs" / "v41_flash.json").read_text())
    vllm_config = NS(scheduler_config=NS(disable_hybrid_kv_cache_manager=False),
                     cache_config=NS(get_resolved_kv_cache_layout=lambda: KVCacheLayout.BLHNC),
                     attention_config=None, speculative_config=None)
    groups = get_kv_cache_groups(vllm_config, parts.v41_specs(cfg, k, replay))
    out = []
    for g in groups:
        first = g.kv_cache_spec.first_spec if hasattr(g.kv_cache_spec, "first_spec") else g.kv_cache_spec
        out.append({"layer_names": list(g.layer_names), "spec": _kind(g.kv_cache_spec),
                    "layer_spec": type(first).__name__, "block_size": g.kv_cache_spec.block_size,
                    "sliding_window": getattr(first, "sliding_window", None),
                    "prefix_cacheable": g.kv_cache_spec.prefix_cacheable})
    return {"vllm": __import__("vllm").__version__, "config": "v41_flash", "dspark": k, "bounded_replay": replay,
            "kv_cache_groups": out}


def main() -> int:
    dest = Path(__file__).resolve().parent / "fixtures"
    dest.mkdir(exist_ok=True)
    major, minor = __import__("vllm").__version__.split(".")[:2]
    tag = f"vllm{int(major)}{int(minor):02d}"  # NOTE: vllm033 for 0.33.x, vllm034 for 0.34.x
    for k in (0, 3):
        (dest / f"{tag}_v41_flash{'_dspark3' if k else ''}.json").write_text(
            json.dumps(plan_v41(k, True), indent=1) + "\n")
    for name in ("flash", "pro"):
        for mtp in (True, False):
            p = plan(name, mtp)
            path = dest / f"{tag}_{name}{'_mtp' if mtp else ''}.json"
            path.write_text(json.dumps(p, indent=1) + "\n")
            print(path.name, [(len(g["layer_names"]), g["layer_spec"], g["block_size"], g["sliding_window"])
                              for g in p["kv_cache_groups"]])
            a = allocations(name, mtp)
            (dest / f"{tag}_alloc_{name}{'_mtp' if mtp else ''}.json").write_text(json.dumps(a, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
