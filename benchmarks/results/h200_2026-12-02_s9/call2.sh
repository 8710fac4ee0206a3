#!/usr/bin/env bash
# Session 9, call 2 (H200): rows per program of one-chunk index lists (TileConfig.bt_one) swept on the prefill
# steps of both Flash layouts (each config's outputs checked against the pipeline's build), then the CUDA
# tests of the tree: fused format (its unit test now builds on CUDA), V4.1, layouts, the GPU contract.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || tail -3 "$OUT/install.log"
t() { local n=$1 l=$2; shift 2; local s=$(date +%s); timeout "$l" "$@" >"$OUT/$n.log" 2>&1; echo "== $n rc=$? $(( $(date +%s)-s ))s"; tail -n "${T:-6}" "$OUT/$n.log"; }
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 16"
T=6 t sweep 150 python3 benchmarks/bench_step.py --sweep --sweep-layouts flash,flash:vllm --sweep-cases "prefill 8K,mixed 256 + 4K" --replays 20
T=4 t format 120 python3 -m pytest -q -rfs $XD -p no:cacheprovider tests/fused/test_fused_format.py
T=8 t cuda 300 python3 -m pytest -q -rfs $XD -p no:cacheprovider tests/v41 tests/layout tests/pipeline/test_gpu_contract.py
