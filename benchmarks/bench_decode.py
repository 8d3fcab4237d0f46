"""Decode attention bandwidth: cupy_paged's paged kernel against cuDNN SDPA and torch FA2 varlen.

bf16, 32 query heads / 8 kv heads, head_dim 128, one query token per sequence, no append.
Metric: bytes of K and V that must be read (batch * context * kv_heads * head_dim * 2 B * 2)
over the CUDA-event median time per call of back-to-back calls (``median_ms``; the single-call
time of runs 1-2 is kept as ``single_call``).  Peers run on contiguous K/V in the same process (torch is
imported only here; a missing peer is skipped).  The launch-bound case (64 x 128) reports
microseconds per call, eager and as a replayed CUDA graph, rotating 8 input sets past the L2.
``--sweep`` then (after the table and the JSON are written, so that a failing candidate loses
only the sweep) times the registered pipeline shape and each :data:`SWEEP` shape at
64 x 4096 (block sizes 16, 32, 256 shuffled, 16 sorted), 256 x 2048, 8 x 32768 and 1 x 131072
(block 16, each shape's own split heuristic) on the same inputs, with each shape's
registers, local memory and CTAs per SM as built here and its largest difference from the
registered kernel's output (NaN: an element left unwritten); it adds ``"sweep"`` to the JSON.
``--trace`` records each CTA's start and end on the GPU clock for one launch each of 64 x 4096,
256 x 2048 and 1 x 131072 (the kernel's TRACE specialization, ``run(..., trace=)``; the registered
kernels hold no trace code) and summarises where the span goes (``"trace"``); ``--fixed-cost``
fits time per call against tiles per CTA at one and two waves (``"fixed_cost"``).

    python benchmarks/bench_decode.py [--quick] [--sweep] [--trace] [--fixed-cost]
                                      [--out benchmarks/results/decode.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import cupy  # noqa: E402

import cupy_paged  # noqa: E402
from cupy_paged._core.types import BF16  # noqa: E402
from cupy_paged._core.arrays import CUPY  # noqa: E402
from cupy_paged._core.compiler import get_function  # noqa: E402
from cupy_paged.kernels import decode as decode_ops  # noqa: E402
from cupy_paged.kernels.decode import Tiles  # noqa: E402

HEADS, KV_HEADS, DIM = 32, 8, 128
# Head dim -> the pipeline shapes --sweep times against the registered one (each also checked by
# tests/test_decode_gpu.py's CANDIDATES; NOTES_decode.md has the earlier sweeps and their outcomes).
SWEEP: dict[int, tuple[Tiles, ...]] = {
    128: (Tiles(32, 3, warps=2),),
}
FA2, CUDNN = "torch FA2 varlen", "cuDNN SDPA"
CHAIN = 4  # calls per timed sample (see median_ms)


def median_ms(fn, warmup=3, reps=20, chain=CHAIN):
    """Median over ``reps`` samples of the CUDA-event time (ms) per call of ``chain`` back-to-back calls.

    One untimed call is queued before each sample's start event, so the GPU is busy while the
    host prepares the timed calls: the time is the device's, not the host's launch latency
    (a decode step inside a captured model graph has none).  ``chain=0`` is the single-call
    method of runs 1-2 (events around one call, host work before its launch included).
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        if chain:
            fn()
        start.record()
        for _ in range(max(chain, 1)):
            fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / max(chain, 1))
    return float(np.median(times))


def per_call_us(fn, calls=200, warmup=20):
    """Microseconds per call of ``calls`` back-to-back calls (host launch cost included)."""
    for _ in range(warmup):
        fn()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(calls):
        fn()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) * 1e3 / calls


def kv_bytes(batch, context):
    return batch * context * KV_HEADS * DIM * 2 * 2


def randn_bf16(shape):
    """Random bf16 on the GPU: the top 16 bits of float32 normals (truncation is fine for timing)."""
    bits = cupy.random.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16
    return bits.astype(np.uint16).view(BF16)


