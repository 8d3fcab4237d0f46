#!/usr/bin/env bash
# The one device run: build every kernel, run the GPU tests, the benchmarks and the sanitizer
# subset, in one call to the lent GPU.  Each step writes its log under $LOGS (default
# /tmp/device_run_logs) under its own time limit, and after each step every log so far is packed
# into $OUT/logs.tgz: the device returns at most 8 files from $OUT, so the logs travel as one file
# (and what finished comes back even if the call is cut short).  A short table prints last.
#   usage (repository root): bash benchmarks/device_run.sh [warm tests bench sanitize ...]
#   (bench = bench_decode bench_varlen bench_calls; each can also run alone)
#   per-step limits in seconds: T_WARM T_TESTS T_BENCH (T_BENCH_DECODE, T_BENCH_CALLS for those
#   benchmarks alone) T_SANITIZE; extra arguments: TEST_ARGS,
#   BENCH_DECODE_ARGS (default --quick), BENCH_VARLEN_ARGS (default --reps 10),
#   BENCH_CALLS_ARGS (default none), SANITIZE_ARGS; T_ENGINE for the engine step;
#   bench_mixed (T_BENCH_MIXED, BENCH_MIXED_ARGS), sanitize_ragged (SANITIZE_RAGGED_K: pytest -k),
#   bench_e2e (T_BENCH_E2E, BENCH_E2E_ARGS), profile_engine (T_PROFILE_ENGINE, PROFILE_ENGINE_ARGS),
#   fuzz (T_FUZZ, FUZZ_ARGS), trace_phases (T_BENCH), trace_call (T_BENCH, TRACE_CALL_ARGS), cold_host (T_BENCH), trace_list (T_BENCH, TRACE_LIST_ARGS),
#   lse_check (T_BENCH), profile_host (T_PROFILE_HOST), ncu_graph and ncu_attention (T_NCU, NCU_ARGS), sanitize_suite (T_SANITIZE_SUITE, SUITE_TOOLS,
#   SUITE_FILES, and sanitize.sh's SANITIZE_K / SANITIZE_T), load (T_LOAD, LOAD_ARGS),
#   sanitizer_control (T_CONTROL: benchmarks/sanitizer_control.py under each tool, logs control_*.log)
set -uo pipefail
OUT=${OUT:-/tmp/cupy_paged_out}
LOGS=${LOGS:-/tmp/device_run_logs}
mkdir -p "$OUT" "$LOGS"
pack_logs() { tar czf "$OUT/logs.tgz" -C "$(dirname "$LOGS")" "$(basename "$LOGS")" 2>/dev/null; }
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
steps=${*:-warm tests bench sanitize}
steps=${steps//bench /bench_decode bench_varlen bench_calls }
[[ $steps == *bench ]] && steps="${steps%bench}bench_decode bench_varlen bench_calls"
collect_results() {  # one file for every results/*.json, since the device returns few files
  python3 - "$OUT/results.json" <<'PY'
import json, pathlib, sys
found = {p.name: json.loads(p.read_text()) for p in sorted(pathlib.Path("benchmarks/results").glob("*.json"))
         if p.name in ("decode.json", "decode_short.json", "varlen.json", "calls.json", "mixed.json")}
pathlib.Path(sys.argv[1]).write_text(json.dumps(found, indent=1))
PY
}
summary=()

run_step() {  # name, log file (under $LOGS, appended), time limit (s), command...
  local name=$1 log=$LOGS/$2.log limit=$3; shift 3
  local start=$SECONDS
  echo "=== $name: $*" >>"$log"
  timeout "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  summary+=("$(printf '%-12s rc=%-3s %4ss  %s' "$name" "$rc" $((SECONDS - start)) "$(tail -n 1 "$log")")")
  pack_logs
}

{ python3 -m cupy_paged info; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv; } >"$LOGS/info.log" 2>&1
for step in $steps; do
  case $step in
    warm) run_step warm warm "${T_WARM:-150}" python3 -m cupy_paged warm --jobs "$(nproc)"
          [[ " ${BENCH_VARLEN_ARGS:-} " == *" --sweep "* ]] &&
            run_step warm_sweep warm "${T_WARM:-150}" python3 benchmarks/bench_varlen.py --warm ;;
    tests) run_step tests tests "${T_TESTS:-240}" python3 -m pytest -m gpu -q -p no:cacheprovider -rfE ${TEST_ARGS:-} ;;
    bench_decode)
      # Only what this run writes comes back: no committed result may pass for a new one.
      rm -f benchmarks/results/decode.json
      run_step bench_decode bench_decode "${T_BENCH_DECODE:-${T_BENCH:-150}}" python3 benchmarks/bench_decode.py ${BENCH_DECODE_ARGS:---quick}
      collect_results ;;
    bench_decode_short)  # both decode pipeline shapes, forced, on short grids of one and two waves
      rm -f benchmarks/results/decode_short.json
      run_step bench_decode_short bench_decode_short "${T_BENCH:-150}" python3 benchmarks/bench_decode.py --short-sweep
      collect_results ;;
    trace_phases)  # the decode kernel's phases CTA by CTA on short grids (TRACE), cuDNN beside
      run_step trace_phases trace_phases "${T_BENCH:-150}" python3 benchmarks/trace_phases.py
      cp benchmarks/results/trace_phases.json "$OUT/" 2>/dev/null ;;
    bench_gemm)  # the example engine's products at M = 64 and 256: its [K, N] weights, [N, K], torch's F.linear
      rm -f benchmarks/results/gemm.json
      run_step bench_gemm bench_gemm "${T_BENCH:-150}" python3 benchmarks/bench_gemm.py
      cp benchmarks/results/gemm.json "$OUT/" 2>/dev/null ;;
    bench_varlen)
      rm -f benchmarks/results/varlen.json
      run_step bench_varlen bench_varlen "${T_BENCH:-150}" python3 benchmarks/bench_varlen.py ${BENCH_VARLEN_ARGS:---reps 10}
      collect_results ;;
    bench_calls)
      rm -f benchmarks/results/calls.json
      run_step bench_calls bench_calls "${T_BENCH_CALLS:-${T_BENCH:-150}}" python3 benchmarks/bench_calls.py ${BENCH_CALLS_ARGS:-}
      collect_results ;;
    bench_mixed)
      rm -f benchmarks/results/mixed.json benchmarks/results/mixed.png
      run_step bench_mixed bench_mixed "${T_BENCH_MIXED:-${T_BENCH:-200}}" python3 benchmarks/bench_mixed.py ${BENCH_MIXED_ARGS:-}
      cp benchmarks/results/mixed.png "$OUT/" 2>/dev/null
      collect_results ;;
    sanitize_ragged)  # the ragged step's kernels under memcheck and racecheck
      run_step memcheck_ragged sanitize "${T_SANITIZE:-90}" compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 \
        python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_ragged.py -k "${SANITIZE_RAGGED_K:-mixes and 4-2 or softcap}"
      run_step racecheck_ragged sanitize "${T_SANITIZE:-90}" compute-sanitizer --tool racecheck --report-api-errors no --error-exitcode 1 \
        python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_ragged.py -k "${SANITIZE_RAGGED_K:-mixes and 4-2 or softcap}" ;;
    sanitize)
      run_step memcheck sanitize "${T_SANITIZE:-90}" compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 \
        python3 -m pytest -m gpu -q -p no:cacheprovider -k "sanitize and not heuristic" ${SANITIZE_ARGS:-}
      run_step racecheck sanitize "${T_SANITIZE:-90}" compute-sanitizer --tool racecheck --report-api-errors no --error-exitcode 1 \
        python3 -m pytest -m gpu -q -p no:cacheprovider -k "sanitize and not heuristic" ${SANITIZE_ARGS:-} ;;
    engine)  # the Llama engine's GPU default, eager and with decode CUDA graphs
      run_step serve_eager engine "${T_ENGINE:-150}" python3 examples/serve_llama.py --no-progress
      run_step serve_graphs engine "${T_ENGINE:-150}" python3 examples/serve_llama.py --no-progress --cuda-graphs ;;
    bench_e2e)  # the engine against Hugging Face continuous batching on one checkpoint
      rm -f benchmarks/results/e2e.json benchmarks/results/e2e.png
      run_step bench_e2e bench_e2e "${T_BENCH_E2E:-420}" python3 benchmarks/bench_e2e.py ${BENCH_E2E_ARGS:-}
      cp benchmarks/results/e2e.png benchmarks/results/e2e.json "$OUT/" 2>/dev/null ;;
    fuzz)  # random configurations of every kernel against the CPU reference (FUZZ_ARGS: e.g. --kernels step, or --hostile)
      rm -f benchmarks/results/fuzz.json benchmarks/results/fuzz_hostile.json
      run_step fuzz fuzz "${T_FUZZ:-300}" python3 benchmarks/fuzz.py --time-limit "$(( ${T_FUZZ:-300} - 30 ))" \
        --log "$LOGS/fuzz_configs$([[ " ${FUZZ_ARGS:-} " == *" --hostile "* ]] && echo _hostile).log" ${FUZZ_ARGS:-}
      cp benchmarks/results/fuzz.json benchmarks/results/fuzz_hostile.json "$OUT/" 2>/dev/null ;;
    trace_list)  # the device-listed ragged launch CTA by CTA beside the host-listed one and the decode kernel
      rm -f benchmarks/results/trace_list.json
      run_step trace_list trace_list "${T_BENCH:-150}" python3 benchmarks/trace_list.py ${TRACE_LIST_ARGS:-}
      cp benchmarks/results/trace_list.json "$OUT/" 2>/dev/null ;;
    lse_check)  # flash_attn_func's LSE call after call, three call paths (benchmarks/lse_order_check.py)
      for mode in torch_func cupy_func torch_varlen; do
        run_step lse_check lse_check "${T_BENCH:-150}" python3 benchmarks/lse_order_check.py 400 nosync "$mode"
      done ;;
    trace_call)  # where inside one eager call the kernel starts (torch.profiler), decode 64x128 and the 32k chunk
      run_step trace_call trace_call "${T_BENCH:-150}" python3 benchmarks/trace_call.py ${TRACE_CALL_ARGS:-}
      cp benchmarks/results/trace_call.json "$OUT/" 2>/dev/null ;;
    cold_host)  # a fixed piece of Python right after waiting for the GPU, two ways (benchmarks/exp_cold_host.py)
      run_step cold_host cold_host "${T_BENCH:-150}" python3 benchmarks/exp_cold_host.py
      cp benchmarks/results/cold_host.json "$OUT/" 2>/dev/null ;;
    profile_host)  # a public call's host microseconds by part, and one layer through the plan with and without out=
      run_step profile_host profile_host "${T_PROFILE_HOST:-150}" python3 benchmarks/profile_host.py ;;
    profile_engine)  # where a decode step of the engine goes (stage device times, host profile)
      run_step profile_engine profile_engine "${T_PROFILE_ENGINE:-200}" python3 benchmarks/profile_engine.py ${PROFILE_ENGINE_ARGS:-}
      cp benchmarks/results/profile_engine.json "$OUT/" 2>/dev/null ;;
    sanitize_suite)  # benchmarks/sanitize.sh over SUITE_TOOLS (default memcheck) and SUITE_FILES (default all)
      export SANITIZE_TOTAL=$(( ${T_SANITIZE_SUITE:-600} - 10 ))
      run_step sanitize_suite sanitize_suite "${T_SANITIZE_SUITE:-600}" env OUT="$LOGS" bash benchmarks/sanitize.sh "${SUITE_TOOLS:-memcheck}" ${SUITE_FILES:-}
      cp benchmarks/results/sanitizer.json "$OUT/" 2>/dev/null ;;
    load)  # benchmarks/load.py: 10,000 requests through the kernels, each against its run alone
      run_step load load "${T_LOAD:-200}" python3 benchmarks/load.py ${LOAD_ARGS:-}
      cp benchmarks/results/load.json "$OUT/" 2>/dev/null ;;
    ncu_graph)  # Nsight Compute over one decode step's graph replay inside a served run (NCU_ARGS: profile_engine's)
      run_step ncu_graph ncu_graph "${T_NCU:-240}" ncu --clock-control none --profile-from-start off --csv --page raw --print-units base \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__registers_per_thread \
        python3 benchmarks/profile_engine.py --ncu ${NCU_ARGS:-}
      run_step ncu_table ncu_table 30 python3 benchmarks/ncu_table.py "$LOGS/ncu_graph.log" ;;
    sanitizer_control)  # benchmarks/sanitizer_control.py under each tool: torch's kernels with the hf pairs' kernel
      # filter (as test_hf_integration.py runs), the engine's cuBLAS product without one (as test_llama_engine.py)
      for tool in memcheck racecheck initcheck synccheck; do
        for mode in torch engine; do
          filter=(); [[ $mode == torch ]] && filter=(--kernel-name regex=paged_decode)
          log=$LOGS/control_${tool}_$mode.log
          ( timeout "${T_CONTROL:-120}" compute-sanitizer --tool "$tool" "${filter[@]}" \
              python3 benchmarks/sanitizer_control.py "$mode" >"$log" 2>&1
            echo "rc=$?" >>"$log" ) &
        done
      done
      wait
      summary+=("$(printf '%-12s %s' sanitizer_control "$(grep -c -E '^========= (Uninitialized|Race reported|Invalid)|Error' "$LOGS"/control_*.log | tr '\n' ' ')")") ;;
    ncu_attention)  # the decode graph's attention in detail: the first paged_decode of one replay (issue 14's next measurement)
      sections=(--kernel-name regex:paged_decode)
      for section in SpeedOfLight MemoryWorkloadAnalysis WarpStateStats Occupancy LaunchStats SchedulerStats; do
        sections+=(--section "$section")
      done
      run_step ncu_attention ncu_attention "${T_NCU:-240}" ncu --clock-control none --profile-from-start off \
        --launch-count 1 "${sections[@]}" python3 benchmarks/profile_engine.py --ncu ${NCU_ARGS:-}
      # beside it, uniform batches of about the same keys per CTA (bf16, block 16, no split, the main
      # pipeline shape): 64 x 600 at 32/8 heads (512 CTAs), at the engine's 16/4 (256 CTAs, one wave),
      # and 64 x 1,280 at 16/4 (the engine's longest sequences); their second round, after the compiling one
      cases=(decode:64x600:bs16:splits=1:main decode:64x600:bs16:splits=1:heads=16/4 decode:64x1280:bs16:splits=1:heads=16/4)
      run_step ncu_attention ncu_attention "${T_NCU:-240}" ncu --clock-control none --launch-skip "${#cases[@]}" \
        --launch-count "${#cases[@]}" "${sections[@]}" python3 benchmarks/profile_paged.py "${cases[@]}" ;;
    kcache)  # the compiled kernels, back to the caller (carry .kcache with CUPY_CACHE_DIR=$PWD/.kcache)
      tar czf "$OUT/kcache.tgz" .kcache 2>/dev/null ;;
    *) echo "unknown step: $step (steps: warm tests bench bench_decode bench_decode_short bench_gemm bench_varlen bench_calls bench_mixed sanitize sanitize_ragged engine bench_e2e fuzz trace_call cold_host trace_list lse_check profile_host profile_engine ncu_graph ncu_attention sanitize_suite sanitizer_control load kcache)" >&2; exit 2 ;;
  esac
done
pack_logs
for log in "$LOGS"/bench_*.log; do [ -f "$log" ] && { echo "== $(basename "$log")"; tail -n 30 "$log"; }; done
grep -h -E "^FAILED|^ERROR" "$LOGS/tests.log" 2>/dev/null | cut -c1-220 | head -n 30
head -n 14 "$LOGS/info.log"
printf '%s\n' "${summary[@]}"
