# Session 37, device call 3 (for an H200 only: the issues' card).  On any other card it stops at once
# (call 1 ran the tests and bench_calls on an H100 already).  On an H200: every issue's benchmark on this
# session's tree, on a quiet GPU, in the order the issues are judged: bench_calls (#11), bench_mixed (#13),
# bench_e2e (#14; E2E=0 leaves it out where the device time left is short).
CALL_LOGS=s37logs3 . benchmarks/call_lib.sh
gpu_line
if ! on_h200; then echo "not an H200: nothing run" | tee -a $R; exit 0; fi
gpu_start
step bench_calls 90 python3 benchmarks/bench_calls.py --shuffle-order --no-profile --out $OUT/ab/calls.json
step bench_mixed 150 python3 benchmarks/bench_mixed.py --out $OUT/ab/mixed.json
[ "${E2E:-1}" = 1 ] && step bench_e2e 230 python3 benchmarks/bench_e2e.py --max-seconds 200 --out $OUT/ab/e2e.json
issue_tables
