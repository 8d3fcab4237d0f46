# Session 38, device call 2: the memoised calls' new refusals on a GPU (tests/test_memo_fast_paths.py,
# the bad-input tests) with the GPU tests of every path a step plan launches and their memcheck shards;
# then, on an H200 only (the issues' card), every issue's benchmark on this tree: bench_calls (#11),
# bench_mixed (#13) and bench_e2e (#14) where END leaves it 400 s.
CALL_LOGS=s38logs2 . benchmarks/call_lib.sh
END=${END:-560}
gpu_start
shard memo $P tests/test_memo_fast_paths.py tests/test_bad_input.py
SHARD_LIMIT=150 step_path_tests
if on_h200; then
  issue_benchmarks ${E2E_BY:-330}
fi
issue_tables
