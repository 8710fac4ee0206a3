"""Host cost of the id-keyed front door, in numpy-op units (stable on a noisy machine).

    python benchmarks/frontend_profile.py [--steps 300] [--batch 256] [--churn] [--old PATH] [--json]
    DSV4_INDEX_ROOT=/path/to/other/checkout python benchmarks/frontend_profile.py ...   # time that tree

One unit = ``a + b`` on two int64 arrays of 256 (timed in the same run, interleaved with the arms).
torch at one intra-op thread. Arms, round-robin per step, GC off, medians over the steps (V4-Flash
layout):

* steady decode (``workload.py``; every request appends at most one block per group):
  ``update(StepBatch)`` safe, the array-form step (for scale); ``batch_from_step`` of the same step as
  a ``StepInput``; ``batch_from_scheduler_output`` of it as a vLLM ``SchedulerOutput``
  (``new_block_ids`` None for a request without new blocks, as vLLM sends it); the same two
  conversions on a step with one request finished and one new; reading the requests' fields and
  building the ``StepInput`` itself, for scale;
* ``--churn``: B running requests with MTP (2 tokens each), every step ``--finish`` of them finish and as
  many join (a ``--join-ctx``-token context each: one block list per group, ≈ 13 K ids at 32 K
  tokens), 30 % of the drafts rejected (``num_computed_tokens`` advances by 1, not 2), blocks appended
  as rows cross a block. Steps in vLLM's order (the running requests as last step less the finished,
  the admitted ones appended). Arms: the conversion of each form plus ``SlotMap.commit`` of its delta,
  and the floor the issue names: one ``np.asarray(list, np.int32)`` per new block-id list.

Each conversion runs against a slot map committed from the previous step (the steady state an engine
sees). ``--old PATH`` times another checkout's package beside this one in the same process (a copy
imported as ``dsv4_old``), the two taking turns to go first on each step; ``DSV4_INDEX_ROOT`` runs the
script on another checkout's package instead; ``--reps N`` times each pure conversion as the least of N
calls on the same input (the first call pays the fresh objects' cache misses, which on a shared machine
swing several-fold between runs); ``--json`` prints one line of medians. ``benchmarks/FRONTEND.md``
keeps the figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from operator import attrgetter
from pathlib import Path
from types import SimpleNamespace as NS

ROOT = Path(__file__).resolve().parent
# NOTE: DSV4_INDEX_ROOT times another checkout's package with this script (old and new trees alternating)
sys.path.insert(0, os.environ.get("DSV4_INDEX_ROOT", str(ROOT.parent)))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "examples"))  # examples/_threads.py: --threads (default 1)

import numpy as np  # noqa: E402

from _threads import add_threads_option, set_threads  # noqa: E402
from dsv4_index import (DSV4Layout, MetadataPipeline, NewRequest, RunningRequest, SlotMap, StepInput,  # noqa: E402
                        batch_from_step)
from workload import Case, Workload  # noqa: E402


def scheduler_output(step: StepInput):
    """The vLLM ``SchedulerOutput`` of ``step`` (field names as at vLLM HEAD)."""
    run = step.running_requests
    cached = NS(req_ids=[r.req_id for r in run], resumed_req_ids=set(), new_token_ids=[], all_token_ids={},
                new_block_ids=[r.new_block_ids if any(r.new_block_ids) else None for r in run],
                num_computed_tokens=[r.num_computed_tokens for r in run], num_output_tokens=[1] * len(run))
    new = [NS(req_id=r.req_id, prompt_token_ids=None, block_ids=r.block_ids, num_computed_tokens=r.num_computed_tokens)
           for r in step.new_requests]
    return NS(scheduled_new_reqs=new, scheduled_cached_reqs=cached,
              num_scheduled_tokens=dict(step.num_scheduled_tokens),
              total_num_scheduled_tokens=step.total_tokens, scheduled_spec_decode_tokens={},
              finished_req_ids=set(step.finished_req_ids), preempted_req_ids=set())


def changed(step: StepInput, k: int) -> StepInput:
    """``step`` with its first running request finished and a new request in its place (same blocks)."""
    r0, rest = step.running_requests[0], list(step.running_requests[1:])
    new = NewRequest(f"new{k}", tuple([1000 + k] for _ in r0.new_block_ids), 0)
    nst = {r.req_id: step.num_scheduled_tokens[r.req_id] for r in rest}
    nst[new.req_id] = 7
    return StepInput([new], rest, nst, finished_req_ids={r0.req_id})


_FIELDS = [attrgetter(f) for f in ("resumed", "req_id", "new_block_ids", "num_computed_tokens")]


def read_columns(run) -> list:
    """The four attribute passes over the running requests that ``batch_from_step`` cannot avoid."""
    return [list(map(f, run)) for f in _FIELDS]


REPS = [1]  # NOTE: --reps: a pure conversion's time is the least of this many calls on the same input


def timed(fn, *a):
    t0 = time.perf_counter()
    fn(*a)
    return time.perf_counter() - t0


def conv_time(fn, *a):
    """The least time of ``REPS[0]`` calls of a pure conversion (the first pays the fresh objects' cache
    misses, which on a shared machine swing several-fold between runs)."""
    return min(timed(fn, *a) for _ in range(REPS[0]))


def unit_time(a, b) -> float:
    """Seconds of one ``a + b`` (256 int64), 32 in a row."""
    t0 = time.perf_counter()
    for _ in range(32):
        a + b
    return (time.perf_counter() - t0) / 32


def report(title: str, t: dict, names: dict, ref: str, as_json: bool) -> None:
    med = {k: statistics.median(v) * 1e6 for k, v in t.items()}
    u = med["unit"]
    print(f"{title}; unit = a + b on 256 int64 = {u:.3f} µs")
    print(f"| arm | µs | units | × {names[ref]} |")
    print("|---|---|---|---|")
    for k, name in names.items():
        print(f"| {name} | {med[k]:.1f} | {med[k] / u:.0f} | {med[k] / med[ref]:.2f} |")
    if as_json:
        print("RESULT " + json.dumps({"title": title, **{k: round(v / u, 1) for k, v in med.items()}}))


def load_old(path: str):
    """The package of the checkout at ``path`` imported as ``dsv4_old`` (a copy; the package imports
    itself only relatively), to time it beside this one in the same process."""
    import importlib
    import shutil
    import tempfile
    d = tempfile.mkdtemp(prefix="dsv4_old_")
    shutil.copytree(Path(path) / "dsv4_index", Path(d) / "dsv4_old")
    sys.path.insert(0, d)
    return importlib.import_module("dsv4_old")


def as_old(old, step: StepInput):
    """``step`` built from the old package's request classes (its converter checks their type)."""
    if old is None:
        return step
    return old.StepInput([old.NewRequest(r.req_id, r.block_ids, r.num_computed_tokens) for r in step.new_requests],
                         [old.RunningRequest(r.req_id, r.new_block_ids, r.num_computed_tokens, r.resumed)
                          for r in step.running_requests], dict(step.num_scheduled_tokens),
                         finished_req_ids=step.finished_req_ids, preempted_req_ids=step.preempted_req_ids)


