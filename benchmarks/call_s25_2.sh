# Session 25, device call 2: the level hand-over (31b2702 back) and the per-stream buffers made on their stream.
# Everything goes to $OUT/run.log as it runs (at most 8 files come back, and a cut call keeps what is there).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=$OUT/run.log
P="python3 -m pytest -m gpu -q -p no:cacheprovider -rfE"
step() { local name=$1 limit=$2; shift 2; echo "=== $name: $*" >>$R; timeout $limit "$@" >>$R 2>&1; echo "=== $name rc=$?" >>$R; echo "$name done at ${SECONDS}s"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >>$R
step warm 100 python3 -m cupy_paged warm --jobs 16
step tests_first 120 $P tests/test_balanced_gpu.py tests/test_calls_gpu.py -k "balanced or new_stream"
step memcheck 120 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 $P tests/test_balanced_gpu.py tests/test_calls_gpu.py -k "hostile or level or new_stream"
step bench_calls 90 python3 benchmarks/bench_calls.py --shuffle-order
step trace_list 60 python3 benchmarks/trace_list.py --cases 64x4096,32x2048,lognormal64,1x32k+63x512
step cold_code 50 python3 benchmarks/exp_cold_code.py --reps 20
step cold_host 40 python3 benchmarks/exp_cold_host.py
step trace_call 30 python3 benchmarks/trace_call.py --mixed-only
step profile_host 30 python3 benchmarks/profile_host.py
cp benchmarks/results/calls.json benchmarks/results/trace_list.json benchmarks/results/cold_host.json benchmarks/results/cold_code.json $OUT/ 2>/dev/null
left=$((560 - SECONDS)); echo "suite limit ${left}s"
timeout $left $P tests/test_varlen_gpu.py >$OUT/tests_a.log 2>&1 &
timeout $left $P tests/test_fa2_features_gpu.py tests/test_ragged.py tests/test_write_kv_cache.py tests/test_llama_engine.py >$OUT/tests_b.log 2>&1 &
timeout $left $P $(ls tests/test_*.py | grep -v -e test_varlen_gpu -e test_fa2_features_gpu -e test_ragged.py -e test_write_kv_cache -e test_llama_engine) >$OUT/tests_c.log 2>&1 &
wait
grep -h -E "rc=|passed|failed" $R | tail -n 20
for s in a b c; do echo "tests_$s $(tail -n1 $OUT/tests_$s.log)"; done
grep -h -E "^FAILED|^ERROR" $R $OUT/tests_*.log | cut -c1-200 | head -20
