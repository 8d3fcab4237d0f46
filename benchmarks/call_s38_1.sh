# Session 38, device call 1: the varlen kernels' v14 mask (a compare and a select a score) and v15 (the
# P zeros of a tile a warpgroup does not see written only on that path) against the tree before both.
#   base  .ab/base37 (commit e3917d8's cupy_paged and cuda_src)
#   new   this tree
# Order: the specializations built; the GPU tests of the varlen path on the new tree (memcheck of its
# sanitize cases beside them); Nsight Compute of one launch per side (registered D = 128, causal 8 x 2048
# and 8 x 4096: instructions, active cycles, duration); bench_calls' varlen cases per side; then, on an
# H200 only, every issue's benchmark on the new tree (bench_calls, bench_mixed; bench_e2e where END leaves
# 400 s).  Make the base side first, then carry .ab/base37:
#   git archive e3917d8 cupy_paged cuda_src | tar x -C .ab/base37 && mkdir -p .ab/base37/benchmarks && cp benchmarks/*.py .ab/base37/benchmarks/
NEW=$PWD
CALL_LOGS=s38logs1 . benchmarks/call_lib.sh
END=${END:-560}
gpu_start
[ -f $NEW/.ab/base37/cuda_src/varlen_common.cuh ] || echo "no .ab/base37: carry .ab/base37" >>$R
uses base $NEW/.ab/base37
uses new $NEW
SHARD_LIMIT=120
shard varlen $P tests/test_varlen_gpu.py -k "not candidates and not sanitize"
CUPY_PAGED_SANITIZER=memcheck shard memcheck_varlen $MEMCHECK $P tests/test_varlen_gpu.py -k "sanitize"
shard calls $P tests/test_calls_gpu.py tests/test_worked_examples.py -k "varlen or worked or func"
shards_done
METRICS=gpu__time_duration.sum,smsp__inst_executed.sum,sm__cycles_active.avg,smsp__issue_active.avg.pct_of_peak_sustained_active
for side in base new; do
  r=$NEW; [ $side = base ] && r=$NEW/.ab/base37
  (cd $r && export PYTHONPATH=$r && step ncu_$side 120 ncu --clock-control none --profile-from-start off --metrics $METRICS \
     --csv --page raw python3 benchmarks/ncu_varlen.py --lens 2048x8 4096x8 --shapes registered)
done
for side in base new; do
  r=$NEW; [ $side = base ] && r=$NEW/.ab/base37
  (cd $r && export PYTHONPATH=$r && step calls_$side 80 python3 benchmarks/bench_calls.py --cases varlen --no-profile \
     --out $OUT/ab/calls_varlen_$side.json)
done
if on_h200; then
  step bench_mixed 150 python3 benchmarks/bench_mixed.py --out $OUT/ab/mixed.json
  step bench_calls 90 python3 benchmarks/bench_calls.py --shuffle-order --no-profile --out $OUT/ab/calls.json
  e2e_in_time
fi
grep -h -E "^=== .* rc=|^shard|uses" $R
grep -h -E "varlen_fwd_wgmma" $R | cut -c1-400
grep -h -E "^\| varlen" $R | cut -c1-200
issue_tables
