"""Per-step benchmark of the metadata pipeline (DESIGN §8): fused vs per-channel kernels.

For each case (decode batches, speculative decode, prefills, mixed) it measures, on the same steps,
for ``MetadataPipeline(fused=True)`` and ``fused=False``:

* kernel launches of ``build()`` and H2D copies of ``update()`` + ``build()`` (torch.profiler),
* host syncs of ``update()`` + ``build()`` (``torch.cuda.set_sync_debug_mode("warn")``, counted),
* host time of ``update()`` + ``build()`` eager (median over steady-state steps),
* GPU time of ``build()`` in CUDA graphs: per call of a 20-call graph (median of replays timed with CUDA
  events, as triton.testing.do_bench_cudagraph) and of one single-call replay (with launch latency),
* output bytes / GPU time;

plus the per-layer ``topk_to_slots`` GPU time for K = 512 (V4-Flash) and K = 1024 (V4-Pro) at B = 256.
Steps are built directly (random contexts, random block ids from a big pool), never from zeros.

Usage::

    python benchmarks/bench_step.py --out bench.json            # GPU, full table
    python benchmarks/bench_step.py --quick --out bench.json    # GPU, smoke subset
    python benchmarks/bench_step.py --dry-run                   # CPU, tiny sizes, Triton interpreter
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "dsv4_index" / "configs"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--quick", action="store_true", help="a fast smoke subset (GPU)")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU under the Triton interpreter")
    p.add_argument("--steps", type=int, default=None, help="steady-state steps timed on the host")
    p.add_argument("--replays", type=int, default=None, help="CUDA-graph replays timed per case")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.dry_run:
    os.environ["TRITON_INTERPRET"] = "1"  # NOTE: before triton is imported (jit picks the interpreter)
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dsv4_index.geometry import DSV4Layout  # noqa: E402
from dsv4_index.pipeline import MetadataPipeline  # noqa: E402
from dsv4_index.step import NewRequest, RunningRequest, StepInput  # noqa: E402

NEW_ID_RANGE = (1, 3_000_000)            # random ids of new requests (slots stay inside int32)
APPEND_ID_START = 3_000_000              # appended ids: a counter, never a duplicate in a row


# ----------------------------------------------------------------------------------------------
# step simulation (no scheduler: steps are built directly)
# ----------------------------------------------------------------------------------------------
class Sim:
    """Requests with random contexts and random block ids; produces StepInputs."""

    def __init__(self, layout, seed):
        self.layout = layout
        self.rng = np.random.default_rng(seed)
        self.reqs = {}        # rid -> [computed, [blocks per group]]
        self.next_append = APPEND_ID_START
        self.n = 0

    def _need(self, seq_len):
        return [-(-seq_len // g.alloc_block_size) for g in self.layout.groups]

    def new(self, ctx, q):
        rid = f"r{self.n}"
        self.n += 1
        need = self._need(ctx + q)
        lo, hi = NEW_ID_RANGE
        # NOTE: distinct within a row (the pipeline rejects duplicates), shared across rows is fine
        ids = tuple((self.rng.choice(hi - lo, size=n, replace=False) + lo).tolist() for n in need)
        self.reqs[rid] = [ctx, need]
        return NewRequest(rid, ids, ctx), rid

    def running(self, rid, q):
        c, have = self.reqs[rid]
        need = self._need(c + q)
        new = []
        for h, n in zip(have, need):
            k = max(n - h, 0)
            new.append(list(range(self.next_append, self.next_append + k)))
            self.next_append += k
        self.reqs[rid][1] = [max(h, n) for h, n in zip(have, need)]
        return RunningRequest(rid, tuple(new), c)

    def advance(self, sched):
        for rid, q in sched.items():
            self.reqs[rid][0] += q


class Workload:
    """A case: a first step that admits the batch, then steady-state steps."""

    def __init__(self, layout, seed, *, decodes=0, ctx_range=(1024, 65536), q_decode=1,
                 prefill=0, prefix=0):
        self.sim = Sim(layout, seed)
        self.decodes, self.ctx_range, self.q_decode = decodes, ctx_range, q_decode
        self.prefill, self.prefix = prefill, prefix
        self.decode_ids, self.prefill_id = [], None
        self.first = True

    @property
    def max_tokens(self):
        return self.decodes * self.q_decode + self.prefill

    @property
    def max_reqs(self):
        return self.decodes + (1 if self.prefill else 0)

    def next_step(self):
        sim = self.sim
        new, running, sched, finished = [], [], {}, set()
        if self.first:
            lo, hi = self.ctx_range
            for c in sim.rng.integers(lo, hi + 1, size=self.decodes).tolist():
                r, rid = sim.new(c, self.q_decode)
                new.append(r)
                sched[rid] = self.q_decode
                self.decode_ids.append(rid)
            self.first = False
        else:
            for rid in self.decode_ids:
                running.append(sim.running(rid, self.q_decode))
                sched[rid] = self.q_decode
        if self.prefill:
            # NOTE: a fresh prefill (or chunk) request every step; the previous one finishes.
            if self.prefill_id is not None:
                finished.add(self.prefill_id)
                sim.reqs.pop(self.prefill_id)
            r, rid = sim.new(self.prefix, self.prefill)
            new.append(r)
            sched[rid] = self.prefill
            self.prefill_id = rid
        step = StepInput(new, running, sched, finished, set())
        sim.advance(sched)
        return step


# ----------------------------------------------------------------------------------------------
# measurements
# ----------------------------------------------------------------------------------------------
def out_bytes(meta):
    seen, total = set(), 0
    tensors = [meta.positions, meta.token_to_req, meta.is_valid_token]
    for ch in meta.channels.values():
        for f in ("slot_mapping", "compressed_slot_mapping", "indices", "lens", "ks", "ke", "cu", "decode_lens"):
            t = getattr(ch, f)
            if t is not None:
                tensors.append(t)
    for t in tensors:
        key = (t.data_ptr(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def count_gpu_events(fn):
    """(kernel launches, H2D copies) of ``fn()`` from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = h2d = 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name.lower()
        if "memcpy" in name:
            h2d += "htod" in name.replace(" ", "")
        elif "memset" not in name:
            kernels += 1
    return kernels, h2d


