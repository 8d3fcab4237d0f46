# Session 30, device call 1: the RAGGED kernel's two start changes, tested and timed side by side.
#   base   .ab/base2  (5193bce: equal split ranges, Q then the block ids: two round trips)
#   graded .ab/graded (graded split ranges, NOTES_mixed.md twenty-ninth session)
#   new    this tree  (graded ranges + the first block ids issued in Q's round trip)
# Tests and memcheck on the new tree first (ragged, the balanced default whose device list runs the
# same kernel, the plan and the calls), then bench_mixed's ragged and short-item cases and
# trace_list's launches for each side in turn, each from its own tree.  On an H200 (the issues'
# card) also the whole bench_mixed and bench_calls on the new tree.  About 330 s on an H100.
# Make the sides first (on the development machine), then carry .ab:
#   git archive 5193bce cupy_paged cuda_src | tar x -C .ab/base2
#   git archive <graded commit> cupy_paged cuda_src | tar x -C .ab/graded
NEW=$PWD
CALL_LOGS=s30logs1 . benchmarks/call_lib.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
mkdir -p $OUT/ab
gpu_line
for side in base2 graded; do
  [ -f $NEW/.ab/$side/cuda_src/decode.cu ] || echo "no .ab/$side: carry .ab" >>$R
  cp -r $NEW/benchmarks $NEW/.ab/$side/ 2>/dev/null
done
uses base $NEW/.ab/base2
uses graded $NEW/.ab/graded
uses new $NEW
export PYTHONPATH=$NEW
step warm 90 python3 -m cupy_paged warm --jobs 16
SHARD_LIMIT=150
shard ragged $P tests/test_ragged.py
shard balanced $P tests/test_balanced_gpu.py
shard plan $P tests/test_plan.py tests/test_arrays.py tests/test_worked_examples.py tests/test_merge.py
shard calls $P tests/test_calls_gpu.py -k "torch or memo or cupy or balanced"
M="compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1"
CUPY_PAGED_SANITIZER=memcheck shard memcheck_ragged $M $P tests/test_ragged.py -k "window_softcap or head_dims_block_sizes or split"
CUPY_PAGED_SANITIZER=memcheck shard memcheck_balanced $M $P tests/test_balanced_gpu.py -k "hostile or level"
shards_done
CASES_MIXED="ragged decode,511@512,q=4"
CASES_TRACE="1x32k+63x512,lognormal64,512x512,64x4096"
for round in 1 2; do
  [ $round = 2 ] && [ $SECONDS -gt 260 ] && break  # a second round only while device time lasts
  for side in base graded new; do
    r=$NEW; [ $side = base ] && r=$NEW/.ab/base2; [ $side = graded ] && r=$NEW/.ab/graded
    (cd $r && export PYTHONPATH=$r && step mixed_$side$round 70 python3 benchmarks/bench_mixed.py --cases "$CASES_MIXED" --out $OUT/ab/mixed_$side$round.json)
    (cd $r && export PYTHONPATH=$r && step trace_$side$round 70 python3 benchmarks/trace_list.py --cases "$CASES_TRACE" --out $OUT/ab/trace_list_$side$round.json)
  done
done
if [[ $GPU == *H200* ]]; then
  step mixed_all 150 python3 benchmarks/bench_mixed.py --out $OUT/ab/mixed.json
  step bench_calls 90 python3 benchmarks/bench_calls.py --shuffle-order --no-profile --out $OUT/ab/calls.json
fi
rm -f $OUT/ab/mixed_base*.png $OUT/ab/mixed_graded*.png $OUT/ab/mixed_new*.png
python3 benchmarks/ab_ragged.py $OUT/ab base,graded,new >$OUT/ab/summary.md 2>&1
pack
grep -h -E "^=== .* rc=|^shard|uses" $R
grep -h -E "^FAILED|^ERROR|ERROR SUMMARY" $L/*.log | cut -c1-200 | head -20
cat $OUT/ab/summary.md; rm -rf $OUT/ab

grep -h -A6 "^| decode-only case" $R | cut -c1-200
grep -h -A6 "^| case | path | b2b" $R | cut -c1-200
