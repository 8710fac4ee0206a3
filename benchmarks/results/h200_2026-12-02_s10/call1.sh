#!/usr/bin/env bash
# Session 10, call 1 (H200): folded window programs (TileConfig.fold). Run from the worktree root (.wt28).
# 1. fold sweep: the large tiles at fold 0 (main's structure), 1 (loads before stores), 2 (the two SWA groups
#    in one program), 2r64 (fold 2 capped at 64 registers), on both Flash layouts, prefill 8K and mixed 256 + 4K,
#    5 interleaved rounds, each arm's outputs checked against the pipeline's build;
# 2. gpu_check (compiled launch == reference, both tile variants, now with the 5-group Flash layout);
# 3. the folded large tiles on CUDA (tests/fused/test_window_fold.py); 4. ncu of one prefill 8K launch per
#    layout at fold 0 and 2.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || tail -3 "$OUT/install.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | head -1
t() { local n=$1 l=$2; shift 2; local s=$(date +%s); timeout "$l" "$@" >"$OUT/$n.log" 2>&1; echo "== $n rc=$? $(( $(date +%s)-s ))s"; tail -n "${T:-6}" "$OUT/$n.log"; }
T=8 t fold 140 python3 benchmarks/bench_step.py --fold-sweep 0,1,2,2r64 --sweep-layouts flash,flash:vllm \
  --sweep-cases "prefill 8K,mixed 256 + 4K" --rounds 5 --replays 25 --out "$OUT/fold.json"
T=8 t check 90 python3 benchmarks/gpu_check.py --steps 10
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 8"
T=3 t foldtest 80 python3 -m pytest -q -rfs $XD -p no:cacheprovider tests/fused/test_window_fold.py
R=benchmarks/results/h200_2026-12-02_s10
T=3 t ncu 80 ncu --clock-control none --profile-from-start off --section SpeedOfLight --section LaunchStats \
  --section Occupancy --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
  --metrics sm__cycles_active.avg,sm__cycles_active.max,sm__cycles_active.min,gpu__time_duration.sum,dram__bytes_write.sum,dram__bytes_read.sum,launch__registers_per_thread,launch__occupancy_limit_registers,sm__warps_active.avg.pct_of_peak_sustained_active \
  --csv --page details --print-units base python3 $R/ncu_step.py --folds 0,2
grep -c "fused_step_kernel" "$OUT/ncu.log"
