# Session 26, device call 1: the whole GPU suite in parallel shards (the code of 3c18003, parts of it
# never run on a GPU), memcheck of the per-thread-stream and contiguous-cache code, then bench_calls
# and bench_mixed alone on the card.  About 540 s.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=$OUT/run.log; L=/tmp/s26logs; mkdir -p $L
P="python3 -m pytest -m gpu -q -p no:cacheprovider -rfE"
pack() { tar czf $OUT/logs.tgz -C /tmp s26logs 2>/dev/null; }
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS; echo "=== $name: $*" >>$R; timeout $limit "$@" >>$R 2>&1; echo "=== $name rc=$? $((SECONDS-t))s" >>$R; pack; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader >>$R
step warm 80 python3 -m cupy_paged warm --jobs 16
shard() { local n=$1; shift; ( t=$SECONDS; timeout 215 "$@" >$L/shard_$n.log 2>&1; echo "shard $n rc=$? $((SECONDS-t))s $(tail -n1 $L/shard_$n.log)" >>$L/shards.txt ) & }
shard balanced $P tests/test_balanced_gpu.py
shard varlen $P tests/test_varlen_gpu.py
shard fa2 $P tests/test_fa2_features_gpu.py tests/test_write_kv_cache.py
shard calls $P tests/test_calls_gpu.py tests/test_decode_gpu.py tests/test_arrays.py tests/test_bad_input.py tests/test_cache.py tests/test_examples.py tests/test_fuzz_hostile.py tests/test_load.py tests/test_merge.py tests/test_plan.py tests/test_tp.py tests/test_worked_examples.py
shard ragged $P tests/test_ragged.py tests/test_llama_engine.py tests/test_hf_integration.py
shard memcheck compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 $P tests/test_balanced_gpu.py tests/test_decode_gpu.py tests/test_calls_gpu.py -k "per_thread or contiguous_cache or new_stream"
wait; cat $L/shards.txt >>$R; pack
step bench_calls 110 python3 benchmarks/bench_calls.py --shuffle-order --no-profile
step bench_mixed 130 python3 benchmarks/bench_mixed.py
cp benchmarks/results/calls.json benchmarks/results/mixed.json benchmarks/results/mixed.png $OUT/ 2>/dev/null
grep -h -E "^=== .* rc=|^shard" $R
grep -h -E "^FAILED|^ERROR|ERROR SUMMARY" $L/*.log | cut -c1-200 | head -20
tail -n 70 $R | grep -v "^===" | cut -c1-220
