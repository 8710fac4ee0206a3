set -u
export PYTHONUNBUFFERED=1
t0=$(date +%s)
python3 -m pip install -q --no-deps --no-build-isolation -e . >$OUT/install.log 2>&1 || tail -3 $OUT/install.log
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
st() { local n=$1 l=$2; shift 2; local a=$(date +%s); timeout $l "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $(( $(date +%s)-a ))s"; tail -n ${TAIL:-6} $OUT/$n.log; }
TAIL=60 st gpu_tests3 105 python3 -m pytest -q -rfE --tb=short -p no:warnings -p no:cacheprovider -v tests/pipeline/test_stream.py "tests/v41/test_query_batch.py::test_declared_step_in_the_large_tiles" tests/v41/test_query_optin.py "tests/v41/test_query_batch.py::test_declared_step_of_many_batch_rows" tests/pipeline/test_aliasing.py tests/kernels/test_candidate_ops.py
TAIL=8 st query_bench2 35 python3 benchmarks/query_bench.py --B 1 --chunk 2048 --q 128 --ctx 8192
r=$(( 150 - ($(date +%s)-t0) ))
[ $r -gt 40 ] && TAIL=24 st flash_busy20k $r python3 examples/flash_decode_step.py --steps 25 --busy-us 20000 --out $OUT/flash_busy20k.json
echo total $(( $(date +%s)-t0 ))s
