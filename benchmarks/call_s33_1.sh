# (Ran as committed or never ran; ab_tma.py, register_from_ab.py and the TMA candidates were removed in the
# thirty-sixth session after call 3 of the thirty-fifth refuted them: `git checkout 74cb9ff` has them.)
# Session 33, device call 1: the varlen wgmma kernel's TMA loader (WgmmaTiles(..., tma=True)).
# 1. The GPU tests of the three TMA candidates (D = 128 with and without the softmax under P V, D = 64):
#    every wgmma candidate case and the TMA cases, under a time limit (a wrong transaction count
#    would hang the launch).
# 2. ab_tma.py: registered vs the TMA shapes, back to back in turns; FA2 and cuDNN for scale.
# 3. register_from_ab.py rewrites WGMMA_TILES on this copy of the tree when a TMA shape wins (>= 1%
#    geomean, no case below 0.99x); then the registered path's varlen tests, the calls and plan
#    tests, memcheck of the varlen sanitize subset and the TMA candidate, and while time lasts
#    bench_calls and the prefill cases of bench_mixed.  At most about 580 s.
CALL_LOGS=s33logs1 . benchmarks/call_lib.sh
gpu_line
mkdir -p $OUT/ab
step tma_tests 150 $P tests/test_varlen_gpu.py -k "wgmma_candidates and (s2pot or s2poxt or d64-wg128x128s2pt)"
if grep -q "^=== tma_tests rc=0" $R; then
  step ab_tma 130 python3 benchmarks/ab_tma.py --out $OUT/ab/ab_tma.json
  step register 20 python3 benchmarks/register_from_ab.py $OUT/ab/ab_tma.json
  if grep -q "registered wg" $R; then
    grep -n "registered from the A/B" cupy_paged/kernels/varlen_wgmma.py >> $R
    SHARD_LIMIT=140
    shard varlen $P tests/test_varlen_gpu.py -k "not candidates and not sanitize"
    shard calls $P tests/test_calls_gpu.py tests/test_plan.py -k "varlen or plan or torch or stream"
    CUPY_PAGED_SANITIZER=memcheck shard memcheck $MEMCHECK $P tests/test_varlen_gpu.py -k "sanitize or (wgmma_candidates and s2pot)"
    shards_done
    [ $SECONDS -lt 400 ] && step bench_calls 90 python3 benchmarks/bench_calls.py --shuffle-order --no-profile --cases "varlen,chunk" --out $OUT/ab/calls.json
    [ $SECONDS -lt 460 ] && step bench_mixed 100 python3 benchmarks/bench_mixed.py --cases "8x2048,prefill,step chunk" --out $OUT/ab/mixed.json
  else
    CUPY_PAGED_SANITIZER=memcheck step memcheck 120 $MEMCHECK $P tests/test_varlen_gpu.py -k "wgmma_candidates and (s2pot or s2poxt or d64-wg128x128s2pt)"
  fi
fi
pack
grep -h -E "^=== .* rc=|^shard " $R
grep -h -A6 "^| case | registered" $R | head -14
grep -h -E "^chunk after|^d64_|^peers|^D = " $R
grep -h "ERROR SUMMARY" $R | tail -3
grep -h -A8 "^| case | ours GPU" $R | cut -c1-180 | head -10
grep -h -A6 "^| case | path | ours ms" $R | cut -c1-180 | head -8
