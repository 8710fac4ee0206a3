#!/usr/bin/env bash
# Session 7, call 2 (H200): the fused kernel with units of several tasks (S_REP) on CUDA: fused tests and the
# compiled-vs-reference check, V4.1 traces with a sliding group per layer, the build time A/B/A against the
# kernel before the change (.oldk, same run), the 5-group layout, and the V4.1 45-group build.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || tail -3 "$OUT/install.log"
t() { local n=$1 l=$2; shift 2; local s=$(date +%s); timeout "$l" "$@" >"$OUT/$n.log" 2>&1; echo "== $n rc=$? $(( $(date +%s)-s ))s"; tail -n "${T:-6}" "$OUT/$n.log"; }
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 8"
T=4 t fused 120 python3 -m pytest -q -rfs $XD -p no:cacheprovider tests/fused/test_fused.py tests/fused/test_fused_format.py
T=8 t check 70 python3 benchmarks/gpu_check.py --steps 10
T=4 t v41 90 python3 -m pytest -q -rfs -p no:cacheprovider tests/v41/test_v41_pipeline.py -k "prefix_hits_replays or dozens"
B="benchmarks/bench_step.py --quick --no-host --replays 25 --layouts flash"
T=4 t benchA1 45 python3 .oldk/$B --out "$OUT/bA1.json"
T=4 t benchB 45 python3 $B --out "$OUT/bB.json"
T=4 t benchA2 45 python3 .oldk/$B --out "$OUT/bA2.json"
T=4 t b5 60 python3 benchmarks/bench_step.py --quick --no-host --replays 25 --layouts flash:vllm --out "$OUT/b5.json"
T=10 t v41b 60 python3 benchmarks/v41_groups.py --ctx 1024
