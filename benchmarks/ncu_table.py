"""Summarise Nsight Compute's raw CSV (``ncu --csv --page raw --metrics ...``) by kernel: launches,
total and mean ``gpu__time_duration.sum``, DRAM bytes read and the rate, grid and block sizes.

    python benchmarks/ncu_table.py ncu.csv [--json out.json]
"""
from __future__ import annotations

import argparse
import collections
import csv
import json
import pathlib
import sys

TIME, READ = "gpu__time_duration.sum", "dram__bytes_read.sum"
# Times to microseconds, bytes to bytes (device_run.sh asks ncu for base units: ns and byte).
SCALE = {TIME: {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6,
                "second": 1e6},
         READ: {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12, "KB": 1e3, "MB": 1e6,
                "GB": 1e9, "TB": 1e12}}


def rows(path: pathlib.Path) -> tuple[list[dict], dict]:
    """The kernel rows of the CSV (after ncu's own ``==PROF==`` lines) and the units row."""
    lines = [line for line in path.read_text().splitlines() if line.startswith('"')]
    table = list(csv.DictReader(lines))
    if not table:
        raise SystemExit(f"{path}: no kernel rows (did the profiled range launch anything?)")
    units, kernels = table[0], table[1:]
    return kernels, units


def number(row: dict, units: dict, name: str) -> float:
    text = row.get(name, "").replace(",", "")
    if text in ("", "n/a"):
        return float("nan")
    unit = units.get(name, "")
    if unit not in SCALE[name]:
        raise SystemExit(f"unknown unit {unit!r} of {name}")
    return float(text) * SCALE[name][unit]


def summarise(kernels: list[dict], units: dict) -> list[dict]:
    groups = collections.OrderedDict()
    for row in kernels:
        key = (row["Kernel Name"], row.get("Grid Size", ""), row.get("Block Size", ""))
        group = groups.setdefault(key, dict(kernel=key[0][:60], grid=key[1], block=key[2], launches=0,
                                            total_us=0.0, read_mb=0.0))
        group["launches"] += 1
        group["total_us"] += number(row, units, TIME)
        group["read_mb"] += number(row, units, READ) / 1e6
    for group in groups.values():
        group["mean_us"] = group["total_us"] / group["launches"]
        group["read_tbs"] = group["read_mb"] / group["total_us"] if group["total_us"] else 0.0
    return sorted(groups.values(), key=lambda g: -g["total_us"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", type=pathlib.Path)
    p.add_argument("--json", type=pathlib.Path)
    args = p.parse_args(argv)
    kernels, units = rows(args.csv)
    table = summarise(kernels, units)
    total = sum(g["total_us"] for g in table)
    print(f"{len(kernels)} kernels, {total:.1f} us in all (each alone, as ncu serialises them)")
    print(f"{'kernel':<60} {'grid':>14} {'block':>12} {'n':>4} {'total us':>9} {'mean us':>8} {'MB read':>8} {'TB/s':>5}")
    for g in table:
        print(f"{g['kernel']:<60} {g['grid']:>14} {g['block']:>12} {g['launches']:>4} {g['total_us']:>9.1f} "
              f"{g['mean_us']:>8.2f} {g['read_mb']:>8.2f} {g['read_tbs']:>5.2f}")
    if args.json:
        args.json.write_text(json.dumps(dict(kernels=len(kernels), total_us=total, table=table), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
