# Session 35, device call 2 (after call 1's decisions are committed): the GPU tests of the paths the
# TMA loader's host code touches and of the engine, in shards, then every issue's benchmark on the
# tree as committed (bench_calls, bench_mixed, and bench_e2e with what time is left).  END bounds it
# (about 560 s).
CALL_LOGS=s35logs2 . benchmarks/call_lib.sh
END=${END:-560}
gpu_line
mkdir -p $OUT/ab
SHARD_LIMIT=150
shard varlen $P tests/test_varlen_gpu.py -k "not candidates and not sanitize"
shard calls $P tests/test_calls_gpu.py tests/test_plan.py tests/test_worked_examples.py -k "varlen or plan or torch or stream or worked"
shard engine $P tests/test_llama_engine.py
shard ragged $P tests/test_ragged.py -k "not window_softcap"
shards_done
step bench_calls 90 python3 benchmarks/bench_calls.py --shuffle-order --no-profile --out $OUT/ab/calls.json
step bench_mixed 150 python3 benchmarks/bench_mixed.py --out $OUT/ab/mixed.json
LEFT=$((END - SECONDS - 30))
[ $LEFT -gt 90 ] && step bench_e2e $((LEFT + 20)) python3 benchmarks/bench_e2e.py --max-seconds $LEFT --out $OUT/ab/e2e.json
pack
grep -h -E "^=== .* rc=|^shard " $R
grep -h -A16 "^| case | ours GPU" $R | cut -c1-200 | head -18
grep -h -A18 "^| case | path | ours ms" $R | cut -c1-200 | head -40
grep -h -A14 "^| requests | configuration" $R | cut -c1-200 | head -16
grep -h -A8 "^| target | value" $R | cut -c1-200 | head -10
