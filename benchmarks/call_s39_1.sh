# Session 39, device call 1.  v16 (NOTES_varlen.md): the TMA loader restored with one 128-row box a column
# block for contiguous K/V, alone and under v12's softmax-under-P V: its GPU tests and memcheck, the A/B
# against the registered shapes (ab_tma.py), and Nsight Compute of the causal 8 x 2048 / 8 x 4096 launches
# beside cuDNN's.  The GPU tests of the CPU-only changes since the last device call (merge, cache, arrays).
# On an H200 (the issues' card) bench_calls and bench_mixed go first.
CALL_LOGS=s39logs1 . benchmarks/call_lib.sh
END=${END:-560}
gpu_line
mkdir -p $OUT/ab
if on_h200; then
  step bench_calls 90 python3 benchmarks/bench_calls.py --shuffle-order --no-profile --out $OUT/ab/calls.json
  step bench_mixed 150 python3 benchmarks/bench_mixed.py --out $OUT/ab/mixed.json
fi
SHARD_LIMIT=140
shard tma $P tests/test_varlen_gpu.py -k "wgmma_candidates and (s2pot or s2poxt or d64-wg128x128s2pt)"
CUPY_PAGED_SANITIZER=memcheck shard memcheck_tma $MEMCHECK $P tests/test_varlen_gpu.py -k "wgmma_candidates and (s2pot or d64-wg128x128s2pt)"
shard after_s38 $P tests/test_merge.py tests/test_cache.py tests/test_arrays.py
shards_done
if grep -q "^shard tma rc=0" $R; then
  step ab_tma 100 python3 benchmarks/ab_tma.py --reps ${AB_REPS:-20} --out $OUT/ab/ab_tma.json
  METRICS=gpu__time_duration.sum,smsp__inst_executed.sum,sm__cycles_active.avg,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed
  [ $SECONDS -lt $((END - 130)) ] && step ncu_shapes 120 ncu --clock-control none --profile-from-start off \
    --metrics $METRICS --section WarpStateStats --csv --page details python3 benchmarks/ncu_varlen.py \
    --lens 4096x8 --shapes registered overlap tma tma_overlap --peers
fi
pack
issue_tables
grep -h -A10 "^| case | registered" $R | head -12
grep -h -E "^chunk after|^d64_|^peers" $R
