"""Per-step benchmark of the metadata pipeline on a GPU (docs/DESIGN.md §8, issue 12).

For each case (``workload.CASES``) and layout (V4-Flash, V4-Pro), with the pipeline sized like a
server (1024 requests, 8192 tokens) and exactly to the case:

* GPU time of ``build()`` (the fused launch): graph-amortized (``K`` launches captured back to back
  in one CUDA graph, median over replays, per launch) and single replay (a one-launch graph, timed
  with events around ``replay()``, so the graph launch is included);
* ``topk_to_slots`` (K = 512 Flash / 1024 Pro) the same two ways, on random request-local picks;
* host time per phase (decode cases): ``update(StepBatch)`` safe / full checks, the ``StepInput``
  conversion, ``build()`` eager and as a graph replay; each call timed alone right after
  ``torch.cuda._sleep`` so the GPU is busy and the host never waits (n = 1, medians);
* launches, H2D copies (torch.profiler), host syncs (sync debug mode) and new allocations per step;
* bytes the launch writes (every output row in ``[0, T_pad)``), the achieved write bandwidth, and the
  launch floor (an empty one-program kernel, graph-amortized and single replay) before and after.

Steps come from ``workload.py`` (random contexts 1K-64K, random block ids): never zeros.

Usage::

    python benchmarks/bench_step.py --out bench.json [--quick] [--layouts flash,pro,flash:vllm] [--no-host]
    python benchmarks/bench_step.py --profile-one "decode B=256"     # one step for ncu
    python benchmarks/bench_step.py --sweep --out sweep.json         # tile configs of both variants, every case
    python benchmarks/bench_step.py --floors                         # empty-kernel launch floors, write bandwidth
    python benchmarks/bench_step.py --topk-sweep                     # top-k rows-per-program x warps
    python benchmarks/bench_step.py --ab --out ab.json               # this round's kernel options vs round 1
    TRITON_INTERPRET=1 python benchmarks/bench_step.py --smoke --device cpu   # no timing: what the suite runs
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "examples"))  # examples/_threads.py: --threads (default 1)

from _threads import add_threads_option, set_threads  # noqa: E402
from dsv4_index import DSV4Layout, MetadataPipeline, batch_from_step  # noqa: E402
from dsv4_index.fused.tasks import TileConfig  # noqa: E402
from workload import CASES, Workload  # noqa: E402

SERVER = (1024, 8192)


def graph_time(fn, k: int, replays: int):
    """(per-call µs in a graph of ``k`` calls, µs of one single-call graph replay), medians."""
    torch.cuda.synchronize()
    out = []
    for n in (k, 1):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                fn()
        g.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(replays):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e3 / n)
        out.append(statistics.median(ts))
    return tuple(out)


def written_bytes(plan, t_pad: int) -> int:
    """Bytes the fused launch writes for a step of ``t_pad`` tokens (every output row in [0, T_pad))."""
    n = 0
    for t in plan.tasks:
        rows = t_pad + 1 if t.kind in ("requests", "replays", "staged_copy") else t_pad
        for o in t.outputs:
            if o is not None:
                n += rows * (o[0].numel() if o.dim() > 1 else 1) * o.element_size()
    return n


SWEEP_SMALL = [TileConfig(8, 8, 128, False, 4), TileConfig(8, 8, 128, False, 8), TileConfig(16, 8, 128, False, 4),
               TileConfig(32, 8, 128, False, 4), TileConfig(8, 4, 128, False, 4), TileConfig(8, 8, 64, False, 2)]
SWEEP_LARGE = [TileConfig(128, 16, 128, True, 4), TileConfig(128, 16, 128, True, 8), TileConfig(128, 8, 128, True, 4),
               TileConfig(256, 32, 128, True, 8), TileConfig(64, 8, 128, True, 4), TileConfig(128, 32, 128, True, 8),
               TileConfig(128, 8, 128, True, 4, True)]  # NOTE: the shipped LARGE (per-block reads)


def _built_step(lname: str, name: str):
    """A server-sized pipeline of layout ``lname`` (``cfg[:groups]``) after 3 steps of case ``name`` and one
    more built: (pipe, its stage layout, the fused plan's distinct outputs, their values now)."""
    cfg_name, _, groups = lname.partition(":")
    layout = DSV4Layout.from_config(cfg_name, max_model_len=131072, **({"groups": groups} if groups else {}))
    pipe = make_pipe(layout, CASES[name], True)
    wl, _ = steady(layout, CASES[name], pipe, 3)
    batch, _ = wl.next_step()
    pipe.update(batch)
    pipe.build()
    outs = list({o.data_ptr(): o for t in pipe.fused_plan.tasks for o in t.outputs if o is not None}.values())
    return pipe, pipe.stage_layout, outs, [o.clone() for o in outs]


def _check_plan(plan, pipe, lay, outs, want, what: str) -> None:
    """Launch ``plan`` on the staged step with its outputs poisoned; every output must equal ``want``."""
    for o in outs:
        o.fill_(True if o.dtype == torch.bool else -7)
    plan.launch(lay)
    _sync(pipe.device)
    bad = sum(not torch.equal(a, b) for a, b in zip(outs, want))
    assert bad == 0, f"{what}: {bad} outputs differ from the pipeline's build"


def sweep(args):
    """Graph / single µs of every tile config of both variants (forced), on every Flash case."""
    from dsv4_index.fused.plan import FusedPlan
    out = []
    for lname, name in [(lname, name) for lname in args.sweep_layouts.split(",") for name in CASES
                        if not args.sweep_cases or name in args.sweep_cases.split(",")]:
        pipe, lay, outs, want = _built_step(lname, name)
        line = []
        for v, cfgs in ((0, SWEEP_SMALL), (1, SWEEP_LARGE)):
            if name.startswith("prefill") and v == 0 and cfgs is SWEEP_SMALL:
                cfgs = cfgs[:2]
            for cfg in cfgs:
                plan = FusedPlan(pipe.fused_plan.tasks, pipe.tables, pipe.ctx.group_cp, pipe.staging.dev,
                                 pipe.ctx.next_n,
                                 tiny=cfg, small=cfg, large=cfg, large_from=0 if v else 1 << 30)
                _check_plan(plan, pipe, lay, outs, want, f"sweep {lname} {name} {cfg}")
                g, s1 = graph_time(lambda: plan.launch(lay), args.k, args.replays)
                tag = (f"{'L' if v else 'S'}{cfg.bt1}/{cfg.bt2}/{cfg.bc}/w{cfg.num_warps}"
                       + ("/bl" if cfg.block_loads else ""))
                line.append(f"{tag} {g:.2f}/{s1:.2f}")
                out.append(dict(layout=lname, case=name, variant=v, cfg=tag, graph_us=g, single_us=s1,
                                programs=plan.grid(lay.t_pad)))
        print(f"sweep {lname} {name} (T_pad {lay.t_pad}, {written_bytes(pipe.fused_plan, lay.t_pad) / 2**20:.1f} MiB): "
              + "  ".join(line), flush=True)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


def fold_sweep(args):
    """The large tiles at each ``--fold-sweep`` entry (``F[rN][sM]``: ``TileConfig.fold = F``, ``maxnreg = N``,
    ``split = M``, 0 where not given) on
    every ``--sweep-layouts`` layout and ``--sweep-cases`` case, each plan's outputs checked against the
    pipeline's build; ``--rounds`` interleaved rounds of every arm, medians, and the ratio of each layout to
    the first one per arm."""
    from dsv4_index.fused.plan import LARGE, FusedPlan
    cfgs = []
    for tok in args.fold_sweep.split(","):
        m = re.fullmatch(r"(\d+)((?:[rs]\d+)*)", tok)
        assert m, f"--fold-sweep entry {tok!r}: F, then rN and / or sM"
        kw = {"r": 0, "s": 0} | {k: int(v) for k, v in re.findall(r"([rs])(\d+)", m[2])}
        cfgs.append((tok, replace(LARGE, fold=int(m[1]), maxnreg=kw["r"], split=kw["s"])))
    arms = []
    for lname, name in [(lname, name) for name in CASES for lname in args.sweep_layouts.split(",")
                        if not args.sweep_cases or name in args.sweep_cases.split(",")]:
        pipe, lay, outs, want = _built_step(lname, name)
        for tag, cfg in cfgs:
            plan = FusedPlan(pipe.fused_plan.tasks, pipe.tables, pipe.ctx.group_cp, pipe.staging.dev, pipe.ctx.next_n,
                             tiny=cfg, small=cfg, large=cfg, large_from=0)
            _check_plan(plan, pipe, lay, outs, want, f"fold sweep {lname} {name} {tag}")
            k = plan._variants[2]["kernel"]
            arms.append(dict(layout=lname, case=name, cfg=tag, plan=plan, lay=lay,
                             programs=plan.grid(lay.t_pad), regs=getattr(k, "n_regs", None),
                             spills=getattr(k, "n_spills", None), graph_us=[]))
    for _ in range(args.rounds):
        for a in arms:
            a["graph_us"].append(graph_time(lambda: a["plan"].launch(a["lay"]), args.k, args.replays)[0])
    first = {}
    out = []
    for a in arms:
        med = statistics.median(a["graph_us"])
        first.setdefault((a["case"], a["cfg"]), med)
        ratio = med / first[(a["case"], a["cfg"])]
        rounds = " ".join(f"{x:.2f}" for x in a["graph_us"])
        print(f"fold sweep | {a['layout']} | {a['case']} | {a['cfg']} | programs {a['programs']} | regs {a['regs']} "
              f"spills {a['spills']} | graph µs median {med:.2f} (rounds: {rounds}) | / first layout {ratio:.3f}",
              flush=True)
        out.append({k: v for k, v in a.items() if k not in ("plan", "lay")} | dict(median_us=med, ratio=ratio))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))


