set -u
export PYTHONUNBUFFERED=1
t0=$(date +%s)
python3 -m pip install -q --no-deps --no-build-isolation -e . >$OUT/install.log 2>&1 || tail -3 $OUT/install.log
python3 -m pip install -q --no-deps .whl/*.whl >>$OUT/install.log 2>&1 || echo "xdist install failed"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c "import torch, triton, numba, numpy, pytest; print(torch.__version__, triton.__version__, numba.__version__, numpy.__version__, pytest.__version__)"
N=""; python3 -c "import xdist" 2>/dev/null && N="-n 12"
st() { local n=$1 l=$2; shift 2; local a=$(date +%s); timeout $l "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $(( $(date +%s)-a ))s"; tail -n ${TAIL:-6} $OUT/$n.log; }
TAIL=25 st gpu_tests 330 python3 -m pytest $N -q -rfEs --tb=short -p no:warnings -p no:cacheprovider --junitxml=$OUT/junit.xml tests/pipeline/test_stream.py tests/v41 tests/fused tests/pipeline/test_aliasing.py tests/kernels/test_candidate_ops.py
TAIL=8 st query_bench 60 python3 benchmarks/query_bench.py --B 1 --chunk 2048 --q 128 --ctx 8192
r=$(( 560 - ($(date +%s)-t0) ))
[ $r -gt 40 ] && TAIL=26 st flash_busy20k $(( r < 130 ? r : 130 )) python3 examples/flash_decode_step.py --steps 25 --busy-us 20000 --out $OUT/flash_busy20k.json
r=$(( 570 - ($(date +%s)-t0) ))
[ $r -gt 30 ] && TAIL=6 st tiny_v41_cuda $r python3 examples/sparse_decode_loop.py --config tiny_v41 --device cuda --steps 60
echo total $(( $(date +%s)-t0 ))s
