"""Does the host run slower right after it waited for the GPU, and does the way it waited matter?

``bench_calls`` and ``bench_mixed`` time one eager call after a synchronisation, and the host time
of the same call is two to four times longer there than with the GPU busy (NOTES_calls.md), for
the peers as for ours.  This times a fixed piece of Python with no GPU work in it (building a
30-entry tuple key and looking it up, the shape of a call's memo lookup, 40 times) right after the
host waited for a spinning kernel of a given length, waiting two ways:

* ``synchronize``: ``stream.synchronize()`` (cudaStreamSynchronize, the driver's own wait, as the
  benchmarks do);
* ``poll``: a Python loop on ``event.done`` until the kernel is done (the thread never blocks).

and, as the baseline, the same piece with no wait before it.  Medians of ``--reps`` samples, us.

    python benchmarks/exp_cold_host.py [--reps 200] [--out benchmarks/results/cold_host.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import bench_calls  # noqa: E402  (the spinning kernel, versions, device name)

WAITS_US = (0, 20, 100, 500, 2000)
RESULTS = HERE / "results" / "cold_host.json"


def workload(memo: dict, values: tuple) -> int:
    """About a memoised call's host work without its launch: keys built from values and looked up."""
    found = 0
    for i in range(40):
        key = ("decode", values, i & 3, *values[:24], None, None, True, False)
        found += memo.get(key, 0)
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    import cupy

    stream = cupy.cuda.get_current_stream()
    values = tuple(range(30))
    memo = {("decode", values, i, *values[:24], None, None, True, False): 1 for i in range(4)}
    bench_calls.busy(stream.ptr, 0.001)
    stream.synchronize()
    rows = []
    for wait_us in WAITS_US:
        for mode in ("synchronize", "poll") if wait_us else ("none",):
            samples = []
            for _ in range(args.reps):
                if wait_us:
                    done = cupy.cuda.Event()
                    bench_calls.busy(stream.ptr, wait_us * 1e-6)
                    done.record(stream)
                    if mode == "synchronize":
                        stream.synchronize()
                    else:
                        while not done.done:
                            pass
                t0 = time.perf_counter()
                workload(memo, values)
                samples.append((time.perf_counter() - t0) * 1e6)
            rows.append({"wait_us": wait_us, "mode": mode, "median_us": round(float(np.median(samples)), 2),
                         "p90_us": round(float(np.percentile(samples, 90)), 2)})
            print(f"  wait {wait_us:5d} us  {mode:<11}  workload {rows[-1]['median_us']:7.2f} us "
                  f"(p90 {rows[-1]['p90_us']:7.2f})", flush=True)
    report = {"device": bench_calls.device_name(), "date": datetime.date.today().isoformat(),
              "versions": bench_calls.versions(), "reps": args.reps, "rows": rows}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print("\n| wait before (us) | how | workload us, median | p90 |\n| ---: | --- | ---: | ---: |")
    for r in rows:
        print(f"| {r['wait_us']} | {r['mode']} | {r['median_us']} | {r['p90_us']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