def _arms(t_pad: int):
    """(name, tiny, small, large) of the same-run comparison: round 1's kernel (``r1``: one table read
    per causal column everywhere) against per-block causal reads (``blocks``) and, for small-variant
    steps, two other small tiles; only arms that change the variant the step runs on.

    NOTE: a per-chunk overlay skip in the whole-row variant was timed and removed (BENCHMARKS.md "How the
    kernel is cut")."""
    from dsv4_index.fused.plan import LARGE, LARGE_FROM, SMALL, SMALL_FROM, TINY
    off = lambda c: replace(c, block_loads=False)  # noqa: E731
    bl = lambda c: replace(c, block_loads=True)  # noqa: E731
    arms = [("r1", off(TINY), off(SMALL), off(LARGE)), ("blocks", bl(TINY), bl(SMALL), bl(LARGE))]
    if SMALL_FROM <= t_pad < LARGE_FROM:
        arms += [("blocks S32", bl(TINY), replace(bl(SMALL), bt1=32), bl(LARGE)),
                 ("blocks S8/4", bl(TINY), replace(bl(SMALL), bt1=8, bt2=4), bl(LARGE))]
    return arms


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def checked_arms(pipe, label: str) -> dict:
    """One :class:`FusedPlan` per arm of ``_arms`` for the pipeline's last staged step, each checked:
    every output of its launch equals the pipeline's own launch (outputs poisoned before each)."""
    from dsv4_index.fused.plan import FusedPlan
    lay, fused = pipe.stage_layout, pipe.fused_plan
    outs = list({o.data_ptr(): o for t in fused.tasks for o in t.outputs if o is not None}.values())
    poison = lambda: [o.fill_(True if o.dtype == torch.bool else -7) for o in outs]  # noqa: E731
    poison()
    fused.launch(lay)
    _sync(pipe.device)
    want = [o.clone() for o in outs]
    plans = {}
    for arm, tiny, small, large in _arms(lay.t_pad):
        plan = FusedPlan(fused.tasks, pipe.tables, pipe.ctx.group_cp, pipe.staging.dev,
                         pipe.ctx.next_n, tiny=tiny, small=small, large=large)
        poison()
        plan.launch(lay)
        _sync(pipe.device)
        bad = sum(not torch.equal(a, b) for a, b in zip(outs, want))
        assert bad == 0, f"{label} arm {arm}: {bad} outputs differ from the pipeline's build"
        plans[arm] = plan
    return plans


