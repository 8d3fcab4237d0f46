"""The short table of a device call's A/B (call_sNN_K.sh): trace_phases.py's kernel times and phases per
side and round, bench_calls' eager ratios and bench_mixed's ragged cases per side.

    python benchmarks/ab_summary.py DIR SIDE[,SIDE...] [--rounds N]

``DIR`` holds ``<side><round>/trace_phases.json``, ``calls_<side>.json`` and ``mixed_<side>.json``
(whichever exist); the first side is the base of the comparison.
"""
from __future__ import annotations

import argparse
import json
import pathlib


def load(path: pathlib.Path):
    try:
        return json.loads(path.read_text())
    except OSError:
        return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=pathlib.Path)
    parser.add_argument("sides")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    sides = args.sides.split(",")
    runs = [f"{side}{r}" for r in range(1, args.rounds + 1) for side in sides]
    rows = {}
    for run in runs:
        report = load(args.dir / run / "trace_phases.json")
        for case in report["cases"] if report else ():
            rows.setdefault((case["name"], case["shape"]), {})[run] = case
    first = [f"{side}1" for side in sides]
    print(f"| grid | shape | kernel us {' / '.join(runs)} | cuDNN | epilogue {' / '.join(sides)} | "
          f"tile 0 landed p0,p50 {' / '.join(sides)} |")
    print("| --- | --- | --- | ---: | --- | --- |")
    for (name, shape), r in rows.items():
        kernel = " / ".join(f"{r[s]['kernel_us']:.2f}" if s in r else "-" for s in runs)
        cudnn = next((r[s]["cudnn_graph_us"] for s in runs if s in r), None)
        epilogue = " / ".join(f"{r[s]['epilogue']:.2f}" if s in r else "-" for s in first)
        tile0 = " / ".join(f"{r[s]['tile0'][0]:.2f},{r[s]['tile0'][1]:.2f}" if s in r else "-" for s in first)
        print(f"| {name} | {shape} | {kernel} | {cudnn} | {epilogue} | {tile0} |")
    for side in sides:
        calls = load(args.dir / f"calls_{side}.json")
        for c in calls["cases"] if calls else ():
            if "ratio" in c:
                print(side, c["name"], "us", c["value"], "vs", c["vs"], c["peers"].get(c["vs"]), "ratio", c["ratio"],
                      "host", c["host_us"], "b2b", c["back_to_back_us"])
        mixed = load(args.dir / f"mixed_{side}.json")
        for c in mixed["cases"] if mixed else ():
            print(side, c["name"], "eager", c["value"], "floor", c["floor"], "b2b", c["back_to_back_us"].get("ours"),
                  "kvcache b2b", c["back_to_back_us"].get("split"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
