# Session 31, device call 2: every issue's benchmark on an H200 (the issues' card), on the code of call 1
# (whose tests passed on an H100): bench_calls, bench_mixed, bench_e2e, eager_floor.py beside them.
# About 430 s on an H200.  On another card the same without bench_e2e.
# Usage on the device: bash benchmarks/call_s31_2.sh
export PYTHONPATH=$PWD
CALL_LOGS=s31logs2 . benchmarks/call_lib.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
mkdir -p $OUT/ab
gpu_line
step warm 90 python3 -m cupy_paged warm --jobs 16
step eager_floor 60 python3 benchmarks/eager_floor.py --out $OUT/ab/eager_floor.json
step bench_calls 90 python3 benchmarks/bench_calls.py --shuffle-order --no-profile --out $OUT/ab/calls.json
step bench_mixed 150 python3 benchmarks/bench_mixed.py --out $OUT/ab/mixed.json
if [[ $GPU == *H200* ]]; then
  step bench_e2e 290 python3 benchmarks/bench_e2e.py --max-seconds 250 --out $OUT/ab/e2e.json
fi
pack
grep -h -E "^=== .* rc=" $R
sed -n '/^case  /,$p' $R | head -8
grep -h -A16 "^| case\|^| requests\|^| decode-only" $R | cut -c1-260 | head -100
