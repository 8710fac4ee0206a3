"""The vLLM side of ``vllm_scheduler_loop.py`` (not a script): vLLM 0.33's KV-cache plan and scheduler
configuration on CPU for the shipped DeepSeek-V4 configs, the script's own replay of every request's block
lists (shared writes, and every output against docs/DESIGN.md §4), the fake model runner and the prompts.
Imports vLLM only inside functions (``--help`` of the script works without it)."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Dict, List, Tuple

__all__ = ["STOP", "fixture_specs", "MTPSpec", "vllm_setup", "Owners", "check_outputs", "model_output", "prompts"]

ROOT = Path(__file__).resolve().parents[1]  # NOTE: the repository
STOP = 7  # NOTE: the fake model's stop token


def fixture_specs():
    """``_specs`` of ``tests/layout/make_vllm_fixtures.py`` (vLLM's per-layer specs, written once there)."""
    path = ROOT / "tests" / "layout" / "make_vllm_fixtures.py"
    spec = importlib.util.spec_from_file_location("_make_vllm_fixtures", path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod._specs


class MTPSpec:
    """vLLM's ``SpeculativeConfig`` for MTP as the scheduler reads it: these fields, every method and
    property vLLM's own (looked up on its class)."""

    def __init__(self, k: int):
        self.method, self.num_speculative_tokens = "mtp", k
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


def vllm_setup(name: str, k: int, num_blocks: int, max_model_len: int, max_tokens: int, max_seqs: int):
    """(vllm_config, kv_cache_config, scheduler_block, hash_block, model config dict) for config ``name`` with
    ``k`` MTP drafts (``k = 0``: no MTP layer, no speculative decoding)."""
    from vllm.config import CacheConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, resolve_kv_cache_block_sizes
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.kv_cache_layout import KVCacheLayout

    cfg = json.loads((ROOT / "dsv4_index" / "configs" / f"{name}.json").read_text())
    ratios = cfg["compress_ratios"] if k else cfg["compress_ratios"][: cfg["num_hidden_layers"]]
    plan_cfg = NS(scheduler_config=NS(disable_hybrid_kv_cache_manager=False),
                  cache_config=NS(get_resolved_kv_cache_layout=lambda: KVCacheLayout.BLHNC),
                  attention_config=None, speculative_config=None)
    groups = get_kv_cache_groups(plan_cfg, fixture_specs()(ratios, cfg["sliding_window"]))
    kcc = generate_scheduler_kv_cache_config([KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                                            kv_cache_groups=groups)])
    vc = VllmConfig()
    vc.scheduler_config = SchedulerConfig(max_num_batched_tokens=max_tokens, max_num_seqs=max_seqs,
                                          max_model_len=max_model_len, enable_chunked_prefill=True,
                                          is_encoder_decoder=False)
    cc = CacheConfig(block_size=min(g.kv_cache_spec.block_size for g in groups if g.kv_cache_spec.prefix_cacheable),
                     enable_prefix_caching=True)
    cc.num_gpu_blocks = num_blocks
    vc.cache_config = cc
    object.__setattr__(vc, "model_config", NS(
        uses_mrope=False, is_encoder_decoder=False, max_model_len=max_model_len, runner_type="generate",
        is_diffusion=False, supports_multimodal_inputs=False, multimodal_config=None, skip_tokenizer_init=True,
        architectures=["DeepseekV4ForCausalLM"], original_max_model_len=max_model_len, return_sampling_mask=False,
        hf_config=NS(**cfg)))
    object.__setattr__(vc, "speculative_config", MTPSpec(k) if k else None)
    sched_block, hash_block = resolve_kv_cache_block_sizes(kcc, vc)
    return vc, kcc, sched_block, hash_block, cfg


class Owners:
    """The script's own count of writes into blocks another live request holds: every request's block
    lists replayed from the SchedulerOutputs (new requests: ``block_ids``; running: ``new_block_ids``
    appended; resumed: replaced), checked against vLLM's ``KVCacheManager.get_block_ids`` (equal, except
    that vLLM has put the null block where a sliding group released a block behind the window)."""

    def __init__(self, block_sizes: List[int], circular: List[bool]):
        self.bs, self.circular = block_sizes, circular
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

    def shared_writes(self, so) -> Tuple[int, int]:
        """``(blocks, tokens)``: the (request, group, block) writes of ``so`` into a block another live request
        holds, and the (token, group) writes among them (circular groups: a fixed ring per request, never
        shared, not counted)."""
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
                bs = self.bs[g]
                if self.circular[g]:
                    continue
                for j in range(lo // bs, (hi - 1) // bs + 1):
                    if j < len(ids) and ids[j] and holders[g].get(ids[j], 0) > 1:
                        blocks += 1
                        tokens += min(hi, (j + 1) * bs) - max(lo, j * bs)
        return blocks, tokens


def _slots(bt, x, unit: int):
    """DESIGN §4 ``slot``: ``bt[x // unit] * unit + x % unit`` (``bt`` a block list, ``x`` int64 positions)."""
    return bt[x // unit] * unit + x % unit


def check_outputs(meta, layout, lists: Dict[str, List[List[int]]], req_ids) -> Tuple[int, List[str]]:
    """The step's outputs against docs/DESIGN.md §4 computed from the replayed block lists (vLLM's): per
    channel and valid token, the raw slot (``slot_mapping``), the compressed slot (``compressed_slot_mapping``:
    row ``pos // R`` when ``(pos + 1) % R == 0``), the window list (``indices`` / ``lens`` of a windowed
    channel: positions ``[max(pos - W + 1, 0), pos]``), the causal compressed list (``c128a``) and the indexer
    lengths (``c4i``: ``(pos + 1) // R``). Returns (tokens checked, the first differences)."""
    import numpy as np

    T = meta.num_tokens
    pos = meta.positions[:T].cpu().numpy().astype(np.int64)
    row = meta.token_to_req[:T].cpu().numpy().astype(np.int64)
    bad: List[str] = []
    for name, spec in layout.channels.items():
        ch, bs, R = meta[name], layout.groups[spec.gid].block_size, spec.compress_ratio
        got = {k: None if getattr(ch, k) is None else getattr(ch, k)[:T].cpu().numpy().astype(np.int64)
               for k in ("slot_mapping", "compressed_slot_mapping", "indices", "lens")}
        for b, rid in enumerate(req_ids):
            sel = np.flatnonzero(row == b)
            p, bt = pos[sel], np.asarray(lists[rid][spec.gid], dtype=np.int64)
            want: Dict[str, np.ndarray] = {}
            if got["slot_mapping"] is not None:
                want["slot_mapping"] = _slots(bt, p, bs)
            if got["compressed_slot_mapping"] is not None:
                done = (p + 1) % R == 0
                c = np.where(done, p // R, 0)
                want["compressed_slot_mapping"] = np.where(done, _slots(bt, c, bs // R), -1)
            if got["indices"] is not None:
                lo = np.maximum(p - spec.window + 1, 0) if spec.window else np.zeros_like(p)
                n = p - lo + 1 if spec.window else (p + 1) // R
                j = np.arange(got["indices"].shape[1])[None, :]
                x = (lo[:, None] + j) if spec.window else np.broadcast_to(j, (p.size, j.shape[1]))
                ok = j < n[:, None]
                want["indices"] = np.where(ok, _slots(bt, np.where(ok, x, 0), bs if spec.window else bs // R), -1)
                want["lens"] = n
            elif got["lens"] is not None:  # NOTE: the indexer's visible compressed rows (c4i)
                want["lens"] = (p + 1) // R
            for k, w in want.items():
                g = got[k][sel]
                if not np.array_equal(g, w):
                    t = int(np.flatnonzero((g != w).reshape(len(sel), -1).any(1))[0])
                    bad.append(f"{name}.{k} of request {rid!r} at position {int(p[t])}: {g[t].tolist()} != "
                               f"DESIGN §4 {w[t].tolist()}")
                    break
    return T, bad


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
