"""Where a step of the Llama engine goes, on the GPU: the device time of each stage of a decode
layer (kernels only), the host's share of a served run (cProfile of ``Engine.run`` with decode
graphs), and the device time of the decode graph replays inside that run and inside a second one
(not profiled) with the ragged launch in the graphs.

Stage times are of work captured in a CUDA graph ``--inner`` times and replayed ``--reps`` times
between two events (median per call), so launch gaps do not count: a profile, not what a call
costs a user (``bench_e2e.py`` times the served engine beside Hugging Face's).  The served run is
the engine's GPU default (64 requests, prompts 128-1024, 256 new tokens), greedy.

    python benchmarks/profile_engine.py [--batch 64] [--requests 64] [--max-new-tokens 256]

``--ncu``: serve the same mix until every request runs and ``--ncu-after`` decode graphs have
been replayed, then profile one step (its one graph replay) between ``cudaProfilerStart`` and
``cudaProfilerStop`` and exit; run it under Nsight Compute with ``--profile-from-start off``
(``device_run.sh``'s ``ncu_graph`` step), which reports each kernel node of the replay.

``--pieces``: serve the same mix to the same point, then time (graph replays, CUDA events) the last
decode step's graph, that step captured without its attention (each layer's attention output a
fixed array), and its eight attention launches alone, and exit (``--out`` gets the figures).
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pathlib
import pstats
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))


def graph_time(fn, inner: int, reps: int) -> float:
    """Median device microseconds of one ``fn()``, from a graph of ``inner`` calls captured with a
    memory pool of its own (``bench_decode.captured`` and ``graph_us``)."""
    import cupy
    from bench_decode import captured, graph_us

    stream = cupy.cuda.Stream(non_blocking=True)
    pool = cupy.cuda.MemoryPool()
    with cupy.cuda.using_allocator(pool.malloc):
        with stream:
            fn()
            stream.synchronize()
        graph = captured(fn, inner, stream)
        with stream:
            return graph_us(lambda: graph.launch(stream), reps, inner)


def stage_times(model, batch: int, inner: int, reps: int) -> tuple[dict, dict]:
    """Device microseconds of each stage of one decode layer (and the model's ends) at ``batch``
    rows: as the NumPy-style expressions run them, and as the fused kernels do."""
    import cupy
    from llama.fused import argmax_rows

    c, layer = model.config, model.layers[0]
    rng = cupy.random.default_rng(0)
    x = rng.standard_normal((batch, c.hidden_size), dtype=cupy.float32)
    h = x.astype(model.dtype)
    qkv = model.matmul(h, layer.qkv)
    positions = cupy.arange(batch) + 500
    cos, sin = model.cos[positions][:, None, :], model.sin[positions][:, None, :]
    attended = rng.standard_normal((batch, c.q_size), dtype=cupy.float32).astype(model.dtype)
    gate_up = model.matmul(h, layer.gate_up)
    hidden = gate_up[:, :c.intermediate_size].copy()
    logits = rng.standard_normal((batch, c.vocab_size), dtype=cupy.float32)
    ids = cupy.arange(batch, dtype=cupy.int32)
    q_view = qkv[:, :c.q_size].reshape(batch, c.num_attention_heads, c.head_dim)
    k_view = qkv[:, c.q_size:c.q_size + c.kv_size].reshape(batch, c.num_key_value_heads, c.head_dim)
    stages = {
        "embed": lambda: model.embed[ids].astype(model.acc),
        "rms_norm + cast": lambda: model.rms_norm(x, layer.input_norm).astype(model.dtype),
        "qkv gemm": lambda: model.matmul(h, layer.qkv),
        "rotate q": lambda: model.rotate(q_view, cos, sin),
        "rotate k": lambda: model.rotate(k_view, cos, sin),
        "v contiguous": lambda: cupy.ascontiguousarray(qkv[:, c.q_size + c.kv_size:]),
        "out gemm + residual": lambda: x + model.matmul(attended, layer.out).astype(model.acc),
        "gate_up gemm": lambda: model.matmul(h, layer.gate_up),
        "swiglu": lambda: (gate_up[:, :c.intermediate_size].astype(model.acc)
                           / (1.0 + cupy.exp(-gate_up[:, :c.intermediate_size].astype(model.acc)))
                           * gate_up[:, c.intermediate_size:].astype(model.acc)).astype(model.dtype),
        "down gemm + residual": lambda: x + model.matmul(hidden, layer.down).astype(model.acc),
        "lm_head gemm + cast": lambda: model.matmul(h, model.lm_head).astype(model.acc),
        "argmax": lambda: cupy.argmax(logits, axis=-1),
    }
    f = model.fused
    fused = {
        "embed_rows": lambda: f.embed(model.embed, ids),
        "add_rms_norm": lambda: f.add_rms_norm(x, h, layer.input_norm),
        "rotary_split": lambda: f.rotary_split(qkv, positions.astype(cupy.int32), model.cos, model.sin,
                                               c.num_attention_heads, c.num_key_value_heads, c.head_dim),
        "swiglu (fused)": lambda: f.swiglu(gate_up),
        "out gemm": lambda: model.matmul(attended, layer.out),
        "down gemm": lambda: model.matmul(hidden, layer.down),
        "lm_head gemm, float32 out": lambda: model.matmul(h, model.lm_head, out_dtype=cupy.float32),
        "argmax_rows": lambda: argmax_rows(logits),
    } if f is not None else {}
    return ({name: graph_time(fn, inner, reps) for name, fn in stages.items()},
            {name: graph_time(fn, inner, reps) for name, fn in fused.items()})


def _requests(args, vocab_size: int) -> list:
    from llama import GenerationRequest

    rng = np.random.default_rng(1)
    return [GenerationRequest(i, rng.integers(0, vocab_size, int(rng.integers(128, 1025))).tolist(),
                              args.max_new_tokens) for i in range(args.requests)]


def _engine(args, model, graph_attention: str = "decode", async_scheduling=None):
    from llama import Engine

    blocks = max(8192, args.requests * -(-(1024 + args.max_new_tokens) // 16))
    return Engine(model, num_blocks=blocks, max_num_seqs=args.batch, max_model_len=1024 + args.max_new_tokens,
                  cuda_graphs=True, graph_attention=graph_attention, async_scheduling=async_scheduling)


def _serve_until_steady(args, model, engine) -> list:
    """Warm ``engine`` up and serve the mix until every request runs (none waiting or
    prefilling) and ``args.ncu_after`` decode graphs were replayed; the running contexts."""
    engine.warm_up()
    for request in _requests(args, model.config.vocab_size):
        engine.add_request(request)
    while engine.has_unfinished():
        stats = engine.scheduler.stats()
        prefilling = any(r.num_computed < len(r.prompt_token_ids) for r in engine.scheduler.running)
        if stats.num_waiting == 0 and not prefilling and engine.graphs.replays >= args.ncu_after:
            return [r.num_tokens for r in engine.scheduler.running]
        engine.step()
    raise RuntimeError("the run ended before the measured step")


def ncu_step(args, model) -> dict:
    """Serve the mix until all requests run and ``args.ncu_after`` graphs were replayed, then one
    step inside the profiler's range; returns what that step was."""
    import cupy

    engine = _engine(args, model, args.graph_attention)
    contexts = _serve_until_steady(args, model, engine)
    graphs = engine.graphs
    replays = graphs.replays
    engine.stream.synchronize()
    cupy.cuda.profiler.start()
    engine.step()
    engine.stream.synchronize()
    cupy.cuda.profiler.stop()
    if graphs.replays - replays != 1:
        raise RuntimeError(f"the profiled step replayed {graphs.replays - replays} graphs, not one")
    return dict(graph_replays_in_range=graphs.replays - replays, running=len(contexts),
                mean_context=float(np.mean(contexts)), max_context=int(max(contexts)),
                graph_attention=args.graph_attention)


def pieces_step(args, model) -> dict:
    """Serve the mix (synchronous steps) until every request runs and ``args.ncu_after`` graphs
    were replayed; then, over the last decode step's padded plan, replay and time apart
    (``bench_decode.graph_us``): the step's own graph; the same step captured with each layer's
    attention replaced by a fixed output (everything but the attention); the eight attention
    launches alone (on a fixed qkv product; they append at the same slots the step did)."""
    import cupy
    from bench_decode import graph_us
    from llama.sampling import row_argmax
    from llama.timing import NoTimer

    engine = _engine(args, model, async_scheduling=False)
    graphs, seen = engine.graphs, {}
    replay = graphs.replay

    def recording(plan):
        seen["plan"] = plan
        return replay(plan)

    graphs.replay = recording
    contexts = _serve_until_steady(args, model, engine)
    plan, stream, c = seen["plan"], engine.stream, model.config
    size = plan.batch_size
    out = {"batch": size, "running": len(contexts), "mean_context": float(np.mean(contexts)),
           "max_context": int(max(contexts))}
    keep = []  # what the captured graphs write, alive while they replay

    def capture(body):
        with cupy.cuda.using_allocator(graphs.pool.malloc):
            body()
            stream.synchronize()
            stream.begin_capture()
            try:
                body()
            finally:
                graph = stream.end_capture()
        return graph

    def attention_only():
        for i in range(c.num_hidden_layers):
            keep.append(model._decode_attention(qkv, plan, *engine.cache.layer(i)))

    with stream:
        stream.synchronize()
        fixed = cupy.zeros((size, c.num_attention_heads, c.head_dim), model.dtype)
        qkv = cupy.zeros((size, c.q_size + 2 * c.kv_size), model.dtype)
        decode_attention = model._decode_attention
        model._decode_attention = lambda *a, **k: fixed
        try:
            no_attention = capture(lambda: keep.append(row_argmax(model.forward(plan, engine.cache, NoTimer(),
                                                                                  all_rows=True))))
        finally:
            model._decode_attention = decode_attention
        attention = capture(attention_only)
        for name, graph in (("step graph us", graphs.graphs[size][0]), ("step without attention us", no_attention),
                            ("attention alone us (all layers)", attention)):
            out[name] = graph_us(lambda g=graph: g.launch(stream), args.reps, 1)
    out["attention in the step us (difference)"] = out["step graph us"] - out["step without attention us"]
    return out


def served_run(args, model, graph_attention: str = "decode", profile: bool = True):
    """Serve the default mix greedily with decode graphs (the graphs' attention on
    ``graph_attention``), under cProfile when ``profile``; the device time of a graph replay is the
    engine's own ``graph`` bucket (CUDA events on each side of each replay and its sampling) over
    its replays."""
    requests = _requests(args, model.config.vocab_size)
    engine = _engine(args, model, graph_attention)
    engine.warm_up()
    profiler = cProfile.Profile() if profile else None
    start = time.perf_counter()
    with profiler or contextlib.nullcontext():
        engine.run(requests)
    wall = time.perf_counter() - start
    text = io.StringIO()
    if profiler is not None:
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    s = engine.stats
    return dict(wall_s=wall, tok_s=s.generated_tokens / wall, steps=dict(s.steps), seconds=dict(s.seconds),
                graph_step_us=1e6 * s.seconds["graph"] / max(1, s.graph_replays),
                graph_replays=s.graph_replays), text.getvalue()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--inner", type=int, default=20)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "results" / "profile_engine.json")
    p.add_argument("--ncu", action="store_true", help="profile one decode step's graph replay, then exit")
    p.add_argument("--ncu-after", type=int, default=32, help="graph replays before the profiled step")
    p.add_argument("--pieces", action="store_true",
                   help="time a decode step's graph, the step without attention and the attention alone, then exit")
    p.add_argument("--graph-attention", choices=("decode", "ragged"), default="decode", help="with --ncu")
    p.add_argument("--force-splits", type=int, default=0,
                   help="an experiment: the decode kernel's split count where the heuristic chooses (0: the heuristic)")
    p.add_argument("--rotary-split", action="store_true",
                   help="decode steps rotate in rotary_split, not inside the decode kernel (LlamaModel.rotary_in_attention)")
    args = p.parse_args(argv)
    if args.force_splits:
        from cupy_paged.kernels import decode as _decode

        _decode.choose_splits = lambda *shape, n=args.force_splits: n  # before the first launch is resolved
    import cupy
    from llama import GPU_DEFAULT, LlamaModel, random_weights
    from llama.weights import BF16

    model = LlamaModel(GPU_DEFAULT, random_weights(GPU_DEFAULT, 0, np.float32), cupy, BF16)
    model.rotary_in_attention = model.rotary_in_attention and not args.rotary_split
    if args.ncu:
        print(json.dumps(ncu_step(args, model)))
        return 0
    if args.pieces:
        result = pieces_step(args, model)
        for name, value in result.items():
            print(f"  {name:<40} {value:10.1f}" if isinstance(value, float) else f"  {name:<40} {value}")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        return 0
    stages, fused = stage_times(model, args.batch, args.inner, args.reps)
    layer_us = sum(v for k, v in stages.items() if k not in ("embed", "lm_head gemm + cast", "argmax"))
    fused_layer_us = (2 * fused["add_rms_norm"] + fused["rotary_split"] + fused["swiglu (fused)"] + fused["out gemm"]
                      + fused["down gemm"] + stages["qkv gemm"] + stages["gate_up gemm"]) if fused else None
    run, profile_text = served_run(args, model)
    ragged_run, _ = served_run(args, model, graph_attention="ragged", profile=False)
    print(profile_text)
    print(f"device us per stage at batch {args.batch} (kernels only: a graph of --inner calls, median):")
    for name, value in stages.items():
        print(f"  {name:<24} {value:9.1f}")
    print(f"  {'layer without attention':<24} {layer_us:9.1f}  (x{GPU_DEFAULT.num_hidden_layers} layers; "
          "the second RMSNorm not counted)")
    print("fused kernels (the model's GPU path):")
    for name, value in fused.items():
        print(f"  {name:<24} {value:9.1f}")
    if fused_layer_us is not None:
        print(f"  {'layer without attention':<24} {fused_layer_us:9.1f}  (both RMSNorms counted)")
    print(f"served: {run['tok_s']:.0f} tok/s, wall {run['wall_s']:.2f} s, steps {run['steps']}, "
          f"buckets {json.dumps({k: round(v, 3) for k, v in run['seconds'].items()})}")
    print(f"the same with the ragged launch in the graphs: {ragged_run['tok_s']:.0f} tok/s, "
          f"buckets {json.dumps({k: round(v, 3) for k, v in ragged_run['seconds'].items()})}")
    print(f"decode graph replay inside the run, mean of every replay (most at batch {args.batch}): "
          f"{run['graph_step_us']:.1f} us (decode kernel, {run['graph_replays']} replays), "
          f"{ragged_run['graph_step_us']:.1f} us (ragged launch)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(batch=args.batch, stages_us=stages, fused_us=fused, run=run,
                                        ragged_run=ragged_run), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
