#!/usr/bin/env bash
# Session 6, call 1 (H200): CUDA tests of what changed this session, the compiled fused check, the
# V4-Flash example (update() µs and metadata share), the build benchmark, V4.1 group build, host mix.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || tail -3 "$OUT/install.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c "import numpy, torch, triton; print('numpy', numpy.__version__, 'torch', torch.__version__, 'triton', triton.__version__)"
t() { local n=$1 l=$2; shift 2; local s=$(date +%s); timeout "$l" "$@" >"$OUT/$n.log" 2>&1; echo "== $n rc=$? $(( $(date +%s)-s ))s"; tail -n "${T:-6}" "$OUT/$n.log"; }
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 8"
T=14 t tests 200 python3 -m pytest -q -rfs $XD -p no:cacheprovider tests/kernels tests/test_fused.py tests/v41 \
  tests/test_circular_blocks.py tests/test_circular.py tests/test_gpu_async.py tests/state tests/test_pipeline.py \
  tests/test_flash_decode_step.py -m "not slow or gpu"
T=8 t check 70 python3 benchmarks/gpu_check.py --steps 10
T=24 t flash 90 python3 examples/flash_decode_step.py --out "$OUT/flash.json"
T=24 t bench 70 python3 benchmarks/bench_step.py --quick --no-host --replays 25 --layouts flash --out "$OUT/bench.json"
T=10 t v41 50 python3 benchmarks/v41_groups.py
T=24 t mix 80 python3 benchmarks/host_profile.py --mix --steps 60 --replicas 3
