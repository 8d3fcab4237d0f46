"""Serve a Llama model by continuous batching over cupy_paged, end to end, and print what it did.

Without ``--checkpoint`` the model has random weights from ``--seed`` and a built-in shape: on the
GPU 8 layers, hidden 2048, 16 query / 4 KV heads of 128, intermediate 5632, vocab 32000, bfloat16;
on the CPU (reference backend) a tiny one.  The requests are a synthetic mix: prompts of random
tokens, of random lengths in [--min-prompt, --max-prompt], most starting with one of two shared
"system prompts" (prefix-cache hits), half greedy, the others sampled (temperature with top-p, or
top-k), each with its own seed.

    python examples/serve_llama.py                       # GPU defaults where a GPU answers, else CPU
    python examples/serve_llama.py --cuda-graphs         # decode steps as CUDA graph replays
    python examples/serve_llama.py --sync                # no step scheduled ahead (the GPU default overlaps)
    python examples/serve_llama.py --checkpoint DIR      # a Hugging Face Llama folder (safetensors)
    CUDA_VISIBLE_DEVICES= python examples/serve_llama.py # the CPU reference backend
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

# The CPU model's matrices are tiny: BLAS threads only contend (on a busy 2-core machine a
# 48 x 128 x 512 product took 18 ms threaded against 0.35 ms on one thread).  Set before NumPy loads.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from cupy_paged._core.arrays import gpu_available  # noqa: E402
from cupy_paged._core.types import BLOCK_SIZES, HEAD_DIMS  # noqa: E402
from llama import (CPU_DEFAULT, GPU_DEFAULT, Engine, GenerationRequest, LlamaModel, SamplingParams,  # noqa: E402
                   load_checkpoint, random_weights)
from llama.weights import BF16  # noqa: E402
from llama.parallel import NcclGroup, SocketGroup, launch_local, ranks_from_environment, shard  # noqa: E402

# Per device: requests, prompt lengths, new tokens, cache blocks, step budget, running requests.
DEFAULTS = {
    "gpu": dict(requests=64, min_prompt=128, max_prompt=1024, max_new_tokens=256, num_blocks=8192,
                max_batch_tokens=2048, max_num_seqs=64, system_prompt=96),
    # A cache too small for all of them at once: some requests are preempted and recomputed.
    "cpu": dict(requests=32, min_prompt=16, max_prompt=192, max_new_tokens=32, num_blocks=96,
                max_batch_tokens=256, max_num_seqs=16, system_prompt=32),
}
DTYPES = {"bfloat16": BF16, "float16": np.dtype(np.float16), "float32": np.dtype(np.float32),
          "float64": np.dtype(np.float64)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=pathlib.Path, help="Hugging Face Llama folder (config.json, *.safetensors)")
    p.add_argument("--cpu", action="store_true", help="the CPU reference backend even where a GPU answers")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default bfloat16 on the GPU, float32 on the CPU")
    p.add_argument("--requests", type=int)
    p.add_argument("--min-prompt", type=int)
    p.add_argument("--max-prompt", type=int)
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--system-prompt", type=int, help="tokens of the shared prompt prefixes (0: none)")
    p.add_argument("--num-blocks", type=int, help="KV cache blocks")
    p.add_argument("--block-size", type=int, default=16,
                   help=f"tokens per KV cache block: a power of two from {BLOCK_SIZES[0]} to {BLOCK_SIZES[-1]} "
                        "(default 16)")
    p.add_argument("--max-batch-tokens", type=int, help="token budget of a step")
    p.add_argument("--max-num-seqs", type=int, help="most running requests")
    p.add_argument("--max-prefill-chunk", type=int, help="most tokens of one prompt in a step")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--cuda-graphs", action="store_true", help="replay decode steps as CUDA graphs (GPU)")
    p.add_argument("--tune-products", action="store_true",
                   help="needs --cuda-graphs: time cuBLAS's candidate kernels per graph size, capture the fastest")
    p.add_argument("--sync", action="store_true",
                   help="one step at a time: no decode step scheduled ahead of the previous step's tokens (GPU)")
    p.add_argument("--shape", help="random weights of this shape instead of the default model: "
                                    "LAYERS,HIDDEN,HEADS,KV_HEADS,INTERMEDIATE[,VOCAB], positive integers; the head "
                                    f"dim HIDDEN // HEADS one of {', '.join(map(str, HEAD_DIMS))}, HEADS a "
                                    "multiple of KV_HEADS")
    p.add_argument("--stats-json", type=pathlib.Path, help="also write the run's figures here (rank 0)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks, one process each: under torchrun / mpirun, or started here")
    p.add_argument("--no-ragged", action="store_true",
                   help="the decode / varlen kernels instead of one ragged launch for decode and mixed steps")
    p.add_argument("--greedy", action="store_true", help="every request greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-warm-up", action="store_true", help="time the first steps' kernel compilation too")
    p.add_argument("--weight-layout", choices=("in_out", "out_in"), default="in_out",
                   help="the products' weights [in, out], or [out, in] as checkpoints store them (LlamaModel)")
    args = p.parse_args(argv)
    device = "cpu" if args.cpu or not gpu_available() else "gpu"
    for name, value in DEFAULTS[device].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.device = device
    args.dtype = DTYPES[args.dtype or ("bfloat16" if device == "gpu" else "float32")]
    # Values argparse's types let through but the run cannot use: the option named, before any work.
    for name in ("requests", "max_new_tokens", "block_size", "tp", "max_batch_tokens", "max_num_seqs",
                 "max_prefill_chunk", "num_blocks", "min_prompt"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    for name in ("seed", "system_prompt"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0; got {getattr(args, name)}")
    if args.min_prompt > args.max_prompt:
        p.error(f"--min-prompt ({args.min_prompt}) must be at most --max-prompt ({args.max_prompt})")
    if args.checkpoint is not None and not (args.checkpoint / "config.json").is_file():
        p.error(f"--checkpoint {args.checkpoint}: no config.json there (a Hugging Face Llama folder)")
    if args.cuda_graphs and device != "gpu":
        p.error("--cuda-graphs needs a GPU (none answers here, or --cpu was given)")
    if args.tune_products and not args.cuda_graphs:
        p.error("--tune-products tunes the products of the captured decode graphs: it needs --cuda-graphs")
    if args.block_size not in BLOCK_SIZES:
        p.error(f"--block-size must be a power of two from {BLOCK_SIZES[0]} to {BLOCK_SIZES[-1]} "
                f"({', '.join(map(str, BLOCK_SIZES))}); got {args.block_size}")
    if args.shape is not None:
        try:
            shape_fields(args.shape)
        except ValueError as error:
            p.error(f"--shape {args.shape}: {error}")
    return args


def synthetic_requests(args, vocab: int) -> list[GenerationRequest]:
    """The built-in request mix (see the module docstring), reproducible from ``--seed``."""
    rng = np.random.default_rng(args.seed + 1)
    systems = [rng.integers(0, vocab, args.system_prompt).tolist() for _ in range(2)]
    kinds = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(),
             SamplingParams(temperature=1.0, top_k=50)]
    requests = []
    for i in range(args.requests):
        length = int(rng.integers(args.min_prompt, args.max_prompt + 1))
        shared = systems[i % 2] if args.system_prompt and i % 4 != 3 else []  # every fourth: no prefix
        tail = rng.integers(0, vocab, max(1, length - len(shared))).tolist()
        kind = SamplingParams() if args.greedy else kinds[i % len(kinds)]
        sampling = SamplingParams(kind.temperature, kind.top_p, kind.top_k, seed=args.seed * 100003 + i)
        requests.append(GenerationRequest(i, shared + tail, args.max_new_tokens, sampling))
    return requests


def build_model(args, rank: int = 0):
    """The model on the chosen device: from ``--checkpoint`` or random from ``--seed``; with
    ``--tp`` the shard of ``rank``."""
    if args.device == "gpu":
        import cupy as xp
    else:
        xp = np
    start = time.perf_counter()
    if args.checkpoint:
        config, weights = load_checkpoint(args.checkpoint)
        source = str(args.checkpoint)
    else:
        config = GPU_DEFAULT if args.device == "gpu" else CPU_DEFAULT
        if args.shape:
            config = shaped(config, args.shape)
        weights = random_weights(config, args.seed, np.float32)
        source = f"random weights (seed {args.seed})"
    if args.tp > 1:
        config, weights = shard(config, weights, rank, args.tp)
        source += f", tensor parallel: rank {rank} of {args.tp}"
    model = LlamaModel(config, weights, xp, args.dtype, weight_layout=args.weight_layout)
    return model, source, time.perf_counter() - start


def shape_fields(text: str) -> dict:
    """The config fields ``--shape`` sets, head_dim with them; ``ValueError`` saying what is wrong
    with a shape the model cannot take."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) not in (5, 6) or min(values) < 1:
        raise ValueError("takes LAYERS,HIDDEN,HEADS,KV_HEADS,INTERMEDIATE[,VOCAB], positive integers")
    names = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
             "vocab_size")
    fields = dict(zip(names, values))
    heads, kv_heads = fields["num_attention_heads"], fields["num_key_value_heads"]
    head_dim = fields["hidden_size"] // heads
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head dim HIDDEN // HEADS = {head_dim}; the attention serves head dims "
                         f"{', '.join(map(str, HEAD_DIMS))}")
    if heads % kv_heads:
        raise ValueError(f"HEADS ({heads}) must be a multiple of KV_HEADS ({kv_heads})")
    return dict(fields, head_dim=head_dim)


