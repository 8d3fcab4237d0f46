# Session 28, device call 1: the decode tests as committed (the hole tests' shared helper had not run
# on a GPU), memcheck of the sanitize/hole cases, and trace_phases.py (the decode kernel's phases CTA
# by CTA on short grids, cuDNN beside).  On an H200 (the issues' card) also the issues' benchmarks in
# one run: bench_calls, bench_mixed, bench_e2e.  About 120 s on an H100, 520 s on an H200.
export PYTHONPATH=$PWD
CALL_LOGS=s28logs SHARD_LIMIT=150 . benchmarks/call_lib.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
gpu_line
step warm 90 python3 -m cupy_paged warm --jobs 16
shard decode $P tests/test_decode_gpu.py
CUPY_PAGED_SANITIZER=memcheck shard memcheck compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 $P tests/test_decode_gpu.py -k "sanitize or hole"
shards_done
step trace_phases 120 python3 benchmarks/trace_phases.py
cp benchmarks/results/trace_phases.json $OUT/ 2>/dev/null
if [[ $GPU == *H200* ]]; then
  step bench_calls 90 python3 benchmarks/bench_calls.py --shuffle-order --no-profile
  step bench_mixed 120 python3 benchmarks/bench_mixed.py
  step bench_e2e 290 python3 benchmarks/bench_e2e.py --max-seconds 250
  cp benchmarks/results/calls.json benchmarks/results/mixed.json benchmarks/results/mixed.png benchmarks/results/e2e.json benchmarks/results/e2e.png $OUT/ 2>/dev/null
fi
grep -h -E "^=== .* rc=|^shard" $R
grep -h -E "^FAILED|^ERROR|ERROR SUMMARY" $L/*.log | cut -c1-200 | head -20
sed -n '/^case  /,$p' $R | head -8
grep -h -A12 "^| case\|^| requests" $R | head -50
