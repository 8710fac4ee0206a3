set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
t0=$(date +%s)
python3 -m pip install -q --no-deps --no-build-isolation -e . >$OUT/install.log 2>&1 || tail -3 $OUT/install.log
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c "import torch, triton, numba, numpy; print(torch.__version__, triton.__version__, numba.__version__, numpy.__version__)"
st() { local n=$1 l=$2; shift 2; local a=$(date +%s); timeout $l "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $(( $(date +%s)-a ))s"; tail -n ${TAIL:-6} $OUT/$n.log; }
TAIL=4 st warm_cpu 200 python3 benchmarks/flash_host.py --device cpu --steps 3
TAIL=6 st fh_cpu 90 python3 benchmarks/flash_host.py --device cpu
TAIL=6 st fh_busy4000 200 python3 benchmarks/flash_host.py --device cuda --busy-us 4000
TAIL=6 st fh_busy0 90 python3 benchmarks/flash_host.py --device cuda --busy-us 0
TAIL=40 st fh_prof 120 python3 benchmarks/flash_host.py --device cuda --busy-us 4000 --steps 20 --profile 25
TAIL=12 st query_bench 200 python3 benchmarks/query_bench.py --B 1 --chunk 2048 --q 128 --ctx 8192
echo total $(( $(date +%s)-t0 ))s
