"""The short table of a ragged-launch A/B (call_s30_1.sh): per side and round, trace_list.py's
back-to-back launches (host list, device list) and bench_mixed's ragged cases (eager, back to back).

    python benchmarks/ab_ragged.py DIR SIDE[,SIDE...]

``DIR`` holds ``trace_list_<side><round>.json`` and ``mixed_<side><round>.json`` (whichever exist).
"""
from __future__ import annotations

import argparse
import json
import pathlib


def load(path: pathlib.Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=pathlib.Path)
    parser.add_argument("sides")
    args = parser.parse_args(argv)
    sides = args.sides.split(",")
    runs = [f"{side}{r}" for r in (1, 2) for side in sides
            if (args.dir / f"trace_list_{side}{r}.json").exists() or (args.dir / f"mixed_{side}{r}.json").exists()]
    rows: dict = {}
    for run in runs:
        report = load(args.dir / f"trace_list_{run}.json")
        for case in report["cases"] if report else ():
            for launch in ("host_list", "device_list"):
                if launch in case:
                    rows.setdefault((case["name"], launch + " b2b"), {})[run] = case[launch]["b2b_us"]
        report = load(args.dir / f"mixed_{run}.json")
        for case in report["cases"] if report else ():
            rows.setdefault((case["name"], "plan eager"), {})[run] = round(case["value"] * 1e3, 2)
            rows.setdefault((case["name"], "plan b2b"), {})[run] = case["back_to_back_us"]["ours"]
    print(f"| case | what (us) | {' | '.join(runs)} |")
    print("| --- | --- |" + " ---: |" * len(runs))
    for (name, what), values in rows.items():
        print(f"| {name} | {what} | " + " | ".join(str(values.get(run, "")) for run in runs) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
