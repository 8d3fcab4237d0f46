# NOT RUN: every device start after call 1 failed; the early block ids it names were reverted after.
# Session 30, device call 3: call_s30_2.sh cut to what the session's last device time holds (about
# 150 s): the committed RAGGED kernel's tests and memcheck, the plan tests (the named-stream layer
# among them), trace_list's last-tile cases, and profile_host.py's plan-layer rows if time is left.
# Usage on the device: bash benchmarks/call_s30_3.sh
export PYTHONPATH=$PWD
CALL_LOGS=s30logs3 . benchmarks/call_lib.sh
mkdir -p $OUT/ab
gpu_line
step warm 60 python3 -m cupy_paged warm --jobs 16
SHARD_LIMIT=90
shard ragged $P tests/test_ragged.py
shard balanced_rest $P tests/test_balanced_gpu.py -k "not matches_reference"
shard plan $P tests/test_plan.py tests/test_worked_examples.py
M="compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1"
CUPY_PAGED_SANITIZER=memcheck shard memcheck_ragged $M $P tests/test_ragged.py -k "window_softcap or head_dims_block_sizes or split"
shards_done
step trace 40 python3 benchmarks/trace_list.py --cases "512x511,512x512,512x513" --calls 4 --out $OUT/ab/trace_list.json
[ $SECONDS -lt 140 ] && step profile 45 python3 benchmarks/profile_host.py
pack
grep -h -E "^=== .* rc=|^shard" $R
grep -h -E "^FAILED|^ERROR|ERROR SUMMARY" $L/*.log | cut -c1-200 | head -20
grep -h -A14 "^| case | path | b2b" $R | grep -E "^\| [0-9a-z]|host_list" | cut -c1-160
grep -h -E "StepPlan|whole call \(|empty" $R | cut -c1-150
