# Session 25, device call 1 as it ran (its last cp of every results file left more than the 8 files the device returns: only the first 8 came back)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
P="python3 -m pytest -m gpu -q -p no:cacheprovider -rfE"
bash benchmarks/device_run.sh warm >/dev/null 2>&1
timeout 200 $P tests/test_calls_gpu.py tests/test_arrays.py tests/test_examples.py tests/test_llama_engine.py tests/test_merge.py -k "merge or new_shapes or numba or jax or torch_interop or alone or f16" >$OUT/tests_new.log 2>&1; echo "tests_new rc=$? $(tail -n1 $OUT/tests_new.log)"
timeout 150 $P tests/test_hf_integration.py >$OUT/tests_hf.log 2>&1; echo "tests_hf rc=$? $(tail -n1 $OUT/tests_hf.log)"
timeout 120 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 $P tests/test_calls_gpu.py -k "merge or new_shapes" >$OUT/memcheck_merge.log 2>&1; echo "memcheck rc=$? $(tail -n1 $OUT/memcheck_merge.log)"
BENCH_CALLS_ARGS=--shuffle-order TRACE_CALL_ARGS=--mixed-only T_BENCH=120 bash benchmarks/device_run.sh bench_calls bench_mixed trace_call cold_host profile_host > $OUT/device_run.log 2>&1
cp benchmarks/results/*.json $OUT/ 2>/dev/null
tail -n 60 $OUT/device_run.log
