# Session 30, device call 2 (not run: every device start after call 1 failed).  On the kernels of
# 5193bce (the session's two kernel changes were measured in call 1 and reverted): the ragged and
# balanced GPU tests and memcheck, the plan tests (the layer on a busy named torch stream among
# them), trace_list's launches with a last tile of one key (512 x 513 against 512 x 512 and
# 512 x 511) and the session's cases, profile_host.py of .ab/base2 (5193bce) and this tree (the plan
# layer's new output), and on an H200 (the issues' card) bench_calls when time allows.  Carry .ab.
# About 200 s on an H100.
# Usage on the device: bash benchmarks/call_s30_2.sh
export PYTHONPATH=$PWD
CALL_LOGS=s30logs2 . benchmarks/call_lib.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
mkdir -p $OUT/ab
gpu_line
step warm 90 python3 -m cupy_paged warm --jobs 16
SHARD_LIMIT=150
shard ragged $P tests/test_ragged.py
shard balanced_ref $P tests/test_balanced_gpu.py -k "matches_reference"
shard balanced_rest $P tests/test_balanced_gpu.py -k "not matches_reference"
shard plan $P tests/test_plan.py tests/test_worked_examples.py tests/test_merge.py
CUPY_PAGED_SANITIZER=memcheck shard memcheck_ragged $MEMCHECK $P tests/test_ragged.py -k "window_softcap or head_dims_block_sizes or split"
CUPY_PAGED_SANITIZER=memcheck shard memcheck_balanced $MEMCHECK $P tests/test_balanced_gpu.py -k "hostile or level"
shards_done
# The plan layer's output as empty_like(q) (torch q): host parts, the base tree (.ab/base2, 5193bce) and
# this one in alternation
[ -f .ab/base2/cuda_src/decode.cu ] && cp -r benchmarks .ab/base2/ 2>/dev/null
for side in base new; do
  r=$PWD; [ $side = base ] && r=$PWD/.ab/base2
  [ -d $r/cupy_paged ] && (cd $r && export PYTHONPATH=$r && step profile_$side 60 python3 benchmarks/profile_host.py)
done
step trace 90 python3 benchmarks/trace_list.py --cases "512x511,512x512,512x513,1x32k+63x512,lognormal64,64x4096" --out $OUT/ab/trace_list.json
if [[ $GPU == *H200* ]] && [ $SECONDS -lt 300 ]; then  # device time is short: the issues' call table only
  step bench_calls 90 python3 benchmarks/bench_calls.py --shuffle-order --no-profile --out $OUT/ab/calls.json
fi
pack
grep -h -E "^=== .* rc=|^shard" $R
grep -h -E "^FAILED|^ERROR|ERROR SUMMARY" $L/*.log | cut -c1-200 | head -20
grep -h -A26 "^| case | path | b2b" $R | grep -E "^\| [0-9a-z]|host_list|device_list" | cut -c1-160
sed -n '/=== mixed_all/,/=== mixed_all rc/p' $R | grep -A20 "^| case | path | ours" | cut -c1-200 | head -22
grep -h -A14 "^| case | ours GPU" $R | cut -c1-220 | head -20
grep -h -E "^=== profile_|StepPlan|whole call \(|empty" $R | cut -c1-150
