"""Continuous batching end to end: a paged KV cache, the scheduler and both kernel paths.

A stand-in model (random embeddings, a few attention layers, greedy argmax) serves a
stream of requests of mixed prompt lengths.  Each step the scheduler picks decodes
first, then prefill chunks under a token budget, builds one plan, and every layer runs
``plan.attention`` (the decode kernel when all sequences have one new token; when decodes
share the step with prompt chunks, the decode kernel for them and the paged varlen kernel for
the chunks; the paged varlen kernel otherwise).  On a GPU everything runs through the CUDA kernels; without
one, through the CPU reference backend.

    python examples/continuous_batching.py [--requests 32] [--layers 4]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import cupy_paged
from cupy_paged._core.arrays import gpu_available


class StandInModel:
    """Embeddings + ``layers`` attention layers with random projections; greedy sampling."""

    def __init__(self, xp, dtype, vocab=512, layers=4, heads=8, kv_heads=2, head_dim=64, seed=0):
        rng = np.random.default_rng(seed)
        width = heads * head_dim
        self.xp, self.dtype, self.shape = xp, dtype, (heads, kv_heads, head_dim)
        self.embed = xp.asarray(rng.standard_normal((vocab, width)).astype(np.float32))
        self.layers = [tuple(xp.asarray((rng.standard_normal((width, n * head_dim)) / np.sqrt(width))
                                        .astype(np.float32)) for n in (heads, kv_heads, kv_heads))
                       for _ in range(layers)]
        self.unembed = xp.asarray(rng.standard_normal((width, vocab)).astype(np.float32))

    def step(self, plan, cache):
        xp = self.xp
        heads, kv_heads, head_dim = self.shape
        x = self.embed[xp.asarray(plan.input_ids)]
        for index, (wq, wk, wv) in enumerate(self.layers):
            q = (x @ wq).astype(self.dtype).reshape(-1, heads, head_dim)
            k = (x @ wk).astype(self.dtype).reshape(-1, kv_heads, head_dim)
            v = (x @ wv).astype(self.dtype).reshape(-1, kv_heads, head_dim)
            x = x + plan.attention(q, k, v, *cache.layer(index)).reshape(x.shape).astype(np.float32)
        logits = x[xp.asarray(plan.logits_indices)] @ self.unembed
        return logits.argmax(-1).tolist()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()
    if gpu_available():
        import cupy as xp
        dtype, where = np.float16, "GPU"
    else:
        xp, dtype, where = np, np.float32, "CPU reference backend"
    model = StandInModel(xp, dtype, layers=args.layers)
    cache = cupy_paged.PagedAttentionCache(args.layers, 2, 64, block_size=16, num_blocks=96,
                                           dtype=np.dtype(dtype).name)
    config = cupy_paged.SchedulerConfig(max_batch_tokens=256, max_num_seqs=16)
    # On the GPU every plan goes into fixed buffers (pinned host, device): their addresses never
    # change, which replaying a captured CUDA graph needs, and unchanged block-table rows are not
    # rewritten.
    buffers = (cupy_paged.PlanBuffers(max_batch=config.max_num_seqs, max_tokens=config.max_batch_tokens,
                                      max_blocks_per_seq=cache.max_blocks_per_seq, device="cuda")
               if xp is not np else None)
    scheduler = cupy_paged.Scheduler(cache, config, buffers=buffers)
    rng = np.random.default_rng(1)
    system_prompt = rng.integers(0, 512, 48).tolist()  # shared: later requests hit the prefix cache
    for i in range(args.requests):
        prompt = system_prompt + rng.integers(0, 512, int(rng.integers(4, 200))).tolist()
        scheduler.add_request(cupy_paged.Request(i, prompt, args.max_new_tokens))

    steps, paths, finished = 0, dict.fromkeys(("decode", "split", "varlen"), 0), []
    start = time.perf_counter()
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        paths[plan.path] += 1
        finished += scheduler.update(plan, model.step(plan, cache))
        steps += 1
    seconds = time.perf_counter() - start
    tokens = sum(len(r.output_token_ids) for r in finished)
    print(f"{len(finished)} requests, {tokens} generated tokens in {steps} steps "
          f"({', '.join(f'{n} {path}' for path, n in paths.items())}) on the {where}: {seconds:.2f} s")
    print(f"preemptions: {scheduler.num_preemptions}; free blocks at the end: {cache.pool.num_free} "
          f"of {cache.num_blocks}")
    first = next((r for r in finished if r.request_id == 0), None)
    print("request 0 generated:", first.output_token_ids if first else [])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
