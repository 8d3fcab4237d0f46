# (Ran as committed; the persistent kernel, ab_persistent.py and bench_mixed --persistent were removed after
# call 3 refuted it on an H200: `git checkout 9bc613b` has them.)
# Session 32, device call 3, for an H200 only (on any other card it stops at once): the measurement
# that decides the persistent ragged kernel (ab_persistent.py; refuted if 512 x 512 gains less than
# 5%), the phases of 512-key items on this card (trace_list.py, one CTA an item), and then the
# issues' benchmarks: bench_mixed, bench_calls and, while time lasts, bench_e2e.  The tree's kernels
# passed their GPU tests in calls 1-2 (H100).  About 250-420 s.
CALL_LOGS=s32logs3 . benchmarks/call_lib.sh
gpu_line
if [[ "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" != *H200* ]]; then
  echo "not an H200: nothing run" | tee -a $R
  exit 0
fi
mkdir -p $OUT/ab
step warm 90 python3 -m cupy_paged warm --jobs 16
step ab_persistent 60 python3 benchmarks/ab_persistent.py --out $OUT/ab/ab_persistent.json
step trace 60 python3 benchmarks/trace_list.py --cases 512x512,1x32k+63x512 --out $OUT/ab/trace_list.json
step mixed_persistent 60 python3 benchmarks/bench_mixed.py --persistent --cases "511@512,ragged decode" --out $OUT/ab/mixed_persistent.json
step bench_mixed 120 python3 benchmarks/bench_mixed.py --out $OUT/ab/mixed.json
step bench_calls 80 python3 benchmarks/bench_calls.py --shuffle-order --no-profile --out $OUT/ab/calls.json
[ $SECONDS -lt 190 ] && step bench_e2e 230 python3 benchmarks/bench_e2e.py --max-seconds 200 --out $OUT/ab/e2e.json
rm -f $OUT/ab/mixed_persistent.png
pack
grep -h -E "^=== .* rc=" $R
grep -h -A10 "^| case | floor us" $R | cut -c1-220 | head -12
grep -h -A16 "^| case | ours GPU" $R | cut -c1-200 | head -18
grep -h -A18 "^| case | path | ours ms" $R | cut -c1-200 | head -40
grep -h -A14 "^| requests | configuration" $R | cut -c1-200 | head -16
grep -h -A8 "^| target | value" $R | cut -c1-200 | head -10
