# Session 25, device call 3 (the session's last device time; a longer call 2 never got a machine), about 330 s.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=$OUT/run.log
P="python3 -m pytest -m gpu -q -p no:cacheprovider -rfE"
step() { local name=$1 limit=$2; shift 2; echo "=== $name: $*" >>$R; timeout $limit "$@" >>$R 2>&1; echo "=== $name rc=$?" >>$R; echo "$name done at ${SECONDS}s"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >>$R
step warm 60 python3 -m cupy_paged warm --jobs 16
step tests_first 100 $P tests/test_balanced_gpu.py tests/test_calls_gpu.py -k "balanced or new_stream"
step memcheck 80 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 $P tests/test_balanced_gpu.py tests/test_calls_gpu.py -k "hostile or level or new_stream"
step bench_calls 45 python3 benchmarks/bench_calls.py --shuffle-order --no-profile --cases 64x4096,32x2048,64x128
step trace_list 30 python3 benchmarks/trace_list.py --cases 64x4096,32x2048
step cold_host 25 python3 benchmarks/exp_cold_host.py --reps 100
cp benchmarks/results/calls.json benchmarks/results/trace_list.json benchmarks/results/cold_host.json $OUT/ 2>/dev/null
left=$((330 - SECONDS)); echo "suite limit ${left}s"
[ $left -gt 20 ] && timeout $left $P tests/test_calls_gpu.py tests/test_decode_gpu.py >$OUT/tests_c.log 2>&1
grep -h -E "rc=|passed|failed" $R | tail -n 20
echo "tests_c $(tail -n1 $OUT/tests_c.log)"
grep -h -E "^FAILED|^ERROR" $R $OUT/tests_*.log | cut -c1-200 | head -20
