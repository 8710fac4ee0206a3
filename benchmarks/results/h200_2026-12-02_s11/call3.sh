#!/usr/bin/env bash
# Session 11, call 3 (H200), merged main (s11-prefill's split kernel + V4.1 top-k reuse in the tiny model).
# 1. the 5 / 4 group ratio on the final kernel: three more rounds of bench_step (graph-amortized, server / exact);
# 2. gpu_check --steps 10 (every case, the 5-group forced-large one included) beside the CUDA tests of
#    tests/fused tests/kernels tests/v41 (the README test included) and the V4.1 example on CUDA (fused metadata).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || tail -3 "$OUT/install.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | head -1
t() { local n=$1 l=$2; shift 2; local s=$(date +%s); timeout "$l" "$@" >"$OUT/$n.log" 2>&1; echo "== $n rc=$? $(( $(date +%s)-s ))s"; tail -n "${T:-6}" "$OUT/$n.log"; }
B="benchmarks/bench_step.py --quick --no-host --replays 25 --layouts flash,flash:vllm"
for r in 1 2 3; do T=6 t bench$r 75 python3 $B --cases "decode B=256,prefill 8K" --out "$OUT/b$r.json"; done
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 10"
( T=5 t cuda 230 python3 -m pytest -q -rfs $XD -p no:cacheprovider --durations=8 tests/fused tests/kernels tests/v41 ) &
( T=3 t v41ex 120 python3 examples/sparse_decode_loop.py --config tiny_v41 --device cuda --steps 120 ) &
T=16 t check 230 python3 benchmarks/gpu_check.py --steps 10
wait