def make_paged(rng, batch, context, block_size, copies=1, shuffle=True, heads=HEADS, kv_heads=KV_HEADS):
    """``copies`` independent (q, k_cache, v_cache, table, lens) sets, blocks shuffled (or, with
    ``shuffle=False``, each sequence's blocks in address order: a diagnostic of memory locality);
    ``heads`` / ``kv_heads`` query and kv heads (the benchmark's 32 / 8 by default)."""
    per_seq = -(-context // block_size)
    sets = []
    for _ in range(copies):
        num_blocks = batch * per_seq
        k = randn_bf16((num_blocks, block_size, kv_heads, DIM))
        v = randn_bf16((num_blocks, block_size, kv_heads, DIM))
        ids = rng.permutation(num_blocks) if shuffle else np.arange(num_blocks)
        table = cupy.asarray(ids.astype(np.int32).reshape(batch, per_seq))
        q = randn_bf16((batch, 1, heads, DIM))
        lens = cupy.full((batch,), context, np.int32)
        sets.append((q, k, v, table, lens))
    return sets


def decode_problem(paged_set, num_splits=0, out=None):
    """The checked problem of one ``make_paged`` set (no value checks), as ``kernels.decode`` runs it."""
    q, k, v, table, lens = paged_set
    return cupy_paged.api.decode.prepare_decode(q, k, v, cache_seqlens=lens, block_table=table, num_splits=num_splits,
                                             out=out, check_values=False)


def ours(sets, num_splits=0, tiles=None):
    """A closure cycling through ``sets`` (out given, no host checks): one decode call each, through
    the public function, or with ``tiles`` a launch of that pipeline shape (resolved once per set,
    on the caller's current CuPy stream).  Its ``outs`` attribute holds the outputs, a set each."""
    outs = [cupy.empty_like(s[0]) for s in sets]
    launches = None
    if tiles is not None:
        problems = [decode_problem(s, num_splits, out) for s, out in zip(sets, outs)]
        launches = [(decode_ops.DecodeLaunch(p, tiles), decode_ops.problem_args(p), p.q.obj) for p in problems]
    state = {"i": 0}

    def call():
        i = state["i"] % len(sets)
        state["i"] += 1
        if launches is not None:
            launch, args, q = launches[i]
            launch.run(CUPY, q, *args, cupy.cuda.get_current_stream().ptr)
            return
        q, k, v, table, lens = sets[i]
        cupy_paged.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table, out=outs[i],
                                           num_splits=num_splits, check_values=False)
    call.outs = outs
    return call


def captured(fn, count: int, stream):
    """A CUDA graph of ``count`` calls of ``fn`` captured on the CuPy ``stream``."""
    with stream:
        stream.begin_capture()
        try:
            for _ in range(count):
                fn()
        finally:
            graph = stream.end_capture()
    return graph


def graph_us(replay, reps: int, per_graph: int) -> float:
    """Median microseconds a call: ``replay()`` launches a graph of ``per_graph`` calls on the
    current stream; each sample is four replays between two events, queued behind one more, so
    that no graph launch latency falls inside the timing."""
    times = []
    for _ in range(reps + 3):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        replay()  # keeps the GPU busy while the timed replays are queued
        start.record()
        for _ in range(4):
            replay()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3 / (4 * per_graph))
    return float(np.median(times[3:]))


