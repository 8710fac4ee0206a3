"""Host cost of ``MetadataPipeline.update(StepBatch)``, in numpy-op units, on any machine.

    python benchmarks/host_profile.py [--rounds 300] [--cases "decode B=256,decode B=1024"]
                                      [--build | --build-only | --lines]

Unit: one numpy op, ``a + b`` on two int64 arrays of 256 entries (timed in the same run, interleaved
with the arms, so that a noisy or slow host moves the unit with the arms). For each case of
``workload.py`` (V4-Flash, server-sized: 1024 requests, 8192 tokens) every arm has its own pipeline
and its own copy of the workload (same seed, same steps) and the arms run round-robin, one step each
per round (the order rotating every round), GC off; medians over rounds:

* ``safe`` / ``full``: ``update()`` of a steady step at ``checks="safe"`` / ``"full"``;
* ``general``: the same steady step through the general checks only (``steady=False``: the path every
  step took before the steady path);
* ``change safe`` / ``change full``: the first step after a batch change (one decode request finishes
  and a short new one (16-64 cached tokens) takes its slot: a new batch, the general checks and a
  rebuilt steady cache), every fourth round;
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

from dsv4_index import DSV4Layout, MetadataPipeline, batch_from_step  # noqa: E402
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
    arms = {"safe": dict(checks="safe"), "full": dict(checks="full"), "general": dict(checks="safe", steady=False),
            "change safe": dict(checks="safe"), "change full": dict(checks="full")}
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
    steady_hits = {k: 0 for k in arms}
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
            steady_hits[k] += bool(p.last_plan_was_steady)
        if i >= 2:
            sm, step = conv_steps[i]
            t0 = time.perf_counter()
            batch_from_step(step, sm, len(layout.groups))
            times["StepInput"].append(time.perf_counter() - t0)
    out = {k: statistics.median(v) for k, v in times.items() if v}
    out["steady_hits"] = steady_hits
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
    """Per-statement median µs of the steady path (``plan_steady``, ``stage``, ``_stage_appends``),
    ``pipes`` pipelines of one case interleaved; a timer after every statement (≈ 0.15 µs each)."""
    import ast
    import collections
    import inspect
    import textwrap
    from dsv4_index.state import requests as req_mod, staging as stage_mod, steady as steady_mod, tables as tab_mod
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
        req_mod.plan_steady = instrument(steady_mod, steady_mod, "plan_steady")
        instrument(tab_mod, tab_mod.BlockTables, "_stage_appends")
        instrument(stage_mod, stage_mod.StepStaging, "stage")
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--cases", default="decode B=256,decode B=1024,MTP 256x2,prefill 8K + 32K cached")
    ap.add_argument("--build", action="store_true", help="also time build() graph replay on CUDA")
    ap.add_argument("--build-only", action="store_true", help="only the build() graph replay figure (CUDA)")
    ap.add_argument("--lines", action="store_true", help="per-statement profile of the steady path (CPU)")
    ap.add_argument("--device", default="cpu", help="device of the update() arms' pipelines (pinned staging "
                                                   "and a real H2D copy on cuda)")
    args = ap.parse_args()
    layout = DSV4Layout.from_config("flash", max_model_len=131072)
    gc.disable()
    print(f"numpy-op unit: a + b on 256 int64, timed interleaved with the arms (µs = this run's host only); "
          f"update() arms on {args.device}")
    print("| case | unit µs | safe | full | general (before) | change safe | change full | change ÷ safe | "
          "next after change (safe) | StepInput | steady hits safe/full |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.cases.split(","):
        if args.lines:
            print(f"steady path of {name}, 5 pipelines interleaved:")
            line_profile(layout, CASES[name])
            continue
        if args.build_only:
            print(f"| {name} | build() graph replay host µs at 8 calls per busy wait | "
                  f"{build_replay_host(layout, CASES[name]):.1f} |", flush=True)
            continue
        r = profile(layout, CASES[name], args.rounds, args.device)
        u = r["unit"]
        h = r["steady_hits"]
        print(f"| {name} | {u * 1e6:.3f} | {r['safe'] / u:.0f} | {r['full'] / u:.0f} | {r['general'] / u:.0f} | "
              f"{r['change safe'] / u:.0f} | {r['change full'] / u:.0f} | {r['change safe'] / r['safe']:.2f} | "
              f"{r['change safe next'] / u:.0f} | {r['StepInput'] / u:.0f} | "
              f"{h['safe']}/{r['n']['safe']}, {h['full']}/{r['n']['full']} |", flush=True)
        print(f"|   (µs) | | {r['safe'] * 1e6:.1f} | {r['full'] * 1e6:.1f} | {r['general'] * 1e6:.1f} | "
              f"{r['change safe'] * 1e6:.1f} | {r['change full'] * 1e6:.1f} | | {r['change safe next'] * 1e6:.1f} | "
              f"{r['StepInput'] * 1e6:.1f} | |", flush=True)
        if args.build:
            print(f"|   build() graph replay host µs at 8 calls per busy wait | "
                  f"{build_replay_host(layout, CASES[name]):.1f} |", flush=True)


if __name__ == "__main__":
    main()
