"""GPU time of one fused build for DeepSeek-V4.1 layouts against V4-Flash (issue 28): a decode step of
``B`` requests at context ``ctx`` (no drafts), for V4-Flash, V4.1-Flash (one sliding group) and V4.1-Flash
with one sliding group per layer (45 groups). The timed step is the first step of ``B`` requests that join
with ``ctx`` tokens already computed (a whole-prompt prefix hit) and schedule one token each: the same
tables, index lists and slot mappings as a decode step at that context, without the prefills (the 45-group
setup through the reference scheduler took over 230 s on the H200's host). Block ids: distinct per group,
never zero. ``--scheduler`` builds the step through the reference scheduler's prefills instead. Prints the
launches per build and the build's GPU time (graph-amortized: ``k`` launches captured in one CUDA graph,
median per launch; and one single-launch graph replay), and the setup time (the first build compiles the
layout's kernel: the 45-group kernel's compile dominates it).

    python benchmarks/v41_groups.py [--B 256] [--ctx 2048]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "examples"))  # examples/_threads.py: --threads (default 1)

from bench_step import graph_time  # noqa: E402

from _threads import add_threads_option, set_threads  # noqa: E402
from dsv4_index import DSV4Layout, MetadataPipeline  # noqa: E402
from dsv4_index.testing.scheduler import ReferenceScheduler  # noqa: E402


def decode_step(layout, B: int, ctx: int, budget: int, device: str):
    """A pipeline after the prefills of ``B`` requests of ``ctx`` tokens, holding their first decode step."""
    # NOTE: no request finishes before the last prefill is done (they are prefilled budget tokens a step), and
    # a pool that never preempts: a sliding group may hold a whole prefill chunk's blocks
    new = B * ctx // budget + 32
    need = sum(g.ring_blocks if g.kind == "circular" else
               -(-(ctx + new + 64 + (g.window or 0)) // g.alloc_block_size) + 2 for g in layout.groups)
    sched = ReferenceScheduler(layout, B * need + 64, max_num_batched_tokens=budget, max_num_seqs=B,
                               num_speculative_tokens=0, enable_prefix_caching=False, seed=0)
    for i in range(B):
        sched.add_request(f"r{i}", ctx, new)
    pipe = MetadataPipeline(layout, B + 1, budget, device, 0)
    t0 = time.perf_counter()
    for _ in range(10_000):
        step = sched.schedule()
        views = sched.batch_view(step)
        pipe.update(step)
        meta = pipe.build()
        if len(views) == B and all(v.is_decode for v in views):
            break  # NOTE: the step just built is the first all-decode step: the one timed
        sched.update_after_step({})
    else:
        raise RuntimeError(f"no all-decode step of {B} requests within 10000 steps")
    return pipe, meta, time.perf_counter() - t0


def joined_step(layout, B: int, ctx: int, budget: int, device: str):
    """A pipeline holding the first step of ``B`` requests joining with ``ctx`` computed tokens, one token
    scheduled each (a decode step at context ``ctx``): ``(pipe, meta, setup seconds)``."""
    from dsv4_index import NewRequest, StepInput
    t0 = time.perf_counter()
    news, nxt = [], 1
    for i in range(B):
        lists = []
        for g in layout.groups:
            n = g.ring_blocks if g.kind == "circular" else -(-(ctx + 1) // g.alloc_block_size)
            lists.append(list(range(nxt, nxt + n)))
            nxt += n
        news.append(NewRequest(f"r{i}", tuple(lists), ctx))
    step = StepInput(new_requests=news, running_requests=[], num_scheduled_tokens={f"r{i}": 1 for i in range(B)})
    pipe = MetadataPipeline(layout, B + 1, budget, device, 0)
    pipe.update(step)
    meta = pipe.build()
    return pipe, meta, time.perf_counter() - t0


CASES = [("V4-Flash", "flash", {}), ("V4.1-Flash", "v41_flash", {}),
         ("V4.1-Flash, SWA per layer", "v41_flash", dict(swa_group_per_layer=True))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--B", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="no timing: build each case's decode step on the CPU")
    ap.add_argument("--scheduler", action="store_true", help="reach the decode step through the reference "
                                                             "scheduler's prefills (slow for 45 groups)")
    add_threads_option(ap)
    args = ap.parse_args(argv)
    set_threads(args.threads)
    setup_step = decode_step if args.scheduler else joined_step
    if args.smoke:
        for label, name, kw in CASES:
            lay = DSV4Layout.from_config(name, 4096, **kw)
            pipe, meta, _ = setup_step(lay, args.B, args.ctx, 512, "cpu")
            print(f"{label}: groups {lay.num_groups}, launches {pipe.num_launches}, T {meta.num_tokens}")
        return 0
    if not torch.cuda.is_available():
        print("needs a CUDA device (try --smoke --B 2 --ctx 64)")
        return 2
    rows = []
    for label, name, kw in CASES:
        lay = DSV4Layout.from_config(name, 1 << 16, **kw)
        t0 = time.perf_counter()
        pipe, meta, setup = setup_step(lay, args.B, args.ctx, 8192, "cuda")
        lay_s = pipe.stage_layout
        g, s1 = graph_time(lambda plan=pipe.fused_plan, st=lay_s: plan.launch(st), args.k, args.replays)
        rows.append((label, lay.num_groups, pipe.num_launches, meta.num_tokens, g, s1, time.perf_counter() - t0))
        print(f"{label}: groups {lay.num_groups}, launches {pipe.num_launches}, T {meta.num_tokens}, "
              f"build {g:.2f} us (graph) / {s1:.2f} us (single), setup {setup:.1f} s, wall {rows[-1][-1]:.0f} s",
              flush=True)
    print(f"\ndecode B={args.B}, ctx {args.ctx}: fused build GPU time")
    base = rows[0][4]
    for label, G, n, _T, g, s1, _ in rows:
        print(f"  {label:<28} groups {G:>3}  launches {n}  {g:7.2f} us graph ({g / base:4.2f}x V4)  "
              f"{s1:7.2f} us single")
    return 0


if __name__ == "__main__":
    sys.exit(main())
