#!/usr/bin/env bash
# One lent-GPU session: install, then the stages named on the command line, each with its log under
# $OUT and a time limit. Used for the figures in BENCHMARKS.md and RELIABILITY.md.
#
#   bash benchmarks/gpu_session.sh check bench ncu cp memcheck racecheck
#
# Stages (limits in seconds; the sanitizer stages run small traces that exercise every kernel once):
#   sweep      fused-launch tile sweep: both variants (small / large tiles), several configs, every Flash case
#   floors     empty-kernel launch floors (graph-amortized, single replay, eager) and the write bandwidth
#   topk-sweep top-k conversion tiles (rows per program x warps)
#   check      benchmarks/gpu_check.py: compiled fused launch + top-k == the PyTorch reference (traces)
#   bench      benchmarks/bench_step.py (JSON + markdown table)
#   ab         bench_step.py --ab: this round's kernel options against round 1's, interleaved in one run,
#              every Flash case, server + exact, graph + single, top-k, counts (the figures of BENCHMARKS.md)
#   bench-pro  bench_step.py on the V4-Pro layout only
#   ncu        Nsight Compute on one server-sized decode B=256 and one prefill 8K + 32K cached step (fused + top-k)
#   cp         examples/cp_decode.py with NCCL on 2 GPUs (when present)
#   flash      examples/flash_decode_step.py (V4-Flash-shaped sparse decode fed by the metadata)
#   gpu-tests  pytest -m gpu (CUDA-only tests)
#   fused-gpu  pytest -m gpu of tests/test_fused.py and the top-k kernel tests only
#   memcheck   compute-sanitizer memcheck over gpu_check.py (few steps)
#   racecheck  compute-sanitizer racecheck over gpu_check.py (few steps)
set -u
export PYTHONUNBUFFERED=1
# NOTE: NVLink multicast stays off on the lent machines (shared hosts).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}
mkdir -p "$OUT"
PY=${PY:-python3}
$PY -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || tail -3 "$OUT/install.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")

stage() {  # stage NAME LIMIT CMD...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "== $name: rc=$? $(( $(date +%s) - t0 ))s"
  tail -n "${TAIL:-4}" "$OUT/$name.log"
}

for s in "$@"; do
  case $s in
    sweep)     TAIL=8 stage sweep 150 $PY benchmarks/bench_step.py --sweep --replays 20 --out "$OUT/sweep.json" ;;
    floors)    TAIL=12 stage floors 40 $PY benchmarks/bench_step.py --floors --replays 30 ;;
    topk-sweep) TAIL=4 stage topk_sweep 60 $PY benchmarks/bench_step.py --topk-sweep --replays 30 ;;
    check)     TAIL=12 stage check 120 $PY benchmarks/gpu_check.py --steps 30 ;;
    bench)     TAIL=34 stage bench 150 $PY benchmarks/bench_step.py --out "$OUT/bench.json" --replays 30 --host-steps 40 --no-host ;;
    ab)        TAIL=60 stage ab 220 $PY benchmarks/bench_step.py --ab --rounds 3 --replays 30 --out "$OUT/ab.json" ;;
    bench-pro) TAIL=12 stage bench_pro 60 $PY benchmarks/bench_step.py --layouts pro --out "$OUT/bench_pro.json" --replays 30 --no-host ;;
    ncu)       for c in "decode B=256" "prefill 8K + 32K cached"; do
                 TAIL=2 stage "ncu_${c//[^a-zA-Z0-9]/_}" 45 ncu --clock-control none -k "regex:fused_step_kernel|_topk_rows" \
                   --launch-skip 5 -c 2 --section SpeedOfLight --section LaunchStats --section Occupancy \
                   --section WarpStateStats --section MemoryWorkloadAnalysis $PY benchmarks/bench_step.py --profile-one "$c"
               done ;;
    cp)        [ "$NGPU" -ge 2 ] && stage cp 50 $PY -m torch.distributed.run --nproc-per-node 2 examples/cp_decode.py --device cuda ;;
    flash)     TAIL=24 stage flash 120 $PY examples/flash_decode_step.py --out "$OUT/flash.json" ;;
    gpu-tests) stage gpu_tests 80 $PY -m pytest -q -x -m gpu -p no:warnings tests ;;
    fused-gpu) stage fused_gpu 60 $PY -m pytest -q -x -m gpu -p no:warnings tests/test_fused.py tests/kernels/test_topk_to_slots.py ;;
    memcheck)  TAIL=8 stage memcheck 90 compute-sanitizer --tool memcheck --error-exitcode 7 $PY benchmarks/gpu_check.py --steps 6 --long-steps 2 ;;
    racecheck) TAIL=8 stage racecheck 90 compute-sanitizer --tool racecheck --error-exitcode 7 $PY benchmarks/gpu_check.py --steps 4 --long-steps 2 ;;
    *) echo "unknown stage $s" ;;
  esac
done
