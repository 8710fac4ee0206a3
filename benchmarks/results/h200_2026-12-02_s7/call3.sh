#!/usr/bin/env bash
# Session 7, call 3 (H200): the fused CUDA tests call 2 did not finish, and the build time of the kernel with
# units of several tasks (B) against the kernel before it (A, .oldk), A/B/A in one session, on the 4-group
# and the 5-group (groups="vllm") Flash layouts.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || tail -3 "$OUT/install.log"
t() { local n=$1 l=$2; shift 2; local s=$(date +%s); timeout "$l" "$@" >"$OUT/$n.log" 2>&1; echo "== $n rc=$? $(( $(date +%s)-s ))s"; tail -n "${T:-6}" "$OUT/$n.log"; }
B="benchmarks/bench_step.py --quick --no-host --replays 25 --layouts flash,flash:vllm"
T=9 t benchA1 75 python3 .oldk/$B --out "$OUT/bA1.json"
T=9 t benchB1 75 python3 $B --out "$OUT/bB1.json"
T=9 t benchA2 40 python3 .oldk/$B --out "$OUT/bA2.json"
T=9 t benchB2 40 python3 $B --out "$OUT/bB2.json"
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 16"
T=4 t fused 250 python3 -m pytest -q -rfs $XD -p no:cacheprovider tests/fused/test_fused.py
