# Session 26, device call 2: llama.products (the decode step's products on our kernel) on a GPU for
# the first time: its GPU tests and the engine's, memcheck of its tests, bench_gemm at M = 64 with
# every variant, then bench_e2e ours-graphs against ours-graphs-cublas at 64 and 256 requests.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=$OUT/run.log; L=/tmp/s26logs; mkdir -p $L
P="python3 -m pytest -m gpu -q -p no:cacheprovider -rfE"
pack() { tar czf $OUT/logs.tgz -C /tmp s26logs 2>/dev/null; }
step() { local name=$1 limit=$2; shift 2; local t=$SECONDS; echo "=== $name: $*" >>$R; timeout $limit "$@" >>$R 2>&1; echo "=== $name rc=$? $((SECONDS-t))s" >>$R; pack; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >>$R
step tests_products 90 $P tests/test_llama_engine.py -k "decode_products or decode_step_on"
( timeout 150 $P tests/test_llama_engine.py >$L/engine.log 2>&1; echo "engine rc=$? $(tail -n1 $L/engine.log)" >>$L/par.txt ) &
( timeout 150 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 $P tests/test_llama_engine.py -k "decode_products_match" >$L/memcheck.log 2>&1; echo "memcheck rc=$? $(grep 'ERROR SUMMARY' $L/memcheck.log | tail -n1) $(tail -n1 $L/memcheck.log)" >>$L/par.txt ) &
wait; cat $L/par.txt >>$R; pack
step bench_gemm 150 python3 benchmarks/bench_gemm.py --rows 64 --variants --no-tuned --reps 20 --out benchmarks/results/gemm_products.json
cp benchmarks/results/gemm_products.json $OUT/ 2>/dev/null
step bench_e2e 200 python3 benchmarks/bench_e2e.py --configs ours-graphs,ours-graphs-cublas --concurrency 64,256 --sweep "" --no-plot --out benchmarks/results/e2e_products.json
cp benchmarks/results/e2e_products.json $OUT/ 2>/dev/null
grep -h -E "^=== .* rc=|^engine|^memcheck" $R
grep -h -E "^FAILED|^ERROR" $R $L/*.log | cut -c1-300 | head -20
grep -h -A12 "^product " $R | head -30
tail -n 40 $R | grep -v "^===" | cut -c1-250
