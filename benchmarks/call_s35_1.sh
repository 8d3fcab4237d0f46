# (Ran as committed or never ran; ab_tma.py, register_from_ab.py and the TMA candidates were removed in the
# thirty-sixth session after call 3 of the thirty-fifth refuted them: `git checkout 74cb9ff` has them.)
# (Ran as committed up to ff33026; the L2 prefetch it measures (profile_engine.py --prefetch, llama.fused.L2Prefetch
# and its tests) was removed after the thirty-fifth session refuted it: `git show ff33026` has them.)
# Session 35, device call 1: call_s34_1.sh's measurements, with the registered varlen path's GPU tests
# run whatever the A/B says (its host launch code changed with the thirty-third session's TMA loader:
# argument offsets after an optional map field, spans built per call; CPU-tested only until now).
# 1. profile_engine.py --prefetch: the steady decode step's graph (64 rows) with each PREFETCH_VARIANTS
#    entry against none, logits compared bit for bit (timed alone on the GPU).
# 2. In parallel shards: the prefetch's GPU test, the TMA candidates' tests and their memcheck, the
#    registered varlen tests, the calls / plan tests of the varlen and plan-layer launches.
# 3. If the candidates pass: ab_tma.py, register_from_ab.py; when a TMA shape is registered, the
#    registered varlen tests again and memcheck of the registered path.  END bounds it (420 is
#    enough for steps 1-3 without the retests).
CALL_LOGS=s35logs1 . benchmarks/call_lib.sh
END=${END:-560}  # seconds this call may take: the last steps start only while they fit
gpu_line
mkdir -p $OUT/ab
step prefetch 90 python3 benchmarks/profile_engine.py --prefetch --out $OUT/ab/prefetch.json
SHARD_LIMIT=170
shard prefetch_test $P tests/test_llama_engine.py -k "l2_prefetch"
shard tma $P tests/test_varlen_gpu.py -k "wgmma_candidates and (s2pot or s2poxt or d64-wg128x128s2pt)"
shard varlen $P tests/test_varlen_gpu.py -k "not candidates and not sanitize"
shard calls $P tests/test_calls_gpu.py tests/test_plan.py -k "varlen or plan or torch or stream"
CUPY_PAGED_SANITIZER=memcheck shard memcheck_tma $MEMCHECK $P tests/test_varlen_gpu.py -k "wgmma_candidates and (s2pot or s2poxt or d64-wg128x128s2pt)"
shards_done
if grep -q "^shard tma rc=0" $R && [ $SECONDS -lt $((END - 130)) ]; then
  step ab_tma 110 python3 benchmarks/ab_tma.py --reps ${AB_REPS:-30} --out $OUT/ab/ab_tma.json
  step register 20 python3 benchmarks/register_from_ab.py $OUT/ab/ab_tma.json
  if grep -q "registered wg" $R && [ $SECONDS -lt $((END - 140)) ]; then
    grep -n "registered from the A/B" cupy_paged/kernels/varlen_wgmma.py >> $R
    SHARD_LIMIT=$((END - SECONDS - 10))
    rm -f $L/shards.txt
    shard varlen_reg $P tests/test_varlen_gpu.py -k "not candidates and not sanitize"
    CUPY_PAGED_SANITIZER=memcheck shard memcheck $MEMCHECK $P tests/test_varlen_gpu.py -k "sanitize or (wgmma_candidates and s2pot)"
    shards_done
  fi
fi
pack
grep -h -E "^=== .* rc=|^shard " $R
grep -h -A12 "^decode step of" $R
grep -h -A6 "^| case | registered" $R | head -14
grep -h -E "^chunk after|^d64_|^peers|^D = " $R
grep -h "ERROR SUMMARY" $R | tail -3
