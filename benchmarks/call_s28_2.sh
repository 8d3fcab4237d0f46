# Session 28, device call 2: the decode kernel's rows stored in 16-byte vectors, real rows only
# (store_rows / share_state).  Tests of every path that stores through store_rows (decode, balanced
# and ragged launches, the calls, the FA2 features) and memcheck of the changed store cases; then
# trace_phases.py, bench_mixed's ragged decode cases and bench_calls' short decode cases, meant as an
# A/B against .ab/base (c1dea07) but, as run, both sides timed this code: every benchmark script puts
# its own checkout first on sys.path, ahead of PYTHONPATH (NOTES_decode.md v16, correction).
# call_s29_1.sh is the A/B done right.  About 400 s.  Usage on the device: bash benchmarks/call_s28_2.sh.
NEW=$PWD BASE=$PWD/.ab/base
CALL_LOGS=s28logs . benchmarks/call_lib.sh
mkdir -p $OUT/ab
gpu_line
[ -f $BASE/cuda_src/decode.cu ] || { echo "no .ab/base: carry .ab" >>$R; }
export PYTHONPATH=$NEW
step warm 90 python3 -m cupy_paged warm --jobs 16
store_path_tests
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
python3 benchmarks/ab_summary.py $OUT/ab base,new
