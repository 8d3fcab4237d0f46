"""Where a prefill CTA's time goes: the warp-specialized varlen kernel's TRACE specialization,
one launch per causal batch, every CTA's phases on the GPU's nanosecond clock.

A fit of the sweep's figures puts about 7-10 us of each CTA's time outside its key tiles, and
persistent CTAs that overlapped the launch and the Q load did not remove it (NOTES_varlen.md,
v10).  This records, per CTA (kernels/varlen_wgmma.py TRACE_COLUMNS): its entry, its task known,
Q's copies issued, every copy issued (the producer), Q landed, the first S, the last tile's
softmax done, the last P V done and the output stored (consumer warpgroup 0), warpgroup 1's
output stored, its key tiles and its SM; and summarises the medians of each phase, the time a
tile takes in the loop, what a CTA spends beside its tiles, and the gap on an SM between one CTA's
end and the next one's entry.  Beside it, CUDA-event medians of the untraced launch.

Writes ``benchmarks/results/trace_varlen.json`` and prints a table last.

    python benchmarks/trace_varlen.py [--lens 1024x16 2048x8 4096x8]
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

import bench_varlen  # noqa: E402  (random causal batches, CUDA-event timing)
from cupy_paged._core.compiler import get_function  # noqa: E402
from cupy_paged._core.types import BF16  # noqa: E402
from cupy_paged.kernels import varlen as varlen_ops  # noqa: E402
from cupy_paged.kernels import varlen_wgmma  # noqa: E402
from cupy_paged.kernels._launch import Launcher  # noqa: E402

RESULTS = HERE / "results" / "trace_varlen.json"
COLUMNS = {name: i for i, name in enumerate(varlen_wgmma.TRACE_COLUMNS)}


# The cp.async shapes only: a trace launch passes no tensor maps (the TMA shapes registered since v16b
# are not traced).
SHAPES = {"cp.async (registered before v16b)": varlen_wgmma.WGMMA_TILES[128],
          "v12 candidate (softmax under P V)": varlen_wgmma.WgmmaTiles(128, 2, producer=True, staged_store=True,
                                                                       pv_overlap=True)}


def traced_launch(batch, tiles):
    """The D = 128 launch of ``batch`` (causal) on ``tiles``, its kernel swapped for the TRACE one;
    returns (call, trace buffer)."""
    import cupy
    from cupy_paged.api.varlen import prepare_varlen

    p = prepare_varlen(batch.q, batch.k, batch.v, batch.cu_q, batch.cu_k, batch.max_q, batch.max_k,
                       None, True, (-1, -1), 0.0, None, None, False, batch.out, False)
    launch = varlen_ops.VarlenLaunch(p, tiles)
    ctas = -(-batch.max_q // tiles.block_m) * launch.heads * launch.batch
    trace = cupy.zeros(ctas * varlen_wgmma.TRACE_ROW, np.uint64)
    function = get_function(varlen_wgmma.kernel_key(BF16, 128, tiles, trace=True), varlen_ops.WGMMA_KERNEL,
                            launch.smem)
    launch.launch = Launcher(function, varlen_ops._LAYOUT + "P")
    launch.launch.pack(*launch._packed(), int(trace.data.ptr))
    ptrs, max_q, out, lse = varlen_ops.problem_args(p)
    return (lambda: launch.run("cupy", None, ptrs, max_q, out, lse, cupy.cuda.get_current_stream().ptr)), trace


def summarise(rows: np.ndarray) -> dict:
    """Medians (us) of each phase over the CTAs that had a task, the loop's time a tile, each
    CTA's time beside its tiles, and the gap between consecutive CTAs on an SM."""
    c = COLUMNS
    rows = rows[rows[:, c["task_known"]] > 0].astype(np.int64)
    us = lambda a, b: (rows[:, c[b]] - rows[:, c[a]]) / 1e3  # noqa: E731
    tiles = rows[:, c["tiles"]]
    end = np.maximum(rows[:, c["stored"]], rows[:, c["stored_group1"]])
    total = (end - rows[:, c["entry"]]) / 1e3
    loop = us("first_s", "last_softmax")
    many = tiles > 1
    per_tile = float(np.median(loop[many] / (tiles[many] - 1))) if many.any() else float("nan")
    gaps = []
    for sm in np.unique(rows[:, c["sm"]]):
        mine = rows[rows[:, c["sm"]] == sm]
        mine = mine[np.argsort(mine[:, c["entry"]])]
        ends = np.maximum(mine[:, c["stored"]], mine[:, c["stored_group1"]])
        gaps.extend((mine[1:, c["entry"]] - ends[:-1]) / 1e3)
    median = lambda x: round(float(np.median(x)), 3)  # noqa: E731
    return dict(ctas=int(len(rows)), mean_tiles=round(float(tiles.mean()), 2), cta_us=median(total),
                entry_to_task=median(us("entry", "task_known")),
                task_to_q_issued=median(us("task_known", "q_issued")),
                q_issued_to_landed=median(us("q_issued", "q_landed")),
                q_landed_to_first_s=median(us("q_landed", "first_s")),
                loop_per_tile=round(per_tile, 3), last_pv=median(us("last_softmax", "last_pv")),
                store=median(us("last_pv", "stored")), group1_after_group0=median(us("stored", "stored_group1")),
                beside_tiles=median(total - tiles * per_tile), sm_gap=median(gaps) if gaps else float("nan"))


def trace_case(batch, tiles) -> dict:
    """The untraced launch's CUDA-event median, whether the traced one writes the same output (over
    an output of NaNs), and the trace's summary."""
    import cupy

    plain = batch.ours(tiles)
    plain_ms = bench_varlen.time_ms(plain, 10)
    call, trace = traced_launch(batch, tiles)
    batch.out.view(np.uint16).fill(0x7FC0)  # NaN: a row the traced kernel does not write shows
    call()
    cupy.cuda.Device().synchronize()
    traced_out = batch.out.copy()
    plain()
    cupy.cuda.Device().synchronize()
    same = bool((traced_out == batch.out).all())
    trace.fill(0)
    call()
    cupy.cuda.Device().synchronize()
    rows = cupy.asnumpy(trace).reshape(-1, varlen_wgmma.TRACE_ROW)
    return dict(untraced_ms=round(plain_ms, 4), same_output=same, **summarise(rows))


def main() -> None:
    import cupy

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lens", nargs="+", default=["1024x16", "2048x8", "4096x8"],
                        help="causal batches as LENGTHxCOUNT")
    args = parser.parse_args()
    cases = []
    for spec in args.lens:
        length, count = map(int, spec.split("x"))
        batch = bench_varlen.Batch([length] * count, [length] * count, 128)
        for shape, tiles in SHAPES.items():
            cases.append(dict(name=f"causal_{spec} {shape}", **trace_case(batch, tiles)))
            print(spec, cases[-1], flush=True)
    RESULTS.write_text(json.dumps(dict(date=str(datetime.date.today()), device=cupy.cuda.runtime.getDeviceProperties(0)
                                       ["name"].decode(), cases=cases), indent=2) + "\n")
    keys = [k for k in cases[0] if k != "name"]
    print("\n| case | " + " | ".join(keys) + " |\n|" + " --- |" * (len(keys) + 1))
    for case in cases:
        print(f"| {case['name']} | " + " | ".join(str(case[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()
