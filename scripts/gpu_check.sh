#!/usr/bin/env bash
# The GPU test suite, for a GPU machine without network: the tests, compute-sanitizer passes on one small case
# per kernel, and a short benchmark summary. Logs go to $OUT (default /tmp/gpu_check). Exit status 0 = all passed.
# Arguments name the steps to run (info pytest selftest sanitizer bench; default all), e.g. to split the suite
# over two calls of a machine that limits a command's time.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export CUDART_KERNELS_CACHE_DIR=${CUDART_KERNELS_CACHE_DIR:-$OUT/kernel-cache}

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
step pytest $PY -m pytest tests -q -rs
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
