# Session 29, device call 2: every issue's benchmark on the code as committed (v17's vector stores
# measured right in call 1), on an H200 (the issues' card): bench_calls, bench_mixed, bench_e2e, with
# eager_floor.py and trace_phases.py beside them.  On another card the same without bench_e2e (its
# targets are the H200's and it takes 250 s).  First the GPU tests of memo_lookup's reader order.
# About 220 s on an H100, 520 s on an H200.
# Usage on the device: bash benchmarks/call_s29_2.sh
export PYTHONPATH=$PWD
CALL_LOGS=s29logs . benchmarks/call_lib.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
gpu_line
mkdir -p $OUT/ab
step warm 90 python3 -m cupy_paged warm --jobs 16
# memo_lookup's reader order per call path (after call 1): the plan's and the calls' GPU tests of
# torch tensors beside CuPy arrays
step tests 150 $P tests/test_plan.py tests/test_arrays.py tests/test_calls_gpu.py -k "torch or memo or cupy"
step eager_floor 60 python3 benchmarks/eager_floor.py --out $OUT/ab/eager_floor.json
step trace_phases 120 python3 benchmarks/trace_phases.py --out $OUT/ab/trace_phases.json
step bench_calls 90 python3 benchmarks/bench_calls.py --shuffle-order --no-profile --out $OUT/ab/calls.json
step bench_mixed 150 python3 benchmarks/bench_mixed.py --out $OUT/ab/mixed.json
if [[ $GPU == *H200* ]]; then
  step bench_e2e 290 python3 benchmarks/bench_e2e.py --max-seconds 250 --out $OUT/ab/e2e.json
fi
pack
grep -h -E "^=== .* rc=" $R
sed -n '/^case  /,$p' $R | head -8
grep -h -A14 "^| case\|^| requests" $R | cut -c1-260 | head -90
