# Session 25, device call 2: the level hand-over (31b2702 back) and the per-stream buffers made on their stream.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
L=$OUT/logs; mkdir -p $L
P="python3 -m pytest -m gpu -q -p no:cacheprovider -rfE"
python3 -m cupy_paged warm --jobs 16 >$L/warm.log 2>&1; echo "warm rc=$? $(tail -n1 $L/warm.log)"
timeout 120 $P tests/test_balanced_gpu.py tests/test_calls_gpu.py -k "balanced or level or new_stream or Balanced or device_list or hostile" >$L/tests_first.log 2>&1; echo "tests_first rc=$? $(tail -n1 $L/tests_first.log)"
timeout 120 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 $P tests/test_balanced_gpu.py tests/test_calls_gpu.py -k "hostile or level or new_stream" >$L/memcheck.log 2>&1; echo "memcheck rc=$? $(tail -n1 $L/memcheck.log)"
timeout 90 python3 benchmarks/bench_calls.py --shuffle-order >$L/bench_calls.log 2>&1; echo "bench_calls rc=$?"
timeout 60 python3 benchmarks/trace_list.py --cases 64x4096,32x2048,lognormal64,1x32k+63x512 >$L/trace_list.log 2>&1; echo "trace_list rc=$?"
timeout 50 python3 benchmarks/exp_cold_code.py --reps 20 >$L/cold_code.log 2>&1; echo "cold_code rc=$?"
timeout 40 python3 benchmarks/exp_cold_host.py >$L/cold_host.log 2>&1; echo "cold_host rc=$?"
timeout 30 python3 benchmarks/trace_call.py --mixed-only >$L/trace_call.log 2>&1; echo "trace_call rc=$?"
timeout 30 python3 benchmarks/profile_host.py >$L/profile_host.log 2>&1; echo "profile_host rc=$?"
cp benchmarks/results/calls.json benchmarks/results/trace_list.json benchmarks/results/cold_host.json benchmarks/results/cold_code.json $L/ 2>/dev/null
left=$((560 - SECONDS)); echo "suite limit ${left}s"
timeout $left $P tests/test_varlen_gpu.py >$L/tests_a.log 2>&1 &
timeout $left $P tests/test_fa2_features_gpu.py tests/test_ragged.py tests/test_write_kv_cache.py tests/test_llama_engine.py >$L/tests_b.log 2>&1 &
timeout $left $P $(ls tests/test_*.py | grep -v -e test_varlen_gpu -e test_fa2_features_gpu -e test_ragged.py -e test_write_kv_cache -e test_llama_engine) >$L/tests_c.log 2>&1 &
wait
for s in a b c; do echo "tests_$s $(tail -n1 $L/tests_$s.log)"; done
grep -h -E "^FAILED|^ERROR" $L/*.log | cut -c1-200 | head -20
tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $L
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
