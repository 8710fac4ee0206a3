#!/usr/bin/env bash
# Session 8, call 2 (H200): examples/flash_decode_step.py with update() wrapped (ex_prof.py beside this file,
# carried as .prof/): MODE=share (ownership share), the same with ONE_THREAD=1 (torch.set_num_threads(1)),
# MODE=prof (cProfile of update()). The wrapper's own "mean us" includes step 0 (the batch's admission); the
# example's median line is the figure.
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
MODE=share timeout 150 python3 .prof/ex_prof.py > "$OUT/ex_share_0.log" 2>&1
MODE=share ONE_THREAD=1 timeout 150 python3 .prof/ex_prof.py > "$OUT/ex_share_1.log" 2>&1
MODE=prof timeout 150 python3 .prof/ex_prof.py > "$OUT/ex_prof_0.log" 2>&1
