# Session 36, device call 3: Nsight Compute over one launch each of our registered causal prefill kernel
# (D = 128, contiguous K/V), torch's FlashAttention-2 varlen and cuDNN SDPA on the same batches (8 x 2048
# and 8 x 4096, bf16, 32 / 8 heads), clocks left as found: where cuDNN's 1.2x over ours at causal prefill
# (NOTES_varlen.md v13) comes from.  The reports' details and raw pages go to $OUT/ab as gzipped CSV.
CALL_LOGS=s36logs3 . benchmarks/call_lib.sh
gpu_line
mkdir -p $OUT/ab
SECTIONS="--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section LaunchStats
  --section Occupancy --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis"
step ncu_prefill 300 ncu --clock-control none --profile-from-start off $SECTIONS -f -o /tmp/ncu_prefill \
  python3 benchmarks/ncu_varlen.py --lens 2048x8 4096x8 --shapes registered --peers
step ncu_details 60 sh -c "ncu --import /tmp/ncu_prefill.ncu-rep --page details --csv | gzip > $OUT/ab/ncu_prefill_details.csv.gz"
step ncu_raw 60 sh -c "ncu --import /tmp/ncu_prefill.ncu-rep --page raw --csv | gzip > $OUT/ab/ncu_prefill_raw.csv.gz"
pack
grep -h -E "^=== .* rc=|^profiled" $R
ncu --import /tmp/ncu_prefill.ncu-rep --page raw --csv --metrics gpu__time_duration.sum,launch__registers_per_thread,launch__grid_size,launch__block_size,sm__throughput.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active 2>&1 | cut -c1-400 | head -20
