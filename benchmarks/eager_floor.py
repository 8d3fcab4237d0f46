"""What one eager call of no work costs on the GPU clock: the floor under every "one eager call" figure.

``bench_calls.time_calls`` times a call as a user makes it: a CUDA event, the call, an event, with
the GPU idle at the start.  The time between the events is then the host's path up to the launch,
the launch's latency, and the kernel.  This script times calls that do no work the same way, in
the same process, so the fixed part of an eager figure on this host can be read off:

* ``cupy empty``: an empty kernel (one CTA of 32 threads) through ``cupy.RawKernel``;
* ``launcher empty``: the same kernel through the package's ``Launcher`` (one packed buffer and
  ``cuLaunchKernel``: what a resolved call's launch costs);
* ``torch add_``: ``add_(1)`` on a one-element CUDA tensor (the cheapest torch op with a kernel);
* ``torch empty_like + add_``: that op on a new tensor like a decode call's q (64 x 32 x 128 bf16),
  the output allocation every default call makes.

Writes ``benchmarks/results/eager_floor.json`` (``bench_calls``' rows: the GPU-clock time of one
eager call as ``value``, host time beside it, the other calls as peers) and prints its table.

    python benchmarks/eager_floor.py [--reps 200] [--out PATH]
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import bench_calls  # noqa: E402  (time_calls, versions)

RESULTS = HERE / "results" / "eager_floor.json"
_EMPTY = r'extern "C" __global__ void empty(int x) { if (x == 12345) asm volatile("trap;"); }'


def calls() -> dict:
    import cupy
    import numpy as np
    import torch

    from cupy_paged.kernels._launch import Launcher

    kernel = cupy.RawKernel(_EMPTY, "empty")
    launcher = Launcher(kernel, "i")
    one = torch.zeros(1, device="cuda")
    like = torch.zeros(64, 32, 128, device="cuda", dtype=torch.bfloat16)
    stream = lambda: cupy.cuda.get_current_stream().ptr  # noqa: E731

    def torch_new():
        torch.empty_like(like).add_(1)

    return {"cupy empty": lambda: kernel((1,), (32,), (np.int32(0),)),
            "launcher empty": lambda: launcher((1, 1, 1), 32, 0, stream(), 0),
            "torch add_": lambda: one.add_(1),
            "torch empty_like + add_": torch_new}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args(argv)
    timings = bench_calls.time_calls(calls(), args.reps, shuffle=True)
    rows = [bench_calls.make_row("eager floor", name, timings, None, bench_calls.Target()) for name in timings]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(device=bench_calls.device_name(),
                                        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                                        versions=bench_calls.versions(), cases=rows), indent=1) + "\n")
    bench_calls.print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