def trees(args):
    """[(prefix, package)]: this checkout (``""``), and with ``--old`` the other one (``"old_"``)."""
    import dsv4_index
    return [("", dsv4_index)] + ([("old_", load_old(args.old))] if args.old else [])


def turns(items: list, i: int) -> list:
    """``items`` in turn order for step ``i`` (the first to touch a step's fresh objects pays its misses)."""
    return items if i % 2 == 0 else items[::-1]


def steady(args, layout) -> None:
    G = len(layout.groups)
    case = Case(f"decode B={args.batch}", decodes=args.batch)
    pipe = MetadataPipeline(layout, 1024, 8192, "cpu", 0, backend="reference")
    wl = Workload(layout, case, 0)
    batch, step = wl.next_step()
    pipe.update(batch)
    a, b = np.arange(256), np.arange(256)
    arms = ("update_sched", "step", "sched", "step_changed", "sched_changed")
    t: dict = {k: [] for k in ("unit", "update", "read", "construct")}
    state = {}
    for pre, pkg in trees(args):
        by_ids = pkg.MetadataPipeline(pkg.DSV4Layout.from_config("flash", max_model_len=131072), 1024, 8192, "cpu",
                                      0, backend="reference")
        by_ids.update(scheduler_output(step))
        sm = pkg.SlotMap(1024)
        sm.commit(pkg.batch_from_step(as_old(pkg if pre else None, step), sm, G)[1])
        state[pre] = (pkg, by_ids, sm)
        t.update({pre + k: [] for k in arms})
    gc.disable()
    for i in range(args.steps + 5):
        batch, step = wl.next_step()
        out = scheduler_output(step)
        ch = changed(step, i)
        ch_out = scheduler_output(ch)
        got = {"unit": unit_time(a, b), "update": timed(pipe.update, batch)}
        for pre in turns(list(state), i):
            pkg, by_ids, sm = state[pre]
            st, stc = as_old(pkg if pre else None, step), as_old(pkg if pre else None, ch)
            got.update({pre + k: v for k, v in zip(arms, (
                timed(by_ids.update, out), conv_time(pkg.batch_from_step, st, sm, G),
                conv_time(pkg.batch_from_scheduler_output, out, sm, G), conv_time(pkg.batch_from_step, stc, sm, G),
                conv_time(pkg.batch_from_scheduler_output, ch_out, sm, G)))})
            sm.commit(pkg.batch_from_step(st, sm, G)[1])
        run = step.running_requests
        got["read"] = timed(read_columns, run)
        t0 = time.perf_counter()
        [RunningRequest(r.req_id, r.new_block_ids, r.num_computed_tokens) for r in run]
        got["construct"] = time.perf_counter() - t0
        if i >= 5:
            for k, v in got.items():
                t[k].append(v)
    gc.enable()
    names = {"update": "update(StepBatch) safe"}
    for pre in state:
        who = "old " if pre else ""
        names.update({pre + "update_sched": f"{who}update(SchedulerOutput) safe, steady",
                      pre + "step": f"{who}batch_from_step, steady",
                      pre + "sched": f"{who}batch_from_scheduler_output, steady",
                      pre + "step_changed": f"{who}batch_from_step, first after a change (1 finished, 1 new)",
                      pre + "sched_changed": f"{who}batch_from_scheduler_output, first after a change"})
    names.update(read="reading the RunningRequests' 4 fields (not conversion)",
                 construct="building the StepInput's RunningRequests (not conversion)")
    report(f"decode B={args.batch}, Flash layout ({G} groups), {args.steps} steps, medians", t, names, "update",
           args.json)


