# Session 36, device call 1: every issue's benchmark on the tree as committed (bench_calls, bench_mixed,
# bench_e2e; about 330 s on an H200), then, with the GPU free of timing, the GPU tests of the registered
# varlen path, the engine and every path a step plan launches, in shards (at most 150 s).
CALL_LOGS=s36logs1 . benchmarks/call_lib.sh
END=${END:-560}
gpu_start
step bench_calls 90 python3 benchmarks/bench_calls.py --shuffle-order --no-profile --out $OUT/ab/calls.json
step bench_mixed 150 python3 benchmarks/bench_mixed.py --out $OUT/ab/mixed.json
e2e_in_time
if [ $SECONDS -lt $((END - 150)) ]; then
  shard_limit
  shard varlen $P tests/test_varlen_gpu.py -k "not candidates and not sanitize"
  shard engine $P tests/test_llama_engine.py
  step_path_tests
fi
pack
issue_tables
