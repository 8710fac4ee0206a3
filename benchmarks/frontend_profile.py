"""Host cost of the id-keyed front ends, in numpy-op units (stable on a noisy machine).

    python benchmarks/frontend_profile.py [--steps 300] [--batch 256]

One unit = ``a + b`` on two int64 arrays of 256 (timed in the same run, interleaved with the arms).
Arms, round-robin per step, GC off, medians over steady steps (V4-Flash layout, decode, every request
appends at most one block per group; ``workload.py``):

* ``update(StepBatch)`` safe, the array-form step (the reference the issue quotes);
* ``batch_from_step`` of the same step as a ``StepInput``;
* ``batch_from_scheduler_output`` of the same step as a vLLM ``SchedulerOutput`` (``new_block_ids``
  None for a request without new blocks, as vLLM sends it);
* the same two conversions on the first step after a batch change (one request finished, one new);
* building the ``StepInput`` itself (its ``RunningRequest`` objects), for scale.

Each conversion runs against a slot map committed from the previous step (the steady state an engine
sees). ``--baseline REV`` (a git revision from ``1cc7a01`` on, e.g. ``1cc7a01``, round 1) adds the same
conversions by that revision's converter (its ``frontend.py`` and ``step_rules.py``), interleaved, and
checks every batch against it (values and dtypes). Prints one table; ``benchmarks/FRONTEND.md`` keeps the figures.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from operator import attrgetter
from pathlib import Path
from types import SimpleNamespace as NS

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from dsv4_index import DSV4Layout, MetadataPipeline, NewRequest, RunningRequest, StepInput  # noqa: E402
from dsv4_index.frontend import batch_from_scheduler_output, batch_from_step  # noqa: E402
from dsv4_index.state.requests import SlotMap  # noqa: E402
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


def committed(sm: SlotMap, step: StepInput) -> SlotMap:
    """A slot map holding ``step``'s running requests in ``sm``'s slots, with the last batch cached."""
    _, d = batch_from_step(StepInput([], step.running_requests, dict(step.num_scheduled_tokens)), sm, None)
    sm.commit(d)
    return sm


def load_baseline(rev: str):
    """The front end of git revision ``rev`` (its ``frontend.py`` with its own ``step_rules.py``) as
    the module ``dsv4_index._baseline_frontend``."""
    import importlib.util
    import subprocess
    mods = {}
    for name in ("step_rules", "frontend"):
        src = subprocess.run(["git", "show", f"{rev}:dsv4_index/{name}.py"], cwd=ROOT.parent, check=True,
                             capture_output=True, text=True).stdout
        src = src.replace("from .step_rules import", "from ._baseline_step_rules import")
        spec = importlib.util.spec_from_loader(f"dsv4_index._baseline_{name}", loader=None)
        mod = importlib.util.module_from_spec(spec)
        mod.__package__ = "dsv4_index"
        sys.modules[spec.name] = mod
        exec(compile(src, f"{rev}:dsv4_index/{name}.py", "exec"), mod.__dict__)
        mods[name] = mod
    return mods["frontend"]


def same(a, b) -> None:
    for k in a.__dataclass_fields__:
        x, y = getattr(a, k), getattr(b, k)
        assert (x is None) == (y is None), k
        assert x is None or (x.dtype == y.dtype and np.array_equal(x, y)), k


_FIELDS = [attrgetter(f) for f in ("resumed", "req_id", "new_block_ids", "num_computed_tokens")]


def read_columns(run) -> list:
    """The four attribute passes over the running requests that ``batch_from_step`` cannot avoid."""
    return [list(map(f, run)) for f in _FIELDS]


def timed(fn, *a):
    t0 = time.perf_counter()
    fn(*a)
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--baseline", help="a git revision whose front end (frontend.py + step_rules.py) to compare "
                                       "with (timing and outputs), e.g. 1cc7a01 (round 1)")
    ap.add_argument("--prefill", action="store_true", help="also time batch_from_step on the prefill and mixed "
                                                          "cases of workload.py (against --baseline if given)")
    args = ap.parse_args()
    old = load_baseline(args.baseline) if args.baseline else None
    layout = DSV4Layout.from_config("flash", max_model_len=131072)
    G = len(layout.groups)
    case = Case(f"decode B={args.batch}", decodes=args.batch)
    pipe = MetadataPipeline(layout, 1024, 8192, "cpu", 0, backend="reference")
    wl = Workload(layout, case, 0)
    batch, step = wl.next_step()
    pipe.update(batch)
    pipe._staged_writes = 0
    a, b = np.arange(256), np.arange(256)
    t = {k: [] for k in ("unit", "update", "step", "sched", "step_changed", "sched_changed", "read", "construct")}
    checked = 0
    sm = SlotMap(1024)
    sm.commit(batch_from_step(step, sm, G)[1])
    if old is not None:
        osm = old.SlotMap(1024)
        osm.commit(old.batch_from_step(step, osm, G)[1])
        for k in ("old_step", "old_sched", "old_step_changed", "old_sched_changed"):
            t[k] = []
    gc.disable()
    for i in range(args.steps + 5):
        batch, step = wl.next_step()
        out = scheduler_output(step)
        ch = changed(step, i)
        ch_out = scheduler_output(ch)
        t0 = time.perf_counter()
        for _ in range(32):
            a + b
        unit = (time.perf_counter() - t0) / 32
        t_upd = timed(pipe.update, batch)
        pipe._staged_writes = 0  # NOTE: nothing is built here; do not make update() apply it

        def ours():
            return [timed(batch_from_step, step, sm, G), timed(batch_from_scheduler_output, out, sm, G),
                    timed(batch_from_step, ch, sm, G), timed(batch_from_scheduler_output, ch_out, sm, G)]

        def theirs():
            return [timed(old.batch_from_step, step, osm, G), timed(old.batch_from_scheduler_output, out, osm, G),
                    timed(old.batch_from_step, ch, osm, G), timed(old.batch_from_scheduler_output, ch_out, osm, G)]
        # NOTE: with a baseline, the two converters take turns going first (the first touches the step cold)
        if old is not None and i % 2:
            t_old, (t_step, t_sched, t_ch, t_ch_out) = theirs(), ours()
        else:
            (t_step, t_sched, t_ch, t_ch_out), t_old = ours(), (theirs() if old is not None else ())
        run = step.running_requests
        t_read = timed(read_columns, run)
        t0 = time.perf_counter()
        [RunningRequest(r.req_id, r.new_block_ids, r.num_computed_tokens) for r in run]
        t_con = time.perf_counter() - t0
        if old is not None:
            for fn, ofn, x in ((batch_from_step, old.batch_from_step, step), (batch_from_step, old.batch_from_step, ch),
                               (batch_from_scheduler_output, old.batch_from_scheduler_output, out),
                               (batch_from_scheduler_output, old.batch_from_scheduler_output, ch_out)):
                same(fn(x, sm, G)[0], ofn(x, osm, G)[0])
                checked += 1
            osm.commit(old.batch_from_step(step, osm, G)[1])
        _, d = batch_from_step(step, sm, G)
        sm.commit(d)
        if i >= 5:
            for k, v in zip(t, (unit, t_upd, t_step, t_sched, t_ch, t_ch_out, t_read, t_con, *t_old)):
                t[k].append(v)
    gc.enable()
    med = {k: statistics.median(v) * 1e6 for k, v in t.items()}
    u = med["unit"]
    print(f"decode B={args.batch}, Flash layout ({G} groups), {args.steps} steps, medians; unit = a + b on 256 "
          f"int64 = {u:.3f} µs")
    print("| arm | µs | units | × update(StepBatch) |")
    print("|---|---|---|---|")
    names = {"update": "update(StepBatch) safe", "step": "batch_from_step, steady",
             "sched": "batch_from_scheduler_output, steady",
             "step_changed": "batch_from_step, first after a change (1 finished, 1 new)",
             "sched_changed": "batch_from_scheduler_output, first after a change",
             "read": "reading the RunningRequests' 4 fields (not conversion)",
             "construct": "building the StepInput's RunningRequests (not conversion)"}
    if old is not None:
        names.update(old_step="baseline batch_from_step, steady",
                     old_sched="baseline batch_from_scheduler_output, steady",
                     old_step_changed="baseline batch_from_step, first after a change",
                     old_sched_changed="baseline batch_from_scheduler_output, first after a change")
    for k, name in names.items():
        print(f"| {name} | {med[k]:.1f} | {med[k] / u:.0f} | {med[k] / med['update']:.2f} |")
    if old is not None:
        print(f"{checked} batches equal to the baseline's (values and dtypes)")
    if args.prefill:
        prefill_cases(layout, old, 60)


def prefill_cases(layout, old, steps: int) -> None:
    """``batch_from_step`` on the prefill-heavy cases (a new request every step), medians."""
    from workload import CASES
    G = len(layout.groups)
    print("| case | batch_from_step µs | baseline µs |")
    print("|---|---|---|")
    for name in ("prefill 8K + 32K cached", "mixed 256 + 4K"):
        wl = Workload(layout, CASES[name], 0)
        _, step = wl.next_step()
        sm = SlotMap(1024)
        sm.commit(batch_from_step(step, sm, G)[1])
        if old is not None:
            osm = old.SlotMap(1024)
            osm.commit(old.batch_from_step(step, osm, G)[1])
        tn, to = [], []
        gc.disable()
        for _ in range(steps):
            _, step = wl.next_step()
            tn.append(timed(batch_from_step, step, sm, G))
            if old is not None:
                to.append(timed(old.batch_from_step, step, osm, G))
                same(batch_from_step(step, sm, G)[0], old.batch_from_step(step, osm, G)[0])
                osm.commit(old.batch_from_step(step, osm, G)[1])
            sm.commit(batch_from_step(step, sm, G)[1])
        gc.enable()
        base = f"{statistics.median(to) * 1e6:.0f}" if to else "-"
        print(f"| {name} | {statistics.median(tn) * 1e6:.0f} | {base} |")


if __name__ == "__main__":
    main()