def peers(batch, context, copies=1):
    """{name: closure} for the torch peers on contiguous K/V, or {} without torch."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception as error:  # noqa: BLE001 - any import failure means no peers
        print(f"peers skipped: {error}")
        return {}
    sets = []
    for _ in range(copies):
        q = torch.randn(batch, 1, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, context, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(batch, context, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
        sets.append((q, k, v))
    cu_q = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    cu_k = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * context
    state = {"i": 0}

    def pick():
        state["i"] += 1
        return sets[state["i"] % len(sets)]

    def cudnn():
        q, k, v = pick()
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)

    def fa2():
        q, k, v = pick()
        torch.ops.aten._flash_attention_forward(
            q.view(batch, HEADS, DIM), k.view(batch * context, KV_HEADS, DIM),
            v.view(batch * context, KV_HEADS, DIM), cu_q, cu_k, 1, context, 0.0, False, False)

    found = {}
    for name, fn in ((CUDNN, cudnn), (FA2, fa2)):
        try:
            fn()
            torch.cuda.synchronize()
            found[name] = fn
        except Exception as error:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
            print(f"{name} unavailable at {batch}x{context}: {str(error).splitlines()[0][:120]}")
    return found


def torch_stream_sync():
    try:
        import torch

        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001
        pass


def bandwidth_case(rng, batch, context, block_size, with_peers, reps, num_splits=0, shuffle=True):
    """One row: our TB/s (and the peers' with ``with_peers``).  ``num_splits`` and ``shuffle`` make
    the comparison rows (forced split count, block table in address order); their names say which."""
    sets = make_paged(rng, batch, context, block_size, shuffle=shuffle)
    splits = decode_ops.plan(decode_problem(sets[0], num_splits))
    def tbps(fn, chain=CHAIN):
        return round(kv_bytes(batch, context) / (median_ms(fn, reps=reps, chain=chain) * 1e-3) / 1e12, 3)

    name = f"{batch}x{context} bs{block_size}"
    name += f" splits={num_splits}" if num_splits else ""
    name += "" if shuffle else " sorted"
    call = ours(sets, num_splits)
    result = {"name": name, "metric": "TB/s of K+V", "value": tbps(call), "single_call": tbps(call, chain=0),
              "num_splits": splits, "peers": {}, "peers_single_call": {}}
    del sets, call
    if with_peers:
        for name, fn in peers(batch, context).items():
            result["peers"][name] = tbps(fn)
            result["peers_single_call"][name] = tbps(fn, chain=0)
        torch_stream_sync()
    cupy.get_default_memory_pool().free_all_blocks()
    return result


def launch_bound_case(rng, batch=64, context=128, block_size=16):
    sets = make_paged(rng, batch, context, block_size, copies=8)
    result = {"name": f"{batch}x{context} bs{block_size} eager", "metric": "us per call",
              "value": round(per_call_us(ours(sets)), 2), "peers": {}}
    # The same call captured once per input set and replayed: launch gaps shrink to graph nodes.
    stream = cupy.cuda.Stream(non_blocking=True)
    graphs = []
    with stream:
        call = ours(sets)
        for _ in sets:  # warm-up on the capturing stream sizes the workspace
            call()
        for _ in sets:
            stream.begin_capture()
            call()
            graphs.append(stream.end_capture())
        state = {"i": 0}

        def replay():
            state["i"] += 1
            graphs[state["i"] % len(graphs)].launch(stream=stream)
        graph_us = per_call_us(replay)
    graph = {"name": f"{batch}x{context} bs{block_size} graph", "metric": "us per call",
             "value": round(graph_us, 2), "peers": {}}
    for name, fn in peers(batch, context, copies=8).items():
        result["peers"][name] = round(per_call_us(fn), 2)
    torch_stream_sync()
    return [result, graph]


def shape_resources(tiles, trace=False):
    """Registers, local memory, shared memory and CTAs per SM of ``paged_decode`` (bf16, D = 128)
    with pipeline shape ``tiles`` as built on this machine (``trace``: its TRACE specialization)."""
    smem = tiles.smem_bytes(DIM)
    kernel = get_function(decode_ops.kernel_key(BF16, DIM, tiles, trace=trace), "paged_decode", smem)
    return {"registers": int(kernel.num_regs), "local_bytes": int(kernel.local_size_bytes), "smem": smem,
            "ctas_per_sm": decode_ops.ctas_per_sm(kernel.num_regs, smem, tiles.threads)}


def sweep_case(rng, block_size, shuffle, reps, batch=64, context=4096):
    """The registered shape and every SWEEP[128] shape on one input set: TB/s, resources and
    the largest difference of each shape's output from the registered kernel's (through
    ``kernels.decode.run``, the same host path for all, no host checks)."""
    sets = make_paged(rng, batch, context, block_size, shuffle=shuffle)
    out = cupy.empty_like(sets[0][0])
    problem = decode_problem(sets[0], out=out)

    def tbps(tiles):
        return round(kv_bytes(batch, context) / (median_ms(lambda: decode_ops.run(problem, tiles), reps=reps)
                                                 * 1e-3) / 1e12, 3)

    name = f"{batch}x{context} bs{block_size}" + ("" if shuffle else " sorted")
    registered = decode_ops.TILES[DIM]
    decode_ops.run(problem)
    reference = out.astype(np.float32)
    row = {"name": name, "registered": registered.label(), "shapes": {}}
    for tiles in (registered,) + SWEEP.get(DIM, ()):
        try:
            out.view(np.uint16).fill(0x7FC0)  # NaN: an unwritten element shows in the difference
            decode_ops.run(problem, tiles)
            diff = float(cupy.abs(out.astype(np.float32) - reference).max())
            result = {"value": tbps(tiles), "maxdiff": diff, "num_splits": decode_ops.plan(problem, tiles),
                      **shape_resources(tiles)}
        except Exception as error:  # noqa: BLE001 - a failing candidate is reported, the sweep goes on
            result = {"value": float("nan"), "error": f"{type(error).__name__}: {str(error)[:200]}"}
        row["shapes"][tiles.label()] = result
        print(f"  sweep {name:22} {tiles.label():15} {result}", flush=True)
    return row


def short_sweep(rng, reps, out: pathlib.Path) -> int:
    """The registered shape and each SWEEP shape, forced, on short contexts whose grids take one or
    two waves of the registered CTAs (32 query / 8 kv heads: 8 CTAs a sequence): what
    ``choose_tiles`` decides between.  Kernel time only: each shape's launches (built once, 8
    input sets rotating past the L2) captured 32 to a CUDA graph, microseconds per launch as the
    median of graph replays between CUDA events (``graph_us``); beside it the shape
    ``num_splits=0`` now takes."""
    per_graph = 32
    rows = []
    stream = cupy.cuda.Stream(non_blocking=True)
    for batch, context in ((64, 128), (64, 256), (48, 192), (64, 512), (64, 1024), (32, 600), (128, 128), (256, 256)):
        sets = make_paged(rng, batch, context, 16, copies=8)
        cupy.cuda.runtime.deviceSynchronize()  # the inputs were filled on the legacy stream; `stream` does not wait for it
        chosen = decode_ops.DecodeLaunch(decode_problem(sets[0])).shape
        row = {"name": f"{batch}x{context} bs16", "ctas": batch * KV_HEADS, "auto": chosen.tiles.label(), "shapes": {}}
        reference = None
        for tiles in (decode_ops.TILES[DIM],) + SWEEP.get(DIM, ()):
            call = ours(sets, 0, tiles)
            with stream:
                for _ in sets:  # eager first: compiles, and sizes any workspace
                    call()
                stream.synchronize()
                got = call.outs[0].astype(np.float32)
            reference = got if reference is None else reference
            graph = captured(call, per_graph, stream)
            us = graph_us(lambda: graph.launch(stream=cupy.cuda.get_current_stream()), reps, per_graph)
            row["shapes"][tiles.label()] = {"us": round(us, 2),
                                            "tb_s": round(kv_bytes(batch, context) / (us * 1e-6) / 1e12, 3),
                                            "maxdiff": float(cupy.abs(got - reference).max()),
                                            "splits": decode_ops.plan(decode_problem(sets[0]), tiles),
                                            **shape_resources(tiles)}
        rows.append(row)
        del sets
        cupy.get_default_memory_pool().free_all_blocks()
    out.write_text(json.dumps(short_report(rows), indent=1))
    print(f"{'case':14} {'CTAs':>5} {'shape':10} {'us':>7} {'TB/s':>6} {'splits':>6} {'CTAs/SM':>7} maxdiff  (num_splits=0 takes)")
    for row in rows:
        for label, r in row["shapes"].items():
            print(f"{row['name']:14} {row['ctas']:5} {label:10} {r['us']:7.2f} {r['tb_s']:6.3f} {r['splits']:6} "
                  f"{r['ctas_per_sm']:7} {r['maxdiff']:.1e}  ({row['auto']})")
    return 0


def short_report(rows: list) -> dict:
    """The short sweep as results cases: per grid the time of the shape ``num_splits=0`` takes (the
    one of its CTA's thread count), both forced shapes as peers, the rows in full beside them."""
    cases = []
    for row in rows:
        shapes, chosen = row["shapes"], row["auto"]
        cases.append({"name": row["name"], "metric": "us per launch (the shape num_splits=0 takes)",
                      "value": shapes[chosen]["us"], "shape": chosen, "ctas": row["ctas"],
                      "peers": {f"{label} forced": r["us"] for label, r in shapes.items()}, "shapes": shapes})
    return {"date": datetime.date.today().isoformat(), "method": " ".join(short_sweep.__doc__.split(".  ")[1].split()),
            "cases": cases}


def fixed_cost_case(rng, reps, batches=(32, 64), contexts=(2048, 4096, 8192, 16384)):
    """Microseconds per call (no split) against tiles per CTA, at one wave (batch 32: 256 CTAs)
    and two (batch 64), with a least-squares line: the slope is the time of a tile, the intercept
    a CTA's fixed cost (start-up, drain, epilogue) per wave.  Contexts start at 32 tiles: below
    that a call is shorter than the host's launch path and the chain times the host."""
    rows = []
    for batch in batches:
        points = []
        for context in contexts:
            sets = make_paged(rng, batch, context, 16)
            ms = median_ms(ours(sets, 1, decode_ops.TILES[DIM]), reps=reps)  # the main shape at both grids
            points.append((context // decode_ops.TILES[DIM].keys, ms * 1e3))
            del sets
            cupy.get_default_memory_pool().free_all_blocks()
        tiles, us = (np.array(v, dtype=float) for v in zip(*points))
        slope, intercept = np.polyfit(tiles, us, 1)
        rows.append({"batch": batch, "points": points, "us_per_tile": round(float(slope), 3),
                     "fixed_us": round(float(intercept), 2)})
        print(f"fixed cost, batch {batch} ({batch * KV_HEADS} CTAs): "
              + ", ".join(f"{t} tiles {u:.1f} us" for t, u in points)
              + f"; fit {slope:.3f} us/tile + {intercept:.2f} us", flush=True)
    return rows


def trace_case(rng, batch, context, block_size=16, calls=8):
    """Where a launch's time goes, from each CTA's start and end on the GPU clock (the last of
    ``calls`` back-to-back calls): the launch's span, the busy fraction of its CTA slots, the
    spread of CTA durations per wave, how long the grid takes to fill and how unevenly it ends."""
    sets = make_paged(rng, batch, context, block_size)
    problem = decode_problem(sets[0], out=cupy.empty_like(sets[0][0]))
    trace = cupy.zeros(decode_ops.trace_size(problem), dtype=np.uint64)
    for _ in range(calls):
        decode_ops.run(problem, trace=trace)
    cupy.cuda.get_current_stream().synchronize()
    start, _, end, sm = (cupy.asnumpy(trace).reshape(-1, decode_ops.TRACE_COLUMNS).astype(np.int64).T)[:4]
    t0 = start.min()
    start, end = (start - t0) / 1e3, (end - t0) / 1e3  # microseconds from the first start
    span = float(end.max())
    slots = decode_ops.slots(cupy.cuda.Device().id, problem.q.dtype, DIM, decode_ops.TILES[DIM], trace=True)
    duration = end - start
    order = np.argsort(start, kind="stable")
    wave = np.empty_like(order)
    wave[order] = np.arange(len(order)) // slots
    last_end = {int(s): float(end[sm == s].max()) for s in np.unique(sm)}
    result = {
        "name": f"{batch}x{context} bs{block_size}", "ctas": int(len(start)), "slots": slots,
        "span_us": round(span, 1),
        "busy_fraction": round(float(duration.sum()) / (span * slots), 4),
        "first_wave_start_us": [round(float(np.sort(start)[i]), 2) for i in (0, min(slots, len(start)) - 1)],
        "duration_us_by_wave": {int(w): [round(float(np.percentile(duration[wave == w], p)), 1) for p in (0, 50, 100)]
                                for w in np.unique(wave)},
        "sm_idle_at_end_us": [round(float(np.percentile([span - e for e in last_end.values()], p)), 1)
                              for p in (0, 50, 90, 100)],
        "tb_per_s_over_span": round(kv_bytes(batch, context) / (span * 1e-6) / 1e12, 3),
    }
    print(f"trace {result['name']}: {result}", flush=True)
    del sets
    cupy.get_default_memory_pool().free_all_blocks()
    return result


def print_sweep(sweep, cases):
    """The sweep's table: TB/s per shape, as a ratio of the registered shape and of cuDNN
    (the peer of the main table's bs16 row of the same batch x context)."""
    def cudnn_of(name):
        wanted = name.split()[0] + " bs16"
        return next((c["peers"].get(CUDNN) for c in cases if c["name"] == wanted), None) or float("nan")

    print(f"\n{'sweep case':20} {'shape':15} {'TB/s':>7} {'x reg.':>7} {'x cuDNN':>8} {'regs':>5} {'local':>6} "
          f"{'smem':>7} {'CTA/SM':>6} maxdiff")
    for row in sweep:
        base = row["shapes"][row["registered"]]["value"]
        cudnn = cudnn_of(row["name"])
        for label, r in row["shapes"].items():
            if "error" in r:
                print(f"{row['name']:20} {label:15} {'failed':>7}  {r['error']}")
                continue
            mark = "*" if label == row["registered"] else " "
            print(f"{row['name']:20} {label + mark:15} {r['value']:7.3f} {r['value'] / base:7.3f} {r['value'] / cudnn:8.3f} "
                  f"{r['registers']:5} {r['local_bytes']:6} {r['smem']:7} {r['ctas_per_sm']:6} {r['maxdiff']:.2e}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "decode.json"))
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--trace", action="store_true",
                        help="then trace each CTA's start and end at 64 x 4096, 256 x 2048 and 1 x 131072 (last)")
    parser.add_argument("--fixed-cost", action="store_true",
                        help="then time calls against tiles per CTA at one and two waves (last)")
    parser.add_argument("--sweep", action="store_true",
                        help="then time the SWEEP shapes against the registered tile shape (last)")
    parser.add_argument("--short-sweep", action="store_true",
                        help="only time the registered and SWEEP shapes on short contexts (grids of one to two waves)"
                             " and write results/decode_short.json")
    args = parser.parse_args(argv)
    reps = 10 if args.quick else 30
    rng = np.random.default_rng(0)
    if args.short_sweep:
        return short_sweep(rng, reps, pathlib.Path(args.out).with_name("decode_short.json"))
    # Bring the clocks up before the first timed case (an idle H200 sits at a low SM clock).
    warm = make_paged(rng, 64, 4096, 16)
    median_ms(ours(warm), warmup=50, reps=50)
    del warm
    cases = []
    shapes = [(64, 4096), (256, 2048), (8, 32768), (1, 131072)]
    for batch, context in shapes:
        for block_size in (16, 32):
            cases.append(bandwidth_case(rng, batch, context, block_size, block_size == 16, reps))
            print(cases[-1], flush=True)
    for block_size in (8, 64, 128, 256):  # the block-size spread at 64 x 4096
        cases.append(bandwidth_case(rng, 64, 4096, block_size, False, reps))
        print(cases[-1], flush=True)
    # Comparison rows, same run: the block table in address order at bs16 and bs256 (both then
    # read exactly the same addresses: if they differ, the kernel depends on the block size; if
    # both are slow, the sorted layout is), other split counts.
    for batch, context, block_size, options in (
            (64, 4096, 16, {"shuffle": False}), (64, 4096, 256, {"shuffle": False}),
            (8, 32768, 16, {"num_splits": 8}), (1, 131072, 16, {"num_splits": 33}), (1, 131072, 16, {"num_splits": 64}),
            (1, 131072, 16, {"num_splits": 128})):
        cases.append(bandwidth_case(rng, batch, context, block_size, False, reps, **options))
        print(cases[-1], flush=True)
    cases.extend(launch_bound_case(rng))
    device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    device = device.decode() if isinstance(device, bytes) else device
    versions = {"cupy": cupy.__version__, "numpy": np.__version__, "cupy_paged": cupy_paged.__version__}
    try:
        import torch

        versions["torch"] = torch.__version__
    except Exception:  # noqa: BLE001
        pass
    report = {"device": device, "date": datetime.date.today().isoformat(), "versions": versions, "cases": cases}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)

    def save():  # after each part, so that a later part's failure loses only that part
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    save()
    print_table(cases)
    if args.sweep:  # last, after the results are written: a failing candidate loses only the sweep
        print(flush=True)
        sweep = []
        for batch, context, block_size, shuffle in (
                (64, 4096, 16, True), (64, 4096, 32, True), (64, 4096, 256, True), (64, 4096, 16, False),
                (256, 2048, 16, True), (8, 32768, 16, True), (1, 131072, 16, True)):
            sweep.append(sweep_case(rng, block_size, shuffle, reps, batch, context))
            cupy.get_default_memory_pool().free_all_blocks()  # the case's 1 GB of K/V
        report["sweep"] = sweep
        save()
        print_sweep(sweep, cases)
    if args.trace:
        report["trace"] = [trace_case(rng, batch, context) for batch, context in ((64, 4096), (256, 2048), (1, 131072))]
        save()
    if args.fixed_cost:
        report["fixed_cost"] = fixed_cost_case(rng, reps)
        save()


def print_table(cases):
    """The table of the run.  A row without peers (bs32, comparison rows) is divided by the peers
    of the first row of its shape (the bs16 row), marked with '*'."""
    width = max(24, *(len(c["name"]) for c in cases))
    print(f"\n{'case':{width}} {'metric':12} {'ours':>7} {'single':>7} "
          + " ".join(f"{p[:10]:>10}" for p in (CUDNN, FA2)) + "  x cuDNN  x FA2")
    shape_peers = {}
    for c in cases:
        shape = c["name"].split()[0]
        if c["peers"]:
            shape_peers.setdefault(shape, c["peers"])
        own = bool(c["peers"])
        peer = [(c["peers"] if own else shape_peers.get(shape, {})).get(p, float("nan")) for p in (CUDNN, FA2)]
        mark = " " if own else "*"
        ratios = "".join(f"{c['value'] / x:7.2f}{mark}" if x == x and c["metric"].startswith("TB") else f"{'':8}"
                         for x in peer)
        shown = peer if own else [float("nan")] * 2
        print(f"{c['name']:{width}} {c['metric']:12} {c['value']:7.3f} {c.get('single_call', float('nan')):7.3f} "
              + " ".join(f"{x:10.3f}" for x in shown) + f"{ratios}  splits={c.get('num_splits', '-')}")


if __name__ == "__main__":
    main()
