#!/usr/bin/env bash
# Session 11, call 4 (H200, the machine of call 3 still warm): the CUDA tests tests/fused tests/kernels tests/v41
# on merged main, every result named (-v) against the collected list (call 3's -q run was cut at 93 %).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || tail -3 "$OUT/install.log"
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 16"
S="tests/fused tests/kernels tests/v41"
python3 -m pytest --collect-only -q -p no:cacheprovider $S 2>/dev/null | grep "::" | sort > "$OUT/collected.txt"
echo "collected $(wc -l < "$OUT/collected.txt")"
s=$(date +%s); timeout 400 python3 -m pytest -v -rfs $XD -p no:cacheprovider --durations=10 $S > "$OUT/cuda.log" 2>&1
echo "== cuda rc=$? $(( $(date +%s)-s ))s"
grep -E "passed|failed|FAILED|ERROR" "$OUT/cuda.log" | tail -8
sed -n '/slowest/,/^$/p' "$OUT/cuda.log" | head -14
grep -oE "(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) tests/[^ ]+" "$OUT/cuda.log" | awk '{print $2}' | sort -u > "$OUT/done.txt"
echo "not finished:"; comm -23 "$OUT/collected.txt" "$OUT/done.txt" | head
