# (Ran as committed; the persistent kernel, ab_persistent.py and bench_mixed --persistent were removed after
# call 3 refuted it on an H200: `git checkout 9bc613b` has them.)
# Session 32, device call 2: the persistent ragged kernel with CTAs that claim their items from a
# counter (each claim in an item's last loop iteration) instead of taking every P-th item (call 1, an H100: correct, but 1-22%
# slower than one CTA an item on every batch of mixed lengths, the static share's imbalance).
# Its tests (test_ragged.py, the persistent cases among them) and memcheck / racecheck / synccheck of
# them, then ab_persistent.py (same host lists, alternating, outputs compared) and the plan's mixed
# steps with and without it; on an H200 the traced 512-key launch beside them.  About 250 s.
CALL_LOGS=s32logs2 . benchmarks/call_lib.sh
gpu_start
SHARD_LIMIT=200
shard ragged $P tests/test_ragged.py
CUPY_PAGED_SANITIZER=memcheck shard memcheck_persistent $MEMCHECK $P tests/test_ragged.py -k "persistent and (one_wave or graph or head_dims or (ragged_mixes and 6-2))"
CUPY_PAGED_SANITIZER=racecheck shard racecheck_persistent compute-sanitizer --tool racecheck --report-api-errors no --error-exitcode 1 $P tests/test_ragged.py -k "persistent_window_softcap_alibi and 1]"
CUPY_PAGED_SANITIZER=synccheck shard synccheck_persistent compute-sanitizer --tool synccheck --report-api-errors no --error-exitcode 1 $P tests/test_ragged.py -k "persistent_window or (persistent_ragged_mixes and 8-1 and 1])"
shards_done
step ab_persistent 120 python3 benchmarks/ab_persistent.py --out $OUT/ab/ab_persistent.json
CASES_MIXED="ragged decode,511@512,@512,@4096"
step mixed_per_item 80 python3 benchmarks/bench_mixed.py --cases "$CASES_MIXED" --out $OUT/ab/mixed_per_item.json
step mixed_persistent 80 python3 benchmarks/bench_mixed.py --persistent --cases "$CASES_MIXED" --out $OUT/ab/mixed_persistent.json
if [[ "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" == *H200* ]]; then
  step trace 60 python3 benchmarks/trace_list.py --cases 512x512,1x32k+63x512 --out $OUT/ab/trace_list.json
fi
rm -f $OUT/ab/*.png
pack
grep -h -E "^=== .* rc=|^shard" $R
grep -h -E "^FAILED|^ERROR|ERROR SUMMARY|RACECHECK SUMMARY" $L/*.log | cut -c1-200 | head -20
grep -h -A10 "^| case | floor us" $R | cut -c1-220 | head -12
grep -h -A12 "^| case | path | ours ms" $R | cut -c1-200
