# (Ran as committed or never ran; ab_tma.py, register_from_ab.py and the TMA candidates were removed in the
# thirty-sixth session after call 3 of the thirty-fifth refuted them: `git checkout 74cb9ff` has them.)
# Session 35, device call 3: the TMA candidates again after the launch fix (3292c9d: parameter
# pointers, the maps 48 bytes into the parameter space), their tests and memcheck in parallel, then
# the A/B against the registered shapes and register_from_ab.py while END allows (about 300 s).
CALL_LOGS=s35logs3 . benchmarks/call_lib.sh
END=${END:-300}
gpu_line
mkdir -p $OUT/ab
SHARD_LIMIT=150
shard tma $P tests/test_varlen_gpu.py -k "wgmma_candidates and (s2pot or s2poxt or d64-wg128x128s2pt)"
CUPY_PAGED_SANITIZER=memcheck shard memcheck_tma $MEMCHECK $P tests/test_varlen_gpu.py -k "wgmma_candidates and (s2pot or d64-wg128x128s2pt)"
shards_done
if grep -q "^shard tma rc=0" $R && [ $SECONDS -lt $((END - 110)) ]; then
  step ab_tma 95 python3 benchmarks/ab_tma.py --reps ${AB_REPS:-20} --out $OUT/ab/ab_tma.json
  step register 15 python3 benchmarks/register_from_ab.py $OUT/ab/ab_tma.json
fi
pack
grep -h -E "^=== .* rc=|^shard " $R
grep -h -A6 "^| case | registered" $R | head -14
grep -h -E "^chunk after|^d64_|^peers|^D = " $R
