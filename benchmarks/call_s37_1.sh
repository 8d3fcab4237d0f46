# Session 37, device call 1.  The thirty-sixth session's host changes and this session's conformance fixes
# (flash_attn_func's checks, padded cu_seqlens, memo keys with the scalars' types, the rotary window rule)
# on a GPU.  On an H200 (the issues' card): every issue's benchmark on a quiet GPU first (bench_calls, the
# eager floor, the host path's parts, bench_mixed, bench_e2e while time is left), then the GPU tests.  On
# any other card: bench_calls, the eager floor and the host path's parts, the GPU tests of what changed,
# then Nsight Compute of our causal prefill beside FlashAttention-2's and cuDNN's (call_s36_3.sh).
CALL_LOGS=s37logs1 . benchmarks/call_lib.sh
if on_h200; then END=${END:-560}; else END=${END:-300}; fi
gpu_start
calls_benchmarks
shard_limit
shard varlen $P tests/test_varlen_gpu.py -k "not candidates and not sanitize"
CUPY_PAGED_SANITIZER=memcheck shard memcheck_varlen $MEMCHECK $P tests/test_varlen_gpu.py -k "sanitize"
shard plan $P tests/test_plan.py tests/test_worked_examples.py tests/test_merge.py tests/test_arrays.py
shard calls $P tests/test_calls_gpu.py tests/test_bad_input.py -k "torch or memo or cupy or stream or balanced or func or bad_input"
shard fa2 $P tests/test_fa2_features_gpu.py
if on_h200; then
  shard engine $P tests/test_llama_engine.py
  shard ragged $P tests/test_ragged.py
  shard balanced $P tests/test_balanced_gpu.py
fi
shards_done
issue_tables
if ! on_h200; then
  mv "$OUT/logs.tgz" "$OUT/logs_tests.tgz"
  bash benchmarks/call_s36_3.sh
fi
