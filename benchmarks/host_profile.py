"""Host cost of ``MetadataPipeline.update(StepBatch)``, in numpy-op units, on any machine.

    python benchmarks/host_profile.py [--rounds 300] [--cases "decode B=256,decode B=1024"]
                                      [--build | --build-only | --lines]
    python benchmarks/host_profile.py --mix [--old /work/main] [--steps 300] [--mix-cases "serving mix"]  # old vs new
    python benchmarks/host_profile.py --cases "decode B=256,MTP 256x2" [--swa-per-layer]  # 4 vs 47 groups

``--mix`` (issues 26, 37): the serving mix, the churn stream (``serving_mix.py``), steady decode B=256 as a
StepBatch, and the same decode as an id-keyed ``StepInput`` and as a vLLM-style ``SchedulerOutput`` (through the
pipeline's own slot map); arms ``safe`` / ``full`` of this tree and, with ``--old PATH``, of the tree at PATH (its
``dsv4_index`` copied and imported as another package in the same process), interleaved step by step (the order
rotating every step), ``torch.set_num_threads(1)``, GC off, nothing built, ``warmup()`` first. Unit: op-eq, one
``np.add(a, b, out=c)`` on 256 int64, sampled before every step. Per arm: mean and p90 op-eq of ``update()`` per
step (each step the fastest of ``--replicas`` pipelines). ``--stub-owners``: the ownership pass (``state/owners``)
a no-op in every arm, so that the rest of ``update()`` is visible.

Unit: one numpy op, ``a + b`` on two int64 arrays of 256 entries (timed in the same run, interleaved
with the arms, so that a noisy or slow host moves the unit with the arms). For each case of
``workload.py`` (V4-Flash, server-sized: 1024 requests, 8192 tokens) every arm has its own pipeline
and its own copy of the workload (same seed, same steps) and the arms run round-robin, one step each
per round (the order rotating every round), GC off; medians over rounds:

* ``safe`` / ``full``: ``update()`` of a steady step at ``checks="safe"`` / ``"full"``;
* ``change safe`` / ``change full``: the first step after a batch change (one decode request finishes
  and a short new one (16-64 cached tokens) takes its slot), every fourth round (``n/a`` with fewer than
  eight rounds);
* ``StepInput``: the id-keyed conversion of the same steady step (``batch_from_step``).

With ``--build`` (CUDA only) also ``build()`` as a CUDA-graph replay, host time at 8 calls per busy
wait (``torch.cuda._sleep`` keeps the GPU busy so the host is never back-pressured).
Nothing is built in the ``update()`` arms (on the CPU ``build()`` runs the reference).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

from dsv4_index import DSV4Layout, MetadataPipeline, StepBatch, StepInput, batch_from_step  # noqa: E402
from dsv4_index.state.requests import SlotMap, SlotMapDelta  # noqa: E402
from workload import CASES, Workload  # noqa: E402

CHANGE_EVERY = 4


class Churn(Workload):
    """A workload whose ``next_step(change=True)`` finishes one decode request and admits a new one
    in its slot (same batch size, a new batch)."""

    def next_step(self, change: bool = False):
        if not change or self.first or not self.decode_ids:
            return super().next_step()
        k = self.n % len(self.decode_ids)
        old = self.decode_ids[k]
        slot = self.slots.pop(old)
        self.free.append(slot)
        # NOTE: a short request joins (16-64 cached tokens): the step measures the batch change, not the
        # staging of a long context's block lists (that is a prefill's cost)
        rid, lists = self._new(int(self.rng.integers(16, 65)), self.case.q_decode)
        self.decode_ids[k] = rid
        c = self.case
        rows, fresh = [], {rid: lists}
        for r in self.decode_ids:
            if r in fresh:
                rows.append((r, self.computed[r], c.q_decode, True, fresh[r], 0))
            else:
                rows.append((r, self.computed[r], c.q_decode, False, self._append(r, c.q_decode), -1))
        batch = self._batch(rows, [slot])
        step = self._step_input(rows, [old])
        for r, nc, q, *_ in rows:
            self.computed[r] = nc + q
        return batch, step


def unit_seconds(reps: int = 200) -> float:
    a, b = np.arange(256, dtype=np.int64), np.arange(256, dtype=np.int64)
    t0 = time.perf_counter()
    for _ in range(reps):
        a + b
    return (time.perf_counter() - t0) / reps


def shadow(pipe, wl) -> SlotMap:
    sm = SlotMap(pipe.max_num_reqs)
    sm.commit(SlotMapDelta(taken=dict(wl.slots)))  # NOTE: the workload's slots, through the public commit
    return sm


def profile(layout, case, rounds: int, device: str = "cpu") -> dict:
    q1 = case.q_decode - 1
    arms = {"safe": dict(checks="safe"), "full": dict(checks="full"), "change safe": dict(checks="safe"),
            "change full": dict(checks="full")}
    pipes = {k: MetadataPipeline(layout, 1024, 8192, device, q1, backend="reference", fused=False, **kw)
             for k, kw in arms.items()}
    loads = {k: Churn(layout, case, 0) for k in arms}
    conv = Churn(layout, case, 0)
    conv_pipe = MetadataPipeline(layout, 1024, 8192, device, q1, backend="reference", fused=False)
    # NOTE: steps are generated before timing (the generator's Python would cool the caches between arms)
    flags = [i >= 2 and i % CHANGE_EVERY == 0 for i in range(rounds + 2)]
    steps = {k: [loads[k].next_step(change=f and k.startswith("change"))[0] for f in flags] for k in arms}
    conv_steps = []
    for i in range(rounds + 2):
        sm = shadow(conv_pipe, conv)
        conv_steps.append((sm, conv.next_step()[1]))
    times = {k: [] for k in [*arms, "change safe next", "StepInput", "unit"]}
    times["change full next"] = []
    names = list(pipes)
    for i, change in enumerate(flags):
        times["unit"].append(unit_seconds())
        for k in names[i % len(names):] + names[:i % len(names)]:  # NOTE: rotate the order every round
            p = pipes[k]
            is_change_arm = k.startswith("change")
            batch = steps[k][i]
            t0 = time.perf_counter()
            p.update(batch)
            dt = time.perf_counter() - t0
            p.staging.applied()  # NOTE: nothing is built here; do not make the next update() apply it
            if is_change_arm and not change and i >= 3 and flags[i - 1]:
                times[k + " next"].append(dt)  # NOTE: the step after the change (the cache was rebuilt)
            if i < 2 or (is_change_arm and not change) or (change and not is_change_arm):
                continue
            times[k].append(dt)
        if i >= 2:
            sm, step = conv_steps[i]
            t0 = time.perf_counter()
            batch_from_step(step, sm, len(layout.groups))
            times["StepInput"].append(time.perf_counter() - t0)
    out = {k: statistics.median(v) if v else float("nan") for k, v in times.items()}
    out["n"] = {k: len(v) for k, v in times.items()}
    return out


def build_replay_host(layout, case, steps: int = 50, per_wait: int = 8) -> float:
    """Host µs of ``build()`` as a CUDA-graph replay, ``per_wait`` calls queued behind one busy wait."""
    import torch
    wl = Workload(layout, case, 0)
    pipe = MetadataPipeline(layout, 1024, 8192, "cuda", case.q_decode - 1, cuda_graphs=True)
    pipe.warmup()
    ts = []
    for i in range(steps):
        batch, _ = wl.next_step()
        pipe.update(batch)
        pipe.build()  # NOTE: captures the graph on first use of this T_pad
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)
        t0 = time.perf_counter()
        for _ in range(per_wait):
            pipe.build()
        ts.append((time.perf_counter() - t0) / per_wait)
        torch.cuda.synchronize()
    return statistics.median(ts[5:]) * 1e6


def line_profile(layout, case, steps: int = 300, pipes: int = 5) -> None:
    """Per-statement median µs of ``update()`` and its host passes (``RequestState.plan``, ``StepChecks.plan``,
    ``BlockOwners.check``, ``StepStaging.stage``), ``pipes`` pipelines of one case interleaved; a timer after every
    statement (≈ 0.15 µs each)."""
    import ast
    import collections
    import inspect
    import textwrap
    from dsv4_index import pipeline as pipe_mod
    from dsv4_index.state import checks as checks_mod, owners as own_mod, requests as req_mod, staging as stage_mod
    acc, last = collections.defaultdict(list), [0.0]
    pc = time.perf_counter

    def tick(key):
        acc[key].append(pc() - last[0])
        last[0] = pc()

    def start():
        last[0] = pc()

    sources = {}

    def instrument(mod, owner, name):
        src = textwrap.dedent(inspect.getsource(getattr(owner, name)))
        sources[name] = src.splitlines()
        tree = ast.parse(src)

        def timed(body):
            out = []
            for st in body:
                for field in ("body", "orelse"):
                    sub = getattr(st, field, None)
                    if isinstance(sub, list) and sub and isinstance(sub[0], ast.stmt):
                        setattr(st, field, timed(sub))
                out.append(st)
                if not isinstance(st, (ast.Return, ast.Raise, ast.Continue, ast.Break)):
                    out.append(ast.parse(f"_tick(({name!r}, {st.lineno}))").body[0])
            return out

        fn = tree.body[0]
        fn.body = [ast.parse("_start()").body[0]] + timed(fn.body)
        ast.fix_missing_locations(tree)
        env = dict(vars(mod), _tick=tick, _start=start)
        exec(compile(tree, mod.__file__, "exec"), env)
        setattr(owner, name, env[name])
        return env[name]

    if getattr(line_profile, "sources", None) is None:  # NOTE: instrument once per process
        instrument(req_mod, req_mod.RequestState, "plan")
        instrument(checks_mod, checks_mod.StepChecks, "plan")
        instrument(stage_mod, stage_mod.StepStaging, "stage")
        instrument(own_mod, own_mod.BlockOwners, "check")
        instrument(pipe_mod, pipe_mod.MetadataPipeline, "update")
        line_profile.sources, line_profile.acc, line_profile.last = sources, acc, last
    sources, acc = line_profile.sources, line_profile.acc
    acc.clear()
    ps = [MetadataPipeline(layout, 1024, 8192, "cpu", case.q_decode - 1, backend="reference", fused=False)
          for _ in range(pipes)]
    loads = [Workload(layout, case, 0) for _ in ps]
    work = [[w.next_step()[0] for _ in range(steps)] for w in loads]
    for i in range(steps):
        for p, w in zip(ps, work):
            if i == steps // 3 and p is ps[0]:
                acc.clear()
            p.update(w[i])
            p.staging.applied()
    print("| function | median µs | statement |\n|---|---|---|")
    for (name, line), v in sorted(acc.items()):
        m = statistics.median(v) * 1e6
        if m >= 0.25:
            print(f"| {name} | {m:.2f} | `{sources[name][line - 1].strip()[:90]}` |")


def op_eq_seconds(reps: int = 50) -> float:
    a, b, c = (np.arange(256, dtype=np.int64) for _ in range(3))
    t0 = time.perf_counter()
    for _ in range(reps):
        np.add(a, b, out=c)
    return (time.perf_counter() - t0) / reps


def load_old(path: str):
    """The ``dsv4_index`` package of the tree at ``path``, imported as ``dsv4_old`` (a copy in a temp dir)."""
    import importlib
    import shutil
    import tempfile
    tmp = Path(tempfile.mkdtemp(prefix="dsv4_old_"))
    shutil.copytree(Path(path) / "dsv4_index", tmp / "dsv4_old", ignore=shutil.ignore_patterns("__pycache__"))
    sys.path.insert(0, str(tmp))
    return importlib.import_module("dsv4_old")


def mix_streams(layout, steps: int):
    """``{case: [(StepBatch, pad_to)]}`` for the serving mix, the churn stream and steady decode B=256."""
    from serving_mix import Stream
    out = {}
    for name, churn in (("serving mix", False), ("churn 1+1", True)):
        st = Stream(layout, 256, 0, churn)
        out[name] = [st.next_step() for _ in range(steps + 2)]
        s = st.stats
        print(f"{name}: {s['finishes'] / s['steps']:.2f} finishes and {s['arrivals'] / s['steps']:.2f} arrivals "
              f"per step, {s['rejected'] / max(s['drafts'], 1):.2f} of drafts rejected, {s['runs'] / s['steps']:.0f} "
              f"runs and {s['crossing'] / s['steps']:.0f} crossing runs per step")
    wl = Workload(layout, CASES["decode B=256"], 0)
    out["steady decode B=256"] = [(wl.next_step()[0], None) for _ in range(steps + 2)]
    wl = Workload(layout, CASES["decode B=256"], 0)
    out["StepInput decode B=256"] = [(wl.next_step()[1], None) for _ in range(steps + 2)]
    sys.path.insert(0, str(ROOT.parent / "tests"))
    from helpers.vllm_stub import from_step
    wl = Workload(layout, CASES["decode B=256"], 0)
    out["SchedulerOutput decode B=256"] = [(from_step(wl.next_step()[1]), None) for _ in range(steps + 2)]
    return out


def port(x, mod):
    """A step of this tree as one of package ``mod`` (the old arm): StepBatch and StepInput rebuilt from their
    fields; a SchedulerOutput (duck-typed) as it is.

    NOTE: a StepInput is rebuilt for this tree's arms too, so that every arm's request objects are allocated the
    same way (together, as a scheduler builds them before the step): the workload's own objects lie scattered
    among the arrays it built beside them, and an arm reading those paid ≈ 14 µs a step of cache misses more than
    one reading rebuilt objects (the StepInput case at B = 256, issue 37)."""
    import dataclasses
    if mod is sys.modules["dsv4_index"] and not isinstance(x, StepInput):
        return x
    if isinstance(x, StepBatch):
        return mod.StepBatch(**_known(mod.StepBatch, vars(x)))
    if isinstance(x, StepInput):
        return dataclasses.replace(
            mod.StepInput(**_known(mod.StepInput, {k.name: getattr(x, k.name) for k in dataclasses.fields(x)})),
            new_requests=[mod.NewRequest(**_known(mod.NewRequest, vars(r))) for r in x.new_requests],
            running_requests=[mod.RunningRequest(**_known(mod.RunningRequest, vars(r))) for r in x.running_requests])
    return x


def _known(cls, kw: dict) -> dict:
    """``kw`` less the fields an older tree's ``cls`` lacks, which must be unset (None or empty) here (``drafts``)."""
    import dataclasses
    names = {f.name for f in dataclasses.fields(cls)}
    extra = {k: v for k, v in kw.items() if k not in names}
    if any(v is not None and not (isinstance(v, (dict, list, tuple)) and not v) for v in extra.values()):
        raise ValueError(f"the old tree's {cls.__name__} lacks the fields {sorted(extra)}, set in this step")
    return {k: v for k, v in kw.items() if k in names}


