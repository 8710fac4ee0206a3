#!/usr/bin/env bash
# Session 8, call 1 (H200): the GPU contract tests after the workload fix (1 launch, 1 H2D copy, 0 syncs,
# 0 allocations per step), the async tests, the V4-Flash example and the host mix (old 59aca62 vs main).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || tail -3 "$OUT/install.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
t() { local n=$1 l=$2; shift 2; local s=$(date +%s); timeout "$l" "$@" >"$OUT/$n.log" 2>&1; echo "== $n rc=$? $(( $(date +%s)-s ))s"; tail -n "${T:-6}" "$OUT/$n.log"; }
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 8"
T=8 t contract 200 python3 -m pytest -q -rfs $XD -p no:cacheprovider tests/pipeline/test_gpu_contract.py tests/pipeline/test_gpu_async.py
T=24 t flash 90 python3 examples/flash_decode_step.py --out "$OUT/flash.json"
T=22 t mix 100 python3 benchmarks/host_profile.py --mix --old .old59 --steps 80 --replicas 3
