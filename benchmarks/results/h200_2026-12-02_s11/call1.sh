#!/usr/bin/env bash
# Session 11, call 1 (H200), branch s11-prefill: split window programs (TileConfig.split, fused/rows.py).
# Run from the worktree root (.wt11k).
# 1. fold/split sweep, large tiles forced, both Flash layouts, prefill 8K and mixed 256 + 4K, 5 rounds: 1 (main's
#    kernel: fold 1, no split), 1s32 (split 32 rows), 1s32r64 (capped at 64 registers), 1s16r64, 1s64r64, 2s32r64
#    (both SWA groups of the 5-group layout in one split program);
# 2. the README test alone under a faulthandler (diagnostic: it never finished on CUDA), in the background, beside
# 3. gpu_check --steps 10 (the new default LARGE = split 32) and the CUDA tests test_window_fold.py + tests/kernels.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || tail -3 "$OUT/install.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | head -1
t() { local n=$1 l=$2; shift 2; local s=$(date +%s); timeout "$l" "$@" >"$OUT/$n.log" 2>&1; echo "== $n rc=$? $(( $(date +%s)-s ))s"; tail -n "${T:-6}" "$OUT/$n.log"; }
T=26 t fold 125 python3 benchmarks/bench_step.py --fold-sweep 1,1s32,1s32r64,1s16r64,1s64r64,2s32r64 \
  --sweep-layouts flash,flash:vllm --sweep-cases "prefill 8K,mixed 256 + 4K" --rounds 5 --replays 25 --out "$OUT/fold.json"
( s=$(date +%s); timeout 150 python3 -m pytest -x -q -p no:cacheprovider -o faulthandler_timeout=90 \
    tests/fused/test_registered_channels.py::test_readme_example_verbatim >"$OUT/readme.log" 2>&1
  echo "== readme rc=$? $(( $(date +%s)-s ))s" >>"$OUT/readme.log" ) &
T=14 t check 80 python3 benchmarks/gpu_check.py --steps 10
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 8"
T=4 t cuda 90 python3 -m pytest -q -rfs $XD -p no:cacheprovider tests/fused/test_window_fold.py tests/kernels
wait
grep -n "== readme\|Timeout\|File \"/\|passed\|failed" "$OUT/readme.log" | head -60
