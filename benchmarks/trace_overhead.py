"""Cost of recording a trace with output digests, per step, on the CPU (V4-Flash layout).

Per step, timed in turn: what ``update()`` + ``build()`` cost (the reference backend on the CPU: the
unit), what a recording adds to them (``record_steps``' own conversion of the step, the digests of
every output, the step and outputs lines serialised and written). Prints medians per step kind and
the bytes each step adds to the trace.

    python benchmarks/trace_overhead.py [--requests 64] [--prefill 2048] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))  # examples/_threads.py

from _threads import add_threads_option, set_threads  # noqa: E402
from dsv4_index import DSV4Layout, MetadataPipeline  # noqa: E402
from dsv4_index.frontend import batch_from_step  # noqa: E402
from dsv4_index.testing.scheduler import ReferenceScheduler, scripted_trace  # noqa: E402
from dsv4_index.tools.digest import output_digests  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=2048, help="prompt length of each request")
    ap.add_argument("--steps", type=int, default=20, help="steps timed per kind (prefill, decode)")
    ap.add_argument("--max-model-len", type=int, default=16384)
    add_threads_option(ap)
    a = ap.parse_args()
    set_threads(a.threads)
    lay = DSV4Layout.from_config("flash", max_model_len=a.max_model_len)
    T = 8192
    pipe = MetadataPipeline(lay, a.requests, T, "cpu", 1, backend="reference")
    sched = ReferenceScheduler(lay, 1 << 22, max_num_batched_tokens=T, max_num_seqs=a.requests,
                               num_speculative_tokens=1)
    script = [{"add": [dict(req_id=f"r{i}", prompt_len=a.prefill, max_new_tokens=a.max_model_len - a.prefill)
                       for i in range(a.requests)]}] + [{}] * (a.steps + a.requests * a.prefill // T + 2)
    rows = {"prefill": [], "decode": []}
    with tempfile.TemporaryDirectory() as d, open(Path(d) / "t.jsonl", "w") as f:
        for i, (step, _) in enumerate(scripted_trace(sched, script)):
            kind = "decode" if step.total_tokens <= 2 * a.requests else "prefill"
            t0 = time.perf_counter()
            batch, delta = batch_from_step(step, pipe.slot_map, len(lay.groups))    # what record_steps adds
            t1 = time.perf_counter()
            pipe.update(step)
            meta = pipe.build()
            t2 = time.perf_counter()
            dg = output_digests(meta, pipe)
            t3 = time.perf_counter()
            n = f.write(json.dumps(dict(type="step", index=i, pad_to=None, step=batch.to_json(),
                                        req_ids=list(delta.order)), separators=(",", ":")) + "\n")
            n += f.write(json.dumps(dict(type="outputs", index=i, digests=dg), separators=(",", ":")) + "\n")
            f.flush()
            t4 = time.perf_counter()
            if len(rows[kind]) < a.steps:
                rows[kind].append((t2 - t1, t3 - t2, (t1 - t0) + (t4 - t3), n, meta.num_tokens))
            if len(rows["decode"]) >= a.steps:
                break
    print(f"V4-Flash (max_model_len {a.max_model_len}), {a.requests} requests, prompts {a.prefill}, T_max {T}, "
          "CPU, reference backend; medians per step")
    print(f"{'step':8s} {'tokens':>7s} {'update+build ms':>16s} {'digests ms':>11s} {'lines ms':>9s} "
          f"{'recording/step':>15s} {'KiB/step':>9s}")
    for kind, r in rows.items():
        if not r:
            continue
        med = [statistics.median(x[i] for x in r) for i in range(5)]
        print(f"{kind:8s} {med[4]:7.0f} {1e3 * med[0]:16.2f} {1e3 * med[1]:11.2f} {1e3 * med[2]:9.2f} "
              f"{(med[1] + med[2]) / med[0]:14.0%} {med[3] / 1024:9.1f}")


if __name__ == "__main__":
    main()