class ConversionFloor:
    """The issue's conversion floor of a SchedulerOutput step: one plain Python loop that reads every request's
    fields the SchedulerOutput carries into preallocated arrays, block-id lists through
    ``np.asarray(list, np.int32)`` (no checks, no slot map: the least any conversion must do)."""

    def __init__(self, max_rows: int = 4096):
        self.nc = np.zeros(max_rows, dtype=np.int64)
        self.q = np.zeros(max_rows, dtype=np.int64)
        self.drafts = np.zeros(max_rows, dtype=np.int64)
        self.resumed = np.zeros(max_rows, dtype=bool)
        self.replay = np.zeros(max_rows, dtype=np.int64)

    def update(self, so, pad_to=None) -> None:
        nst, spec = so.num_scheduled_tokens, so.scheduled_spec_decode_tokens or {}
        nc, q, drafts, resumed, replay = self.nc, self.q, self.drafts, self.resumed, self.replay
        blocks = []
        i = 0
        for r in so.scheduled_new_reqs:
            rid = r.req_id
            nc[i], q[i], replay[i] = r.num_computed_tokens, nst[rid], r.replay_start or 0
            d = spec.get(rid)
            drafts[i] = len(d) if d else 0
            blocks.append([np.asarray(b, np.int32) for b in r.block_ids])
            i += 1
        c = so.scheduled_cached_reqs
        res = c.resumed_req_ids
        for rid, ids, n in zip(c.req_ids, c.new_block_ids, c.num_computed_tokens):
            nc[i], q[i], resumed[i] = n, nst[rid], rid in res
            d = spec.get(rid)
            drafts[i] = len(d) if d else 0
            if ids is not None:
                blocks.append([np.asarray(b, np.int32) for b in ids])
            i += 1
        self.gone = [*so.finished_req_ids, *(so.preempted_req_ids or ())]
        self.blocks = blocks


