#!/usr/bin/env bash
# The one device run: build every kernel, run the GPU tests, the sanitizer subset and the
# benchmarks, in one call to the lent H200.  Full logs go under $OUT; a short table prints last.
#   usage (from the repository root): bash benchmarks/device_run.sh [tests|sanitize|bench ...]
set -uo pipefail
OUT=${OUT:-/tmp/cupy_paged_out}
LOGS=$(mktemp -d)  # bundled into $OUT/logs.tgz at the end (the device returns few files)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
steps=${*:-tests sanitize bench}
summary=()

run_step() {  # name, command...
  local name=$1; shift
  local start=$SECONDS
  timeout "${STEP_TIMEOUT:-420}" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-10s rc=%-3s %4ss  %s' "$name" "$rc" $((SECONDS - start)) "$(tail -n 1 "$LOGS/$name.log")")")
}

python3 -m cupy_paged info >"$LOGS/info.log" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv >>"$LOGS/info.log" 2>&1
run_step warm python3 -m cupy_paged warm --jobs "$(nproc)"
for step in $steps; do
  case $step in
    tests) run_step tests python3 -m pytest -m gpu -q -p no:cacheprovider ;;
    sanitize)
      run_step memcheck compute-sanitizer --tool memcheck --error-exitcode 1 \
        python3 -m pytest -m gpu -q -p no:cacheprovider -k sanitize
      run_step racecheck compute-sanitizer --tool racecheck --error-exitcode 1 \
        python3 -m pytest -m gpu -q -p no:cacheprovider -k sanitize ;;
    bench)
      for bench in benchmarks/bench_varlen.py benchmarks/bench_decode.py; do
        [ -f "$bench" ] && run_step "$(basename "$bench" .py)" python3 "$bench"
      done
      mkdir -p "$LOGS/results" && cp benchmarks/results/*.json "$LOGS/results/" 2>/dev/null ;;
  esac
done
mkdir -p "$OUT" && tar czf "$OUT/logs.tgz" -C "$LOGS" .
for log in "$LOGS"/bench_*.log; do [ -f "$log" ] && { echo "== $(basename "$log")"; tail -n 40 "$log"; }; done
grep -h -E "FAILED|Error" "$LOGS/tests.log" 2>/dev/null | head -n 30
head -n 14 "$LOGS/info.log"
printf '%s\n' "${summary[@]}"
