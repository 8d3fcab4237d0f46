"""The example engine's products at decode batch sizes: its weight layout against checkpoints' and torch's.

The engine (``examples/llama``) multiplies activations ``[M, K]`` by weights it stores ``[K, N]``
(cuBLAS's "NN" kernels); checkpoints store a linear layer's weight ``[N, K]``, which torch's
``F.linear`` reads transposed ("TN").  Under ncu a decode step's products at 64 requests read 878 MB
at 2.2 TB/s (benchmarks/NOTES_e2e.md section 8), against the 4.44 TB/s read ceiling.  This times
each product of the default model (hidden 2048, 16/4 heads of 128, intermediate 5632, vocab
32000, bf16) at M = 64 and 256, kernel time only: 20 or more products captured in a CUDA graph,
the weights rotating over enough copies to pass the 50 MB L2 (whole passes), the median of graph
replays between CUDA events (the LM head with float32 output, as the engine writes its logits;
torch's with bf16).  Four ways: ``Gemm(a, w)`` with ``w [K, N]`` (cuBLAS's default kernel), the same
after ``Gemm.tune`` timed cuBLASLt's candidates for the shape (what the engine's decode graphs
capture), ``Gemm(a, w,
b_rows_out=True)`` with ``w [N, K]``, and torch's ``F.linear`` on the same ``[N, K]`` weights (a
peer, skipped without torch).  Writes ``results/gemm.json`` (cases: name, metric, value = the
engine's layout, floor = weight bytes / 4.44 TB/s on the H200 or the card's measured read stream
(ceiling.py), peers).

    python benchmarks/bench_gemm.py [--reps 30]
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from bench_decode import captured, graph_us, randn_bf16  # noqa: E402  (the decode benchmark's timing and inputs)
import ceiling  # noqa: E402  (4.44 TB/s on the H200, measured on another card)

PER_GRAPH = 20
L2_PASS = 150e6  # bytes of weight copies to rotate over, three times the L2
# (name, K, N) of the default model's products (examples/llama/config.py's GPU default).
PRODUCTS = (("qkv", 2048, 3072), ("out", 2048, 2048), ("gate_up", 2048, 11264), ("down", 5632, 2048),
            ("lm_head", 2048, 32000))


def products_per_graph(copies: int) -> int:
    """At least ``PER_GRAPH`` products, a whole number of passes over the weight copies, so that
    no copy is read twice within less than a full pass (which would hit the L2)."""
    return copies * -(-PER_GRAPH // copies)


def ours(a, weights, rows_out: bool, reps: int, out_dtype=None, tuned: bool = False):
    """The engine's ``Gemm`` over ``weights`` (each ``[K, N]``, or ``[N, K]`` with ``rows_out``);
    with ``tuned``, after ``Gemm.tune`` chose the shape's kernel: (us, the tune's report)."""
    import cupy
    from llama.cublas import Gemm

    gemm, stream = Gemm(), cupy.cuda.Stream(non_blocking=True)
    report = None
    if tuned:
        m, k = a.shape
        n = weights[0].shape[0 if rows_out else 1]
        report = gemm.tune(m, n, k, a.dtype, out_dtype, rows_out)
    per_graph, state = products_per_graph(len(weights)), {"i": 0}

    def product():
        gemm(a, weights[state["i"] % len(weights)], out_dtype, b_rows_out=rows_out)
        state["i"] += 1

    cupy.cuda.runtime.deviceSynchronize()  # the inputs were made on the legacy stream
    with stream:
        for _ in weights:  # eager first: cuBLAS's choice of kernel, outside the capture
            product()
        stream.synchronize()
    graph = captured(product, per_graph, stream)
    us = graph_us(lambda: graph.launch(stream=cupy.cuda.get_current_stream()), reps, per_graph)
    return (us, report) if tuned else us


def torch_linear(a, weights, reps: int) -> float | None:
    """torch's ``F.linear`` on the same ``[N, K]`` weights (shared through DLPack), or None."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    import cupy

    def tensor(x):  # bfloat16 through its bits: DLPack carries uint16 everywhere
        return torch.from_dlpack(x.view(cupy.uint16)).view(torch.bfloat16)

    ta = tensor(a)
    tw = [tensor(w) for w in weights]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for w in tw:
            F.linear(ta, w)
    torch.cuda.current_stream().wait_stream(side)
    graph, per_graph = torch.cuda.CUDAGraph(), products_per_graph(len(tw))
    with torch.cuda.graph(graph):
        for i in range(per_graph):
            F.linear(ta, tw[i % len(tw)])
    return graph_us(graph.replay, reps, per_graph)


def main(argv=None) -> int:
    import cupy

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "results" / "gemm.json")
    parser.add_argument("--rows", default="64,256", help="comma-separated M values")
    parser.add_argument("--no-tuned", action="store_true", help="skip the Gemm.tune column")
    args = parser.parse_args(argv)
    cupy.random.seed(0)
    cases = []
    print(f"{'product':8} {'M':>4} {'MB':>6} {'floor us':>8} {'[K,N] us':>9} {'tuned us':>9} {'[N,K] us':>9} "
          f"{'F.linear':>9}  tuned kernel")
    for name, k, n in PRODUCTS:
        nbytes = k * n * 2
        copies = max(2, math.ceil(L2_PASS / nbytes))
        kn = [randn_bf16((k, n)) for _ in range(copies)]
        nk = [cupy.ascontiguousarray(w.T) for w in kn]
        for m in (int(r) for r in args.rows.split(",")):
            a = randn_bf16((m, k))
            floor = nbytes / ceiling.read_bytes_per_s() * 1e6
            logits = np.float32 if name == "lm_head" else None  # the engine's LM head writes float32
            today, rows_out = ours(a, kn, False, args.reps, logits), ours(a, nk, True, args.reps, logits)
            tuned, report = (float("nan"), None) if args.no_tuned else ours(a, kn, False, args.reps, logits, tuned=True)
            peer = torch_linear(a, nk, args.reps)  # bf16 output throughout
            peers = {"ours, [N, K] weights": round(rows_out, 2), "ours tuned (Gemm.tune), [K, N] weights": round(tuned, 2)}
            if peer is not None:
                peers["torch F.linear, [N, K] weights"] = round(peer, 2)
            cases.append({"name": f"{name} M={m} K={k} N={n}", "metric": "us per product", "value": round(today, 2),
                          "floor": round(floor, 2), "peers": peers, "tune": report})
            print(f"{name:8} {m:4} {nbytes / 1e6:6.1f} {floor:8.2f} {today:9.2f} {tuned:9.2f} {rows_out:9.2f} "
                  f"{'-' if peer is None else f'{peer:9.2f}':>9}  {report}", flush=True)
        del kn, nk
        cupy.get_default_memory_pool().free_all_blocks()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": datetime.date.today().isoformat(), "cases": cases}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