def stub_owners(mod) -> None:
    """``--stub-owners``: the ownership pass of package ``mod`` (``state/owners``) made a no-op (check and commit), so
    that the rest of ``update()`` is visible (timing only: the steps of the mix are valid)."""
    cls = mod.state.owners.BlockOwners
    cls.check = cls.commit = lambda self, plan: None


def mix_profile(steps: int, old_path, replicas: int, only=None, stub: bool = False) -> None:
    import torch
    torch.set_num_threads(1)
    mods = {"new": sys.modules["dsv4_index"]}
    if old_path:
        mods["old"] = load_old(old_path)
    if stub:
        for mod in mods.values():
            stub_owners(mod)
    layout = DSV4Layout.from_config("flash", max_model_len=131072)
    streams = mix_streams(layout, steps)
    print("| case | arm | mean op-eq | mean w/o top 2 % | p50 | p90 op-eq | mean µs |\n|---|---|---|---|---|---|---|")
    for case, work in streams.items():
        if only and case not in only:
            continue
        arms = {}
        gc.collect()  # NOTE: GC is off while timing; the last case's pipelines (cycles) would pile up to an OOM kill
        for tag, mod in mods.items():
            lay = mod.DSV4Layout.from_config("flash", max_model_len=131072)
            own = [(port(b, mod), pad) for b, pad in work]
            for checks in ("safe", "full"):
                pipes = [mod.MetadataPipeline(lay, 1024, 8192, "cpu", 1, backend="reference", fused=False,
                                              checks=checks) for _ in range(replicas)]
                for p in pipes:
                    p.warmup()
                arms[f"{tag} {checks}"] = (pipes, own)
        if case.startswith("SchedulerOutput"):
            arms["conversion floor"] = ([ConversionFloor() for _ in range(replicas)], work)
        times, units, refused = {k: [] for k in arms}, [], {}
        names = list(arms)
        for i in range(len(work)):
            units.append(op_eq_seconds())
            for k in names[i % len(names):] + names[:i % len(names)]:
                if k in refused:
                    continue
                pipes, own = arms[k]
                best = None
                for p in pipes:
                    b, pad = own[i]
                    t0 = time.perf_counter()
                    try:
                        p.update(b, pad_to=pad)
                    except ValueError as e:  # NOTE: a tree that rejects a step of the stream: said, not timed
                        refused[k] = f"step {i}: {e}"
                        break
                    dt = time.perf_counter() - t0
                    if hasattr(p, "staging"):
                        p.staging.applied()
                    best = dt if best is None else min(best, dt)
                if i >= 2 and k not in refused:
                    times[k].append(best)
        u = statistics.median(units)
        for k, why in refused.items():
            print(f"| {case} | {k} | rejected {why[:300]} | | | | |", flush=True)
            names.remove(k)
        for k in names:
            v = np.sort(np.asarray(times[k]) / u)
            trim = v[:max(1, int(len(v) * 0.98))].mean()
            print(f"| {case} | {k} | {v.mean():.0f} | {trim:.0f} | {np.median(v):.0f} | {np.percentile(v, 90):.0f} | "
                  f"{np.mean(times[k]) * 1e6:.1f} |", flush=True)
        print(f"| {case} | unit (µs) | {u * 1e6:.3f} | | | | |", flush=True)


