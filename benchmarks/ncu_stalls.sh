#!/usr/bin/env bash
# Where the decode kernel's warps stall, instruction by instruction, beside cuDNN SDPA: Nsight
# Compute's stall-reason ratios and its sampled source page (SASS, per-instruction samples) for the
# calls of exp_cold_code.py's cases (ours default, ours num_splits=1 where the default balances,
# cuDNN SDPA; three of each), the reports kept outside $OUT and their pages written into it as
# gzipped CSV.  usage: bash benchmarks/ncu_stalls.sh "decode 64x4096" ["decode 64x576 16/4" ...]
set -uo pipefail
OUT=${OUT:-/tmp/cupy_paged_out}
mkdir -p "$OUT" /tmp/ncu_stalls
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
reasons=$(echo smsp__average_warps_issue_stalled_{no_instruction,long_scoreboard,barrier,wait,short_scoreboard,math_pipe_throttle,mio_throttle,lg_throttle,branch_resolving,imc_miss,dispatch_stall,not_selected,selected}_per_issue_active.ratio | tr ' ' ',')
for case in "$@"; do
  tag=$(echo "$case" | tr -c 'a-zA-Z0-9\n' '_')
  rep=/tmp/ncu_stalls/$tag
  timeout "${T_NCU:-200}" ncu --clock-control none -k regex:"paged_decode|cudnn" -c 9 --section WarpStateStats \
    --section SourceCounters --metrics gpu__time_duration.sum,smsp__inst_executed.sum,"$reasons" -f -o "$rep" \
    python3 benchmarks/exp_cold_code.py --ncu-target "$case" >"$OUT/ncu_stalls_$tag.log" 2>&1
  ncu --import "$rep.ncu-rep" --page raw --csv --metrics gpu__time_duration.sum,smsp__inst_executed.sum,"$reasons" \
    >"$OUT/ncu_stalls_${tag}_raw.csv" 2>&1
  ncu --import "$rep.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip >"$OUT/ncu_stalls_${tag}_source.csv.gz"
done
