#!/usr/bin/env bash
# Session 9, call 3 (H200): the fused-format unit test that now builds on CUDA, the fused kernel's CUDA-only
# tests (graphs, direct launch, variants compiled at construction) on the final kernel.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || tail -3 "$OUT/install.log"
t() { local n=$1 l=$2; shift 2; local s=$(date +%s); timeout "$l" "$@" >"$OUT/$n.log" 2>&1; echo "== $n rc=$? $(( $(date +%s)-s ))s"; tail -n "${T:-6}" "$OUT/$n.log"; }
T=4 t unit 120 python3 -m pytest -q -rfs -p no:cacheprovider tests/fused/test_fused_format.py -k "one_unit"
T=4 t cudaonly 200 python3 -m pytest -q -rfs -p no:cacheprovider tests/fused/test_fused.py -k "cuda_graph or direct_launch or every_variant or large_tile"
