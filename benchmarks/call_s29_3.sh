# Session 29, device call 3: graded split ranges in the RAGGED kernel (NOTES_mixed.md, twenty-ninth
# session), tested and timed against the previous commit's tree (.ab/base2, run from its own folder
# with the benchmarks copied in); the GPU tests of memo_lookup's reader order with them.  On an H200
# (the issues' card) also the whole bench_mixed and bench_calls on this code.  About 250 s (H100), 380 s
# (H200).
# Not run: the twenty-ninth session's device time ran out on failed starts, and the change was
# reverted (e4747d2's parent has it).  To run it: `git revert <the revert>` first, then make the base
# tree from the commit before that (its kernels are the reverted state), then on the device
# bash benchmarks/call_s29_3.sh (with .ab carried):
#   rm -rf .ab/base2 && mkdir -p .ab/base2 && git archive <commit before the re-apply> cupy_paged cuda_src | tar x -C .ab/base2
NEW=$PWD BASE=$PWD/.ab/base2
CALL_LOGS=s29logs3 . benchmarks/call_lib.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
mkdir -p $OUT/ab
gpu_line
[ -f $BASE/cuda_src/decode.cu ] || echo "no .ab/base2: carry .ab" >>$R
cp -r $NEW/benchmarks $BASE/ 2>/dev/null
uses base $BASE
uses new $NEW
export PYTHONPATH=$NEW
step warm 90 python3 -m cupy_paged warm --jobs 16
SHARD_LIMIT=120
shard ragged $P tests/test_ragged.py
shard balanced $P tests/test_balanced_gpu.py
shard mixed_kinds $P tests/test_plan.py tests/test_arrays.py tests/test_worked_examples.py tests/test_merge.py
shard calls $P tests/test_calls_gpu.py -k "torch or memo or cupy or balanced"
export CUPY_PAGED_SANITIZER=memcheck
shard memcheck_ragged compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 $P tests/test_ragged.py -k "window_softcap or head_dims_block_sizes or split"
unset CUPY_PAGED_SANITIZER
shards_done
for round in 1 2; do
  [ $round = 2 ] && [ $SECONDS -gt 170 ] && break  # the second round only while device time lasts
  for side in base new; do
    r=$NEW; [ $side = base ] && r=$BASE
    (cd $r && export PYTHONPATH=$r && step mixed_$side$round 60 python3 benchmarks/bench_mixed.py --cases "ragged decode" --out $OUT/ab/mixed_$side$round.json)
    (cd $r && export PYTHONPATH=$r && step trace_$side$round 60 python3 benchmarks/trace_list.py --cases "1x32k+63x512,lognormal64" --out $OUT/ab/trace_list_$side$round.json)
  done
done
if [[ $GPU == *H200* ]]; then
  step mixed_all 150 python3 benchmarks/bench_mixed.py --out $OUT/ab/mixed.json
  step bench_calls 90 python3 benchmarks/bench_calls.py --shuffle-order --no-profile --out $OUT/ab/calls.json
fi
rm -f $OUT/ab/mixed_base*.png $OUT/ab/mixed_new*.png
pack; rm -rf $OUT/ab
grep -h -E "^=== .* rc=|^shard|uses" $R
grep -h -E "^FAILED|^ERROR|ERROR SUMMARY" $L/*.log | cut -c1-200 | head -20
grep -h -A4 "^| decode-only case" $R | cut -c1-220
grep -h -A3 "^| case | path | b2b" $R | cut -c1-200
sed -n '/=== mixed_all/,/=== mixed_all rc/p' $R | grep -A20 "^| case | path | ours" | cut -c1-200 | head -22
grep -h -A14 "^| case | ours GPU\|^| requests" $R | cut -c1-220 | head -40
