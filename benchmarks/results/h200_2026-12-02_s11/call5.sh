#!/usr/bin/env bash
# Session 11, call 5 (H200), merged main: the CUDA tests of tests/layout (engine-plan and V4.1 layouts, rings of
# several blocks) and tests/pipeline/test_gpu_contract.py (1 launch, 0 syncs, 0 allocations) on the split kernel.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || tail -3 "$OUT/install.log"
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 16"
S="tests/layout tests/pipeline/test_gpu_contract.py"
python3 -m pytest --collect-only -q -p no:cacheprovider $S 2>/dev/null | grep "::" | sort > "$OUT/collected.txt"
echo "collected $(wc -l < "$OUT/collected.txt")"
s=$(date +%s); timeout 230 python3 -m pytest -v -rfs $XD -p no:cacheprovider --durations=6 $S > "$OUT/cuda.log" 2>&1
echo "== cuda rc=$? $(( $(date +%s)-s ))s"
grep -E "passed|failed|FAILED|ERROR" "$OUT/cuda.log" | tail -6
grep -oE "(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) tests/[^ ]+" "$OUT/cuda.log" | awk '{print $2}' | sort -u > "$OUT/done.txt"
echo "not finished:"; comm -23 "$OUT/collected.txt" "$OUT/done.txt" | head
gzip "$OUT/cuda.log"
