#!/usr/bin/env bash
# Session 6, call 2 (H200), after the ownership checks' fast path merged: the CUDA tests call 1 did not
# reach (V4.1, rings of several blocks fused), the V4-Flash example, V4.1 build time, and the host mix
# old (59aca62, carried as .old59) vs new on the H200's host.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || tail -3 "$OUT/install.log"
t() { local n=$1 l=$2; shift 2; local s=$(date +%s); timeout "$l" "$@" >"$OUT/$n.log" 2>&1; echo "== $n rc=$? $(( $(date +%s)-s ))s"; tail -n "${T:-6}" "$OUT/$n.log"; }
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 12"
T=12 t tests2 170 python3 -m pytest -q -rfs $XD -p no:cacheprovider tests/v41 tests/test_circular_blocks.py \
  tests/kernels/test_circular_kernel_blocks.py tests/test_fused.py tests/test_gpu_async.py -m "not slow or gpu"
T=22 t flash2 60 python3 examples/flash_decode_step.py --out "$OUT/flash2.json"
T=8 t v41b 110 python3 benchmarks/v41_groups.py --ctx 1024
T=22 t mix2 130 python3 benchmarks/host_profile.py --mix --old .old59 --steps 100 --replicas 3
