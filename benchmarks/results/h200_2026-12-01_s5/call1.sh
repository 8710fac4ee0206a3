#!/usr/bin/env bash
# Session 5, call 1: verify the circular-overlay fix on the H200, then the whole suite on CUDA.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t() { local n=$1 l=$2; shift 2; local s=$(date +%s); timeout $l "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $(( $(date +%s)-s ))s"; tail -n ${T:-6} $OUT/$n.log; }
T=15 t circ 130 python3 -m pytest -q -rs -p no:cacheprovider tests/test_overlay.py tests/test_circular.py tests/test_engine_groups.py tests/test_hybrid_rings.py tests/test_scheduler.py::test_circular_fused_triton_equals_reference tests/test_gpu_async.py tests/test_torch_ops.py::test_reduce_overhead_uses_cuda_graphs_with_build_outside
T=8 t check 70 python3 benchmarks/gpu_check.py --steps 20 --long-steps 4
T=25 t suite 320 python3 -m pytest -q -rs -n 8 -p no:cacheprovider --durations=15 tests --deselect tests/test_gpu_async.py
