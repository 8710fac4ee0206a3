"""Drive vLLM 0.33's own scheduler on CPU against the metadata pipeline (issues 26 item 4 and 28): every
``SchedulerOutput`` it sends must be accepted by ``update()`` under ``checks="safe"`` and ``"full"``.

What is vLLM's here: the per-layer KV-cache specs (its spec classes, with the arguments its DeepSeek-V4
modules pass: ``tests/layout/make_vllm_fixtures.py``), its grouping (``get_kv_cache_groups``), the
scheduler's KV-cache config (``generate_scheduler_kv_cache_config``), the scheduler and hash block sizes
(``resolve_kv_cache_block_sizes``), and the ``Scheduler`` itself (prefix caching on, chunked prefill, MTP as
``method="mtp"`` with ``num_speculative_tokens`` drafts), its ``Request`` and block hasher. What is not:
the model (a fake runner: a prefill chunk that ends its prompt samples one token, a decode step accepts a
random number of its drafts, a stop token ends a request at random) and the config objects the scheduler
reads (a real ``VllmConfig`` without a model; the model and speculative configs are stand-ins holding the
fields the scheduler reads, their methods vLLM's own).

Each step goes, as vLLM sends it, to one pipeline per ``--checks`` level (default ``safe`` and ``full``;
``validate`` = ``validate=True``) on the layout ``DSV4Layout.from_kv_cache_config`` builds from vLLM's own
``KVCacheConfig`` (``--layout shorthand``: ``from_config(groups="vllm")``), on CPU (``backend="reference"``,
``fused=False``). The script counts, independently of the library, the writes
into a block another live request holds (block lists replayed from the SchedulerOutputs and compared with
vLLM's ``KVCacheManager.get_block_ids`` every step), the prefix-cache hits, preemptions and rejected drafts.

Needs vLLM 0.33 (not a dependency: ``pip install --no-deps vllm==0.33.0`` and its light dependencies, or the
``vllm`` extra), run with ``VLLM_TARGET_DEVICE=cpu``::

    VLLM_TARGET_DEVICE=cpu PYTHONPATH=. /work/venv-vllm/bin/python benchmarks/vllm_scheduler_loop.py --steps 400

``--verify`` builds every step on the first pipeline and checks every output of every token (raw and compressed
slot mappings, window lists, causal compressed lists) against docs/DESIGN.md §4 computed from vLLM's own block
lists. ``--mutate K`` first feeds up to K corrupted copies of each step for running requests (one new block id
replaced by an id another live request holds in that group) and up to K for new requests (one block id they
write replaced by a running request's): each must be rejected, and the pipeline must then accept the real step.
Exit status 0 when no step was rejected, no mutation accepted and no output differed, 1 otherwise (each printed
with its step).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
STOP = 7  # NOTE: the fake model's stop token


def _fixture_specs():
    """``_specs`` of ``tests/layout/make_vllm_fixtures.py`` (vLLM's per-layer specs, written once there)."""
    path = ROOT / "tests" / "layout" / "make_vllm_fixtures.py"
    spec = importlib.util.spec_from_file_location("_make_vllm_fixtures", path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod._specs


class _Spec:
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
    groups = get_kv_cache_groups(plan_cfg, _fixture_specs()(ratios, cfg["sliding_window"]))
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
    object.__setattr__(vc, "speculative_config", _Spec(k) if k else None)
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


def _model_output(sched, so, rng: random.Random, accept: float, stop: float, k: int, late: bool = False):
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


def _prompts(rng: random.Random, n: int, shared: int, max_prompt: int, burst: int) -> List[List[int]]:
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


class Loop:
    """vLLM's scheduler, the fake runner, the script's own block-list replay and the pipelines under test
    (one per check level), stepped together (module docstring)."""

    def __init__(self, args):
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler

        from dsv4_index import DSV4Layout

        self.args, k = args, args.spec
        vc, kcc, self.sched_block, self.hash_block, cfg = vllm_setup(
            args.config, k, args.num_blocks, args.max_model_len, args.max_tokens, args.max_seqs)
        so_manager = NS(grammar_bitmask=lambda *a, **kw: None, accept_tokens=lambda *a: True,
                        validate_tokens=lambda req, toks: toks)  # NOTE: no structured output
        vc.scheduler_config.async_scheduling = bool(args.async_scheduling)  # NOTE: read by the KV-cache manager
        sched = AsyncScheduler if args.async_scheduling else Scheduler
        self.sched = sched(vc, kcc, so_manager, block_size=self.sched_block, hash_block_size=self.hash_block)
        self.in_flight: list = []  # NOTE: async scheduling: the step whose output comes after the next schedule
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(self.hash_block, sha256, vc.num_hash_lookahead_tokens)
        self.layout = (DSV4Layout.from_kv_cache_config(kcc, cfg, args.max_model_len) if args.layout == "plan" else
                       DSV4Layout.from_config(cfg, args.max_model_len, groups="vllm"))
        self.pipes = {lvl: self.pipeline(lvl) for lvl in args.checks}
        self.owners = Owners([g.alloc_block_size for g in self.layout.groups],
                             [g.kind == "circular" for g in self.layout.groups])
        self.rng = random.Random(args.seed)
        self.mrng = random.Random(args.seed + 1)  # NOTE: mutations leave the scheduler's run as it was
        self.prompts = _prompts(self.rng, args.requests, args.shared_prefixes, args.max_prompt, args.burst)
        self.next = 0
        self.history: list = []  # NOTE: the real steps so far, kept under --mutate only
        self.stats = dict(steps=0, idle_steps=0, tokens=0, new=0, prefix_hits=0, hit_tokens=0, preempted=0, resumed=0,
                          finished=0, rejected_drafts=0, shared_writes=0, shared_write_tokens=0, steps_zeroing_blocks=0,
                          steps_copying_blocks=0,
                          accepted={lvl: 0 for lvl in self.pipes},
                          rejected={lvl: 0 for lvl in self.pipes}, mutations={lvl: 0 for lvl in self.pipes},
                          mutations_rejected={lvl: 0 for lvl in self.pipes}, verified_tokens=0, output_mismatches=0)
        self.update_s = {lvl: 0.0 for lvl in self.pipes}

    def arrivals(self) -> None:
        """Submit ``--initial`` prompts before the first step, then ``--burst`` more per step with chance
        ``--arrival`` (a burst shares one prefix: same-step prefix hits)."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request
        a, rng = self.args, self.rng
        n = a.initial if self.next == 0 else (a.burst if rng.random() < a.arrival else 0)
        for _ in range(min(n, len(self.prompts) - self.next)):
            sp = SamplingParams(max_tokens=rng.randrange(4, a.max_output), stop_token_ids=[STOP])
            self.sched.add_request(Request(f"r{self.next}", self.prompts[self.next], sp, None,
                                           block_hasher=self.hasher))
            self.next += 1

    def schedule(self):
        """One ``Scheduler.schedule()``, counted and replayed; None when there is nothing left to do."""
        self.arrivals()
        so = self.sched.schedule()
        if not so.num_scheduled_tokens and self.next >= len(self.prompts):
            return None
        st = self.stats
        st["steps"] += 1
        st["idle_steps"] += not so.num_scheduled_tokens  # NOTE: e.g. a chunk whose state blocks never fit
        st["tokens"] += so.total_num_scheduled_tokens
        st["new"] += len(so.scheduled_new_reqs)
        hits = [r.num_computed_tokens for r in so.scheduled_new_reqs if r.num_computed_tokens > 0]
        st["prefix_hits"] += len(hits)
        st["hit_tokens"] += sum(hits)
        st["preempted"] += len(so.preempted_req_ids or ())
        st["resumed"] += len(so.scheduled_cached_reqs.resumed_req_ids)
        st["finished"] += len(so.finished_req_ids)
        st["steps_zeroing_blocks"] += bool(getattr(so, "new_block_ids_to_zero", None))  # NOTE: ignored by the
        st["steps_copying_blocks"] += bool(getattr(so, "kv_cache_block_copies", None))  # library (README)
        self.owners.apply(so)
        self.owners.sync(self.sched.kv_cache_manager.get_block_ids)
        blocks, tokens = self.owners.shared_writes(so)
        st["shared_writes"] += blocks
        st["shared_write_tokens"] += tokens
        return so

    def mutations(self, so, limit: int) -> list:
        """Up to ``limit`` copies of ``so``, each with one new block id of a running request replaced by an id
        another live request holds in that group (and this one does not): a write into another holder's
        block, which every check level must reject. Every other copy takes the id from a request admitted in
        this same step, when one holds any (its prefix hits: the same-step pattern of vLLM's prefix cache)."""
        import copy
        c, out = so.scheduled_cached_reqs, []
        fresh = {r.req_id for r in so.scheduled_new_reqs}
        for i, (rid, nb) in enumerate(zip(c.req_ids, c.new_block_ids)):
            if nb is None or rid in c.resumed_req_ids:
                continue
            for g, ids in enumerate(nb):
                if not ids or self.owners.circular[g] or len(out) >= limit:
                    continue
                mine = set(self.owners.lists[rid][g])
                held = [sorted({b for r, lists in self.owners.lists.items() if r != rid and (r in fresh or not k)
                                for b in lists[g] if b and b not in mine}) for k in (0, 1)]
                others = held[1] if held[1] and len(out) % 2 == 0 else held[0]
                if others:
                    bad = copy.deepcopy(so)
                    bad.scheduled_cached_reqs.new_block_ids[i][g][self.mrng.randrange(len(ids))] = \
                        others[self.mrng.randrange(len(others))]
                    out.append((f"{rid!r} gid {g}", bad))
        return out + self._new_mutations(so, limit)

    def _new_mutations(self, so, limit: int) -> list:
        """Up to ``limit`` copies of ``so``, each with one block id a new request writes (at or after its
        ``num_computed_tokens``) replaced by an id a running request holds in that group."""
        import copy
        fresh, out = {r.req_id for r in so.scheduled_new_reqs}, []
        for i, r in enumerate(so.scheduled_new_reqs):
            for g, ids in enumerate(r.block_ids):
                first = r.num_computed_tokens // self.bs_of(g)
                if len(out) >= limit or self.owners.circular[g] or first >= len(ids):
                    continue
                others = sorted({b for q, lists in self.owners.lists.items() if q not in fresh for b in lists[g]
                                 if b and b not in ids})
                if others:
                    bad = copy.deepcopy(so)
                    bad.scheduled_new_reqs[i].block_ids[g][self.mrng.randrange(first, len(ids))] = \
                        others[self.mrng.randrange(len(others))]
                    out.append((f"new {r.req_id!r} gid {g}", bad))
        return out

    def bs_of(self, g: int) -> int:
        return self.owners.bs[g]

    def feed_mutations(self, so, step: int) -> List[str]:
        """Every pipeline must reject each of :meth:`mutations` (and stay as it was: the real step follows)."""
        errors = []
        for what, bad in self.mutations(so, self.args.mutate):
            for lvl, pipe in self.pipes.items():
                self.stats["mutations"][lvl] += 1
                try:
                    pipe.update(bad)
                except ValueError:
                    self.stats["mutations_rejected"][lvl] += 1
                    continue
                errors.append(f"MUTATION ACCEPTED step {step} checks={lvl}: a block id of {what} replaced by "
                              f"another live request's block")
                self.pipes[lvl] = self._replayed(lvl)  # NOTE: the accepted corruption is now its state
        return errors

    def pipeline(self, lvl: str):
        """A CPU reference pipeline on the layout: ``checks=lvl``, or ``validate=True`` for ``"validate"`` (the
        full checks, both planners run and compared on every step, ``check_metadata`` after every build)."""
        from dsv4_index import MetadataPipeline
        level = dict(validate=True) if lvl == "validate" else dict(checks=lvl)
        return MetadataPipeline(self.layout, self.args.max_seqs, self.args.max_tokens, "cpu",
                                num_speculative_tokens=self.args.spec, backend="reference", fused=False, **level)

    def _replayed(self, lvl: str):
        """A new pipeline of level ``lvl`` fed every real step so far (after a mutation was accepted)."""
        pipe = self.pipeline(lvl)
        for so in self.history:
            pipe.update(so)
        return pipe

    def feed(self, so, step: int) -> List[str]:
        """``update(so)`` on every pipeline; the rejection messages."""
        errors = []
        if self.args.mutate:
            import copy
            self.history.append(copy.deepcopy(so))
        for lvl, pipe in self.pipes.items():
            t0 = time.perf_counter()
            try:
                pipe.update(so)
                self.stats["accepted"][lvl] += 1
            except ValueError as e:
                self.stats["rejected"][lvl] += 1
                errors.append(f"REJECTED step {step} checks={lvl}: {e}")
            self.update_s[lvl] += time.perf_counter() - t0
        return errors

    def verify(self, step: int) -> List[str]:
        """``build()`` the first pipeline and check every output against the replayed lists (:func:`check_outputs`)."""
        lvl, pipe = next(iter(self.pipes.items()))
        if self.stats["rejected"][lvl] or pipe.req_ids is None:
            return []
        n, bad = check_outputs(pipe.build(), self.layout, self.owners.lists, pipe.req_ids)
        self.stats["verified_tokens"] += n
        self.stats["output_mismatches"] += len(bad)
        return [f"OUTPUT step {step}: {b}" for b in bad[:3]]

    def finish(self, so) -> None:
        """The fake runner's output for ``so`` back into the scheduler (and its drafts). Async scheduling: the
        output of the step before, once ``so`` is scheduled (vLLM's batch queue of two; the drafts stay in the
        worker, the scheduler schedules placeholders)."""
        late = bool(self.args.async_scheduling)
        if late:
            self.in_flight.append(so)
            if len(self.in_flight) < 2:
                return
            so = self.in_flight.pop(0)
        out, drafts, rejected = _model_output(self.sched, so, self.rng, self.args.accept, self.args.stop,
                                              self.args.spec, late)
        self.stats["rejected_drafts"] += rejected
        self.sched.update_from_output(so, out)
        if drafts is not None and not late:
            self.sched.update_draft_token_ids(drafts)

    def summary(self) -> dict:
        s = dict(self.stats, config=self.args.config, spec=self.args.spec,
                 groups=[g.name for g in self.layout.groups], scheduler_block=self.sched_block,
                 hash_block=self.hash_block)
        s["update_us"] = {lvl: round(1e6 * t / max(s["steps"], 1), 1) for lvl, t in self.update_s.items()}
        return s


def run(args) -> dict:
    """``args.steps`` steps of the loop (module docstring), every rejection printed; the summary."""
    loop = Loop(args)
    for step in range(args.steps):
        so = loop.schedule()
        if so is None:
            break
        lines = loop.feed_mutations(so, step) + loop.feed(so, step)
        for line in lines + (loop.verify(step) if args.verify else []):
            print(line)
        loop.finish(so)
    return loop.summary()


def parser() -> argparse.ArgumentParser:
    """The command line (``parser().parse_args([])``: the defaults, for tests)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="flash", choices=["flash", "pro"])
    p.add_argument("--spec", type=int, default=1, help="MTP drafts per step (0: no MTP layer, no drafts)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--requests", type=int, default=400, help="prompts submitted over the run")
    p.add_argument("--initial", type=int, default=24, help="prompts submitted before the first step")
    p.add_argument("--arrival", type=float, default=0.5, help="chance of a burst of prompts per step")
    p.add_argument("--burst", type=int, default=1, help="prompts per arrival, sharing one prefix")
    p.add_argument("--shared-prefixes", type=int, default=4, help="prefixes the prompts share (0: a fresh one "
                   "per burst)")
    p.add_argument("--max-prompt", type=int, default=3000)
    p.add_argument("--max-output", type=int, default=200)
    p.add_argument("--accept", type=float, default=0.7, help="chance each draft is accepted (in order)")
    p.add_argument("--stop", type=float, default=0.02, help="chance a decode step samples the stop token")
    p.add_argument("--num-blocks", type=int, default=3000, help="vLLM's KV-cache blocks (small: preemptions)")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-tokens", type=int, default=2048, help="max_num_batched_tokens (chunked prefill)")
    p.add_argument("--max-seqs", type=int, default=64)
    p.add_argument("--layout", default="plan", choices=["plan", "shorthand"],
                   help="the pipelines' layout: from vLLM's KVCacheConfig, or from_config(groups='vllm')")
    p.add_argument("--checks", nargs="+", default=["safe", "full"], choices=["safe", "full", "validate"],
                   help="one pipeline per level ('validate': validate=True)")
    p.add_argument("--async-scheduling", action="store_true", help="vLLM's AsyncScheduler: each step is "
                   "scheduled before the previous step's output (rejected drafts) is known")
    p.add_argument("--mutate", type=int, default=0, help="corrupted copies of each step to feed first (each must "
                   "be rejected): one new block id replaced by another live request's")
    p.add_argument("--verify", action="store_true", help="build() every step and check every output of the "
                   "first pipeline against DESIGN §4 from vLLM's block lists")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        print(f"vllm is not importable ({e}); install vllm==0.33.0 (the 'vllm' extra) and run with "
              f"VLLM_TARGET_DEVICE=cpu")
        return 2
    t0 = time.perf_counter()
    s = run(args)
    s["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.json:
        print(json.dumps(s))
    else:
        for key, v in s.items():
            print(f"{key}: {v}")
    missed = any(s["mutations"][lvl] != s["mutations_rejected"][lvl] for lvl in s["mutations"])
    return 0 if not any(s["rejected"].values()) and not missed and not s["output_mismatches"] else 1


if __name__ == "__main__":
    sys.exit(main())
