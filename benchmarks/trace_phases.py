"""Where a short decode launch's time goes, phase by phase, CTA by CTA.

The decode kernel's TRACE specialization stamps each CTA's start, the moment its first K/V tile
has landed, the end of its K/V loop, the moment its rows are stored, and its end, on the GPU's
nanosecond clock (decode.cu ``trace_row``, ``trace_phase``).  For short grids of one to two waves
(the launches whose fixed part decides issue 11's 64 x 128 case and the example engine's decode
step) this prints, per grid, the median over 8 launches (8 input sets rotating past the L2,
captured in one CUDA graph and replayed) of:

* ``start``: when the CTAs start, from the launch's first CTA (the grid filling the SMs);
* ``tile0``: when their first tile has landed (the prologue's round trips plus the first bytes);
* ``loop``: when their K/V loop has drained;
* ``stored`` / ``end``: when their rows are stored and they exit;
* the per-CTA phase lengths (prologue, loop, epilogue) and the bytes over the whole span and over
  the window in which tiles stream (the median CTA's first tile to the last loop's end);

beside the kernel's time per launch without the trace code (graph replays between CUDA events) and
with it (what the stamps cost), and cuDNN SDPA's on contiguous K/V in a torch CUDA graph.  Writes ``results/trace_phases.json``.

    python benchmarks/trace_phases.py [--reps N]
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import bench_decode as bd  # noqa: E402
import cupy  # noqa: E402

from cupy_paged._core.arrays import CUPY  # noqa: E402
from cupy_paged.kernels import decode as decode_ops  # noqa: E402

# (batch, context, heads, kv heads, shape): "auto" is what num_splits=0 takes, "main" the registered shape.
CASES = ((64, 128, 32, 8, "auto"), (64, 128, 32, 8, "main"), (128, 128, 32, 8, "auto"), (64, 1024, 32, 8, "auto"),
         (64, 576, 16, 4, "auto"), (64, 4096, 32, 8, "main"))
SETS = 8


def _pct(values, ps=(0, 50, 100)) -> list:
    return [round(float(np.percentile(values, p)), 2) for p in ps]


# Where the phase stamps are: trees before commit 912334c (an A/B's base side) kept them in
# columns 5-7 and had no TRACE_PHASES.
PHASES = getattr(decode_ops, "TRACE_PHASES", (5, 6, 7))


def launch_phases(rows: np.ndarray) -> dict:
    """One launch's trace rows (``TRACE_COLUMNS`` each) as microseconds from its first CTA's start."""
    start, end = rows[:, 0], rows[:, 2]
    tile0, loop, stored = (rows[:, c] for c in PHASES)
    t0 = start.min()
    rel = (lambda a: (a - t0) / 1e3)
    return {"start": _pct(rel(start)), "tile0": _pct(rel(tile0)), "loop": _pct(rel(loop)), "stored": _pct(rel(stored)),
            "end": _pct(rel(end)), "prologue": float(np.median(tile0 - start)) / 1e3,
            "loop_len": float(np.median(loop - tile0)) / 1e3, "epilogue": float(np.median(end - loop)) / 1e3,
            "span": float(rel(end).max()), "stream_window": float(rel(loop).max() - np.median(rel(tile0)))}


def cudnn_graph_us(batch, context, heads, kv_heads, reps) -> float | None:
    """cuDNN SDPA (contiguous K/V, 8 sets) per call in a torch CUDA graph, or None."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception:  # noqa: BLE001
        return None
    sets = [(torch.randn(batch, heads, 1, bd.DIM, device="cuda", dtype=torch.bfloat16),
             torch.randn(batch, context, kv_heads, bd.DIM, device="cuda", dtype=torch.bfloat16).transpose(1, 2),
             torch.randn(batch, context, kv_heads, bd.DIM, device="cuda", dtype=torch.bfloat16).transpose(1, 2))
            for _ in range(SETS)]

    def calls():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for q, k, v in sets:
                torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            calls()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            calls()
        times = []
        for _ in range(reps + 3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            graph.replay()
            a.record()
            for _ in range(4):
                graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / (4 * SETS))
        return float(np.median(times[3:]))
    except Exception as error:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
        print(f"cuDNN unavailable at {batch}x{context}: {str(error).splitlines()[0][:120]}")
        return None


