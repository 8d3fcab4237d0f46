# Session 35, device call 2 (not yet run): the GPU tests of the varlen path (its host launch code
# changed with the TMA loader) and of the engine beside those of every path a step plan launches,
# in shards, then every issue's benchmark on the tree as committed (bench_e2e on an H200 while it
# fits in END, about 560 s).
CALL_LOGS=s35logs2 . benchmarks/call_lib.sh
END=${END:-560}
gpu_line
mkdir -p $OUT/ab
SHARD_LIMIT=150
shard varlen $P tests/test_varlen_gpu.py -k "not candidates and not sanitize"
shard engine $P tests/test_llama_engine.py
step_path_tests
issue_benchmarks $((END - 240))
pack
issue_tables
