"""The persistent ragged kernel (decode.cu ``PERSIST``) against one CTA per item, same host list.

For each batch of decode lengths, the step plan's rule lists the work on the host (as
``trace_list.py`` does) and the same list is launched by both kernels in alternation:
``kernels.ragged.PERSISTENT`` False (one CTA per item and kv head) and True (one wave of CTAs, each
taking every P-th item and loading the next item's Q, block ids and first tiles during the current
one).  Back-to-back CUDA-event medians (``bench_decode.median_ms``), the outputs compared (the same
arithmetic per item: equal bit for bit), and with ``--cap`` a third launch whose grid holds that
many CTAs a kv head (each CTA takes many items).  Floors at ``--ceiling`` TB/s (the card's read
ceiling: 4.44 on an H200, about 3.2 on an H100).

    python benchmarks/ab_persistent.py [--cases 512x512,1x32k+63x512,...] [--rounds 2] [--out F]
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

import bench_decode  # noqa: E402
import trace_list  # noqa: E402
from cupy_paged.kernels import ragged  # noqa: E402

CASES = ("512x512", "512x511", "1x2048+255x128", "1x32k+63x512", "lognormal64", "64x4096", "256x2048")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cap", type=int, default=0, help="also time a grid of this many CTAs a kv head")
    parser.add_argument("--ceiling", type=float, default=None, help="TB/s; default by the card's name")
    parser.add_argument("--out", type=pathlib.Path, default=HERE / "results" / "ab_persistent.json")
    args = parser.parse_args(argv)
    import cupy_paged

    device = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    ceiling = args.ceiling or (4.44 if "H200" in device else 3.2)
    rng = np.random.default_rng(0)
    rows = []
    sides = [("per_item", False, None), ("persistent", True, None)]
    if args.cap:
        sides.append((f"persistent_cap{args.cap}", True, args.cap))
    for name in args.cases.split(","):
        case = trace_list.Case(rng, trace_list.CASES[name])
        run, _, _ = case.host_list()
        times = {label: [] for label, _, _ in sides}
        outs = {}
        for _ in range(args.rounds):
            for label, persistent, cap in sides:
                ragged.PERSISTENT, ragged.PERSISTENT_GRID_CAP = persistent, cap
                case.out.fill(float("nan"))
                run()
                cupy.cuda.get_current_stream().synchronize()
                outs[label] = case.out.copy()
                times[label].append(bench_decode.median_ms(run, reps=30) * 1e3)
        ragged.PERSISTENT, ragged.PERSISTENT_GRID_CAP = False, None
        kv_bytes = int(case.lengths.sum()) * trace_list.KV_HEADS * trace_list.DIM * 2 * 2
        floor = kv_bytes / (ceiling * 1e12) * 1e6
        row = {"name": name, "floor_us": round(floor, 2), "ctas_per_item": int(case.batch)}
        for label, _, _ in sides:
            best = min(times[label])
            row[label] = {"b2b_us": [round(t, 2) for t in times[label]], "fraction_of_ceiling": round(floor / best, 3),
                          "nan": bool(cupy.isnan(outs[label]).any()),
                          "max_abs_diff_vs_per_item": float(cupy.abs(outs[label].astype(np.float32)
                                                                     - outs["per_item"].astype(np.float32)).max())}
        rows.append(row)
        print(name, json.dumps(row), flush=True)
        del case, run
        cupy.get_default_memory_pool().free_all_blocks()
    cupy_paged.check_errors()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": datetime.date.today().isoformat(), "device": device, "cupy": cupy.__version__,
                                    "ceiling_tb_s": ceiling, "cases": rows}, indent=1))
    labels = [label for label, _, _ in sides]
    print(f"\n| case | floor us | " + " | ".join(f"{label} us (of ceiling)" for label in labels) + " | persistent / per item | diff |")
    print("| --- | ---: |" + " ---: |" * len(labels) + " ---: | --- |")
    for row in rows:
        cells = [f"{min(row[label]['b2b_us']):.2f} ({row[label]['fraction_of_ceiling']})" for label in labels]
        ratio = min(row["persistent"]["b2b_us"]) / min(row["per_item"]["b2b_us"])
        diffs = ", ".join(f"{row[label]['max_abs_diff_vs_per_item']:g}{' NaN' if row[label]['nan'] else ''}"
                          for label in labels[1:])
        print(f"| {row['name']} | {row['floor_us']} | " + " | ".join(cells) + f" | {ratio:.3f} | {diffs} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
