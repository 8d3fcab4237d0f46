# Session 37, device call 1.  On an H200 (the issues' card): call_s36_2.sh with the whole call (every issue's
# benchmark on the thirty-sixth session's host changes, then the GPU tests).  On any other card:
# call_s36_2.sh in 300 s (bench_calls, the eager floor, the host path's parts, the GPU tests of the varlen
# path, the calls and the plan, memcheck of the varlen path), then call_s36_3.sh (Nsight Compute of our
# causal prefill beside FlashAttention-2's and cuDNN's).
if [[ "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" == *H200* ]]; then
  END=560 bash benchmarks/call_s36_2.sh
else
  END=300 bash benchmarks/call_s36_2.sh
  mv "$OUT/logs.tgz" "$OUT/logs_s36_2.tgz"
  bash benchmarks/call_s36_3.sh
fi
