# Session 37, device call 3: the varlen kernels' mask as one select a score (no branch, the loadable
# bytes read only in a tile with a hole) against the mask before it, on the same card.
#   base  .ab/base37 (commit e3917d8's cupy_paged and cuda_src: the per-score branchy mask)
#   new   this tree
# Nsight Compute of one launch each (registered D = 128 shape, causal 8 x 2048 and 8 x 4096, clocks as
# found): instructions executed, active cycles, duration; then bench_calls' varlen cases on each side,
# then the GPU tests of the varlen path on the new tree (and memcheck of its sanitize cases).
# Make the base side first, then carry .ab:
#   git archive <base commit> cupy_paged cuda_src | tar x -C .ab/base37 && mkdir -p .ab/base37/benchmarks && cp benchmarks/*.py .ab/base37/benchmarks/
NEW=$PWD
CALL_LOGS=s37logs3 . benchmarks/call_lib.sh
END=${END:-200}
mkdir -p $OUT/ab
gpu_line
[ -f $NEW/.ab/base37/cuda_src/varlen_common.cuh ] || echo "no .ab/base37: carry .ab" >>$R
uses base $NEW/.ab/base37
uses new $NEW
export PYTHONPATH=$NEW
step warm 90 python3 -m cupy_paged warm --jobs 16
METRICS=gpu__time_duration.sum,smsp__inst_executed.sum,sm__cycles_active.avg,smsp__issue_active.avg.pct_of_peak_sustained_active
for side in base new; do
  r=$NEW; [ $side = base ] && r=$NEW/.ab/base37
  (cd $r && export PYTHONPATH=$r && step ncu_$side 120 ncu --clock-control none --profile-from-start off --metrics $METRICS \
     --csv --page raw python3 benchmarks/ncu_varlen.py --lens 2048x8 4096x8 --shapes registered)
done
if [ "${CALLS:-0}" = 1 ]; then  # bench_calls' varlen cases per side, where device time allows
  for side in base new; do
    r=$NEW; [ $side = base ] && r=$NEW/.ab/base37
    (cd $r && export PYTHONPATH=$r && step calls_$side 80 python3 benchmarks/bench_calls.py --cases varlen --no-profile \
       --out $OUT/ab/calls_varlen_$side.json)
  done
fi
shard_limit
shard varlen $P tests/test_varlen_gpu.py -k "not candidates and not sanitize"
CUPY_PAGED_SANITIZER=memcheck shard memcheck_varlen $MEMCHECK $P tests/test_varlen_gpu.py -k "sanitize"
shard calls $P tests/test_calls_gpu.py tests/test_worked_examples.py -k "varlen or worked or func"
shards_done
grep -h -E "^=== .* rc=|^shard|uses" $R
grep -h -E "varlen_fwd_wgmma" $R | cut -c1-400
grep -h -E "^\| varlen" $R | cut -c1-200