def shaped(config, text: str):
    """``config`` with the layer count and widths of ``--shape``."""
    import dataclasses

    return dataclasses.replace(config, **shape_fields(text))


def write_stats(path: pathlib.Path, args, engine) -> None:
    """The run's figures as JSON (for benchmarks/bench_tp.py)."""
    import json

    s = engine.stats
    path.write_text(json.dumps(dict(tp=args.tp, device=args.device, requests=s.requests,
                                    generated_tokens=s.generated_tokens, prompt_tokens=s.prompt_tokens,
                                    wall_seconds=s.wall_seconds, tokens_per_second=s.tokens_per_second,
                                    steps=dict(s.steps), seconds=dict(s.seconds)), indent=1))


def print_table(rows: list[tuple[str, str]]) -> None:
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


def report(args, model, source, engine, load_seconds, warm_seconds) -> None:
    s, c = engine.stats, model.config
    where = "GPU (CUDA kernels)" if args.device == "gpu" else "CPU (reference backend)"
    total = max(s.wall_seconds, 1e-9)
    buckets = [(name, s.seconds[name]) for name in ("attention", "other", "graph", "host") if s.seconds[name] > 0
               or name != "graph"]
    print_table([
        ("device", f"{where}, {np.dtype(model.dtype).name}"),
        ("model", f"{c.num_hidden_layers} layers, hidden {c.hidden_size}, heads {c.num_attention_heads}/"
                  f"{c.num_key_value_heads} x {c.head_dim}, vocab {c.vocab_size}; {source} ({load_seconds:.1f} s)"),
        ("warm-up", "skipped" if args.no_warm_up else
         f"{warm_seconds:.1f} s (kernels compiled{', graphs captured' if args.cuda_graphs else ''}; not below)"),
        ("requests", f"{s.requests}"),
        ("prompt tokens", f"{s.prompt_tokens} ({s.computed_prompt_tokens} computed)"),
        ("generated tokens", f"{s.generated_tokens}"),
        ("wall time", f"{s.wall_seconds:.2f} s"),
        ("tokens per second", f"{s.tokens_per_second:.1f} generated, "
                              f"{(s.generated_tokens + s.computed_prompt_tokens) / total:.1f} processed"),
        ("steps", ", ".join(f"{kind} {s.steps[kind]}" for kind in ("decode", "mixed", "prefill"))
         + f" (kernel paths: {', '.join(f'{k} {v}' for k, v in sorted(s.kernel_paths.items()))})"),
        ("decode graph replays", f"{s.graph_replays}" if args.cuda_graphs else "off"),
        ("prefix-cache hit rate", f"{100 * s.prefix_hit_rate:.1f}% ({s.prefix_hit_tokens} of "
                                  f"{s.prefix_queried_tokens} tokens)"),
        ("preemptions", f"{s.preemptions}"),
        ("peak cache use", f"{s.peak_blocks} of {s.num_blocks} blocks ({100 * s.peak_blocks / s.num_blocks:.1f}%)"),
        ("time", ", ".join(f"{name} {sec:.2f} s ({100 * sec / total:.0f}%)" for name, sec in buckets)
         + (" (host work overlaps the device's with asynchronous scheduling)" if engine.async_scheduling else "")),
    ])


