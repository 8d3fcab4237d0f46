# Session 31, device call 2, for an H200 (where short ragged items run at their CTA's chain, not the
# memory's rate: NOTES_mixed.md, thirty-first session): the RAGGED kernel's first block ids issued in
# Q's round trip (the thirtieth session's change, brought back by reverting its revert; on an H100
# it gained nothing, where each CTA's start queues behind the memory) tested, then timed beside the
# base tree in alternation; then, as device time allows, every issue's benchmark on this tree.
#   base   .ab/base2  (5193bce's kernels: Q, then the block ids)
#   new    this tree
# About 300 s on an H200 (the second A/B round and the issues' benchmarks only while time lasts).  Carry .ab (git archive 5193bce cupy_paged cuda_src | tar x -C .ab/base2).
NEW=$PWD
CALL_LOGS=s31logs2 . benchmarks/call_lib.sh
[ -f $NEW/.ab/base2/cuda_src/decode.cu ] || echo "no .ab/base2: carry .ab" >>$R
cp -r $NEW/benchmarks $NEW/.ab/base2/ 2>/dev/null
uses base $NEW/.ab/base2
uses new $NEW
export PYTHONPATH=$NEW
gpu_start
step_path_tests
CASES_MIXED="ragged decode,511@512"
CASES_TRACE="512x512,1x32k+63x512,lognormal64,64x4096"
for round in 1 2; do
  [ $round = 2 ] && [ $SECONDS -gt 230 ] && break  # a second round only while device time lasts
  for side in base new; do
    r=$NEW; [ $side = base ] && r=$NEW/.ab/base2
    (cd $r && export PYTHONPATH=$r && step mixed_$side$round 70 python3 benchmarks/bench_mixed.py --cases "$CASES_MIXED" --out $OUT/ab/mixed_$side$round.json)
    (cd $r && export PYTHONPATH=$r && step trace_$side$round 70 python3 benchmarks/trace_list.py --cases "$CASES_TRACE" --out $OUT/ab/trace_list_$side$round.json)
  done
done
rm -f $OUT/ab/mixed_base*.png $OUT/ab/mixed_new*.png
python3 benchmarks/ab_ragged.py $OUT/ab base,new >$OUT/ab/summary.md 2>&1
[ $SECONDS -lt 280 ] && issue_benchmarks 280
pack
grep -h -E "^=== .* rc=|^shard|uses" $R
grep -h -E "^FAILED|^ERROR|ERROR SUMMARY" $L/*.log | cut -c1-200 | head -20
cat $OUT/ab/summary.md
grep -h -A16 "^| case | ours GPU" $R | cut -c1-200 | head -18
grep -h -A16 "^| case | path | ours ms" $R | cut -c1-200 | head -18
