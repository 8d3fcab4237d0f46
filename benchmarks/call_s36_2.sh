# Session 36, device call 2, on the tree without the TMA candidates (every registered cubin byte-identical
# to call 1's, tools/cubin_digests.py; the varlen launcher lost its parameter-pointer mode).  On an H200
# (the issues' card): every issue's benchmark first on a quiet GPU, then the GPU tests as in call 1.  On
# any other card: the GPU tests of the varlen path and the calls, and bench_calls alone (the host figures).
# On both, beside bench_calls: the eager floor of this host (eager_floor.py) and the host path's parts
# (profile_host.py), about 15 s.
CALL_LOGS=s36logs2 . benchmarks/call_lib.sh
END=${END:-560}
gpu_start
calls_benchmarks
if [ $SECONDS -lt $((END - 100)) ]; then
  shard_limit
  shard varlen $P tests/test_varlen_gpu.py -k "not candidates and not sanitize"
  CUPY_PAGED_SANITIZER=memcheck shard memcheck_varlen $MEMCHECK $P tests/test_varlen_gpu.py -k "sanitize"
  if on_h200; then shard engine $P tests/test_llama_engine.py; step_path_tests; else
    shard plan $P tests/test_plan.py tests/test_worked_examples.py tests/test_merge.py tests/test_arrays.py
    shard calls $P tests/test_calls_gpu.py -k "torch or memo or cupy or stream or balanced"
    shards_done
  fi
fi
pack
issue_tables
