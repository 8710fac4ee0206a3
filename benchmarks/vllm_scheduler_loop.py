# over 400 lines: one driver of vLLM's scheduler against the pipeline (loop, mutations and their oracle, replay, report)
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

``--config v41`` (DeepSeek-V4.1-Flash): the specs vLLM's ``models/deepseek_v41`` modules declare on an H200
(``vllm_parts.v41_specs``), DSpark drafts (``--spec``), model runner V2 (the scheduler's output form), and SWA
bounded replay (``--replay on``, the default as on the H200): a prefix hit comes back with
``NewRequestData.replay_start``; ``pipe.update(so)`` remembers it and derives ``replay_end = replay_start + W``,
as runner V2 pads those tokens' full-group slots; the script computes the same bounds on its own
(``Loop.replay_bounds``) and ``--verify`` checks every output against them.

The vLLM side (plan, configs, the replay and its checks, the fake runner) is ``vllm_parts.py`` beside this file.

Needs vLLM 0.33 (not a dependency: ``pip install --no-deps vllm==0.33.0`` and its light dependencies, or the
``vllm`` extra), run with ``VLLM_TARGET_DEVICE=cpu``::

    VLLM_TARGET_DEVICE=cpu PYTHONPATH=. /work/venv-vllm/bin/python benchmarks/vllm_scheduler_loop.py --steps 400

``--verify`` builds every step on the first pipeline and checks every output of every token (raw and compressed
slot mappings, window lists, causal compressed lists) against docs/DESIGN.md §4 computed from vLLM's own block
lists. ``--mutate K`` first feeds up to K corrupted copies of each step for running requests (one new block id
replaced by an id another live request certainly reads in that group, ``Loop.certain``) and up to K for new
requests (one block id they write replaced by such an id of a running request): each must be rejected, and the
pipeline must then accept the real step. An id only the holder's band keeps (behind the window of its lower
bound ``nc + n - d`` but not of its upper bound ``nc + n``: async scheduling frees on the optimistic count) is
no certain corruption and is not used (``band_ids_skipped``, counted once per id and mutation): the rule accepts
the write and rejects the read. ``--handovers K`` feeds such ids instead, on copies of the pipelines, which must
accept them and then reject the real step in which the holder reads the block (``vllm_handovers.py``).
Exit status 0 when no step was rejected, no mutation accepted, no hand-over rejected nor its read accepted, and no
output differed, 1 otherwise (each printed with its step).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace as NS
from typing import List

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_handovers import Handovers  # noqa: E402
from vllm_parts import (STOP, Owners, check_outputs, model_output, model_runner_v2, prompts,  # noqa: E402
                        vllm_setup)


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
            args.config, k, args.num_blocks, args.max_model_len, args.max_tokens, args.max_seqs, args.replay == "on")
        so_manager = NS(grammar_bitmask=lambda *a, **kw: None, accept_tokens=lambda *a: True,
                        validate_tokens=lambda req, toks: toks)  # NOTE: no structured output
        vc.scheduler_config.async_scheduling = bool(args.async_scheduling)  # NOTE: read by the KV-cache manager
        sched = AsyncScheduler if args.async_scheduling else Scheduler
        with model_runner_v2(args.config == "v41"):  # NOTE: V4.1's DSpark and bounded replay run on runner V2 only
            self.sched = sched(vc, kcc, so_manager, block_size=self.sched_block, hash_block_size=self.hash_block)
        self.lookups: dict = {}  # NOTE: request id -> hit tokens of its last prefix-cache lookup
        self._count_lookups()
        self.replays: dict = {}  # NOTE: request id -> NewRequestData.replay_start (nonzero)
        self.live: dict = {}  # NOTE: this step's replaying requests: id -> (replay_start, replay_end)
        self.req_ids: dict = {}  # NOTE: per pipeline, the request id of each batch row of its last step
        self.in_flight: list = []  # NOTE: async scheduling: the step whose output comes after the next schedule
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(self.hash_block, sha256, vc.num_hash_lookahead_tokens)
        self.layout = (DSV4Layout.from_kv_cache_config(kcc, cfg, args.max_model_len) if args.layout == "plan" else
                       DSV4Layout.from_config(cfg, args.max_model_len, groups="vllm"))
        self.pipes = {lvl: self.pipeline(lvl) for lvl in args.checks}
        self.owners = Owners([g.alloc_block_size for g in self.layout.groups],
                             [g.kind == "circular" for g in self.layout.groups],
                             [g.kind == "full" for g in self.layout.groups])
        self.rng = random.Random(args.seed)
        self.mrng = random.Random(args.seed + 1)  # NOTE: mutations leave the scheduler's run as it was
        self.prompts = prompts(self.rng, args.requests, args.shared_prefixes, args.max_prompt, args.burst)
        self.next = 0
        self.history: list = []  # NOTE: the real steps so far, kept under --mutate only
        self.bounds: dict = {}  # NOTE: request id -> (nc + n, replay_start) of its last step fed (the upper bound)
        self.stats = dict(steps=0, idle_steps=0, tokens=0, new=0, prefix_hits=0, hit_tokens=0, preempted=0, resumed=0,
                          finished=0, rejected_drafts=0, shared_writes=0, shared_write_tokens=0, steps_zeroing_blocks=0,
                          steps_copying_blocks=0, replays=0, replay_steps=0, short_hits=0, short_hit_tokens=0,
                          accepted={lvl: 0 for lvl in self.pipes},
                          rejected={lvl: 0 for lvl in self.pipes}, mutations={lvl: 0 for lvl in self.pipes},
                          mutations_rejected={lvl: 0 for lvl in self.pipes}, verified_tokens=0, output_mismatches=0,
                          band_ids_skipped=0)
        self.update_s = {lvl: 0.0 for lvl in self.pipes}
        self.handovers = Handovers(self, args.handovers) if args.handovers else None

    def _count_lookups(self) -> None:
        """Record what each prefix-cache lookup found (``KVCacheManager.get_computed_blocks``): V4.1 bounded
        replay drops a hit of at most ``W`` tokens (the scheduler admits the request from 0, with no replay
        and none of the hit's blocks), so ``num_computed_tokens`` alone does not show it (``short_hits``)."""
        mgr = self.sched.kv_cache_manager
        lookup, seen = mgr.get_computed_blocks, self.lookups

        def get_computed_blocks(request, *a, **kw):
            got = lookup(request, *a, **kw)
            seen[request.request_id] = got[1]
            return got

        mgr.get_computed_blocks = get_computed_blocks

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
        W = self.sched.prefix_replay_tokens
        short = [self.lookups.get(r.req_id, 0) for r in so.scheduled_new_reqs if not r.num_computed_tokens]
        short = [n for n in short if 0 < n <= W]  # NOTE: dropped by vLLM: admitted from 0 (no replay)
        st["short_hits"] += len(short)
        st["short_hit_tokens"] += sum(short)
        self.lookups.clear()
        st["preempted"] += len(so.preempted_req_ids or ())
        st["resumed"] += len(so.scheduled_cached_reqs.resumed_req_ids)
        st["finished"] += len(so.finished_req_ids)
        self.live = self.replay_bounds(so)
        st["replays"] += sum(bool(getattr(r, "replay_start", 0)) for r in so.scheduled_new_reqs)
        st["replay_steps"] += bool(self.live)
        st["steps_zeroing_blocks"] += bool(getattr(so, "new_block_ids_to_zero", None))  # NOTE: ignored by the
        st["steps_copying_blocks"] += bool(getattr(so, "kv_cache_block_copies", None))  # library (README)
        self.owners.apply(so)
        self.owners.sync(self.sched.kv_cache_manager.get_block_ids)
        blocks, tokens = self.owners.shared_writes(so, {r: e for r, (_, e) in self.live.items()})
        st["shared_writes"] += blocks
        st["shared_write_tokens"] += tokens
        return so

    def certain(self, so, rid: str, g: int, j: int) -> bool:
        """Request ``rid`` certainly reads its block position ``j`` of group ``g`` (docs/DESIGN.md §5: a full
        group's every block; a sliding block from the window start of ``rid``'s first token in this step when
        ``so`` schedules it, else of the upper bound ``nc + n`` of its last step, every draft accepted). A
        block only the band below keeps may be handed on: writing it is no certain corruption (the pipeline
        accepts it and rejects the holder's read, should it come)."""
        grp = self.layout.groups[g]
        if grp.kind != "sliding":
            return True
        c = so.scheduled_cached_reqs
        nc = dict(zip(c.req_ids, c.num_computed_tokens))
        if rid in so.num_scheduled_tokens and rid in nc:
            at, rs = nc[rid], self.live.get(rid, (0, 0))[0]
        else:
            at, rs = self.bounds.get(rid, (0, 0))
        return j >= max(at - grp.window + 1, 0, rs) // self.owners.bs[g]

    def _held_by(self, so, g: int, who, skip) -> list:
        """Sorted ids of group ``g`` that a request of ``who`` certainly reads (:meth:`certain`), but not ``skip``."""
        out, band = set(), set()
        for r in who:
            for j, b in enumerate(self.owners.lists[r][g]):
                if b and b not in skip:
                    (out if self.certain(so, r, g, j) else band).add(b)
        self.stats["band_ids_skipped"] += len(band - out)
        return sorted(out)

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
                held = [self._held_by(so, g, [r for r in self.owners.lists if r != rid and (r in fresh or not k)],
                                      mine) for k in (0, 1)]
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
                others = self._held_by(so, g, [q for q in self.owners.lists if q not in fresh], set(ids))
                if others:
                    bad = copy.deepcopy(so)
                    bad.scheduled_new_reqs[i].block_ids[g][self.mrng.randrange(first, len(ids))] = \
                        others[self.mrng.randrange(len(others))]
                    out.append((f"new {r.req_id!r} gid {g}", bad))
        return out

    def replay_bounds(self, so) -> dict:
        """``{req_id: (replay_start, replay_end)}`` of the step's requests that replay (vLLM V4.1's SWA bounded
        replay): ``replay_start`` as ``NewRequestData`` carries it when vLLM admits the request (nonzero), and
        ``replay_end = replay_start + W`` (``Scheduler.prefix_replay_tokens``) while the request's chunk starts
        below it: what model runner V2 does with them (``models/deepseek_v41/nvidia/model_state.py``:
        ``_pad_replayed_slots_kernel`` pads the prefix-cacheable groups' slots of positions ``[replay_start,
        replay_start + W)`` of a prefilling request, and returns at once when ``replay_start == 0``)."""
        for rid in list(so.finished_req_ids) + list(so.preempted_req_ids or ()):
            self.replays.pop(rid, None)
        for r in so.scheduled_new_reqs:
            self.replays.pop(r.req_id, None)
            if getattr(r, "replay_start", 0):
                self.replays[r.req_id] = r.replay_start
        c, W = so.scheduled_cached_reqs, self.sched.prefix_replay_tokens
        nc = dict(zip(c.req_ids, c.num_computed_tokens))
        nc.update({r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs})
        return {rid: (rs, rs + W) for rid, rs in self.replays.items()
                if rid in so.num_scheduled_tokens and nc[rid] < rs + W}

    def update(self, lvl: str, pipe, so) -> None:
        """``pipe.update(so)``: the library reads ``NewRequestData.replay_start``, remembers it and derives
        ``replay_end = replay_start + W`` itself; the script's own bounds (:meth:`replay_bounds`) are what
        ``--verify`` checks the outputs against."""
        pipe.update(so)
        self.req_ids[lvl] = pipe.req_ids

    def bs_of(self, g: int) -> int:
        return self.owners.bs[g]

    def feed_mutations(self, so, step: int) -> List[str]:
        """Every pipeline must reject each of :meth:`mutations` (and stay as it was: the real step follows)."""
        errors = []
        for what, bad in self.mutations(so, self.args.mutate):
            for lvl, pipe in self.pipes.items():
                self.stats["mutations"][lvl] += 1
                try:
                    self.update(lvl, pipe, bad)
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
        for so, live in self.history:
            self.live = live
            self.update(lvl, pipe, so)
        return pipe

    def feed(self, so, step: int) -> List[str]:
        """``update(so)`` on every pipeline; the rejection messages."""
        errors = []
        if self.args.mutate:
            import copy
            self.history.append((copy.deepcopy(so), self.live))
        for lvl, pipe in self.pipes.items():
            t0 = time.perf_counter()
            try:
                self.update(lvl, pipe, so)
                self.stats["accepted"][lvl] += 1
            except ValueError as e:
                self.stats["rejected"][lvl] += 1
                errors.append(f"REJECTED step {step} checks={lvl}: {e}")
            self.update_s[lvl] += time.perf_counter() - t0
        c = so.scheduled_cached_reqs
        nc = dict(zip(c.req_ids, c.num_computed_tokens))
        nc.update({r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs})
        for rid in list(so.finished_req_ids) + list(so.preempted_req_ids or ()):
            self.bounds.pop(rid, None)
        for rid, n in so.num_scheduled_tokens.items():
            self.bounds[rid] = (nc[rid] + n, self.live.get(rid, (0, 0))[0])
        return errors

    def verify(self, step: int) -> List[str]:
        """``build()`` the first pipeline and check every output against the replayed lists (:func:`check_outputs`)."""
        lvl, pipe = next(iter(self.pipes.items()))
        if self.stats["rejected"][lvl] or self.req_ids.get(lvl) is None:
            return []
        n, bad = check_outputs(pipe.build(), self.layout, self.owners.lists, self.req_ids[lvl], self.live)
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
        out, drafts, rejected = model_output(self.sched, so, self.rng, self.args.accept, self.args.stop,
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
        lines = loop.feed_mutations(so, step)
        lines += loop.handovers.feed(so, step) if loop.handovers else []
        lines += loop.feed(so, step)
        for line in lines + (loop.verify(step) if args.verify else []):
            print(line)
        loop.finish(so)
    return loop.summary()


def parser() -> argparse.ArgumentParser:
    """The command line (``parser().parse_args([])``: the defaults, for tests)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="flash", choices=["flash", "pro", "v41"],
                   help="v41: DeepSeek-V4.1-Flash (vllm_parts.v41_specs; --spec K: DSpark drafts)")
    p.add_argument("--replay", default="on", choices=["on", "off"], help="v41: vLLM's SWA bounded replay "
                   "(CacheConfig.swa_bounded_replay, on with model runner V2 as on the H200)")
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
    p.add_argument("--handovers", type=int, default=0, help="hand-over copies of each step to feed to copies of "
                   "the pipelines (each must be accepted, and a later read of the block rejected; vllm_handovers.py)")
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
    missed |= s.get("handovers", 0) != s.get("handovers_accepted", 0) or s.get("handover_reads_accepted", 0) > 0
    return 0 if not any(s["rejected"].values()) and not missed and not s["output_mismatches"] else 1


if __name__ == "__main__":
    sys.exit(main())
