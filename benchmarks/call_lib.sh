# What the benchmarks/call_sNN_K.sh device scripts share; source it first: `. benchmarks/call_lib.sh`.
#   R       the run log ($OUT/run.log), L the step and shard logs (/tmp/$CALL_LOGS), P pytest on GPU tests,
#           MEMCHECK compute-sanitizer's memcheck that fails on any error
#   pack    the logs into $OUT/logs.tgz, and $OUT/ab (an A/B's results) into $OUT/ab.tgz when present:
#           the device returns at most 8 files from $OUT
#   step NAME LIMIT CMD...   CMD under `timeout LIMIT`, its output and rc appended to $R, then pack
#   shard NAME CMD...        CMD in the background (limit $SHARD_LIMIT, default 170 s), log $L/shard_NAME.log;
#   shards_done              waits for them and appends their last lines to $R
#   gpu_line                 the card, driver and clocks into $R
#   on_h200                  whether the card is an H200 (the issues' card)
#   gpu_start                gpu_line, $OUT/ab made, every registered specialization built (step warm)
#   step_path_tests          the GPU tests of the paths a step plan launches (plan, calls, ragged, balanced) and
#                            memcheck of the ragged and balanced launches, in shards, waited for
#   issue_benchmarks [S]     bench_calls and bench_mixed into $OUT/ab, and on an H200 while fewer than S
#                            seconds (default 330) have passed bench_e2e: every issue's benchmark
#   issue_tables             the step rc lines and the tables issue_benchmarks printed, from $R
#   calls_benchmarks         bench_calls, this host's eager floor (eager_floor.py) and the host path's parts
#                            (profile_host.py); on an H200 then bench_mixed, and bench_e2e where END leaves time
#   e2e_in_time              bench_e2e (about 230 s) where at least 400 s of END are left
#   shard_limit              SHARD_LIMIT set to what END leaves (10 s kept), at most 150 s
export PYTHONUNBUFFERED=1
R=$OUT/run.log; L=/tmp/${CALL_LOGS:-calllogs}; mkdir -p "$L"
P="python3 -m pytest -m gpu -q -p no:cacheprovider -rfE"
MEMCHECK="compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1"
pack() {
  tar czf "$OUT/logs.tgz" -C "$(dirname "$L")" "$(basename "$L")" 2>/dev/null
  [ -d "$OUT/ab" ] && tar czf "$OUT/ab.tgz" -C "$OUT" ab 2>/dev/null
  return 0
}
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS; echo "=== $name: $*" >>"$R"; timeout "$limit" "$@" >>"$R" 2>&1; echo "=== $name rc=$? $((SECONDS-t))s" >>"$R"; pack; }
shard() { local n=$1; shift; ( t=$SECONDS; timeout "${SHARD_LIMIT:-170}" "$@" >"$L/shard_$n.log" 2>&1; echo "shard $n rc=$? $((SECONDS-t))s $(tail -n1 "$L/shard_$n.log")" >>"$L/shards.txt" ) & }
shards_done() { wait; cat "$L/shards.txt" >>"$R" 2>/dev/null; pack; }
gpu_line() { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader >>"$R"; }
on_h200() { [[ "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" == *H200* ]]; }
# uses SIDE ROOT: which package and kernel source the tree ROOT imports (an A/B side's record in $R)
uses() {
  (cd "$2" && PYTHONPATH="$2" python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import cupy_paged; from cupy_paged._core import compiler; print('$1 uses', cupy_paged.__file__, compiler.source_dir())") >>"$R" 2>&1
}
# store_path_tests: the GPU tests of every path that stores through the decode kernel's store_rows
# (decode, calls, FA2 features, worked examples, plan, merge, ragged, balanced) and memcheck of its
# store, hole and off-16-bytes cases and of the ragged window/softcap/ALiBi and head-dim cases, in
# shards, waited for
store_path_tests() {
  shard decode $P tests/test_decode_gpu.py
  shard calls $P tests/test_calls_gpu.py
  shard fa2 $P tests/test_fa2_features_gpu.py tests/test_worked_examples.py tests/test_plan.py tests/test_merge.py
  shard ragged $P tests/test_ragged.py
  shard balanced $P tests/test_balanced_gpu.py
  CUPY_PAGED_SANITIZER=memcheck shard memcheck $MEMCHECK $P tests/test_decode_gpu.py tests/test_calls_gpu.py -k "sanitize or hole or off_16"
  CUPY_PAGED_SANITIZER=memcheck shard memcheck_ragged $MEMCHECK $P tests/test_ragged.py -k "window_softcap or head_dims_block_sizes"
  shards_done
}
gpu_start() { mkdir -p "$OUT/ab"; gpu_line; step warm 90 python3 -m cupy_paged warm --jobs 16; }
step_path_tests() {
  local SHARD_LIMIT=${SHARD_LIMIT:-150}
  shard plan $P tests/test_plan.py tests/test_worked_examples.py tests/test_merge.py tests/test_arrays.py
  shard calls $P tests/test_calls_gpu.py -k "torch or memo or cupy or stream or balanced"
  shard ragged $P tests/test_ragged.py
  shard balanced $P tests/test_balanced_gpu.py
  CUPY_PAGED_SANITIZER=memcheck shard memcheck_ragged $MEMCHECK $P tests/test_ragged.py -k "window_softcap or head_dims_block_sizes or split"
  CUPY_PAGED_SANITIZER=memcheck shard memcheck_balanced $MEMCHECK $P tests/test_balanced_gpu.py -k "hostile or level"
  shards_done
}
issue_benchmarks() {
  step bench_calls 90 python3 benchmarks/bench_calls.py --shuffle-order --no-profile --out $OUT/ab/calls.json
  step bench_mixed 150 python3 benchmarks/bench_mixed.py --out $OUT/ab/mixed.json
  if on_h200 && [ $SECONDS -lt "${1:-330}" ]; then
    step bench_e2e 230 python3 benchmarks/bench_e2e.py --max-seconds 200 --out $OUT/ab/e2e.json
  fi
}
calls_benchmarks() {
  step bench_calls 90 python3 benchmarks/bench_calls.py --shuffle-order --no-profile --out $OUT/ab/calls.json
  step eager_floor 40 python3 benchmarks/eager_floor.py --out $OUT/ab/eager_floor.json
  step profile 40 python3 benchmarks/profile_host.py
  if on_h200; then
    step bench_mixed 150 python3 benchmarks/bench_mixed.py --out $OUT/ab/mixed.json
    e2e_in_time
  fi
}
issue_tables() {
  grep -h -E "^=== .* rc=|^shard " $R
  grep -h -A16 "^| case | ours GPU" $R | cut -c1-200 | head -18
  grep -h -A18 "^| case | path | ours ms" $R | cut -c1-200 | head -40
  grep -h -A14 "^| requests | configuration" $R | cut -c1-200 | head -16
  grep -h -A8 "^| target | value" $R | cut -c1-200 | head -10
}
e2e_in_time() {
  [ $SECONDS -lt $((END - 400)) ] && step bench_e2e 230 python3 benchmarks/bench_e2e.py --max-seconds 200 --out $OUT/ab/e2e.json
  return 0
}
shard_limit() { SHARD_LIMIT=$((END - 10 - SECONDS)); [ $SHARD_LIMIT -gt 150 ] && SHARD_LIMIT=150; return 0; }
