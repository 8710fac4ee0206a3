set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >$OUT/install.log 2>&1 || tail -3 $OUT/install.log
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
timeout 170 python3 -m pytest -v -rfE --tb=short -p no:warnings -p no:cacheprovider tests/pipeline/test_stream.py "tests/pipeline/test_aliasing.py::test_every_shipped_layout_has_disjoint_buffers[pro-unfused]" > $OUT/call3.log 2>&1; echo "rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/call3.log | tail -12
