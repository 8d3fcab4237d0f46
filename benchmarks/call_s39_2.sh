# Session 39, device call 2: v16 registered (NOTES_varlen.md): D = 128 varlen over contiguous K/V and paged
# caches (blocks of 16 keys or more) on the TMA loader with the softmax under P V, D = 64 paged on the TMA
# loader; the paged boxes now issued by each 16-row run's first producer thread.  Every GPU test of the
# varlen paths (the registered path, the candidates, memcheck of both), of the public calls, the plan,
# the FA2 features, streams, the engine, examples and the HF integration; the A/B with the paged cases
# (ab_tma.py); bench_calls (host times, varlen against FlashAttention-2, the chunk after 32k); on an H200
# bench_mixed.
CALL_LOGS=s39logs2 . benchmarks/call_lib.sh
END=${END:-560}
gpu_start
SHARD_LIMIT=${SHARD_LIMIT:-170}
shard varlen $P tests/test_varlen_gpu.py -k "not sanitize"
CUPY_PAGED_SANITIZER=memcheck shard memcheck_varlen $MEMCHECK $P tests/test_varlen_gpu.py -k "sanitize or (wgmma_candidates and (s2poxt or d64-wg128x128s2pt))"
shard calls $P tests/test_calls_gpu.py tests/test_plan.py tests/test_worked_examples.py tests/test_memo_fast_paths.py
shard features $P tests/test_fa2_features_gpu.py tests/test_streams_and_debug.py tests/test_bad_input.py
shard engine $P tests/test_llama_engine.py tests/test_examples.py tests/test_hf_integration.py
shards_done
step ab_tma 60 python3 benchmarks/ab_tma.py --reps 20 --out $OUT/ab/ab_tma.json
step bench_calls 90 python3 benchmarks/bench_calls.py --shuffle-order --no-profile --out $OUT/ab/calls.json
if on_h200 && [ $SECONDS -lt $((END - 160)) ]; then
  step bench_mixed 150 python3 benchmarks/bench_mixed.py --out $OUT/ab/mixed.json
fi
pack
issue_tables
grep -h -A12 "^| case | registered" $R | head -13
grep -h -E "^chunk after|^d64_|^peers" $R
grep -h -E "FAILED|ERROR " $L/shard_*.log | head -20
