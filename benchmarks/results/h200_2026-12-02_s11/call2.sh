#!/usr/bin/env bash
# Session 11, call 2 (H200), the final kernel of s11-prefill (LARGE: split 32, maxnreg 64; the split tiles' fast
# path when no listed block id is negative; the next slab's words loaded before a slab's store). Run from .wt11k.
# 1. build time, main 49fed7c (A, carried as .base, its own bench_step.py) against this tree (B), A/B/A/B, both
#    Flash layouts, decode B=256 and prefill 8K (graph-amortized, server-sized and exact);
# 2. gpu_check --steps 10, beside the CUDA tests test_window_fold.py + test_window_split.py + tests/kernels and
#    the README test (the causal whole-row loop over > 16 chunks: it no longer compiles 512 copies).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || tail -3 "$OUT/install.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | head -1
t() { local n=$1 l=$2; shift 2; local s=$(date +%s); timeout "$l" "$@" >"$OUT/$n.log" 2>&1; echo "== $n rc=$? $(( $(date +%s)-s ))s"; tail -n "${T:-6}" "$OUT/$n.log"; }
B="benchmarks/bench_step.py --quick --no-host --replays 25 --layouts flash,flash:vllm"
T=6 t benchA1 45 python3 .base/$B --cases "decode B=256,prefill 8K" --out "$OUT/bA1.json"
T=6 t benchB1 45 python3 $B --cases "decode B=256,prefill 8K" --out "$OUT/bB1.json"
T=6 t benchA2 35 python3 .base/$B --cases "decode B=256,prefill 8K" --out "$OUT/bA2.json"
T=6 t benchB2 35 python3 $B --cases "decode B=256,prefill 8K" --out "$OUT/bB2.json"
( s=$(date +%s); timeout 80 python3 -m pytest -x -q -p no:cacheprovider -o faulthandler_timeout=70 \
    tests/fused/test_registered_channels.py::test_readme_example_verbatim >"$OUT/readme.log" 2>&1
  echo "== readme rc=$? $(( $(date +%s)-s ))s" >>"$OUT/readme.log" ) &
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 6"
( T=4 t cuda 85 python3 -m pytest -q -rfs $XD -p no:cacheprovider tests/fused/test_window_fold.py \
    tests/fused/test_window_split.py tests/kernels ) &
T=14 t check 85 python3 benchmarks/gpu_check.py --steps 10
wait
tail -4 "$OUT/readme.log"
