# Prepared in the thirty-ninth session for the next device call.  On an H200 (the issues' card) first,
# on a quiet GPU: every issue's benchmark with v16b registered (bench_calls, bench_mixed, and bench_e2e
# while fewer than E2E_BY seconds have passed).  Then, on any card, the varlen candidates' GPU tests that
# the thirty-ninth session's call 2 did not reach (its shard's limit; their cubins are unchanged since
# they last passed) with the registered launch's shape by layout (written after it), and the ab_tma A/B again
# where time is left.
CALL_LOGS=s40logs1 . benchmarks/call_lib.sh
END=${END:-560}
gpu_start
if on_h200; then
  issue_benchmarks ${E2E_BY:-330}
fi
step profile 40 python3 benchmarks/profile_host.py  # the host path's parts, the tensor maps' encoding among them
shard_limit
shard varlen_candidates $P tests/test_varlen_gpu.py -k "candidates or registered_launch"
# The TMA shapes' shared memory under racecheck and their barriers under synccheck (registered since
# v16b, never run under either): the sanitize subset, contiguous and paged.
CUPY_PAGED_SANITIZER=racecheck shard racecheck_varlen compute-sanitizer --tool racecheck --report-api-errors no --error-exitcode 1 $P tests/test_varlen_gpu.py -k "sanitize_contiguous or sanitize_paged"
CUPY_PAGED_SANITIZER=synccheck shard synccheck_varlen compute-sanitizer --tool synccheck --report-api-errors no --error-exitcode 1 $P tests/test_varlen_gpu.py -k "sanitize_contiguous or sanitize_paged"
shards_done
[ $SECONDS -lt $((END - 40)) ] && step ab_tma 35 python3 benchmarks/ab_tma.py --reps 20 --out $OUT/ab/ab_tma.json
pack
issue_tables
grep -h -A12 "^| case | registered" $R | head -13
