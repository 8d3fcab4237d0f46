#!/usr/bin/env bash
# The GPU suite under compute-sanitizer, one process per (tool, test file), several at once, so that
# a long suite fits in few device calls: each pair's result is merged into the results file, which
# keeps the pairs of earlier calls (with their dates) until they are run again.
#   usage (repository root, on the GPU): bash benchmarks/sanitize.sh TOOL[,TOOL...] [FILE ...]
#     TOOL: memcheck racecheck initcheck synccheck (or "all"); FILE: test files (default: every
#     file with GPU tests); SANITIZE_K: a pytest -k expression; SANITIZE_T: seconds per pair
#     (default 600); SANITIZE_TOTAL: seconds for all pairs; SANITIZE_JOBS: pairs run at once
#     (default: a third of the CPUs; on the H200 machine thirteen at once ran CuPy out of device
#     memory, five did not); SANITIZE_KERNELS: a regex of kernel names, the only kernels instrumented (the project's
#     own, so that a framework's kernels in a test -- cuBLAS, cuDNN -- neither slow the run nor
#     report; passed as --kernel-name regex=..., so no comma in it; initcheck then does not see what the
#     other kernels write, so it reports every read of their outputs, and racecheck with a filter has
#     failed inside torch's bf16 cuBLAS GEMM: benchmarks/sanitizer_control.py shows both without
#     cupy_paged); SANITIZE_OUT: results file (default benchmarks/results/sanitizer.json).
#     SANITIZE_SHARDS: n processes per (tool, file), each running every n-th test (CUPY_PAGED_SHARD,
#     tests/conftest.py), a case each, named "TOOL:FILE[i/n]".  tests/test_load.py runs only when named.
#   Each pair runs with CUPY_PAGED_SANITIZER=TOOL set, for the tests whose timing a tool changes.
#   One case per pair (benchmarks/sanitizer_record.py): name "TOOL:FILE" ("TOOL:FILE -k EXPR" with
#   SANITIZE_K, then " kernels=REGEX" with SANITIZE_KERNELS), metric "errors" (the tool's error summary; for racecheck its hazards), peers {} ; the
#   test outcome, seconds and date beside it, and the printed reports counted by kernel, those in the
#   project's own kernels apart.  A pair cut short, killed, or that ran no test has value null.
set -uo pipefail
tools=${1:?usage: sanitize.sh TOOL[,TOOL...] [FILE ...]}; shift
[[ $tools == all ]] && tools=memcheck,racecheck,initcheck,synccheck
files=("$@")
if [ ${#files[@]} -eq 0 ]; then  # test_load.py's 10,000 requests under a sanitizer would not end: named only
  mapfile -t files < <(grep -l -E "mark\.gpu" tests/test_*.py | grep -v -x tests/test_load.py)
fi
deadline=$((SECONDS + ${SANITIZE_TOTAL:-100000}))  # SANITIZE_TOTAL: seconds for all pairs (device_run.sh gives its step's)
shards=${SANITIZE_SHARDS:-1}
[[ $shards =~ ^[1-9][0-9]*$ ]] || { echo "SANITIZE_SHARDS must be a whole number >= 1; got '$shards'" >&2; exit 2; }
jobs=${SANITIZE_JOBS:-$(( $(nproc) / 3 > 0 ? $(nproc) / 3 : 1 ))}
[[ $jobs =~ ^[1-9][0-9]*$ ]] || { echo "SANITIZE_JOBS must be a whole number >= 1; got '$jobs'" >&2; exit 2; }
results=${SANITIZE_OUT:-benchmarks/results/sanitizer.json}
logs=${OUT:-/tmp}/sanitize_logs
mkdir -p "$logs" "$(dirname "$results")"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1

record() {  # tool name rc seconds log: merge one pair's case into the results file (under a lock)
  flock "$logs/.results.lock" python3 benchmarks/sanitizer_record.py "$results" "$@" "${SANITIZE_KERNELS:-}" "${SANITIZE_K:-}"
}

run_pair() {  # tool file shard: one sanitizer process over (a shard of) one test file, then its record
  local tool=$1 file=$2 shard=$3 extra=() start=$SECONDS name=$2
  local log=$logs/${tool}_$(basename "$file" .py)${SANITIZE_K:+_k_${SANITIZE_K//[^a-zA-Z0-9]/_}}.log
  [[ -n ${SANITIZE_K:-} ]] && name="$file -k $SANITIZE_K"  # another selection of a file is another case
  # so is another set of kernels instrumented (the unfiltered verdict of the same file stays beside it)
  [[ -n ${SANITIZE_KERNELS:-} ]] && { name="$name kernels=$SANITIZE_KERNELS"; log=${log%.log}_kernels.log; }
  if (( shards > 1 )); then name="$name[$shard/$shards]"; log=${log%.log}_$shard.log; fi
  [[ -n ${SANITIZE_KERNELS:-} ]] && extra=(--kernel-name "regex=$SANITIZE_KERNELS")
  local left=$((deadline - SECONDS - 20))  # ends each pair in time to record it, none left running
  local limit=${SANITIZE_T:-600}; (( left < limit )) && limit=$left
  if (( limit < 10 )); then echo "$tool $file: no time left, not run"; return; fi
  CUPY_PAGED_SHARD=$( (( shards > 1 )) && echo "$shard/$shards") CUPY_PAGED_SANITIZER=$tool timeout "$limit" compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 99 \
    "${extra[@]}" python3 -m pytest -m gpu -q -p no:cacheprovider -x "$file" ${SANITIZE_K:+-k "$SANITIZE_K"} >"$log" 2>&1
  record "$tool" "$name" $? $((SECONDS - start)) "$log"
}

for file in "${files[@]}"; do  # file by file, so that a long file's four tools start early
  for tool in ${tools//,/ }; do
    for ((shard = 0; shard < shards; shard++)); do
      while (( $(jobs -rp | wc -l) >= jobs )); do wait -n; done
      run_pair "$tool" "$file" "$shard" &
    done
  done
done
wait
