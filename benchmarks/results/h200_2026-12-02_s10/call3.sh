#!/usr/bin/env bash
# Session 10, call 3 (H200), the final kernel. Run from the worktree root (.wt28).
# 1. the CUDA tests tests/fused tests/kernels tests/layout (call 2's run was cut by its 250 s limit at 96 %);
# 2. build time, main 9179143 (A, carried as .base) against the final kernel (B), A/B/A/B, both Flash layouts,
#    prefill 8K and decode B=256 (graph-amortized, server-sized and exact); the A arm runs this tree's
#    bench_step.py (for --cases) over main's package (.base/benchmarks/bench_step.py replaced by it).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || tail -3 "$OUT/install.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | head -1
t() { local n=$1 l=$2; shift 2; local s=$(date +%s); timeout "$l" "$@" >"$OUT/$n.log" 2>&1; echo "== $n rc=$? $(( $(date +%s)-s ))s"; tail -n "${T:-6}" "$OUT/$n.log"; }
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 16"
T=4 t cuda 300 python3 -m pytest -q -rfs $XD -p no:cacheprovider tests/fused tests/kernels tests/layout
B="benchmarks/bench_step.py --quick --no-host --replays 25 --layouts flash,flash:vllm"
T=7 t benchA1 50 python3 .base/$B --cases "decode B=256,prefill 8K" --out "$OUT/bA1.json"
T=7 t benchB1 50 python3 $B --cases "decode B=256,prefill 8K" --out "$OUT/bB1.json"
T=7 t benchA2 40 python3 .base/$B --cases "decode B=256,prefill 8K" --out "$OUT/bA2.json"
T=7 t benchB2 40 python3 $B --cases "decode B=256,prefill 8K" --out "$OUT/bB2.json"
