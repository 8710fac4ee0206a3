"""Host cost of ``MetadataPipeline.update()`` (CPU only, no kernels) and the bytes one step copies.

    python benchmarks/host_profile.py [--reqs 256 1024] [--steps 500] [--max-model-len 131072]

Steady decode of ``--reqs`` requests on the Flash layout: every step each request schedules one
token and appends a block to a group whenever its length crosses that group's block boundary.
Prints the median and p90 ``update()`` time (µs) per batch size and the mean H2D bytes per step
(``last_step_stats``).
``build()`` is not timed: on CPU it would run the reference or the interpreter, not the host path.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # NOTE: only to construct the fused plan; nothing launches
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4_index import DSV4Layout, MetadataPipeline  # noqa: E402
from dsv4_index.step import NewRequest, RunningRequest, StepInput  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "dsv4_index" / "configs"


def decode_steps(layout, B: int, steps: int, ctx0: int = 3000):
    """(admit step, [decode steps]) with block ids from a counter (never reused)."""
    nxt = [1]

    def take(n):
        ids = list(range(nxt[0], nxt[0] + n))
        nxt[0] += n
        return ids

    groups = layout.groups
    lens = {f"r{i}": ctx0 + 37 * i for i in range(B)}
    new = [NewRequest(rid, tuple(take(-(-(n + 1) // g.alloc_block_size)) for g in groups), n)
           for rid, n in lens.items()]
    admit = StepInput(new, [], {rid: 1 for rid in lens}, set(), set())
    lens = {rid: n + 1 for rid, n in lens.items()}
    out = []
    for _ in range(steps):
        running = []
        for rid, n in lens.items():
            add = tuple(take(1) if n % g.alloc_block_size == 0 else [] for g in groups)
            running.append(RunningRequest(rid, add, n))
        out.append(StepInput([], running, {rid: 1 for rid in lens}, set(), set()))
        lens = {rid: n + 1 for rid, n in lens.items()}
    return admit, out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reqs", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--max-model-len", type=int, default=131072)
    a = ap.parse_args(argv)
    layout = DSV4Layout.from_config(CONFIGS / "flash.json", max_model_len=a.max_model_len)
    widths = {g.name: g.table_width for g in layout.groups}
    print(f"flash max_model_len={a.max_model_len} table widths {widths}")
    for B in a.reqs:
        run(layout, B, a.steps)


def run(layout, B: int, steps: int) -> None:
    pipe = MetadataPipeline(layout, B, max(B, 256), "cpu", fused=True)
    assert pipe._fused is not None
    admit, trace = decode_steps(layout, B, steps)
    pipe.update(admit)
    pipe._pending = []
    times, nbytes, tbytes = [], [], []
    for st in trace:
        t0 = time.perf_counter()
        pipe.update(st)
        times.append((time.perf_counter() - t0) * 1e6)
        pipe._pending = []  # NOTE: stands in for build(), whose one launch applies the staged segments
        nbytes.append(pipe.last_step_stats.h2d_bytes)
        tbytes.append(pipe.last_step_stats.table_bytes)
    print(f"B={B} decode: update() median {statistics.median(times):.1f} us "
          f"(p90 {sorted(times)[int(0.9 * len(times))]:.1f} us) over {len(times)} steps; "
          f"H2D {statistics.mean(nbytes):.0f} B/step (block-table segments {statistics.mean(tbytes):.0f} B), "
          f"1 copy/step")
    whole = sum(4 * (g.table_width + 1) * B / g.alloc_block_size * g.blocks_per_kv_block for g in layout.groups)
    print(f"  whole-row commit of the same appends would copy ~{whole:.0f} B/step")

if __name__ == "__main__":
    main()
