# Session 29, device call 1: the final code of the twenty-eighth session on a GPU, and the A/B that
# session could not run.
#  1. Tests of every path that stores through store_rows or writes TRACE rows (decode, calls, FA2
#     features, ragged, balanced), memcheck of the store and hole cases: the TRACE-column and
#     hoisted-`single` edits never ran on a GPU.
#  2. The A/B that call_s28_3.sh (never run; removed) meant: each side from its own tree, benchmarks and tests copied in, each
#     printing the package and source it imported.  base = c1dea07 (before the vector stores),
#     new = this commit, ids = this commit plus v16 (the first tiles' block ids in the first round
#     trip).  trace_phases.py two rounds of three sides; bench_calls' short decode cases and
#     bench_mixed's ragged decode cases per side.  The ids tree's decode tests and memcheck only if
#     its kernel won (0.3 us or more at 64 x 128 or 64 x 576 in both rounds).
#  3. trace_list.py on the ragged batches (the RAGGED kernel's phase stamps, first run): whether the
#     waves of 1 x 32k + 63 x 512 each pay the ~3.3 us start (NOTES_mixed.md, twenty-eighth session).
#  4. eager_floor.py: what one eager call of an empty kernel costs on this host's GPU clock.
# About 250-330 s.  Usage on the device: bash benchmarks/call_s29_1.sh (with .ab carried).  The
# trees, made first (.ab is git-ignored):
#   rm -rf .ab && mkdir -p .ab/base .ab/ids
#   git archive c1dea07 cupy_paged cuda_src | tar x -C .ab/base
#   git archive HEAD cupy_paged cuda_src | tar x -C .ab/ids
#   git show 7caae26 -- cuda_src/decode.cu | (cd .ab/ids && patch -p1)
NEW=$PWD
CALL_LOGS=s29logs . benchmarks/call_lib.sh
mkdir -p $OUT/ab
gpu_line
[ -f $NEW/.ab/ids/cuda_src/decode.cu ] || echo "no .ab trees: carry .ab" >>$R
root() { case $1 in base) echo $NEW/.ab/base;; ids) echo $NEW/.ab/ids;; new) echo $NEW;; esac; }
for side in base ids; do r=$(root $side); cp -r $NEW/benchmarks $NEW/tests $r/ 2>/dev/null; done
for side in base ids new; do uses $side $(root $side); done
export PYTHONPATH=$NEW
step warm 90 python3 -m cupy_paged warm --jobs 16
store_path_tests
for round in 1 2; do
  for side in base new ids; do
    r=$(root $side); mkdir -p $OUT/ab/$side$round
    (cd $r && export PYTHONPATH=$r && step phases_${side}$round 60 python3 benchmarks/trace_phases.py --reps 20 --out $OUT/ab/$side$round/trace_phases.json)
  done
done
IDS=$(root ids)
if python3 - <<'PY'
import json, os, sys
def us(side, name):  # the first row of a grid: the shape num_splits=0 takes
    try:
        rows = [c for c in json.load(open(f"{os.environ['OUT']}/ab/{side}/trace_phases.json"))["cases"] if c["name"] == name]
    except OSError:
        return 0.0
    return rows[0]["kernel_us"] if rows else 0.0
wins = [all(us(f"new{r}", n) - us(f"ids{r}", n) >= 0.3 for r in (1, 2)) for n in ("64x128 32/8", "64x576 16/4")]
print("ids wins:", wins)
sys.exit(0 if any(wins) else 1)
PY
then
  (cd $IDS && export PYTHONPATH=$IDS && step ids_tests 120 $P tests/test_decode_gpu.py tests/test_calls_gpu.py)
  (cd $IDS && export PYTHONPATH=$IDS CUPY_PAGED_SANITIZER=memcheck && step ids_memcheck 120 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 $P tests/test_decode_gpu.py -k "sanitize or hole")
fi
for side in base new ids; do
  r=$(root $side)
  (cd $r && export PYTHONPATH=$r && step calls_$side 60 python3 benchmarks/bench_calls.py --shuffle-order --no-profile --cases "decode 64x128,decode 128x128,decode 64x4096" --out $OUT/ab/calls_$side.json)
  (cd $r && export PYTHONPATH=$r && step mixed_$side 60 python3 benchmarks/bench_mixed.py --cases "ragged decode" --out $OUT/ab/mixed_$side.json)
done
step trace_list 90 python3 benchmarks/trace_list.py --cases "1x32k+63x512,lognormal64,64x4096" --out $OUT/ab/trace_list.json
step eager_floor 60 python3 benchmarks/eager_floor.py --out $OUT/ab/eager_floor.json
rm -f $OUT/ab/*.png
pack; rm -rf $OUT/ab
grep -h -E "^=== .* rc=|^shard|uses|ids wins" $R
grep -h -E "^FAILED|^ERROR|ERROR SUMMARY" $L/*.log | cut -c1-200 | head -20
mkdir -p /tmp/abx && tar xzf $OUT/ab.tgz -C /tmp/abx
python3 benchmarks/ab_summary.py /tmp/abx/ab base,new,ids
grep "^| eager floor" $R
