#!/usr/bin/env bash
# Session 5, call 3: the tests that failed on CUDA, old-vs-new bench interleaved, whole suite again.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
ROOT=$PWD
t() { local n=$1 l=$2; shift 2; local s=$(date +%s); timeout $l "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $(( $(date +%s)-s ))s"; tail -n ${T:-6} $OUT/$n.log; }
export PYTHONPATH=$ROOT:$ROOT/.wt/_notes
T=8 t fixed 110 python3 -m pytest -q -rs -n 6 -p no:cacheprovider -p failog tests/test_flash_decode_step.py tests/test_cp.py tests/test_state_ownership.py tests/test_packaging.py tests/test_ring_peer.py tests/kernels/test_no_block.py tests/test_null_block.py
for r in 1 2; do
  (cd $ROOT/.wt/old && PYTHONPATH=$ROOT/.wt/old T=7 t bench_old_$r 40 python3 benchmarks/bench_step.py --quick --no-host --replays 25 --layouts flash)
  PYTHONPATH=$ROOT T=7 t bench_new_$r 40 python3 benchmarks/bench_step.py --quick --no-host --replays 25 --layouts flash
done
T=8 t suite 225 python3 -m pytest -q -rs -n 15 -p no:cacheprovider -p failog --timeout 150 --durations=25 tests --deselect tests/test_gpu_async.py
