#!/usr/bin/env bash
# Session 7, call 1 (H200): fused rings of several blocks and V4.1 on CUDA (tests), the 5-group
# (groups="vllm") build against the 4-group one with a tile sweep of the prefill cases, the V4.1
# 45-group build (joined-step setup), the V4-Flash example, and the host mix old (59aca62) vs new.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || tail -3 "$OUT/install.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
t() { local n=$1 l=$2; shift 2; local s=$(date +%s); timeout "$l" "$@" >"$OUT/$n.log" 2>&1; echo "== $n rc=$? $(( $(date +%s)-s ))s"; tail -n "${T:-6}" "$OUT/$n.log"; }
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 16"
T=8 t rings 130 python3 -m pytest -q -rfs $XD -p no:cacheprovider tests/layout/test_circular_blocks.py \
  tests/kernels/test_circular_kernel_blocks.py
T=8 t v41 100 python3 -m pytest -q -rfs $XD -p no:cacheprovider tests/v41
T=10 t v41b 50 python3 benchmarks/v41_groups.py --ctx 1024
T=30 t b5 60 python3 benchmarks/bench_step.py --quick --no-host --replays 25 --layouts flash,flash:vllm --out "$OUT/b5.json"
T=6 t sweep5 80 python3 benchmarks/bench_step.py --sweep --sweep-layouts flash,flash:vllm --sweep-cases "prefill 8K" --replays 20
T=24 t flash 60 python3 examples/flash_decode_step.py --out "$OUT/flash.json"
T=22 t mix 80 python3 benchmarks/host_profile.py --mix --old .old59 --steps 80 --replicas 3
