#!/usr/bin/env bash
# Session 10, call 2 (H200), the final kernel (large tiles: fold=1, window entries stepped from the chunk's first
# block). Run from the worktree root (.wt28).
# 1. fold sweep: fold 0 (main's window program), 1 (the new default), 2 (two SWA groups per program), 1r56 (fold 1
#    capped at 56 registers: 9 programs per SM), both Flash layouts, prefill 8K and mixed 256 + 4K, 5 rounds;
# 2. gpu_check (compiled launch == reference, both tile variants, Flash 4- and 5-group layouts);
# 3. the CUDA tests: tests/fused tests/kernels tests/layout.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || tail -3 "$OUT/install.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | head -1
t() { local n=$1 l=$2; shift 2; local s=$(date +%s); timeout "$l" "$@" >"$OUT/$n.log" 2>&1; echo "== $n rc=$? $(( $(date +%s)-s ))s"; tail -n "${T:-6}" "$OUT/$n.log"; }
T=16 t fold 120 python3 benchmarks/bench_step.py --fold-sweep 0,1,2,1r56 --sweep-layouts flash,flash:vllm \
  --sweep-cases "prefill 8K,mixed 256 + 4K" --rounds 5 --replays 25 --out "$OUT/fold.json"
T=9 t check 90 python3 benchmarks/gpu_check.py --steps 10
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 16"
T=12 t cuda 250 python3 -m pytest -q -rfs $XD -p no:cacheprovider tests/fused tests/kernels tests/layout
