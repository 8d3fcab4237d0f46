# Session 28, device call 2: the decode kernel's rows stored in 16-byte vectors, real rows only
# (store_rows / share_state), against the code before it (.ab/base: cupy_paged and cuda_src of
# c1dea07, carried).  Tests of every path that stores through store_rows (decode, balanced and
# ragged launches, the calls, the FA2 features) and memcheck of the changed store cases on the new
# code; then A/B in alternation: trace_phases.py (kernel time in graphs and the phases, cuDNN
# beside), bench_mixed's ragged decode cases, bench_calls' short decode cases (eager, torch, cuDNN beside) (64 x 4096 in trace_phases: the long grid, no drop).
# About 400 s.  Usage on the device: bash benchmarks/call_s28_2.sh (with .ab carried).
export PYTHONUNBUFFERED=1
NEW=$PWD BASE=$PWD/.ab/base
R=$OUT/run.log; L=/tmp/s28logs; mkdir -p $L $OUT/ab
P="python3 -m pytest -m gpu -q -p no:cacheprovider -rfE"
pack() { tar czf $OUT/logs.tgz -C /tmp s28logs 2>/dev/null; }
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS; echo "=== $name: $*" >>$R; timeout $limit "$@" >>$R 2>&1; echo "=== $name rc=$? $((SECONDS-t))s" >>$R; pack; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader >>$R
[ -f $BASE/cuda_src/decode.cu ] || { echo "no .ab/base: carry .ab" >>$R; }
export PYTHONPATH=$NEW
step warm 90 python3 -m cupy_paged warm --jobs 16
shard() { local n=$1; shift; ( t=$SECONDS; timeout 170 "$@" >$L/shard_$n.log 2>&1; echo "shard $n rc=$? $((SECONDS-t))s $(tail -n1 $L/shard_$n.log)" >>$L/shards.txt ) & }
shard decode $P tests/test_decode_gpu.py
shard calls $P tests/test_calls_gpu.py
shard fa2 $P tests/test_fa2_features_gpu.py tests/test_worked_examples.py tests/test_plan.py tests/test_merge.py
shard ragged $P tests/test_ragged.py
shard balanced $P tests/test_balanced_gpu.py
export CUPY_PAGED_SANITIZER=memcheck
shard memcheck compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 $P tests/test_decode_gpu.py tests/test_calls_gpu.py -k "sanitize or hole or off_16"
shard memcheck_ragged compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 $P tests/test_ragged.py -k "window_softcap or head_dims_block_sizes"
unset CUPY_PAGED_SANITIZER
wait; cat $L/shards.txt >>$R; pack
for round in 1 2; do
  for side in base new; do
    src=$NEW; [ $side = base ] && src=$BASE
    mkdir -p $OUT/ab/$side$round
    PYTHONPATH=$src step phases_${side}$round 60 python3 benchmarks/trace_phases.py --reps 20 --out $OUT/ab/$side$round/trace_phases.json
  done
done
for side in base new; do
  src=$NEW; [ $side = base ] && src=$BASE
  PYTHONPATH=$src step mixed_$side 60 python3 benchmarks/bench_mixed.py --cases "ragged decode,step chunk512" --out $OUT/ab/mixed_$side.json
  PYTHONPATH=$src step calls_$side 60 python3 benchmarks/bench_calls.py --shuffle-order --no-profile --cases "decode 64x128,decode 128x128,decode 64x4096" --out $OUT/ab/calls_$side.json

done
grep -h -E "^=== .* rc=|^shard" $R
grep -h -E "^FAILED|^ERROR|ERROR SUMMARY" $L/*.log | cut -c1-200 | head -20
python3 - <<'PY'
import json, os
out = os.environ["OUT"] + "/ab"
rows = {}
for side in ("base1", "new1", "base2", "new2"):
    try:
        for c in json.load(open(f"{out}/{side}/trace_phases.json"))["cases"]:
            rows.setdefault((c["name"], c["shape"]), {})[side] = c
    except OSError:
        pass
print("| grid | shape | kernel base 1 / new 1 / base 2 / new 2 | cuDNN (graph) | epilogue base / new | end p100 base / new |")
print("| --- | --- | --- | ---: | --- | --- |")
for (name, shape), r in rows.items():
    k = " / ".join(f"{r[s]['kernel_us']:.2f}" if s in r else "-" for s in ("base1", "new1", "base2", "new2"))
    cud = r.get("new1", r.get("base1", {})).get("cudnn_graph_us")
    epi = " / ".join(f"{r[s]['epilogue']:.2f}" if s in r else "-" for s in ("base1", "new1"))
    end = " / ".join(f"{r[s]['end'][2]:.2f}" if s in r else "-" for s in ("base1", "new1"))
    print(f"| {name} | {shape} | {k} | {cud} | {epi} | {end} |")
for side in ("base", "new"):
    try:
        for c in json.load(open(f"{out}/calls_{side}.json"))["cases"]:
            if "ratio" in c:
                print(side, c["name"], "us", c["value"], "vs", c["vs"], c["peers"].get(c["vs"]), "ratio", c["ratio"], "host", c["host_us"], "b2b", c["back_to_back_us"])
    except OSError:
        pass
for side in ("base", "new"):
    try:
        for c in json.load(open(f"{out}/mixed_{side}.json"))["cases"]:
            print(side, c["name"], "eager", c["value"], "floor", c["floor"], "b2b", c["back_to_back_us"].get("ours"))
    except OSError:
        pass
    try:
        for c in json.load(open(f"{out}/decode_{side}.json"))["cases"]:
            print(side, json.dumps(c)[:160])
    except OSError:
        pass
PY