def count_syncs(fn):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(x.message).lower() for x in w)


def graph_time_us(fn, replays, calls=20):
    """GPU time of ``fn`` in CUDA graphs (µs): (median per call of a graph of ``calls`` back-to-back
    calls, as triton.testing.do_bench_cudagraph; median of one single-call graph replay, which
    includes the graph-launch latency), or (None, None) if capture fails."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g1, gn = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g1):
            fn()
        with torch.cuda.graph(gn):
            for _ in range(calls):
                fn()
    except Exception as e:  # noqa: BLE001 - report, do not abort the table
        print(f"  capture failed: {type(e).__name__}: {e}", file=sys.stderr)
        return None, None

    def timed(g, n):
        for _ in range(3):
            g.replay()
        times = []
        for _ in range(n):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        return statistics.median(times)

    return timed(gn, max(replays // 10, 5)) / calls, timed(g1, replays)


def run_case(name, layout, wl_args, *, steps, replays, device, seed):
    gpu = device == "cuda"
    wl = Workload(layout, seed, **wl_args)
    pipes = {flag: MetadataPipeline(layout, wl.max_reqs, wl.max_tokens, device, fused=flag,
                                    num_speculative_tokens=wl.q_decode - 1) for flag in (True, False)}
    for p in pipes.values():
        p.warmup()
    res = {"case": name, "B": wl.max_reqs, "tokens": wl.max_tokens}
    # NOTE: every pipeline sees the same steps in the same order, each exactly once
    admit = wl.next_step()
    timed = [wl.next_step() for _ in range(steps + 1)]
    probes = [wl.next_step() for _ in range(4 if gpu else 1)]
    host = {True: [], False: []}
    for p in pipes.values():
        p.update(admit)
        p.build()
    for i, step in enumerate(timed):
        for flag, p in pipes.items():
            if gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            p.update(step)
            p.build()
            dt = time.perf_counter() - t0
            if i:  # NOTE: the first steady step may still touch cold paths
                host[flag].append(dt * 1e6)
    for flag, p in pipes.items():
        tag = "fused" if flag else "unfused"
        res[f"host_us_{tag}"] = statistics.median(host[flag])
        if gpu:
            res[f"syncs_{tag}"] = count_syncs(lambda: (p.update(probes[0]), p.build()))
            p.update(probes[1])
            res[f"launches_{tag}"], _ = count_gpu_events(p.build)
            _, res[f"h2d_{tag}"] = count_gpu_events(lambda: (p.update(probes[2]), p.build()))
            p.update(probes[3])
            res[f"gpu_us_{tag}"], res[f"gpu1_us_{tag}"] = graph_time_us(p.build, replays)
        else:
            p.update(probes[0])
            p.build()
    meta = pipes[True].build()
    res["out_bytes"] = out_bytes(meta)
    # NOTE: both paths saw the same steps: their outputs must agree (cheap cross-check)
    other = pipes[False].build()
    res["equal"] = all(
        (getattr(meta[c], f) is None) or torch.equal(getattr(meta[c], f), getattr(other[c], f))
        for c in meta.channels for f in ("slot_mapping", "compressed_slot_mapping", "indices", "lens", "ks", "ke"))
    if gpu and res.get("gpu_us_fused") and res.get("gpu_us_unfused"):
        res["speedup"] = res["gpu_us_unfused"] / res["gpu_us_fused"]
        res["GBps_fused"] = res["out_bytes"] / (res["gpu_us_fused"] * 1e-6) / 1e9
    return res


def topk_case(name, layout, B, K, ctx_range, *, replays, device, seed):
    wl = Workload(layout, seed, decodes=B, ctx_range=ctx_range)
    p = MetadataPipeline(layout, wl.max_reqs, wl.max_tokens, device)
    p.warmup()
    p.update(wl.next_step())
    meta = p.build()
    g = torch.Generator(device="cpu").manual_seed(seed)
    seq = meta.seq_lens.cpu().long()
    n_c = (seq // layout.c4_ratio).clamp(min=1)
    tok = meta.token_to_req.cpu().long()
    topk = (torch.rand(meta.num_tokens_padded, K, generator=g) * n_c[tok][:, None]).long()
    topk[torch.rand(topk.shape, generator=g) < 0.05] = -1
    topk = topk.to(torch.int32).to(device)
    res = {"case": name, "B": B, "K": K}
    if device == "cuda":
        res["gpu_us"], res["gpu1_us"] = graph_time_us(lambda: meta.topk_to_slots("c4a", topk), replays)
    else:
        meta.topk_to_slots("c4a", topk)
    return res


# ----------------------------------------------------------------------------------------------
def cases(args):
    if args.dry_run:
        tiny = DSV4Layout.from_config(CONFIGS / "tiny.json", max_model_len=512, mla_block_size=16,
                                      swa_block_size=8)
        r = (16, 300)
        return [("decode B=2", tiny, dict(decodes=2, ctx_range=r)),
                ("decode+1spec B=2", tiny, dict(decodes=2, ctx_range=r, q_decode=2)),
                ("prefill 24 (prefix 64)", tiny, dict(prefill=24, prefix=64)),
                ("mixed 2 dec + 16 chunk", tiny, dict(decodes=2, ctx_range=r, prefill=16))], \
               [("topk B=2 K=4", tiny, 2, 4, r)]
    L = 131072
    flash = DSV4Layout.from_config(CONFIGS / "flash.json", max_model_len=L)
    pro = DSV4Layout.from_config(CONFIGS / "pro.json", max_model_len=L)
    r = (1024, 65536)
    full = [("flash decode B=1", flash, dict(decodes=1, ctx_range=r)),
            ("flash decode B=32", flash, dict(decodes=32, ctx_range=r)),
            ("flash decode B=256", flash, dict(decodes=256, ctx_range=r)),
            ("flash decode B=1024", flash, dict(decodes=1024, ctx_range=r)),
            ("pro decode B=256", pro, dict(decodes=256, ctx_range=r)),
            ("flash decode+1spec B=256", flash, dict(decodes=256, ctx_range=r, q_decode=2)),
            ("flash prefill 8192 fresh", flash, dict(prefill=8192)),
            ("flash prefill 8192 (32K prefix)", flash, dict(prefill=8192, prefix=32768)),
            ("flash mixed 256 dec + 4096 chunk", flash, dict(decodes=256, ctx_range=r, prefill=4096))]
    topk = [("flash topk_to_slots B=256 K=512", flash, 256, 512, r),
            ("pro topk_to_slots B=256 K=1024", pro, 256, 1024, r)]
    if args.quick:
        return [full[0], full[2], full[6]], topk[:1]
    return full, topk


def fmt(v, nd=1):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def main(args):
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --dry-run on CPU")
    steps = args.steps or (3 if args.dry_run else (10 if args.quick else 50))
    replays = args.replays or (20 if args.quick else 200)
    step_cases, topk_cases = cases(args)
    rows, trows = [], []
    for i, (name, layout, wl) in enumerate(step_cases):
        t0 = time.time()
        rows.append(run_case(name, layout, wl, steps=steps, replays=replays, device=device, seed=args.seed + i))
        print(f"  {name}: done in {time.time() - t0:.1f}s", file=sys.stderr)
    for i, (name, layout, B, K, r) in enumerate(topk_cases):
        trows.append(topk_case(name, layout, B, K, r, replays=replays, device=device, seed=args.seed + 100 + i))

    cols = [("case", "case"), ("B", "B"), ("tokens", "T"), ("launches_fused", "launches"),
            ("launches_unfused", "launches (unfused)"), ("h2d_fused", "H2D"), ("h2d_unfused", "H2D (unfused)"),
            ("syncs_fused", "syncs"),
            ("syncs_unfused", "syncs (unfused)"), ("host_us_fused", "host µs"),
            ("host_us_unfused", "host µs (unfused)"), ("gpu_us_fused", "GPU µs (graph)"),
            ("gpu1_us_fused", "GPU µs (1 replay)"),
            ("gpu_us_unfused", "GPU µs (unfused)"),
            ("gpu1_us_unfused", "GPU µs (unfused, 1 replay)"), ("speedup", "unfused/fused"),
            ("out_bytes", "out bytes"), ("GBps_fused", "GB/s"), ("equal", "equal")]
    print("| " + " | ".join(h for _, h in cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(fmt(r.get(k), 2 if k == "speedup" else 1) for k, _ in cols) + " |")
    print()
    print("| case | B | K | GPU µs per layer (graph) | GPU µs (1 replay) |")
    print("|---|---|---|---|---|")
    for r in trows:
        print(f"| {r['case']} | {r['B']} | {r['K']} | {fmt(r.get('gpu_us'), 2)} | {fmt(r.get('gpu1_us'), 2)} |")
    info = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
            "torch": torch.__version__, "steps": steps, "replays": replays,
            "dry_run": args.dry_run, "quick": args.quick}
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception:  # pragma: no cover
        pass
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"info": info, "steps": rows, "topk_to_slots": trows}, indent=2))
        print(f"wrote {args.out}", file=sys.stderr)
    if not all(r["equal"] for r in rows):
        raise SystemExit("fused and unfused outputs differ")


if __name__ == "__main__":
    main(ARGS)