def case(rng, batch, context, heads, kv_heads, shape, reps) -> dict:
    sets = bd.make_paged(rng, batch, context, 16, copies=SETS, heads=heads, kv_heads=kv_heads)
    cupy.cuda.runtime.deviceSynchronize()
    problems = [bd.decode_problem(s, out=cupy.empty_like(s[0])) for s in sets]
    tiles = decode_ops.TILES[bd.DIM] if shape == "main" else decode_ops.DecodeLaunch(problems[0]).shape.tiles
    traces = [cupy.zeros(decode_ops.trace_size(p, tiles), dtype=np.uint64) for p in problems]
    stream = cupy.cuda.Stream(non_blocking=True)

    def closure(trace: bool):
        launches = [(decode_ops.DecodeLaunch(p, tiles, trace=t if trace else None), decode_ops.problem_args(p), p.q.obj)
                    for p, t in zip(problems, traces)]
        state = {"i": 0}

        def call():
            launch, args, q = launches[state["i"] % SETS]
            state["i"] += 1
            launch.run(CUPY, q, *args, cupy.cuda.get_current_stream().ptr)
        return call

    timed = {}
    for name, trace in (("plain", False), ("traced", True)):
        call = closure(trace)
        with stream:
            for _ in range(SETS):
                call()
            stream.synchronize()
        graph = bd.captured(call, SETS, stream)
        timed[name] = bd.graph_us(lambda: graph.launch(stream=cupy.cuda.get_current_stream()), reps, SETS)
        if trace:  # one more replay, then the trace of each set's launch
            with stream:
                graph.launch(stream=stream)
            stream.synchronize()
            phases = [launch_phases(cupy.asnumpy(t).reshape(-1, decode_ops.TRACE_COLUMNS).astype(np.int64))
                        for t in traces]
    merged = {}
    for key in phases[0]:
        values = [launch[key] for launch in phases]
        merged[key] = ([round(float(np.median([v[i] for v in values])), 2) for i in range(len(values[0]))]
                       if isinstance(values[0], list) else round(float(np.median(values)), 2))
    kv = batch * context * kv_heads * bd.DIM * 2 * 2
    row = {"name": f"{batch}x{context} {heads}/{kv_heads}", "shape": tiles.label(), "ctas": batch * kv_heads,
           "slots": decode_ops.slots(cupy.cuda.Device().id, problems[0].q.dtype, bd.DIM, tiles),
           "kernel_us": round(timed["plain"], 2), "traced_us": round(timed["traced"], 2),
           "cudnn_graph_us": cudnn_graph_us(batch, context, heads, kv_heads, reps),
           "kv_mb": round(kv / 1e6, 2), **merged,
           "tb_s_span": round(kv / (merged["span"] * 1e-6) / 1e12, 3),
           "tb_s_stream_window": round(kv / (merged["stream_window"] * 1e-6) / 1e12, 3)}
    if row["cudnn_graph_us"] is not None:
        row["cudnn_graph_us"] = round(row["cudnn_graph_us"], 2)
    print(json.dumps(row), flush=True)
    del sets, problems
    cupy.get_default_memory_pool().free_all_blocks()
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", default=str(HERE / "results" / "trace_phases.json"))
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    warm = bd.make_paged(rng, 64, 4096, 16)
    bd.median_ms(bd.ours(warm), warmup=50, reps=30)  # the clocks up before the first case
    del warm
    rows = [case(rng, *c, args.reps) for c in CASES]
    device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    report = {"device": device.decode() if isinstance(device, bytes) else device,
              "date": datetime.date.today().isoformat(), "method": " ".join(__doc__.split("\n\n")[1].split()),
              "cases": rows}
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"\n{'case':16} {'shape':9} {'CTAs':>5} {'kernel':>7} {'traced':>7} {'cuDNN':>6} {'tile0 p50/p100':>15} "
          f"{'loop p50/p100':>14} {'end p100':>8} {'pro':>5} {'loop':>6} {'epi':>5} {'TB/s win':>8}")
    for r in rows:
        cud = "-" if r["cudnn_graph_us"] is None else f"{r['cudnn_graph_us']:.2f}"
        print(f"{r['name']:16} {r['shape']:9} {r['ctas']:5} {r['kernel_us']:7.2f} {r['traced_us']:7.2f} {cud:>6} "
              f"{r['tile0'][1]:7.2f}/{r['tile0'][2]:<7.2f} {r['loop'][1]:6.2f}/{r['loop'][2]:<7.2f} {r['end'][2]:8.2f} "
              f"{r['prologue']:5.2f} {r['loop_len']:6.2f} {r['epilogue']:5.2f} {r['tb_s_stream_window']:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
