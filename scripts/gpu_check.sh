#!/usr/bin/env bash
# The GPU test suite, for a GPU machine without network: the tests, compute-sanitizer passes on one small case
# per kernel, and a short benchmark summary. Logs go to $OUT (default /tmp/gpu_check). Exit status 0 = all passed.
# Arguments name the steps to run (info pytest selftest sanitizer bench; default all), e.g. to split the suite
# over two calls of a machine that limits a command's time. The test files run in GPU_CHECK_SHARDS pytest processes
# side by side on the one GPU (default 4; 1 = one process): the suite is bound by the host (interpreters started
# by the README and torch/jax tests), not by the GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export CUDART_KERNELS_CACHE_DIR=${CUDART_KERNELS_CACHE_DIR:-$OUT/kernel-cache}
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # jax would take 75% of the GPU's memory from the processes beside it

# Install from the tree if the environment allows it offline; otherwise run from the source tree.
if ! $PY -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1; then
  echo "pip install from the tree failed (see install.log); using PYTHONPATH=$PWD"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

status=0
summary=()
STEPS="$*"
step() {  # step NAME COMMAND...: run, log to $OUT/NAME.log, record pass/fail (unless not among the steps asked for)
  local name=$1; shift
  if [ -n "$STEPS" ] && [[ " $STEPS " != *" ${name%%-*} "* ]]; then return; fi
  local t0=$SECONDS
  if "$@" >"$OUT/$name.log" 2>&1; then r=PASS; else r=FAIL; status=1; fi
  summary+=("$(printf '%-22s %s  (%ss)  %s' "$name" "$r" $((SECONDS - t0)) "$(tail -n 1 "$OUT/$name.log")")")
}

step info $PY -m cudart_kernels info
pytest_shards() {  # every n-th test in each of n processes (tests/conftest.py reads CK_TEST_SHARD); pytest-K.log
  local n=${GPU_CHECK_SHARDS:-4} k rc=0 pids=()
  for ((k = 0; k < n; k++)); do
    CK_TEST_SHARD=$k/$n $PY -m pytest tests -q -rs --durations=10 >"$OUT/pytest-$k.log" 2>&1 &
    pids+=($!)
  done
  for k in "${!pids[@]}"; do wait "${pids[k]}" || rc=1; done
  for ((k = 0; k < n; k++)); do echo "shard $k/$n: $(tail -n 1 "$OUT/pytest-$k.log")"; done
  return $rc
}

step pytest pytest_shards
step selftest $PY -m cudart_kernels selftest
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
for tool in memcheck racecheck synccheck; do
  step "sanitizer-$tool" "$SAN" --tool "$tool" --error-exitcode 1 $PY scripts/sanitize_cases.py
done
step bench $PY -m cudart_kernels bench --quick --json "$OUT/bench.json"

echo
cat "$OUT/bench.log" 2>/dev/null | tail -n 20
echo
printf '%s\n' "${summary[@]}"
exit $status
