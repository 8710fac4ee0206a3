#!/usr/bin/env bash
# ./dev demo's wall and user time under added load (BENCHMARKS "The demo at load"):
#   bash benchmarks/demo_load.sh MODE [RUNS]    MODE: none | same | other1 | other3 (default RUNS 2)
# none: nothing added; same: 3 busy loops started from this script's session (Linux autogroup: they share the
# demo's session); other1: 3 loops in one other session (setsid); other3: 3 loops, each in its own session.
# LOOPS=N: N loops instead of 3 (e.g. LOOPS=2 other3: a load average of 3 with the demo running).
# The loops are killed (by their pids) at the end. Python: $PYTHON, else .venv/bin/python.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mode=${1:?usage: demo_load.sh none|same|other1|other3 [RUNS]}
runs=${2:-2}
n=${LOOPS:-3}
pids=()
case $mode in
  none) ;;
  same) for _ in $(seq "$n"); do (while :; do :; done) & pids+=($!); done ;;
  other1) setsid bash -c "for _ in \$(seq $n); do (while :; do :; done) & done; wait" & sleep 0.5
          mapfile -t pids < <(pgrep -s "$(ps -o sid= -p $! | tr -d ' ')") ;;
  other3) for _ in $(seq "$n"); do setsid bash -c 'while :; do :; done' & pids+=($!); done ;;
  *) echo "unknown MODE $mode" >&2; exit 2 ;;
esac
trap '[ ${#pids[@]} -gt 0 ] && kill "${pids[@]}" 2>/dev/null; true' EXIT
sleep 5
for _ in $(seq "$runs"); do
  l0=$(cut -d' ' -f1 /proc/loadavg)
  /usr/bin/time -f "$mode wall %e user %U sys %S" "$PY" examples/sparse_decode_loop.py 2>&1 >/dev/null | tail -n 1 \
    | tr '\n' ' '
  echo "load1 before $l0 after $(cut -d' ' -f1 /proc/loadavg)"
done
