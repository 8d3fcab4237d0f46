#!/usr/bin/env bash
# The GPU checks of examples/llama in one run on a CUDA machine, from the repository root:
#   bash examples/llama/gpu_check.sh
# 1. tests/test_llama_engine.py whole: the CPU tests, and the GPU ones (CUDA graph replay gives the
#    eager tokens; a padded graph's logits match eager and a dense float64 forward; no device error);
# 2. the CLI's GPU default (8 layers, hidden 2048, bf16, 64 requests, prompts 128-1024, 256 new
#    tokens) eager, then with --cuda-graphs: both must finish and print their tables;
# 3. a sharded bfloat16 checkpoint written by llama.weights, served with --checkpoint --cuda-graphs.
# Logs go to $OUT (default /tmp/llama_gpu_out); a summary prints last.
set -uo pipefail
OUT=${OUT:-/tmp/llama_gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
summary=()
step() {  # name, time limit (s), command...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-14s rc=%-3s %4ss  %s' "$name" "$rc" $((SECONDS - start)) "$(grep -v '^requests:' "$OUT/$name.log" | tail -n 1)")")
}
step tests 300 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_llama_engine.py
step serve_eager 300 python3 examples/serve_llama.py --no-progress
step serve_graphs 300 python3 examples/serve_llama.py --no-progress --cuda-graphs
CKPT=${CKPT:-/tmp/llama_gpu_ckpt}
step serve_checkpoint 300 bash -c "python3 -c \"
import sys; sys.path.insert(0, 'examples')
from llama import LlamaConfig, random_weights, save_checkpoint
from llama.weights import BF16
c = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=2, head_dim=64, rope_theta=500000.0)
save_checkpoint('$CKPT', c, random_weights(c, 5), dtype=BF16, max_shard_bytes=40 << 20)
\" && python3 examples/serve_llama.py --checkpoint $CKPT --requests 16 --max-new-tokens 32 --cuda-graphs --no-progress"
for name in serve_eager serve_graphs serve_checkpoint; do echo "=== $name"; cat "$OUT/$name.log"; done
printf '%s\n' "${summary[@]}"
