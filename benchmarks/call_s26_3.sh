# Session 26, device call 3: the whole end-to-end comparison (ours and Hugging Face's paths, 64 and
# 256 requests, the sweep and the plot) on the code as committed (cuBLAS products), and trace_call
# (where the 64 x 128 call's launch and kernel fall, ours against cuDNN).  About 450 s.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=$OUT/run.log
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS; echo "=== $name: $*" >>$R; timeout $limit "$@" >>$R 2>&1; echo "=== $name rc=$? $((SECONDS-t))s" >>$R; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >>$R
step trace_call 60 python3 benchmarks/trace_call.py --reps 30
step bench_e2e 430 python3 benchmarks/bench_e2e.py --max-seconds 380
cp benchmarks/results/e2e.json benchmarks/results/e2e.png benchmarks/results/trace_call.json $OUT/ 2>/dev/null
grep -h -E "^=== .* rc=" $R
grep -A12 "^| requests" $R | head -60
grep -A12 "^| target" $R | head -14
grep -A14 "^| run " $R | head -16
grep -E "skipped|FAILED" $R | head
