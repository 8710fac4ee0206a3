set -u
export PYTHONUNBUFFERED=1
t0=$(date +%s)
python3 -m pip install -q --no-deps --no-build-isolation -e . >$OUT/install.log 2>&1 || tail -3 $OUT/install.log
python3 -m pip install -q --no-deps .whl/*.whl >>$OUT/install.log 2>&1 || echo "xdist install failed"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
git log -1 --format=%h 2>/dev/null; head -c 300 .trial/rev.txt
st() { local n=$1 l=$2; shift 2; local a=$(date +%s); timeout $l "$@" > $OUT/$n.log 2>&1; echo "== $n rc=$? $(( $(date +%s)-a ))s"; tail -n ${TAIL:-6} $OUT/$n.log; }
(cd .trial/base && timeout 250 python3 benchmarks/flash_host.py --device cuda --steps 3 > $OUT/base_warm.log 2>&1) &
TAIL=14 st stream 120 python3 -m pytest -v -rfE --tb=short -p no:warnings -p no:cacheprovider -p no:xdist tests/pipeline/test_stream.py
TAIL=40 st gpu_rest 330 python3 -m pytest -n 14 -v -rfE --tb=short -p no:warnings -p no:cacheprovider --junitxml=$OUT/junit.xml tests/v41 tests/fused tests/pipeline/test_aliasing.py tests/kernels/test_candidate_ops.py
grep -E "FAILED|ERROR" $OUT/gpu_rest.log | head -20
wait
for k in 1 2; do
TAIL=1 st fh_new$k 60 python3 benchmarks/flash_host.py --device cuda --busy-us 4000 --steps 30
(cd .trial/base && TAIL=1 st fh_base$k 60 python3 benchmarks/flash_host.py --device cuda --busy-us 4000 --steps 30)
done
echo total $(( $(date +%s)-t0 ))s
