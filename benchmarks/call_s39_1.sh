# Prepared in the thirty-eighth session for the next device call (any Hopper card): where the causal
# prefill's cycles go when its consumers' chain, not its issue slots, sets them (NOTES_varlen.md, v15).
# Nsight Compute of one launch each, causal 8 x 2048 and 8 x 4096, registered D = 128 shape beside v12's
# softmax-under-P V candidate (lean producer) and cuDNN SDPA: duration, instructions, active cycles, issue
# rate, the tensor pipe's share of cycles, and the warp states (what a consumer warp waits on).  Then
# the H200-only benchmarks of call_s37_2.sh where the card is an H200.
CALL_LOGS=s39logs1 . benchmarks/call_lib.sh
END=${END:-560}
gpu_start
METRICS=gpu__time_duration.sum,smsp__inst_executed.sum,sm__cycles_active.avg,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed
step ncu_shapes 150 ncu --clock-control none --profile-from-start off --metrics $METRICS --section WarpStateStats \
  --csv --page details python3 benchmarks/ncu_varlen.py --lens 2048x8 4096x8 --shapes registered overlap --peers
shard cpu_after $P tests/test_merge.py tests/test_cache.py tests/test_arrays.py; shards_done
grep -h -E "^=== .* rc=|^shard" $R
grep -h -E "gpu__time|inst_executed|cycles_active|issue_active|pipe_tensor|Stall|Warp Cycles Per" $R | cut -c1-200 | head -60
if on_h200; then
  issue_benchmarks 330
  issue_tables
fi
