#!/usr/bin/env bash
# Session 9, call 4 (H200): the final tree (the window chunk's dispatch moved to ops/_device.window_chunk):
# the compiled launch against the reference, and the fused tests of the large tiles and compiled variants.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || tail -3 "$OUT/install.log"
t() { local n=$1 l=$2; shift 2; local s=$(date +%s); timeout "$l" "$@" >"$OUT/$n.log" 2>&1; echo "== $n rc=$? $(( $(date +%s)-s ))s"; tail -n "${T:-6}" "$OUT/$n.log"; }
T=9 t check 90 python3 benchmarks/gpu_check.py --steps 10
T=4 t fused 150 python3 -m pytest -q -rfs -p no:cacheprovider tests/fused/test_fused.py -k "large_tile or every_variant or flash_one_step or cuda_graph"
