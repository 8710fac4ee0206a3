set -u
export PYTHONUNBUFFERED=1
t0=$(date +%s)
python3 -m pip install -q --no-deps --no-build-isolation -e . >$OUT/install.log 2>&1 || tail -3 $OUT/install.log
st() { local n=$1 l=$2; shift 2; local a=$(date +%s); timeout $l "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $(( $(date +%s)-a ))s"; tail -n ${TAIL:-6} $OUT/$n.log; }
TAIL=15 st gpu_tests 330 python3 -m pytest -q -rfE -p no:warnings -p no:cacheprovider tests/v41 tests/pipeline/test_stream.py tests/pipeline/test_aliasing.py tests/kernels/test_candidate_ops.py tests/fused
TAIL=22 st flash_new 150 python3 examples/flash_decode_step.py --steps 40 --out $OUT/flash_new.json
echo total $(( $(date +%s)-t0 ))s