class Churn:
    """Id-keyed steps of a churning MTP batch (see the module docstring), in vLLM's row order."""

    def __init__(self, layout, B: int, finish: int, join_ctx: int, reject: float = 0.3, seed: int = 0):
        self.alloc = [g.alloc_block_size for g in layout.groups]
        self.rng = np.random.default_rng(seed)
        self.B, self.finish, self.join_ctx, self.reject = B, finish, join_ctx, reject
        self.order: list = []
        self.nc: dict = {}
        self.held: dict = {}
        self.next_id, self.n = 1, 0
        self.joined: list = [self._join(int(c)) for c in self.rng.integers(1024, 8192, size=B)]

    def _ids(self, n: int) -> list:
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return ids

    def _join(self, ctx: int):
        rid = f"q{self.n}"
        self.n += 1
        self.nc[rid] = ctx
        self.held[rid] = [-(-(ctx + 2) // a) for a in self.alloc]
        return NewRequest(rid, tuple(self._ids(n) for n in self.held[rid]), ctx)

    def next_step(self) -> StepInput:
        """The next step (the first admits the whole batch)."""
        new, self.joined = self.joined, []
        finished = []
        if not new:
            gone = set(self.rng.choice(len(self.order), self.finish, replace=False).tolist())
            finished = [r for i, r in enumerate(self.order) if i in gone]
            self.order = [r for i, r in enumerate(self.order) if i not in gone]
            new = [self._join(self.join_ctx) for _ in range(self.finish)]
        running = []
        for rid in self.order:
            need = [-(-(self.nc[rid] + 2) // a) for a in self.alloc]
            lists = tuple(self._ids(max(n - h, 0)) for n, h in zip(need, self.held[rid]))
            self.held[rid] = [max(n, h) for n, h in zip(need, self.held[rid])]
            running.append(RunningRequest(rid, lists, self.nc[rid]))
        nst = {r.req_id: 2 for r in running}
        nst.update({r.req_id: 2 for r in new})
        step = StepInput(new, running, nst, finished_req_ids=finished)
        for r in running:  # NOTE: rejected drafts: num_computed_tokens advances by 1, not 2
            self.nc[r.req_id] += 1 if self.rng.random() < self.reject else 2
        for r in new:
            self.nc[r.req_id] += 2
        self.order = self.order + [r.req_id for r in new]  # NOTE: vLLM appends admitted requests
        return step


def floor(lists: list) -> None:
    """The issue's floor: one ``np.asarray(list, np.int32)`` per new block-id list."""
    for x in lists:
        np.asarray(x, np.int32)


def churn(args, layout) -> None:
    G = len(layout.groups)
    wl = Churn(layout, args.batch, args.finish, args.join_ctx)
    first = wl.next_step()
    a, b = np.arange(256), np.arange(256)
    arms = ("step", "sched", "commit", "update_sched")
    t: dict = {k: [] for k in ("unit", "floor")}
    state = {}
    for pre, pkg in trees(args):
        sm_step, sm_sched = pkg.SlotMap(1024), pkg.SlotMap(1024)
        sm_step.commit(pkg.batch_from_step(as_old(pkg if pre else None, first), sm_step, G)[1])
        sm_sched.commit(pkg.batch_from_scheduler_output(scheduler_output(first), sm_sched, G)[1])
        pipe = pkg.MetadataPipeline(pkg.DSV4Layout.from_config("flash", max_model_len=131072), 1024, 8192, "cpu",
                                    1, backend="reference")
        pipe.update(scheduler_output(first))
        state[pre] = (pkg, sm_step, sm_sched, pipe)
        t.update({pre + k: [] for k in arms})
    n_ids = []
    gc.disable()
    for i in range(args.steps + 5):
        step = wl.next_step()
        out = scheduler_output(step)
        lists = [x for r in step.new_requests for x in r.block_ids]
        got = {"unit": unit_time(a, b), "floor": conv_time(floor, lists)}
        for pre in turns(list(state), i):
            pkg, sm_step, sm_sched, pipe = state[pre]
            st = as_old(pkg if pre else None, step)
            got.update({pre + "step": conv_time(pkg.batch_from_step, st, sm_step, G),
                        pre + "sched": conv_time(pkg.batch_from_scheduler_output, out, sm_sched, G)})
            _, d2 = pkg.batch_from_scheduler_output(out, sm_sched, G)
            got[pre + "commit"] = timed(sm_sched.commit, d2)
            sm_step.commit(pkg.batch_from_step(st, sm_step, G)[1])
            got[pre + "update_sched"] = timed(pipe.update, out)
        n_ids.append(sum(map(len, lists)))
        if i >= 5:
            for k, v in got.items():
                t[k].append(v)
    gc.enable()
    names = {"floor": "floor: np.asarray(list, np.int32) per new block-id list"}
    for pre in state:
        who = "old " if pre else ""
        names.update({pre + "step": f"{who}batch_from_step, churn",
                      pre + "sched": f"{who}batch_from_scheduler_output, churn",
                      pre + "commit": f"{who}SlotMap.commit of the SchedulerOutput's delta",
                      pre + "update_sched": f"{who}update(SchedulerOutput) safe, churn (a pipeline)"})
    report(f"churn B={args.batch} x 2 (MTP), {args.finish} finish + {args.finish} join per step "
           f"({statistics.mean(n_ids):.0f} new ids), 30 % drafts rejected, {args.steps} steps, medians",
           t, names, "floor", args.json)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--churn", action="store_true", help="time the churn case instead of steady decode")
    ap.add_argument("--finish", type=int, default=4, help="churn: requests finishing (and joining) per step")
    ap.add_argument("--join-ctx", type=int, default=32768, help="churn: tokens of a joining request's context")
    ap.add_argument("--prefill", action="store_true", help="also time batch_from_step on the prefill and mixed "
                                                          "cases of workload.py")
    ap.add_argument("--json", action="store_true", help="also print one RESULT line of medians in units")
    ap.add_argument("--reps", type=int, default=1, help="time each pure conversion (and the floor) as the least "
                                                        "of this many calls on the same input (1: the first call)")
    ap.add_argument("--old", help="another checkout (e.g. a worktree of an older commit) whose package to time "
                                  "beside this one, interleaved in the same process (arms prefixed old_)")
    add_threads_option(ap)
    args = ap.parse_args()
    set_threads(args.threads)
    REPS[0] = args.reps
    layout = DSV4Layout.from_config("flash", max_model_len=131072)
    if args.churn:
        churn(args, layout)
    else:
        steady(args, layout)
    if args.prefill:
        prefill_cases(layout, 60)


def prefill_cases(layout, steps: int) -> None:
    """``batch_from_step`` on the prefill-heavy cases (a new request every step), medians."""
    from workload import CASES
    G = len(layout.groups)
    print("| case | batch_from_step µs |")
    print("|---|---|")
    for name in ("prefill 8K + 32K cached", "mixed 256 + 4K"):
        wl = Workload(layout, CASES[name], 0)
        _, step = wl.next_step()
        sm = SlotMap(1024)
        sm.commit(batch_from_step(step, sm, G)[1])
        tn = []
        gc.disable()
        for _ in range(steps):
            _, step = wl.next_step()
            tn.append(timed(batch_from_step, step, sm, G))
            sm.commit(batch_from_step(step, sm, G)[1])
        gc.enable()
        print(f"| {name} | {statistics.median(tn) * 1e6:.0f} |")


if __name__ == "__main__":
    main()