def _num(x: float, digits: int = 0) -> str:
    return "n/a" if x != x else f"{x:.{digits}f}"  # NOTE: NaN: no step of that kind in the rounds run


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--cases", default="decode B=256,decode B=1024,MTP 256x2,prefill 8K + 32K cached")
    ap.add_argument("--build", action="store_true", help="also time build() graph replay on CUDA")
    ap.add_argument("--build-only", action="store_true", help="only the build() graph replay figure (CUDA)")
    ap.add_argument("--lines", action="store_true", help="per-statement profile of update()'s host passes (CPU)")
    ap.add_argument("--device", default="cpu", help="device of the update() arms' pipelines (pinned staging "
                                                   "and a real H2D copy on cuda)")
    ap.add_argument("--swa-per-layer", action="store_true", help="V4-Flash with one sliding group per layer "
                    "(47 groups; host cost against the number of groups)")
    ap.add_argument("--mix", action="store_true", help="issue 26: serving mix, churn and steady decode, old vs new")
    ap.add_argument("--old", default=None, help="with --mix: a tree whose dsv4_index is the old arm")
    ap.add_argument("--steps", type=int, default=300, help="with --mix: steps per case")
    ap.add_argument("--mix-cases", default=None, help="with --mix: only these cases (comma-separated names)")
    ap.add_argument("--replicas", type=int, default=1, help="with --mix: pipelines per arm (fastest counts)")
    ap.add_argument("--stub-owners", action="store_true", help="with --mix: the ownership pass (state/owners) a no-op "
                    "in every arm, so the rest of update() is visible")
    args = ap.parse_args()
    layout = DSV4Layout.from_config("flash", max_model_len=131072, swa_group_per_layer=args.swa_per_layer)
    gc.disable()
    if args.mix:
        mix_profile(args.steps, args.old, args.replicas, args.mix_cases.split(",") if args.mix_cases else None,
                    args.stub_owners)
        return
    print(f"numpy-op unit: a + b on 256 int64, timed interleaved with the arms (µs = this run's host only); "
          f"update() arms on {args.device}")
    print("| case | unit µs | safe | full | change safe | change full | change ÷ safe | next after change (safe) | "
          "StepInput |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.cases.split(","):
        if args.lines:
            print(f"update() of {name}, 5 pipelines interleaved:")
            line_profile(layout, CASES[name])
            continue
        if args.build_only:
            print(f"| {name} | build() graph replay host µs at 8 calls per busy wait | "
                  f"{build_replay_host(layout, CASES[name]):.1f} |", flush=True)
            continue
        r = profile(layout, CASES[name], args.rounds, args.device)
        u = r["unit"]
        keys = ("safe", "full", "change safe", "change full")
        print(f"| {name} | {u * 1e6:.3f} | " + " | ".join(_num(r[k] / u) for k in keys) +
              f" | {_num(r['change safe'] / r['safe'], 2)} | {_num(r['change safe next'] / u)} | "
              f"{_num(r['StepInput'] / u)} |", flush=True)
        print("|   (µs) | | " + " | ".join(_num(r[k] * 1e6, 1) for k in keys) +
              f" | | {_num(r['change safe next'] * 1e6, 1)} | {_num(r['StepInput'] * 1e6, 1)} |", flush=True)
        if args.build:
            print(f"|   build() graph replay host µs at 8 calls per busy wait | "
                  f"{build_replay_host(layout, CASES[name]):.1f} |", flush=True)


if __name__ == "__main__":
    main()
