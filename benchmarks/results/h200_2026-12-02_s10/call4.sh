#!/usr/bin/env bash
# Session 10, call 4 (H200): merged main (s10-prefill's kernel + the V4.1 KV sharing of the tiny model).
# The CUDA set tests/fused tests/kernels tests/layout (calls 2-3 were cut with one test left), every finished test
# named (-v) beside the collected list, the slowest listed; then the V4.1 pipeline tests if time is left.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || tail -3 "$OUT/install.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 16"
S="tests/fused tests/kernels tests/layout"
python3 -m pytest --collect-only -q -p no:cacheprovider $S 2>/dev/null | grep "::" | sort > "$OUT/collected.txt"
echo "collected $(wc -l < "$OUT/collected.txt")"
s=$(date +%s); timeout 330 python3 -m pytest -v -rfs $XD -p no:cacheprovider --durations=12 $S > "$OUT/cuda.log" 2>&1
echo "== cuda rc=$? $(( $(date +%s)-s ))s"
grep -E "passed|failed|FAILED|ERROR" "$OUT/cuda.log" | tail -8
sed -n '/slowest/,/^$/p' "$OUT/cuda.log" | head -16
grep -oE "(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) tests/[^ ]+" "$OUT/cuda.log" | awk '{print $2}' | sort -u > "$OUT/done.txt"
echo "not finished:"; comm -23 "$OUT/collected.txt" "$OUT/done.txt" | head
s=$(date +%s); timeout 50 python3 -m pytest -q -rfs $XD -p no:cacheprovider tests/v41/test_v41_pipeline.py > "$OUT/v41.log" 2>&1
echo "== v41 rc=$? $(( $(date +%s)-s ))s"; tail -3 "$OUT/v41.log"
