"""One server-sized prefill 8K step per layout and fold, launched once each between cudaProfilerStart/Stop
(for ``ncu --profile-from-start off``): the fused launch of the large tiles at ``--folds`` (``F`` or ``FrN``)."""
import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench_step import CASES, DSV4Layout, make_pipe, steady  # noqa: E402
from dsv4_index.fused.plan import LARGE, FusedPlan  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--layouts", default="flash,flash:vllm")
ap.add_argument("--folds", default="0,2")
ap.add_argument("--case", default="prefill 8K")
args = ap.parse_args()
for lname in args.layouts.split(","):
    cfg_name, _, groups = lname.partition(":")
    layout = DSV4Layout.from_config(cfg_name, max_model_len=131072, **({"groups": groups} if groups else {}))
    pipe = make_pipe(layout, CASES[args.case], True)
    wl, _ = steady(layout, CASES[args.case], pipe, 3)
    batch, _ = wl.next_step()
    pipe.update(batch)
    pipe.build()
    lay = pipe.stage_layout
    for tok in args.folds.split(","):
        f, _, r = tok.partition("r")
        cfg = replace(LARGE, fold=int(f), maxnreg=int(r or 0))
        plan = FusedPlan(pipe.fused_plan.tasks, pipe.tables, pipe.ctx.group_cp, pipe.staging.dev, pipe.ctx.next_n,
                         tiny=cfg, small=cfg, large=cfg, large_from=0)
        plan.launch(lay)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        plan.launch(lay)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print(f"profiled {lname} fold {tok}: programs {plan.num_programs(lay.t_pad)}", flush=True)
