"""GPU time of V4.1's two-level (candidate) indexer metadata (issue 38): a V4.1-Flash decode step of ``B``
requests at context ``ctx`` (the step of ``benchmarks/v41_groups.py``: ``B`` requests joining with ``ctx`` computed
tokens, one token each), channel ``c1a`` (ratio 1, the candidate source's ratio).

Arms, each a CUDA graph (``k`` calls back to back, median per call over ``--replays``; and one single-call graph
replay), all on the same step and inputs (DESIGN §8):

* ``build off``: the fused build of the same step on the layout without the two-level indexer (the config's
  candidate keys removed); ``build``: the fused build with it (the candidate channel adds no fused task: the ratio
  is the target's, <= 1.15); ``build+phys``: the build plus the step's ``candidate_blocks_to_physical`` (the
  per-step conversion at the candidate source layer), ratio against ``build off``;
* ``topk``: ``meta.topk_to_slots("c1a", topk)`` at ``K = index_topk``; ``cand``: one consumer layer's
  ``meta.candidate_topk_to_slots("c1a", blocks, cols)`` at the same ``K``, ratio against ``topk`` (target <= 1.2).

Inputs are never zeros: each token gets ``min(nb, cdiv(n_c, C))`` distinct visible blocks (the rest ``-1``), columns
drawn over its valid columns, top-k rows drawn over ``[0, n_c)``, the last 8 of each row ``-1``.

    python benchmarks/candidate_bench.py [--B 256] [--ctx 2048]
    python benchmarks/candidate_bench.py --smoke --B 2 --ctx 64     # CPU, no timing
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

from bench_step import graph_time  # noqa: E402
from v41_groups import joined_step  # noqa: E402

from dsv4_index import DSV4Layout  # noqa: E402
from dsv4_index.config import shipped_config  # noqa: E402


def inputs(meta, channel: str, seed: int = 0):
    """(blocks int32 [T_pad, nb], cols int32 [T_pad, K], topk int32 [T_pad, K]) on the step's device."""
    lay, dev = meta.layout, meta.positions.device
    C, nb, K = lay.candidate_block_size, lay.candidate_topk_blocks, lay.index_topk
    R = lay.channels[channel].compress_ratio
    g = torch.Generator().manual_seed(seed)
    n_c = ((meta.positions.cpu() + 1) // R) * meta.is_valid_token.cpu()
    nvis = torch.clamp((n_c + C - 1) // C, max=nb)
    Tp = meta.num_tokens_padded
    blocks = torch.full((Tp, nb), -1, dtype=torch.int32)
    for t in range(Tp):
        n = int(nvis[t])
        if n:
            blocks[t, :n] = torch.randperm(int((n_c[t] + C - 1) // C), generator=g)[:n].to(torch.int32)
    ncols = (nvis * C).clamp(min=1)
    cols = (torch.rand(Tp, K, generator=g) * ncols[:, None]).long().to(torch.int32)
    topk = (torch.rand(Tp, K, generator=g) * n_c.clamp(min=1)[:, None]).long().to(torch.int32)
    cols[:, -8:] = -1
    topk[:, -8:] = -1
    return blocks.to(dev), cols.to(dev), topk.to(dev)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--B", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--max-model-len", type=int, default=1 << 16)
    ap.add_argument("--smoke", action="store_true", help="no timing: build the step and convert once on the CPU")
    args = ap.parse_args(argv)
    dev = "cpu" if args.smoke else "cuda"
    if not args.smoke and not torch.cuda.is_available():
        print("needs a CUDA device (try --smoke --B 2 --ctx 64)")
        return 2
    lay = DSV4Layout.from_config("v41_flash", 4096 if args.smoke else args.max_model_len)
    pipe, meta, _ = joined_step(lay, args.B, args.ctx, 512 if args.smoke else 8192, dev)
    blocks, cols, topk = inputs(meta, "c1a")
    phys = meta.candidate_blocks_to_physical("c1a", blocks)
    slots = meta.candidate_topk_to_slots("c1a", blocks, cols)
    n_phys, n_slots = int(phys[1].sum()), int(slots[1].sum())
    if args.smoke:
        print(f"smoke OK: V4.1-Flash decode B={args.B}, T_pad {meta.num_tokens_padded}, C {lay.candidate_block_size}, "
              f"nb {lay.candidate_topk_blocks}: {n_phys} physical blocks, {n_slots} consumer slots")
        return 0
    meta.topk_to_slots("c1a", topk)  # NOTE: every kernel compiled before a graph captures it
    torch.cuda.synchronize()
    plan, st = pipe.fused_plan, pipe.stage_layout
    cfg = {k: v for k, v in shipped_config("v41_flash").items() if not k.startswith("candidate_")}
    off = DSV4Layout.from_config(cfg, args.max_model_len)
    assert off.candidate_block_size is None
    pipe_off, _, _ = joined_step(off, args.B, args.ctx, 8192, dev)
    plan_off, st_off = pipe_off.fused_plan, pipe_off.stage_layout

    def build():
        plan.launch(st)

    def build_phys():
        plan.launch(st)
        meta.candidate_blocks_to_physical("c1a", blocks)

    arms = {"build off": lambda: plan_off.launch(st_off), "build": build, "build+phys": build_phys,
            "topk": lambda: meta.topk_to_slots("c1a", topk),
            "cand": lambda: meta.candidate_topk_to_slots("c1a", blocks, cols)}
    res = {name: graph_time(fn, args.k, args.replays) for name, fn in arms.items()}
    print(f"V4.1-Flash decode B={args.B}, ctx {args.ctx}, T_pad {meta.num_tokens_padded}, K {lay.index_topk}, "
          f"C {lay.candidate_block_size}, nb {lay.candidate_topk_blocks} ({torch.cuda.get_device_name()}); "
          f"{n_phys} physical blocks, {n_slots} consumer slots valid")
    for name, (g, s1) in res.items():
        print(f"  {name:<11} {g:8.2f} us graph  {s1:8.2f} us single")
    print(f"  build / build off      = {res['build'][0] / res['build off'][0]:.3f}x (target <= 1.15)")
    print(f"  build+phys / build off = {res['build+phys'][0] / res['build off'][0]:.3f}x")
    print(f"  cand / topk            = {res['cand'][0] / res['topk'][0]:.3f}x (target <= 1.2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
