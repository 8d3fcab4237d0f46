# (Ran as committed; the persistent kernel, ab_persistent.py and bench_mixed --persistent were removed after
# call 3 refuted it on an H200: `git checkout 9bc613b` has them.)
# Session 32, device call 1.  On an H200 (where short ragged items run at their CTA's chain, not the
# memory's rate: NOTES_mixed.md, thirty-first session): the RAGGED kernel's first block ids issued in
# Q's round trip (the thirtieth session's change, brought back by reverting its revert) tested, then
# timed beside the base tree, with the phase trace of 512-key items that decides the persistent
# lever; on an H100 the A/B is skipped (there the memory binds and the change measured nothing) and
# only this tree's trace runs.  Then every issue's benchmark on this tree (bench_e2e on an H200).
#   base   .ab/base2  (5193bce's kernels: Q, then the block ids)
#   new    this tree
# About 450-550 s on an H200.  Carry .ab (git archive 5193bce cupy_paged cuda_src | tar x -C .ab/base2).
NEW=$PWD
CALL_LOGS=s32logs1 . benchmarks/call_lib.sh
[ -f $NEW/.ab/base2/cuda_src/decode.cu ] || echo "no .ab/base2: carry .ab" >>$R
cp -r $NEW/benchmarks $NEW/.ab/base2/ 2>/dev/null
uses base $NEW/.ab/base2
uses new $NEW
export PYTHONPATH=$NEW
gpu_start
# step_path_tests' ragged shard runs the persistent kernel's tests too (test_ragged.py -k persistent);
# here memcheck, racecheck and synccheck of it, beside the others
SHARD_LIMIT=150
CUPY_PAGED_SANITIZER=memcheck shard memcheck_persistent $MEMCHECK $P tests/test_ragged.py -k "persistent and (one_wave or graph or (ragged_mixes and 6-2))"
CUPY_PAGED_SANITIZER=racecheck shard racecheck_persistent compute-sanitizer --tool racecheck --report-api-errors no --error-exitcode 1 $P tests/test_ragged.py -k "persistent_window or (persistent_ragged_mixes and 4-2 and 3])"
CUPY_PAGED_SANITIZER=synccheck shard synccheck_persistent compute-sanitizer --tool synccheck --report-api-errors no --error-exitcode 1 $P tests/test_ragged.py -k "persistent_window or (persistent_ragged_mixes and 8-1 and 1])"
step_path_tests
# The persistent ragged kernel (PERSIST, unrun before this call): its outputs against one CTA per item
# on the same host lists (NaN-poisoned, compared), and its time beside it; then the plan's mixed steps on it.
step ab_persistent 150 python3 benchmarks/ab_persistent.py --cap 3 --out $OUT/ab/ab_persistent.json
step mixed_persistent 80 python3 benchmarks/bench_mixed.py --persistent --cases "ragged decode,511@512,@512" --out $OUT/ab/mixed_persistent.json
CASES_MIXED="ragged decode,511@512"
CASES_TRACE="512x512,1x32k+63x512,lognormal64,64x4096"
SIDES=new
[[ "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" == *H200* ]] && SIDES="base new"
for side in $SIDES; do
  r=$NEW; [ $side = base ] && r=$NEW/.ab/base2
  [ "$SIDES" != new ] && (cd $r && export PYTHONPATH=$r && step mixed_${side}1 70 python3 benchmarks/bench_mixed.py --cases "$CASES_MIXED" --out $OUT/ab/mixed_${side}1.json)
  (cd $r && export PYTHONPATH=$r && step trace_${side}1 70 python3 benchmarks/trace_list.py --cases "$CASES_TRACE" --out $OUT/ab/trace_list_${side}1.json)
done
rm -f $OUT/ab/mixed_base*.png $OUT/ab/mixed_new*.png
[ "$SIDES" != new ] && python3 benchmarks/ab_ragged.py $OUT/ab base,new >$OUT/ab/summary.md 2>&1
issue_benchmarks 340
pack
grep -h -E "^=== .* rc=|^shard|uses" $R
grep -h -E "^FAILED|^ERROR|ERROR SUMMARY" $L/*.log | cut -c1-200 | head -20
cat $OUT/ab/summary.md 2>/dev/null
grep -h -A10 "^| case | floor us" $R | cut -c1-220 | head -12
grep -h -A16 "^| case | ours GPU" $R | cut -c1-200 | head -18
grep -h -A16 "^| case | path | ours ms" $R | cut -c1-200 | head -18
grep -h -A14 "^| requests | configuration" $R | cut -c1-200 | head -16
grep -h -A8 "^| target | value" $R | cut -c1-200 | head -10
