# (Ran as committed or never ran; ab_tma.py, register_from_ab.py and the TMA candidates were removed in the
# thirty-sixth session after call 3 of the thirty-fifth refuted them: `git checkout 74cb9ff` has them.)
# (Ran as committed up to ff33026; the L2 prefetch it measures (profile_engine.py --prefetch, llama.fused.L2Prefetch
# and its tests) was removed after the thirty-fifth session refuted it: `git show ff33026` has them.)
# Session 34, device call 1.
# 1. profile_engine.py --prefetch: a decode step's graph (64 rows, the engine's default mix, served to
#    the steady decode phase) with the next products' weights fetched into the L2 on a side stream,
#    in each of PREFETCH_VARIANTS, against none; logits compared bit for bit.
#    Then the GPU test that the prefetch changes no token.
# 2. The thirty-third session's TMA loader (call_s33_1.sh's first steps): the candidates' GPU tests,
#    the A/B against the registered shapes, and when a TMA shape wins (register_from_ab.py) the
#    registered path's varlen and plan tests and memcheck, while time lasts.  At most about 560 s.
CALL_LOGS=s34logs1 . benchmarks/call_lib.sh
END=${END:-560}  # seconds this call may take: the last steps start only while they fit
gpu_line
mkdir -p $OUT/ab
step prefetch 90 python3 benchmarks/profile_engine.py --prefetch --out $OUT/ab/prefetch.json
step prefetch_test 60 $P tests/test_llama_engine.py -k "l2_prefetch"
step tma_tests 130 $P tests/test_varlen_gpu.py -k "wgmma_candidates and (s2pot or s2poxt or d64-wg128x128s2pt)"
if grep -q "^=== tma_tests rc=0" $R && [ $SECONDS -lt $((END - 100)) ]; then
  step ab_tma 110 python3 benchmarks/ab_tma.py --reps ${AB_REPS:-30} --out $OUT/ab/ab_tma.json
  step register 20 python3 benchmarks/register_from_ab.py $OUT/ab/ab_tma.json
  if grep -q "registered wg" $R && [ $SECONDS -lt $((END - 140)) ]; then
    grep -n "registered from the A/B" cupy_paged/kernels/varlen_wgmma.py >> $R
    SHARD_LIMIT=120
    shard varlen $P tests/test_varlen_gpu.py -k "not candidates and not sanitize"
    shard calls $P tests/test_calls_gpu.py tests/test_plan.py -k "varlen or plan or torch or stream"
    CUPY_PAGED_SANITIZER=memcheck shard memcheck $MEMCHECK $P tests/test_varlen_gpu.py -k "sanitize or (wgmma_candidates and s2pot)"
    shards_done
  elif [ $SECONDS -lt $((END - 130)) ]; then
    CUPY_PAGED_SANITIZER=memcheck step memcheck 110 $MEMCHECK $P tests/test_varlen_gpu.py -k "wgmma_candidates and (s2pot or s2poxt or d64-wg128x128s2pt)"
  fi
fi
pack
grep -h -E "^=== .* rc=|^shard " $R
grep -h -A12 "^decode step of" $R
grep -h -A6 "^| case | registered" $R | head -14
grep -h -E "^chunk after|^d64_|^peers|^D = " $R
grep -h "ERROR SUMMARY" $R | tail -3
