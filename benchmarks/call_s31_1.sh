# Session 31, device call 1, on the kernels of 5193bce and the thirtieth session's plan layer (its new
# output as empty_like(q), on a named stream from that stream's pool; CPU-tested only until now):
# the plan, calls, ragged and balanced GPU tests (the busy named-stream test among them) and memcheck,
# profile_host.py (the plan layer's host parts), trace_list.py's one-key last tile (512 x 513 against
# 512 x 512 and 512 x 511), then every issue's benchmark: bench_calls, bench_mixed, and on an H200
# (the issues' card) bench_e2e.  About 300 s on an H100, 560 s on an H200.  Run on commit 09eaa11, whose
# copy wrote these steps out (its tests a subset of step_path_tests', bench_e2e with no time condition).
# Usage on the device: bash benchmarks/call_s31_1.sh
export PYTHONPATH=$PWD
CALL_LOGS=s31logs1 . benchmarks/call_lib.sh
gpu_start
step_path_tests
step profile 60 python3 benchmarks/profile_host.py
step trace 90 python3 benchmarks/trace_list.py --cases "512x511,512x512,512x513,1x32k+63x512,lognormal64" --out $OUT/ab/trace_list.json
issue_benchmarks
pack
grep -h -E "^=== .* rc=|^shard" $R
grep -h -E "^FAILED|^ERROR|ERROR SUMMARY" $L/*.log | cut -c1-200 | head -20
grep -h -E "StepPlan|whole call \(|empty" $R | cut -c1-150
grep -h -A26 "^| case | path | b2b" $R | grep -E "^\| [0-9a-z]|host_list" | cut -c1-160
sed -n '/^case  /,$p' $R | head -8
grep -h -A14 "^| case\|^| requests" $R | cut -c1-260 | head -90