def smoke(args):
    """The suite's check that this script still runs (CPU, ``TRITON_INTERPRET=1``, no timing): one step
    of ``--smoke-case`` on the Flash layout, sized exactly, through every ``--ab`` arm (each must equal
    the pipeline's build), the top-k conversion, ``written_bytes`` and the table of programs."""
    layout = DSV4Layout.from_config("flash", max_model_len=args.smoke_len)
    case = replace(CASES[args.smoke_case], ctx_range=(64, args.smoke_len // 2))
    pipe = make_pipe(layout, case, False, device=args.device)
    wl, _ = steady(layout, case, pipe, 2)
    batch, _ = wl.next_step()
    pipe.update(batch)
    meta = pipe.build()
    plans = checked_arms(pipe, args.smoke_case)
    lay = pipe.stage_layout
    topk = torch.full((meta.num_tokens_padded, layout.index_topk), -1, dtype=torch.int32, device=pipe.device)
    slots, lens = meta.topk_to_slots("c4a", topk)
    assert int(lens.sum()) == 0, "an all -1 top-k has no valid entry"
    progs = {a: p.grid(lay.t_pad) for a, p in plans.items()}
    print(f"smoke OK: {args.smoke_case} on {pipe.device}, T_pad {lay.t_pad}, arms {progs} programs, "
          f"{written_bytes(pipe.fused_plan, lay.t_pad)} bytes written per launch", flush=True)


def ab(args):
    """Same-run comparison of kernel options (``_arms``), arms interleaved over ``--rounds`` rounds
    (graph-amortized and single replay medians per round, the median of the rounds reported), every
    Flash case, server-sized and exact; each arm's outputs must equal the pipeline's own build; the
    pipeline's top-k conversion timed in the same rounds."""
    layout = DSV4Layout.from_config("flash", max_model_len=131072)
    res = []
    floor0 = empty_floor(args)
    for name in CASES:
        case = CASES[name]
        r = dict(case=name)
        for server in (True, False):
            tag = "server" if server else "exact"
            pipe = make_pipe(layout, case, server)
            wl, _ = steady(layout, case, pipe, 3)
            batch, _ = wl.next_step()
            pipe.update(batch)
            meta = pipe.build()
            lay = pipe.stage_layout
            plans = checked_arms(pipe, f"{name} {tag}")
            topk = None
            if "c4a" in meta:
                n_c = meta["c4i"].lens[:meta.num_tokens_padded].clamp(min=1).long()
                topk = (torch.rand(meta.num_tokens_padded, layout.index_topk, device="cuda") * n_c[:, None]).long() \
                    .to(torch.int32)
                topk[:, -8:] = -1
            times = {a: [] for a in plans}
            tk = []
            for _ in range(args.rounds):
                for a, plan in plans.items():
                    times[a].append(graph_time(lambda: plan.launch(lay), args.k, args.replays))
                if topk is not None:
                    tk.append(graph_time(lambda: meta.topk_to_slots("c4a", topk), args.k, args.replays))
            for a, ts in times.items():
                r[f"{tag}_{a}"] = (statistics.median(g for g, _ in ts), statistics.median(s for _, s in ts))
            if tk:
                r[f"{tag}_topk"] = (statistics.median(g for g, _ in tk), statistics.median(s for _, s in tk))
            r[f"{tag}_T_pad"] = lay.t_pad
            r[f"{tag}_programs"] = {a: p.grid(lay.t_pad) for a, p in plans.items()}
            if server:
                r[f"{tag}_written_bytes"] = written_bytes(pipe.fused_plan, lay.t_pad)
            del pipe, plans
        r.update(counts_case(layout, case))
        res.append(r)
        print(json.dumps(r), flush=True)
    floor1 = empty_floor(args)
    print(f"\nempty-kernel floor (graph / single, µs): before {floor0[0]:.2f} / {floor0[1]:.2f}, after "
          f"{floor1[0]:.2f} / {floor1[1]:.2f}")
    print("\n| case | arm | graph server / exact | single server / exact |\n|---|---|---|---|")
    for r in res:
        arms = [k[len("server_"):] for k in r if k.startswith("server_") and isinstance(r[k], tuple)]
        for a in arms:
            sv, ex = r[f"server_{a}"], r.get(f"exact_{a}", (float("nan"),) * 2)
            print(f"| {r['case']} | {a} | {sv[0]:.2f} / {ex[0]:.2f} | {sv[1]:.2f} / {ex[1]:.2f} |")
    print("\n| case | launches | H2D | syncs | allocs |\n|---|---|---|---|---|")
    for r in res:
        print(f"| {r['case']} | {r['kernels']} | {r['h2d_copies']} | {r['syncs']} | {r['new_allocations']} |")
    if args.out:
        args.out.write_text(json.dumps(dict(cases=res, floor=dict(before=floor0, after=floor1)), indent=1))


def empty_floor(args):
    """(graph-amortized, single replay) µs of an empty one-program Triton kernel: the launch floor."""
    import triton

    @triton.jit
    def _empty_kernel(x_ptr, n):
        pass

    x = torch.empty(16, dtype=torch.int32, device="cuda")
    _empty_kernel[(1,)](x, 0)
    return graph_time(lambda: _empty_kernel[(1,)](x, 0), args.k, args.replays)


def floors(args):
    """What a launch costs with no work (the single-replay gap), and the device's write bandwidth."""
    import triton
    import triton.language as tl

    @triton.jit
    def _empty(x_ptr, n):
        pass

    @triton.jit
    def _fill(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.full([BLOCK], -1, tl.int32), mask=i < n)

    x = torch.empty(64 << 20, dtype=torch.int32, device="cuda")
    y = torch.empty_like(x)
    for grid in (1, 132, 528, 2076, 16524):
        _empty[(grid,)](x, 0)
        g, s1 = graph_time(lambda: _empty[(grid,)](x, 0), args.k, args.replays)
        print(f"floor empty kernel grid {grid}: graph {g:.2f} us, single replay {s1:.2f} us", flush=True)
    for mib in (8, 42, 256):
        n = mib << 18
        _fill[(triton.cdiv(n, 4096),)](x, n, BLOCK=4096)
        g, _ = graph_time(lambda: _fill[(triton.cdiv(n, 4096),)](x, n, BLOCK=4096), 5, args.replays)
        gc_, _ = graph_time(lambda: y[:n].copy_(x[:n]), 5, args.replays)
        print(f"floor write {mib} MiB: fill {g:.2f} us = {n * 4 / g / 1e6:.2f} TB/s; copy {gc_:.2f} us = "
              f"{2 * n * 4 / gc_ / 1e6:.2f} TB/s (read + write)", flush=True)
    # eager launch latency (events around a direct launch, no graph)
    ts = []
    for _ in range(args.replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        _empty[(1,)](x, 0)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    print(f"floor empty kernel eager (events around the launch): {statistics.median(ts):.2f} us", flush=True)


def topk_sweep(args):
    from dsv4_index.ops.topk_to_slots import kernel as tk
    layout = DSV4Layout.from_config("flash", max_model_len=131072)
    for name in ("decode B=1", "decode B=256", "decode B=1024", "MTP 256x2"):
        case = CASES[name]
        pipe = make_pipe(layout, case, True)
        wl, _ = steady(layout, case, pipe, 3)
        batch, _ = wl.next_step()
        pipe.update(batch)
        meta = pipe.build()
        b = pipe.builders["c4a"]
        K = layout.index_topk
        Tp = meta.num_tokens_padded
        n_c = meta["c4i"].lens[:Tp].clamp(min=1).long()
        topk = (torch.rand(Tp, K, device="cuda") * n_c[:, None]).long().to(torch.int32)
        topk[:, -8:] = -1
        s = b.spec
        bt = pipe.ctx.tables[s.gid]
        out, lens = b.topk_flat[:Tp * K].view(Tp, K), b.topk_lens[:Tp]
        ref = meta.topk_to_slots("c4a", topk)[0].clone()
        line = []
        for tile in ((1, 4), (1, 1), (1, 2), (1, 8), (2, 4), (2, 8), (4, 8)):
            fn = lambda: tk.launch_rows(topk, b.token_rows, b.token_nc, bt, s.rows_per_block, s.compress_ratio,  # noqa
                                        bt.shape[1], 1, 0, 1, False, out, lens, Tp, tile=tile)
            fn()
            assert torch.equal(out, ref), (name, tile)
            g, s1 = graph_time(fn, args.k, args.replays)
            line.append(f"{tile[0]}x{tile[1]}w {g:.2f}/{s1:.2f}")
        print(f"topk sweep {name}: " + "  ".join(line), flush=True)


def make_pipe(layout, case, server: bool, device: str = "cuda", **kw):
    R, T = SERVER if server else (case.max_reqs + 1, case.max_tokens)
    pipe = MetadataPipeline(layout, R, T, device, case.q_decode - 1, **kw)
    pipe.warmup()
    return pipe


def steady(layout, case, pipe, steps: int, seed=0):
    """Run the workload's first steps through ``pipe``; return (workload, last StepBatch)."""
    wl = Workload(layout, case, seed)
    batch = None
    for _ in range(steps):
        batch, _ = wl.next_step()
        pipe.update(batch)
        pipe.build()
    _sync(pipe.device)
    return wl, batch


def gpu_case(layout, case, server, args):
    pipe = make_pipe(layout, case, server)
    wl, _ = steady(layout, case, pipe, 3)
    batch, _ = wl.next_step()
    pipe.update(batch)
    meta = pipe.build()
    lay = pipe.stage_layout
    graph, single = graph_time(lambda: pipe.fused_plan.launch(lay), args.k, args.replays)
    wb = written_bytes(pipe.fused_plan, lay.t_pad)
    res = dict(build_graph_us=graph, build_single_us=single, T=meta.num_tokens, B=meta.num_reqs,
               programs=pipe.fused_plan.grid(lay.t_pad), variant=pipe.fused_plan.variant(lay.t_pad),
               written_bytes=wb, write_tb_s=wb / graph / 1e6, h2d_bytes=pipe.last_step_stats.h2d_bytes,
               launches=pipe.num_launches)
    if "c4a" in meta:
        K = layout.index_topk
        n_c = meta["c4i"].lens[:meta.num_tokens_padded].clamp(min=1).long()
        topk = (torch.rand(meta.num_tokens_padded, K, device="cuda") * n_c[:, None]).long().to(torch.int32)
        topk[:, -8:] = -1
        g2, s2 = graph_time(lambda: meta.topk_to_slots("c4a", topk), args.k, args.replays)
        res.update(topk_graph_us=g2, topk_single_us=s2)
    return res


def host_case(layout, case, args):
    """Host µs per phase (median, n = 1 after a GPU sleep)."""
    out = {}
    for label, kw in (("safe", {}), ("full", dict(checks="full"))):
        pipe = make_pipe(layout, case, True, **kw)
        wl, _ = steady(layout, case, pipe, 3)
        ts_u, ts_b, ts_c = [], [], []
        gc.disable()
        for _ in range(args.host_steps):
            shadow = _shadow_slots(pipe, wl) if label == "safe" else None  # NOTE: state before the step
            batch, step = wl.next_step()
            torch.cuda.synchronize()
            torch.cuda._sleep(2_000_000)
            t0 = time.perf_counter()
            pipe.update(batch)
            t1 = time.perf_counter()
            pipe.build()
            t2 = time.perf_counter()
            if label == "safe":
                # NOTE: StepInput conversion alone (pure: the slot map is not committed)
                t3 = time.perf_counter()
                batch_from_step(step, shadow, len(layout.groups))
                ts_c.append(time.perf_counter() - t3)
            ts_u.append(t1 - t0)
            ts_b.append(t2 - t1)
        gc.enable()
        torch.cuda.synchronize()
        out[f"update_{label}_us"] = statistics.median(ts_u[5:]) * 1e6
        out[f"build_eager_{label}_us"] = statistics.median(ts_b[5:]) * 1e6
        if ts_c:
            out["step_input_conversion_us"] = statistics.median(ts_c[5:]) * 1e6
    pipe = make_pipe(layout, case, True, cuda_graphs=True)
    wl, _ = steady(layout, case, pipe, 3)
    ts = []
    for _ in range(args.host_steps):
        batch, _ = wl.next_step()
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000)
        pipe.update(batch)
        t0 = time.perf_counter()
        pipe.build()
        ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    out["build_graph_replay_us"] = statistics.median(ts[5:]) * 1e6
    return out


def _shadow_slots(pipe, wl):
    """A SlotMap equal to the workload's slot assignment (so the conversion sees running requests)."""
    from dsv4_index.state.requests import SlotMap, SlotMapDelta
    sm = SlotMap(pipe.max_num_reqs)
    sm.commit(SlotMapDelta(taken=dict(wl.slots)))  # NOTE: the workload's slots, through the public commit
    return sm


def counts_case(layout, case):
    """Launches, H2D copies, syncs and new allocations of one update() + build()."""
    pipe = make_pipe(layout, case, True)
    wl, _ = steady(layout, case, pipe, 3)
    batch, _ = wl.next_step()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        pipe.update(batch)
        pipe.build()
        torch.cuda.synchronize()
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                  and "memcpy" not in e.name.lower() and "memset" not in e.name.lower())
    copies = sum(1 for e in prof.events() if "memcpy" in e.name.lower() and "htod" in e.name.lower().replace(" ", ""))
    batch, _ = wl.next_step()
    torch.cuda.synchronize()
    allocs0 = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        pipe.update(batch)
        pipe.build()
    torch.cuda.set_sync_debug_mode(0)
    allocs = torch.cuda.memory_stats().get("allocation.all.allocated", 0) - allocs0
    syncs = sum(1 for x in w if "synchroniz" in str(x.message).lower())
    return dict(kernels=kernels, h2d_copies=copies, syncs=syncs, new_allocations=allocs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layouts", default="flash,pro")
    ap.add_argument("--pro-cases", default="decode B=1,decode B=256,decode B=1024,MTP 256x2,prefill 8K",
                    help="cases run on the Pro layout (all cases run on Flash)")
    ap.add_argument("--k", type=int, default=20, help="launches per graph (graph-amortized)")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--host-steps", type=int, default=60)
    ap.add_argument("--profile-one", default=None, help="one server-sized step of this case, for ncu")
    ap.add_argument("--sweep", action="store_true", help="fused-launch tile sweep (both variants, every case)")
    ap.add_argument("--sweep-layouts", default="flash", help="with --sweep: layouts (e.g. flash,flash:vllm)")
    ap.add_argument("--sweep-cases", default="", help="with --sweep: comma-separated case names (default all)")
    ap.add_argument("--fold-sweep", default="", help="large tiles at these folds (F[rN][sM]: maxnreg N, split M), with "
                    "--sweep-layouts, --sweep-cases and --rounds")
    ap.add_argument("--cases", default="", help="comma-separated case names of the timing table (default: all)")
    ap.add_argument("--no-host", action="store_true", help="skip the host-time phases")
    ap.add_argument("--floors", action="store_true", help="launch floors (empty kernels) and the write bandwidth")
    ap.add_argument("--topk-sweep", action="store_true", help="top-k conversion tiles (rows x warps)")
    ap.add_argument("--ab", action="store_true", help="same-run comparison of kernel options, every Flash case")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of --ab")
    ap.add_argument("--smoke", action="store_true",
                    help="no timing: one exact-sized step through every --ab arm, checked (CPU: TRITON_INTERPRET=1)")
    ap.add_argument("--smoke-case", default="decode B=1", help="case of --smoke (workload.CASES)")
    ap.add_argument("--smoke-len", type=int, default=4096, help="max_model_len of --smoke")
    ap.add_argument("--device", default="cuda", help="device of --smoke (every other mode needs cuda)")
    add_threads_option(ap)
    args = ap.parse_args()
    set_threads(args.threads)
    if args.smoke:
        smoke(args)
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_step.py: every mode but --smoke needs CUDA (try --smoke --device cpu)")
    if args.fold_sweep:
        fold_sweep(args)
        return
    if args.sweep:
        sweep(args)
        return
    if args.floors:
        floors(args)
        return
    if args.topk_sweep:
        topk_sweep(args)
        return
    if args.ab:
        ab(args)
        return
    if args.profile_one:
        layout = DSV4Layout.from_config("flash", max_model_len=131072)
        case = CASES[args.profile_one]
        pipe = make_pipe(layout, case, True)
        wl, _ = steady(layout, case, pipe, 3)
        batch, _ = wl.next_step()
        pipe.update(batch)
        meta = pipe.build()
        topk = torch.randint(-1, 64, (meta.num_tokens_padded, layout.index_topk), device="cuda", dtype=torch.int32)
        meta.topk_to_slots("c4a", topk)
        torch.cuda.synchronize()
        return
    names = ["decode B=1", "decode B=256", "MTP 256x2", "prefill 8K"] if args.quick else list(CASES)
    if args.cases:
        names = [n for n in names if n in args.cases.split(",")]
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "k": args.k, "cases": []}
    rows = []
    floor0 = empty_floor(args)
    for lname in args.layouts.split(","):
        cfg, _, groups = lname.partition(":")  # NOTE: "flash:vllm" = from_config("flash", groups="vllm")
        layout = DSV4Layout.from_config(cfg, max_model_len=131072, **({"groups": groups} if groups else {}))
        for name in names:
            if cfg == "pro" and name not in args.pro_cases.split(","):
                continue
            case = CASES[name]
            r = dict(layout=lname, case=name)
            for server in (True, False):
                g = gpu_case(layout, case, server, args)
                r.update({f"{'server' if server else 'exact'}_{k}": v for k, v in g.items()})
            if lname == "flash":
                r.update(counts_case(layout, case))
                if not args.no_host and (not args.quick or name.startswith("decode B=256")):
                    r.update(host_case(layout, case, args))
            results["cases"].append(r)
            rows.append(r)
            print(json.dumps(r), flush=True)
    print("\n| layout | case | build graph µs server / exact | build single µs server / exact | topk graph µs "
          "(server) | topk single µs | launches | H2D | syncs | allocs | update safe / full µs | StepInput µs "
          "| build eager / graph replay µs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    f = lambda v: "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)  # noqa: E731
    for r in rows:
        print(f"| {r['layout']} | {r['case']} | {f(r['server_build_graph_us'])} / {f(r['exact_build_graph_us'])} | "
              f"{f(r['server_build_single_us'])} / {f(r['exact_build_single_us'])} | "
              f"{f(r.get('server_topk_graph_us'))} | "
              f"{f(r.get('server_topk_single_us'))} | {f(r.get('kernels'))} | {f(r.get('h2d_copies'))} | "
              f"{f(r.get('syncs'))} | {f(r.get('new_allocations'))} | {f(r.get('update_safe_us'))} / "
              f"{f(r.get('update_full_us'))} | {f(r.get('step_input_conversion_us'))} | "
              f"{f(r.get('build_eager_safe_us'))} / {f(r.get('build_graph_replay_us'))} |")
    floor1 = empty_floor(args)
    results["empty_kernel_floor_us"] = dict(before=floor0, after=floor1)
    print(f"\nempty-kernel floor (graph / single replay, µs): before {floor0[0]:.2f} / {floor0[1]:.2f}, "
          f"after {floor1[0]:.2f} / {floor1[1]:.2f}")
    print("\n| layout | case | variant | programs | MiB written | graph µs | TB/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['case']} | {r['server_variant']} | {r['server_programs']} | "
              f"{r['server_written_bytes'] / 2**20:.1f} | {r['server_build_graph_us']:.2f} | "
              f"{r['server_write_tb_s']:.2f} |")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
