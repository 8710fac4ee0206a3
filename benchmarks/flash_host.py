"""Host time of ``update()`` on the workload of ``examples/flash_decode_step.py`` (V4-Flash, B requests decoding 2
tokens a step, contexts up to ``max_model_len``, a few requests reaching it and rejoining every step with up to
512 prefix-hit blocks each; block ids near 2**25 unless ``--dense``), ``build()`` after each (not timed), no
attention: the part of the example's ``metadata: update() host`` row that is the library's host work.

    python benchmarks/flash_host.py [--steps 40] [--batch 256]                 # CPU pipeline
    python benchmarks/flash_host.py --device cuda [--busy-us 4000]             # CUDA pipeline, GPU kept busy

With ``--device cuda --busy-us N`` every ``update()`` is enqueued behind an ``N`` µs GPU busy wait (as the
example's timer does): an ``update()`` that waits on the device shows up as a time near ``N``; compare with the
same run at ``--busy-us 0`` and on ``--device cpu``. Prints the first step's time and the median / p90 / mean of
the others (µs), torch at one thread; ``--profile N``: the N functions of ``update()`` with the most own time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # NOTE: appended: a tree on PYTHONPATH (an old one, compared) wins

from dsv4_index import DSV4Layout, MetadataPipeline  # noqa: E402
from dsv4_index.config import normalize_config  # noqa: E402
from examples.flash_decode_step import Workload  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=131072)
    ap.add_argument("--ctx", type=int, nargs=2, default=(4096, None), metavar=("LO", "HI"),
                    help="contexts of joining requests (default 4096 .. max_model_len)")
    ap.add_argument("--dense", action="store_true", help="low block ids (the example's --storage dense)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--busy-us", type=float, default=0.0, help="CUDA: a GPU busy wait before every update()")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also print the N functions of update() with the most own time (cProfile)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dev = torch.device(args.device)
    L, B, Tp = args.max_model_len, args.batch, 2 * args.batch
    layout = DSV4Layout.from_config(normalize_config("flash"), L)
    wl = Workload(layout, B, (args.ctx[0], args.ctx[1] or L), L, args.steps, 0, not args.dense)
    cols = sum(g.columns(max(8192, Tp))[0] for g in layout.groups)
    pipe = MetadataPipeline(layout, max(256, B), max(8192, Tp), dev, num_speculative_tokens=1,
                            max_staged_blocks=max(1 << 20, B * cols + 1024))
    t = time.perf_counter()
    pipe.warmup(pad_sizes=(Tp,))
    warm = time.perf_counter() - t
    cycles = 0
    if dev.type == "cuda" and args.busy_us > 0:
        torch.cuda.synchronize()
        t = time.perf_counter()
        torch.cuda._sleep(1_000_000)
        torch.cuda.synchronize()
        cycles = int(args.busy_us * 1_000_000 / ((time.perf_counter() - t) * 1e6))
    times = []
    prof = None
    if args.profile:
        import cProfile
        prof = cProfile.Profile()
    for step in range(args.steps):
        batch, *_ = wl.next_step()
        if cycles:
            torch.cuda._sleep(cycles)
        if prof is not None and step:
            prof.enable()
        t = time.perf_counter_ns()
        pipe.update(batch, pad_to=Tp)
        times.append((time.perf_counter_ns() - t) / 1e3)
        if prof is not None:
            prof.disable()
        pipe.build()  # NOTE: as the example does (not timed): the staged writes are applied by the launch
        if dev.type == "cuda":
            torch.cuda.synchronize()
        wl.advance()
    rest = sorted(times[1:]) or [float("nan")]
    import dsv4_index
    print(f"flash_host: tree {Path(dsv4_index.__file__).parent.parent}, device {dev}, B={B}, "
          f"max_model_len {L}, {'dense' if args.dense else 'virtual'} ids, busy {args.busy_us:.0f} us, "
          f"warmup {warm:.1f} s")
    print(f"update() us: first {times[0]:.0f}; steps 2-{len(times)}: median {statistics.median(rest):.1f}, "
          f"p90 {rest[-(-9 * (len(rest) - 1) // 10)]:.1f}, mean {float(np.mean(rest)):.1f}")
    if prof is not None:
        import pstats
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
