# Session 27, device call 2: every issue's benchmark in one run on the code as committed -- the
# public calls (issue 11), the mixed steps (issue 13), the engine beside Hugging Face (issue 14) --
# so that the targets are read on one card in one run.  About 560 s.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=$OUT/run.log
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS; echo "=== $name: $*" >>$R; timeout $limit "$@" >>$R 2>&1; echo "=== $name rc=$? $((SECONDS-t))s" >>$R; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader >>$R
step warm 60 python3 -m cupy_paged warm --jobs 16
step bench_calls 110 python3 benchmarks/bench_calls.py --shuffle-order --no-profile
step bench_mixed 110 python3 benchmarks/bench_mixed.py
step bench_e2e 300 python3 benchmarks/bench_e2e.py --max-seconds 260
cp benchmarks/results/calls.json benchmarks/results/mixed.json benchmarks/results/mixed.png benchmarks/results/e2e.json benchmarks/results/e2e.png $OUT/ 2>/dev/null
grep -h -E "^=== .* rc=" $R
grep -h -A14 "^| case" $R | head -16
grep -h -A12 "^| target" $R | head -24
