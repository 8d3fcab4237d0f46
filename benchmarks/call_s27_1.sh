# Session 27, device call 1: the decode kernel's first tiles' block ids read in its first round
# trip (paged cache, split 0, no left window), against the code before it (.ab/base: cupy_paged and
# cuda_src of the parent commit, carried).  The decode tests and their sanitizer cases on the new
# code, then A/B in alternation: bench_decode --short-sweep (kernel time, graphs), bench_calls on
# the short decode cases (eager, cuDNN beside), trace_call (kernel time inside one eager call).
# About 540 s.  Usage on the device: bash benchmarks/call_s27_1.sh (with .ab carried).
export PYTHONUNBUFFERED=1
NEW=$PWD BASE=$PWD/.ab/base
R=$OUT/run.log; L=/tmp/s27logs; mkdir -p $L $OUT/ab
P="python3 -m pytest -m gpu -q -p no:cacheprovider -rfE"
pack() { tar czf $OUT/logs.tgz -C /tmp s27logs 2>/dev/null; }
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS; echo "=== $name: $*" >>$R; timeout $limit "$@" >>$R 2>&1; echo "=== $name rc=$? $((SECONDS-t))s" >>$R; pack; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader >>$R
[ -f $BASE/cuda_src/decode.cu ] || { echo "no .ab/base: carry .ab" >>$R; }
export PYTHONPATH=$NEW
step warm 90 python3 -m cupy_paged warm --jobs 16
shard() { local n=$1; shift; ( t=$SECONDS; timeout 200 "$@" >$L/shard_$n.log 2>&1; echo "shard $n rc=$? $((SECONDS-t))s $(tail -n1 $L/shard_$n.log)" >>$L/shards.txt ) & }
shard decode $P tests/test_decode_gpu.py
shard calls $P tests/test_calls_gpu.py
shard fa2 $P tests/test_fa2_features_gpu.py tests/test_write_kv_cache.py tests/test_worked_examples.py
shard fuzz $P tests/test_fuzz_hostile.py tests/test_plan.py tests/test_merge.py
export CUPY_PAGED_SANITIZER=memcheck
shard memcheck compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 $P tests/test_decode_gpu.py tests/test_calls_gpu.py tests/test_fa2_features_gpu.py -k "sanitize"
export CUPY_PAGED_SANITIZER=racecheck
shard racecheck compute-sanitizer --tool racecheck --report-api-errors no --error-exitcode 1 $P tests/test_decode_gpu.py -k "staged_ids or first_ids"
unset CUPY_PAGED_SANITIZER
wait; cat $L/shards.txt >>$R; pack
for round in 1 2; do
  for side in base new; do
    src=$NEW; [ $side = base ] && src=$BASE
    mkdir -p $OUT/ab/$side$round
    PYTHONPATH=$src step short_${side}$round 60 python3 benchmarks/bench_decode.py --short-sweep --out $OUT/ab/$side$round/decode.json
  done
done
for side in base new; do
  src=$NEW; [ $side = base ] && src=$BASE
  PYTHONPATH=$src step calls_$side 70 python3 benchmarks/bench_calls.py --shuffle-order --no-profile --cases "decode 64x128,decode 128x128,decode 256x256,decode 32x2048" --out $OUT/ab/calls_$side.json
  PYTHONPATH=$src step trace_$side 45 python3 benchmarks/trace_call.py --reps 30 --out $OUT/ab/trace_$side.json
done
grep -h -E "^=== .* rc=|^shard" $R
grep -h -E "^FAILED|^ERROR|ERROR SUMMARY|RACECHECK SUMMARY" $L/*.log | cut -c1-200 | head -20
python3 - <<'EOF'
import json, os, glob
out = os.environ["OUT"] + "/ab"
rows = {}
for side in ("base1", "new1", "base2", "new2"):
    try:
        for c in json.load(open(f"{out}/{side}/decode_short.json"))["cases"]:
            for label, us in c["peers"].items():
                rows.setdefault((c["name"], label), {})[side] = us
    except OSError:
        pass
print("| grid | shape | base 1 | new 1 | base 2 | new 2 | new - base (mean) |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
for (name, label), r in rows.items():
    b = [r[k] for k in ("base1", "base2") if k in r]; n = [r[k] for k in ("new1", "new2") if k in r]
    d = (sum(n) / len(n) - sum(b) / len(b)) if b and n else float("nan")
    print(f"| {name} | {label} | " + " | ".join(f"{r.get(k, float('nan')):.2f}" for k in ("base1", "new1", "base2", "new2")) + f" | {d:+.2f} |")
EOF
grep -h -A8 "^| case" $R | head -40
grep -h "decode 64x128" $R | head -8
