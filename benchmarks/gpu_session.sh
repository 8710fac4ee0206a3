#!/usr/bin/env bash
# One lent-GPU session: install, then the stages named on the command line (default: all), each with its
# log under $OUT. Used for the figures in BENCHMARKS.md and RELIABILITY.md.
#
#   bash benchmarks/gpu_session.sh                 # tests bench demo cp
#   bash benchmarks/gpu_session.sh memcheck racecheck
#
# Stages:
#   tests      the whole pytest suite, kernels compiled (no interpreter), GPU-only tests included
#              (pytest-xdist, 8 workers sharing the GPU, when the machine has it)
#   bench      benchmarks/bench_step.py (JSON + markdown table)
#   demo       examples/sparse_decode_loop.py on CUDA
#   cp         examples/cp_decode.py with NCCL: 2 ranks, and 4 ranks when 4 GPUs are present
#   memcheck   compute-sanitizer memcheck over the kernel, fused, pipeline and graph tests
#   racecheck  compute-sanitizer racecheck over the fused-kernel tests
set -u
export PYTHONUNBUFFERED=1
# NOTE: NVLink multicast stays off on the lent machines (shared hosts).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}
mkdir -p "$OUT"
PY=${PY:-python3}

$PY -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || cat "$OUT/install.log"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

stage() {  # stage NAME TIMEOUT CMD...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc, $(( $(date +%s) - t0 )) s"
  tail -n "${TAIL:-6}" "$OUT/$name.log"
}

NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
stages=${*:-tests bench demo cp}
for s in $stages; do
  case $s in
    tests)     XD=$($PY -c "import xdist" 2>/dev/null && echo "-n 8")
               TAIL=25 stage tests 300 $PY -m pytest -q -p no:warnings $XD --durations=12 tests ;;
    bench)     TAIL=40 stage bench 300 $PY benchmarks/bench_step.py --out "$OUT/bench.json" ;;
    demo)      stage demo 120 $PY examples/sparse_decode_loop.py --device cuda ;;
    cp)        stage cp2 120 $PY -m torch.distributed.run --nproc-per-node 2 examples/cp_decode.py --device cuda
               if [ "$NGPU" -ge 4 ]; then
                 stage cp4 120 $PY -m torch.distributed.run --nproc-per-node 4 examples/cp_decode.py --device cuda --interleave 2
               fi ;;
    memcheck)  HYPOTHESIS_PROFILE=dev TAIL=12 stage memcheck 300 compute-sanitizer --tool memcheck --error-exitcode 7 \
                 $PY -m pytest -q -p no:warnings tests/kernels tests/test_fused.py tests/test_pipeline.py ;;
    racecheck) HYPOTHESIS_PROFILE=dev TAIL=12 stage racecheck 200 compute-sanitizer --tool racecheck --error-exitcode 7 \
                 $PY -m pytest -q -p no:warnings tests/test_fused.py ;;
    *) echo "unknown stage $s" ;;
  esac
done
echo "gpus: $NGPU"
