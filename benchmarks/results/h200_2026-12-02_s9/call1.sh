#!/usr/bin/env bash
# Session 9, call 1 (H200): the fused kernel's per-block window reads. CUDA tests of the fused kernel, the
# compiled launch against the reference, then build time old (A: 28de5ce, carried as .oldk) against new (B),
# A/B/A/B in one session, Flash 4-group and vLLM 5-group layouts.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || tail -3 "$OUT/install.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
t() { local n=$1 l=$2; shift 2; local s=$(date +%s); timeout "$l" "$@" >"$OUT/$n.log" 2>&1; echo "== $n rc=$? $(( $(date +%s)-s ))s"; tail -n "${T:-6}" "$OUT/$n.log"; }
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 8"
T=4 t fused 150 python3 -m pytest -q -rfs $XD -p no:cacheprovider tests/fused/test_fused.py tests/fused/test_fused_format.py
T=8 t check 70 python3 benchmarks/gpu_check.py --steps 10
B="benchmarks/bench_step.py --quick --no-host --replays 25 --layouts flash,flash:vllm"
T=9 t benchA1 75 python3 .oldk/$B --out "$OUT/bA1.json"
T=9 t benchB1 75 python3 $B --out "$OUT/bB1.json"
T=9 t benchA2 60 python3 .oldk/$B --out "$OUT/bA2.json"
T=9 t benchB2 60 python3 $B --out "$OUT/bB2.json"
