"""Where a device-listed ragged launch's time goes, CTA by CTA, beside the same work listed on the host.

``flash_attn_with_kvcache``'s default over a paged cache is one ragged launch whose work list the
launch builds itself (kernels/ragged.py ``DeviceListLaunch``): the CTA that takes ticket 0 lists
the items while the others wait.  Back to back it has run 10-27 us behind the decode kernel on
uniform batches, while the step plan's ragged launch with a host-built list of the same rule runs
within 2 us of it (RESULTS.md, twelfth session).  This benchmark records, for one launch of each,
every CTA's start, the moment it knows its work item, its end, its SM and its number (the TRACE
specialization of ``paged_decode``), and summarises: how long the builder took, how long the
first CTAs waited, when the first real work began, the real CTAs' durations, the padding CTAs,
and where the last real CTA ended.  Beside it, CUDA-event medians of the untraced launches back to
back: the device list, the host list, the decode kernel (``num_splits=1``) and the public call.

The host list here is the plan's rule (runtime/_work.py) over the call's lengths as cached keys
and one query token a sequence (the rule then counts one key more a sequence than the device
list does: the same split counts away from a range boundary).

Writes ``benchmarks/results/trace_list.json`` and prints a table last.

    python benchmarks/trace_list.py [--cases 64x4096,256x2048,lognormal64,1x32k+63x512] [--calls 8]
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

import cupy  # noqa: E402

import bench_decode  # noqa: E402  (random paged sets, CUDA-event medians)
from bench_mixed import lognormal_contexts  # noqa: E402  (the same long-tailed contexts)
from cupy_paged._core.arrays import CUPY, read  # noqa: E402
from cupy_paged.kernels import decode as decode_ops  # noqa: E402
from cupy_paged.kernels import ragged  # noqa: E402
from cupy_paged.runtime._work import fill_work, plan_work  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK = bench_decode.HEADS, bench_decode.KV_HEADS, bench_decode.DIM, 16
RESULTS = HERE / "results" / "trace_list.json"


CASES = {
    "64x4096": [4096] * 64,
    "32x2048": [2048] * 32,  # level, one wave: nothing splits
    "256x2048": [2048] * 256,
    "lognormal64": lognormal_contexts(),
    "1x32k+63x512": [32768] + [512] * 63,
    # ragged batches of 256 sequences (four waves of the decode kernel's CTAs, as issue 11's
    # 256 x 2048), where the hardware's scheduling of many waves might balance well enough, and of
    # 128 (two waves: the control, still balanced by default)
    "lognormal128@4k": [int(n) for n in np.clip(np.random.default_rng(11).lognormal(6.5, 1.0, 128), 16, 4096)],
    "lognormal256@2k": [int(n) for n in np.clip(np.random.default_rng(12).lognormal(6.5, 1.0, 256), 16, 2048)],
    "1x2048+255x128": [2048] + [128] * 255,
    "255x128+1x2048": [128] * 255 + [2048],
    # short items only (16 waves of 512-key CTAs): where each CTA's fixed start weighs most
    "512x512": [512] * 512,
    # the same with one key more or less: a last tile of one key, or of 63 (what an extra loop turn costs)
    "512x513": [513] * 512,
    "512x511": [511] * 512,
}


class Case:
    """One batch of lengths over a shuffled paged cache, and the three launches of its work."""

    def __init__(self, rng, lengths):
        self.lengths = np.asarray(lengths, np.int64)
        batch = len(lengths)
        q, k, v, table, _ = bench_decode.make_paged(rng, batch, int(self.lengths.max()), BLOCK)[0]
        self.lens = cupy.asarray(self.lengths.astype(np.int32))
        self.set = (q, k, v, table, self.lens)
        self.out = cupy.empty_like(q)
        self.stream = cupy.cuda.get_current_stream().ptr
        self.q3 = q.reshape(batch, HEADS, DIM)
        self.ptrs = (q.data.ptr, k.data.ptr, v.data.ptr, 0, 0, table.data.ptr, 0)
        self.max_blocks = int(table.shape[1])
        self.batch = batch

    def ragged_launch(self, trace=None):
        q3, k = read(self.q3, "q"), read(self.set[1], "k_cache")
        return ragged.RaggedLaunch.from_arrays(q3, k, None, None, self.max_blocks, DIM ** -0.5, trace=trace)

    def device_list(self, trace=None):
        """(launch, grid CTAs): the device-listed launch as BalancedDecodeLaunch makes it."""
        listed = ragged.DeviceListLaunch(self.ragged_launch(trace), self.batch, -(-(HEADS // KV_HEADS) // ragged.ROWS),
                                         1, self.max_blocks * BLOCK)

        def run():
            listed.run(self.ptrs, (self.lens.data.ptr, 0, 0), 1, self.out.data.ptr, 0, self.stream)
        return run, listed.max_items * KV_HEADS, listed

    def host_list(self, trace=None):
        """(launch, grid CTAs): the plan's rule over the lengths, listed here and uploaded once."""
        launch = self.ragged_launch(trace)
        per_head = ragged.slots_per_head(launch.device, launch.dtype, DIM, KV_HEADS)
        max_items, max_slots = ragged.list_capacities(self.batch, 1, per_head)
        query = np.ones(self.batch, np.int64)
        tile = ragged.tile_keys(DIM)
        outline = plan_work(query, self.lengths, HEADS // KV_HEADS, tile, per_head, max_items, max_slots)
        row_groups, splits, items, slots = outline
        work = np.zeros((items, ragged.WORK_INTS), np.int32)
        fill_work(query, self.lengths, HEADS // KV_HEADS, tile, row_groups, splits, items, work)
        work_gpu = cupy.asarray(work)

        def run():
            launch.run(self.ptrs[:7], (work_gpu.data.ptr, items, slots), self.out.data.ptr, 0, self.stream)
        run.keep = work_gpu
        return run, items * KV_HEADS, None

    def decode_kernel(self, trace=None):
        """(launch, grid CTAs): the decode kernel, one split (the kernel the balanced call is timed against)."""
        p = bench_decode.decode_problem(self.set, num_splits=1, out=self.out)
        launch = decode_ops.DecodeLaunch(p, None, trace)
        args = decode_ops.problem_args(p)

        def run():
            launch.run(CUPY, p.q.obj, *args, self.stream)
        return run, decode_ops.trace_size(p) // decode_ops.TRACE_COLUMNS, None


def listed_items(listed) -> int:
    """Items of the list a DeviceListLaunch built last (rows of query length > 0)."""
    work_ptr, _ = next(iter(listed._work_ptrs.values()))
    mem = cupy.cuda.UnownedMemory(work_ptr, listed.ints * 4, owner=None)
    rows = cupy.ndarray((listed.max_items, ragged.WORK_INTS), np.int32, cupy.cuda.MemoryPointer(mem, 0))
    return int((rows[:, 5] > 0).sum())


# The device list builder's stamps (decode.cu build_stamp), after the five columns of every row.
BUILD_PHASES = ("ticket", "staged", "first pass", "rounds", "buckets", "stored", "released")


def summarise(rows: np.ndarray, real_items: int) -> dict:
    """The trace of one launch (rows: start, ready, end, SM, number, the builder's stamps, the phases; ns)
    in microseconds from its first start; ``build_phases_us``: from ticket 0's start to each of its
    stamps (None where no CTA built a list)."""
    rows = rows.astype(np.int64)
    start, ready, end, _, number = rows[:, :5].T
    t0 = start.min()
    start, ready, end = (start - t0) / 1e3, (ready - t0) / 1e3, (end - t0) / 1e3
    has_phases = rows.shape[1] > max(decode_ops.TRACE_PHASES)
    tile0, drained = ((rows[:, c] - t0) / 1e3 for c in decode_ops.TRACE_PHASES[:2]) if has_phases else (None, None)
    real = number // KV_HEADS < real_items
    pad = ~real
    first = number == 0
    waited = ready - start
    stamps = rows[first, 5:5 + len(BUILD_PHASES)] if first.any() and rows.shape[1] > 5 else None
    built = stamps is not None and stamps.size and (stamps[0] > 0).all()
    phases = ({name: round(float(at - t0) / 1e3 - float(start[first][0]), 2)
               for name, at in zip(BUILD_PHASES, stamps[0])} if built else None)
    pct = (lambda a, p: round(float(np.percentile(a, p)), 2) if a.size else None)
    return {
        "ctas": int(len(start)), "real_ctas": int(real.sum()), "padding_ctas": int(pad.sum()),
        "span_us": round(float(end.max()), 2),
        "last_real_end_us": round(float(end[real].max()), 2),
        "ticket0_ready_us": round(float(waited[first][0]), 2) if first.any() else None,
        "first_real_ready_us": round(float(ready[real].min()), 2),
        "wait_us_p50_p100": [pct(waited[real], 50), pct(waited[real], 100)],
        "real_duration_us_p10_p50_p90": [pct((end - ready)[real], p) for p in (10, 50, 90)],
        "padding_duration_us_p50_p100": [pct((end - start)[pad], 50), pct((end - start)[pad], 100)],
        "padding_last_end_us": round(float(end[pad].max()), 2) if pad.any() else None,
        "busy_real_slot_us": round(float((end - ready)[real].sum()), 1),
        "build_phases_us": phases,
        # Each real CTA's own phases (decode.cu trace_phase): its work known -> its first tile landed,
        # and its K/V loop drained -> its end (the store, and a ragged split's merge).
        "tile0_after_ready_us_p10_p50_p90": [pct((tile0 - ready)[real], p) for p in (10, 50, 90)] if has_phases else None,
        "epilogue_us_p50_p90": [pct((end - drained)[real], p) for p in (50, 90)] if has_phases else None,
    }


def trace_one(make, calls: int, out) -> tuple[dict, float, object]:
    """The trace of the last of ``calls`` traced launches, the untraced launch's back-to-back median
    (us), a copy of the traced launch's output ``out`` and its raw trace rows."""
    run, ctas, _ = make(None)
    b2b = bench_decode.median_ms(run, reps=30) * 1e3
    trace = cupy.zeros(ctas * decode_ops.TRACE_COLUMNS, np.uint64)
    run, _, listed = make(trace)
    for _ in range(calls):
        run()
    cupy.cuda.get_current_stream().synchronize()
    rows = cupy.asnumpy(trace).reshape(-1, decode_ops.TRACE_COLUMNS)
    real_items = listed_items(listed) if listed is not None else ctas // KV_HEADS
    return summarise(rows, real_items), b2b, out.copy(), rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--calls", type=int, default=8, help="traced launches of each; the last one is read")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS,
                        help="the JSON; the raw trace rows go beside it (.npz, one array a case and launch)")
    args = parser.parse_args(argv)
    import cupy_paged

    rng = np.random.default_rng(0)
    device = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    report = {"date": datetime.date.today().isoformat(), "device": device, "cupy": cupy.__version__, "cases": []}
    table, raw = [], {}
    for name in args.cases.split(","):
        case = Case(rng, CASES[name])
        public = bench_decode.ours([case.set])
        row = {"name": name, "public_b2b_us": round(bench_decode.median_ms(public, reps=30) * 1e3, 2)}
        outs = {}
        for label, make in (("decode_kernel", case.decode_kernel), ("device_list", case.device_list),
                            ("host_list", case.host_list)):
            summary, b2b, outs[label], raw[f"{name}/{label}"] = trace_one(make, args.calls, case.out)
            # The three launches compute the same attention: their outputs agree to bf16 rounding.
            diff = float(cupy.abs(outs[label].astype(np.float32) - outs["decode_kernel"].astype(np.float32)).max())
            row[label] = {"b2b_us": round(b2b, 2), "max_abs_diff_vs_decode_kernel": diff, **summary}
            print(f"{name} {label}: {row[label]}", flush=True)
        report["cases"].append(row)
        table.append(row)
        del case
        cupy.get_default_memory_pool().free_all_blocks()
    cupy_paged.check_errors()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    np.savez_compressed(args.out.with_suffix(".npz"), **raw)
    print("\n| case | path | b2b us | span us | ticket 0 ready | first real ready | wait p50/max | real dur p50 "
          "| last real end | padding CTAs / last end |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- |")
    for row in table:
        print(f"| {row['name']} | public call | {row['public_b2b_us']} | | | | | | | |")
        for label in ("device_list", "host_list", "decode_kernel"):
            r = row[label]
            print(f"| | {label} | {r['b2b_us']} | {r['span_us']} | {r['ticket0_ready_us']} "
                  f"| {r['first_real_ready_us']} "
                  f"| {r['wait_us_p50_p100']} | {r['real_duration_us_p10_p50_p90'][1]} | {r['last_real_end_us']} "
                  f"| {r['padding_ctas']} / {r['padding_last_end_us']} |")
    print("\n| case | " + " | ".join(BUILD_PHASES) + " |  (device list builder: us from its start to each stamp)")
    print("| --- |" + " ---: |" * len(BUILD_PHASES))
    for row in table:
        phases = row["device_list"]["build_phases_us"] or {}
        print(f"| {row['name']} | " + " | ".join(str(phases.get(name)) for name in BUILD_PHASES) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
