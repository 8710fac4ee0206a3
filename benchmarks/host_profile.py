"""Host cost of ``MetadataPipeline.update()`` per phase, on any machine (no kernel runs).

    python benchmarks/host_profile.py [--steps 200] [--cases "decode B=256,decode B=1024"]

For each case of ``workload.py`` (V4-Flash, server-sized: 1024 requests, 8192 tokens): the median µs of
``update(StepBatch)`` with ``checks="safe"`` and ``"full"``, of the ``StepInput`` conversion
(``batch_from_step``), and of the two phases of a safe update: the checks (``plan_step``) and the
staging fill + copy. GC off, medians over steady steps. ``build()`` is not timed here (on CPU it runs
the reference; on the H200 ``bench_step.py`` times it).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

from dsv4_index import DSV4Layout, MetadataPipeline, batch_from_step  # noqa: E402
from dsv4_index.batch import SlotMap  # noqa: E402
from dsv4_index.state import plan_step  # noqa: E402
from workload import CASES, Workload  # noqa: E402


def shadow(pipe, wl):
    sm = SlotMap(pipe.max_num_reqs)
    sm.slot_of = dict(wl.slots)
    sm._free = sorted(set(range(pipe.max_num_reqs)) - set(wl.slots.values()), reverse=True)
    return sm


def profile(layout, case, steps: int) -> dict:
    out = {}
    for checks in ("safe", "full"):
        pipe = MetadataPipeline(layout, 1024, 8192, "cpu", case.q_decode - 1, checks=checks, backend="reference")
        wl = Workload(layout, case, 0)
        ts, tp, tc, tsg = [], [], [], []
        for i in range(steps + 3):
            sm = shadow(pipe, wl) if checks == "safe" else None
            batch, step = wl.next_step()
            if checks == "safe" and i >= 3:
                t0 = time.perf_counter()
                batch_from_step(step, sm, len(layout.groups))
                tc.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                plan_step(batch, occupied=pipe._occupied, tables=pipe.tables, cp=pipe.cp,
                          max_num_tokens=pipe.max_num_tokens, max_writes=pipe.max_staged_blocks, pad_to=None,
                          decode_threshold=1 + pipe.num_speculative_tokens, level=checks)
                tp.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            pipe.update(batch)
            if i >= 3:
                ts.append(time.perf_counter() - t0)
            pipe._staged_writes = 0  # NOTE: nothing is built here; do not make update() apply it
        out[f"update_{checks}"] = statistics.median(ts) * 1e6
        if checks == "safe":
            out["checks"] = statistics.median(tp) * 1e6
            out["staging"] = out["update_safe"] - out["checks"]
            out["step_input"] = statistics.median(tc) * 1e6
            out["h2d_bytes"] = pipe.last_step_stats.h2d_bytes
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--cases", default="decode B=1,decode B=256,decode B=1024,MTP 256x2,prefill 8K,"
                                       "prefill 8K + 32K cached,mixed 256 + 4K")
    args = ap.parse_args()
    layout = DSV4Layout.from_config("flash", max_model_len=131072)
    print("| case | update(StepBatch) safe µs | of which checks / staging | full checks µs | StepInput "
          "conversion µs | H2D bytes |")
    print("|---|---|---|---|---|---|")
    gc.disable()
    for name in args.cases.split(","):
        r = profile(layout, CASES[name], args.steps)
        print(f"| {name} | {r['update_safe']:.1f} | {r['checks']:.1f} / {r['staging']:.1f} | {r['update_full']:.1f} | "
              f"{r['step_input']:.1f} | {r['h2d_bytes']} |", flush=True)


if __name__ == "__main__":
    main()