def main(argv=None) -> int:
    args = parse_args(argv)
    group = None
    if args.tp > 1:
        ranks = ranks_from_environment()
        if ranks.world_size == 1:  # no launcher: start the ranks here
            return launch_local(main, args.tp, sys.argv[1:] if argv is None else argv)
        if ranks.world_size != args.tp:
            raise SystemExit(f"--tp {args.tp} but the launcher started {ranks.world_size} processes")
        if args.cuda_graphs:
            raise SystemExit("--cuda-graphs with --tp is not offered yet")
        group = NcclGroup(ranks) if args.device == "gpu" else SocketGroup(ranks)
    model, source, load_seconds = build_model(args, 0 if group is None else group.rank)
    requests = synthetic_requests(args, model.config.vocab_size)
    engine = Engine(model, num_blocks=args.num_blocks, block_size=args.block_size,
                    max_batch_tokens=args.max_batch_tokens, max_num_seqs=args.max_num_seqs,
                    max_prefill_chunk=args.max_prefill_chunk, enable_prefix_caching=not args.no_prefix_caching,
                    max_model_len=args.max_prompt + args.max_new_tokens, cuda_graphs=args.cuda_graphs,
                    async_scheduling=False if args.sync else None,
                    ragged=not args.no_ragged, seed=args.seed, group=group, tune_products=args.tune_products)
    if group is not None and group.rank > 0:
        engine.follow()
        return 0
    start = time.perf_counter()
    if not args.no_warm_up:
        engine.warm_up()
    warm_seconds = time.perf_counter() - start
    from tqdm import tqdm

    with tqdm(total=len(requests), unit="req", desc="requests", disable=args.no_progress) as bar:
        engine.run(requests, on_finish=lambda request: bar.update(1))
    engine.stop_followers()
    report(args, model, source, engine, load_seconds, warm_seconds)
    if args.stats_json:
        write_stats(args.stats_json, args, engine)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
