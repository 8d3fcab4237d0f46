# (Ran as committed up to 74cb9ff; its TMA step selects nothing since the candidates were removed.)
# (Ran as committed up to ff33026; the L2 prefetch it measures (profile_engine.py --prefetch, llama.fused.L2Prefetch
# and its tests) was removed after the thirty-fifth session refuted it: `git show ff33026` has them.)
# Session 34, device call 2 (the device time left after failed starts fits one short call): the L2
# prefetch of call_s34_1.sh alone -- profile_engine.py --prefetch and the GPU test that it changes no
# token -- then, while END allows, the TMA candidates' GPU tests.
CALL_LOGS=s34logs2 . benchmarks/call_lib.sh
END=${END:-230}
gpu_line
mkdir -p $OUT/ab
step prefetch 90 python3 benchmarks/profile_engine.py --prefetch --reps 20 --out $OUT/ab/prefetch.json
step prefetch_test 60 $P tests/test_llama_engine.py -k "l2_prefetch"
LEFT=$((END - SECONDS))
[ $LEFT -gt 40 ] && step tma_tests $LEFT $P tests/test_varlen_gpu.py -x -k "wgmma_candidates and (s2pot or s2poxt or d64-wg128x128s2pt)"
pack
grep -h -E "^=== .* rc=" $R
grep -h -A12 "^decode step of" $R
grep -h -E "passed|failed|error" $R | tail -4
