#!/usr/bin/env bash
# Session 5, call 2: whole suite on CUDA (failures logged as they come), fused check, old-vs-new bench.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p $OUT
ROOT=$PWD
t() { local n=$1 l=$2; shift 2; local s=$(date +%s); timeout $l "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $(( $(date +%s)-s ))s"; tail -n ${T:-6} $OUT/$n.log; }
export PYTHONPATH=$ROOT:$ROOT/.wt/_notes
T=4 t async 60 python3 -m pytest -q -p no:cacheprovider -p failog tests/test_gpu_async.py
T=4 t check 50 python3 benchmarks/gpu_check.py --steps 8 --long-steps 1
T=6 t suite 290 python3 -m pytest -q -rs -n 14 -p no:cacheprovider -p failog --durations=12 tests --deselect tests/test_gpu_async.py
for r in 1; do
  (cd $ROOT/.wt/old && PYTHONPATH=$ROOT/.wt/old T=14 t bench_old_$r 75 python3 benchmarks/bench_step.py --quick --no-host --replays 20 --layouts flash)
  PYTHONPATH=$ROOT T=14 t bench_new_$r 75 python3 benchmarks/bench_step.py --quick --no-host --replays 20 --layouts flash
done
