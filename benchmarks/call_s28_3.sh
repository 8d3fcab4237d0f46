# Session 28, device call 3: the A/B of call 2 again, done right, with a third side.  Calls 2 (and
# the twenty-seventh session's call 1) ran the base side on the new code: the benchmark scripts put
# their own checkout first on sys.path, ahead of PYTHONPATH.  Here each side runs from its own tree
# (.ab/base: c1dea07; .ab/ids: this commit plus the twenty-seventh session's early block ids, v16;
# the working tree: this commit), with the benchmarks and tests copied into it, and each run prints
# the package and source folder it used.  In alternation: trace_phases.py (two rounds, three sides),
# then bench_calls' short decode cases and bench_mixed's ragged decode cases (base and new); the ids
# tree's decode tests and memcheck only if its kernel won.  About 130-190 s.
# Usage on the device: bash benchmarks/call_s28_3.sh (with .ab carried).  The trees, made here first
# (.ab is git-ignored):
#   rm -rf .ab && mkdir -p .ab/base .ab/ids
#   git archive c1dea07 cupy_paged cuda_src | tar x -C .ab/base
#   git archive e71c628 cupy_paged cuda_src | tar x -C .ab/ids
#   git show 7caae26 -- cuda_src/decode.cu | (cd .ab/ids && patch -p1)
NEW=$PWD
CALL_LOGS=s28logs . benchmarks/call_lib.sh
mkdir -p $OUT/ab
gpu_line
root() { case $1 in base) echo $NEW/.ab/base;; ids) echo $NEW/.ab/ids;; new) echo $NEW;; esac; }
for side in base ids; do r=$(root $side); cp -r $NEW/benchmarks $NEW/tests $r/ 2>/dev/null; done
for side in base ids new; do
  r=$(root $side)
  (cd $r && PYTHONPATH=$r python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_decode, cupy_paged; from cupy_paged._core import compiler; print('$side uses', cupy_paged.__file__, compiler.source_dir())") >>$R 2>&1
done
export PYTHONPATH=$NEW
step warm 60 python3 -m cupy_paged warm --jobs 16 --filter HEAD_DIM=128
for round in 1 2; do
  for side in base new ids; do
    r=$(root $side); mkdir -p $OUT/ab/$side$round
    (cd $r && PYTHONPATH=$r step phases_${side}$round 50 python3 benchmarks/trace_phases.py --reps 20 --out $OUT/ab/$side$round/trace_phases.json)
  done
done
# The tests and memcheck of the ids tree only where its kernel beat this commit's (0.3 us or more at
# 64 x 128 or 64 x 576 in both rounds): nothing runs beside the timings.
IDS=$(root ids)
if python3 - <<'PY'
import json, os, sys
def us(side, name):  # the first row of a grid: the shape num_splits=0 takes
    rows = [c for c in json.load(open(f"{os.environ['OUT']}/ab/{side}/trace_phases.json"))["cases"] if c["name"] == name]
    return rows[0]["kernel_us"] if rows else 0.0
wins = [all(us(f"new{r}", n) - us(f"ids{r}", n) >= 0.3 for r in (1, 2)) for n in ("64x128 32/8", "64x576 16/4")]
print("ids wins:", wins)
sys.exit(0 if any(wins) else 1)
PY
then
  cd $IDS; export PYTHONPATH=$IDS SHARD_LIMIT=120
  shard ids_tests $P tests/test_decode_gpu.py tests/test_calls_gpu.py
  CUPY_PAGED_SANITIZER=memcheck shard ids_memcheck compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 $P tests/test_decode_gpu.py -k "sanitize or hole"
  shards_done
  cd $NEW; export PYTHONPATH=$NEW
fi
for side in base new; do
  r=$(root $side)
  (cd $r && PYTHONPATH=$r step calls_$side 50 python3 benchmarks/bench_calls.py --shuffle-order --no-profile --cases "decode 64x128,decode 128x128,decode 64x4096" --out $OUT/ab/calls_$side.json)
  (cd $r && PYTHONPATH=$r step mixed_$side 50 python3 benchmarks/bench_mixed.py --cases "ragged decode" --out $OUT/ab/mixed_$side.json)
done
rm -f $OUT/ab/*.png
pack; rm -rf $OUT/ab
grep -h -E "^=== .* rc=|^shard|uses" $R
grep -h -E "^FAILED|^ERROR|ERROR SUMMARY" $L/*.log | cut -c1-200 | head -20
mkdir -p /tmp/abx && tar xzf $OUT/ab.tgz -C /tmp/abx
python3 benchmarks/ab_summary.py /tmp/abx/ab base,new,ids
