# Session 33, device call 1: the varlen wgmma kernel's TMA loader (WgmmaTiles(..., tma=True)), a
# candidate beside the registered shape.  Its GPU tests first (every case of a wgmma candidate and the
# TMA cases: block sizes 16-256, holes inside full tiles, contiguous, blocks of 8 and strides no map
# takes), under a time limit (a wrong transaction count would hang the launch); then the A/B of
# ab_tma.py (back to back, registered vs TMA, FA2 and cuDNN for scale), then memcheck of the same tests.
# About 250-350 s.
CALL_LOGS=s33logs1 . benchmarks/call_lib.sh
gpu_line
mkdir -p $OUT/ab
step tma_tests 150 $P tests/test_varlen_gpu.py -k "wgmma_candidates and (s2pot or s2poxt or d64-wg128x128s2pt)"
if grep -q "^=== tma_tests rc=0" $R; then
  step ab_tma 120 python3 benchmarks/ab_tma.py --out $OUT/ab/ab_tma.json
  CUPY_PAGED_SANITIZER=memcheck step memcheck 150 $MEMCHECK $P tests/test_varlen_gpu.py -k "wgmma_candidates and (s2pot or s2poxt or d64-wg128x128s2pt)"
fi
pack
grep -h -E "^=== .* rc=" $R
grep -h -E "passed|failed|error" $R | tail -6
grep -h -A12 "^| case | registered" $R | head -14
grep -h -E "^chunk after|^peers" $R
grep -h "ERROR SUMMARY" $R | tail -2
