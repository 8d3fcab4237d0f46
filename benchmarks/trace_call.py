"""Where, inside one eager call, the GPU work starts: a torch.profiler (CUPTI) trace of single calls.

``bench_calls.py`` times one eager call between CUDA events: the host's path to the launch, the
launch's latency and the kernel are all inside that figure.  This splits it.  Each call runs
``--reps`` times on an idle GPU, each reading its own copy of the K/V (as in ``bench_calls.py``),
inside a ``record_function`` range; from the profiler's trace, per call (medians, microseconds, from the
start of the call's range on the host clock, which CUPTI aligns with the GPU's):

* ``launch api``: when the call's first launch API (``cuLaunchKernel`` / ``cudaLaunchKernel``) starts;
* ``first kernel``: when its first kernel starts on the GPU, and ``kernels``: the GPU time of its
  kernels, first start to last end;
* ``host``: the length of the call's range.

Cases: decode 64 x 128 (bf16, 32/8 heads, D = 128, block 16, shuffled table) -- ours with torch
tensors and with CuPy arrays (default arguments) and cuDNN SDPA on contiguous copies -- the
512-token chunk after a 32k prefix, ours paged and ours on contiguous K/V (torch tensors), and
decode 64 x 4096, where the default call balances on the device (the ragged ``paged_decode``,
whose first CTA lists the work), beside ``num_splits=1`` (the decode kernel) and cuDNN; and
``bench_mixed``'s mixed step (a 512-token chunk after 1,536 cached plus 255 decodes at 2,048)
through ``StepPlan.attention`` on its path and on the ragged launch, and as two public calls
(``--mixed-only``: that case alone).  Every CUDA API call inside a call's range is listed too
(``apis``: median start and duration).  Each call's kernels are
also listed by name (median duration) with ``gaps``: the kernels' span less their durations.

    python benchmarks/trace_call.py [--reps 30] [--out benchmarks/results/trace_call.json]
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

import bench_calls  # noqa: E402  (the calls, inputs and helpers of the call benchmark)

LAUNCH_APIS = ("cuLaunchKernel", "cudaLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC", "cuGraphLaunch",
               "cudaGraphLaunch")


def decode_calls(batch: int = 64, context: int = 128) -> dict:
    """Ours with torch tensors and with CuPy arrays, and cuDNN SDPA: ``bench_calls``' decode case."""
    calls, peers = bench_calls.decode_calls(batch, context)
    case = f"decode {batch}x{context}"
    return {f"{case} {bench_calls.OURS_TORCH}": calls[bench_calls.OURS_TORCH],
            f"{case} {bench_calls.OURS_CUPY}": calls[bench_calls.OURS_CUPY],
            f"{case} {bench_calls.CUDNN}": peers[bench_calls.CUDNN]}


def chunk_calls(prefix: int = 32768, chunk: int = 512) -> dict:
    """Ours paged and ours on contiguous K/V, torch tensors: ``bench_calls``' chunk case."""
    calls, _ = bench_calls.chunk_calls(prefix, chunk)
    case = f"chunk{chunk} after {prefix // 1024}k"
    return {f"{case} paged": calls[bench_calls.OURS_TORCH], f"{case} contiguous": calls[bench_calls.CONTIGUOUS]}


def traced(calls: dict, reps: int) -> list:
    """The profiler's trace events of ``reps`` rounds of ``calls`` (each call in its own range)."""
    import cupy
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    stream = cupy.cuda.get_current_stream()
    for call in calls.values():  # warm-up: compile, allocate
        for _ in range(3):
            call()
    stream.synchronize()
    path = pathlib.Path("/tmp/trace_call.json")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(reps):
            for name, call in calls.items():
                with record_function(f"{name}#{i}"):
                    call()
                torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    return json.loads(path.read_text())["traceEvents"]


def split(events: list, names) -> dict:
    """{call name: {part: median us}} from the trace (see the module docstring)."""
    ranges = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
              and e.get("name", "").rsplit("#", 1)[0] in names]
    apis = [e for e in events if e.get("ph") == "X" and e.get("name") in LAUNCH_APIS]
    kernels = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            kernels.setdefault(e.get("args", {}).get("correlation"), []).append(e)
    parts: dict = {}
    for r in ranges:
        start, end = r["ts"], r["ts"] + r["dur"]
        inside = sorted((a for a in apis if start <= a["ts"] <= end), key=lambda a: a["ts"])
        launched = [k for a in inside for k in kernels.get(a.get("args", {}).get("correlation"), [])]
        if not inside or not launched:
            continue
        first = min(k["ts"] for k in launched)
        last = max(k["ts"] + k["dur"] for k in launched)
        p = parts.setdefault(r["name"].rsplit("#", 1)[0], {"launch api": [], "first kernel": [], "kernels": [],
                                                           "gaps": [], "host": [], "launches": []})
        p["launch api"].append(inside[0]["ts"] - start)
        p["first kernel"].append(first - start)
        p["kernels"].append(last - first)
        p["gaps"].append(last - first - sum(k["dur"] for k in launched))
        p["host"].append(r["dur"])
        p["launches"].append(len(inside))
        for k in launched:
            p.setdefault(f"kernel {k['name'][:40]}", []).append(k["dur"])
        # Every CUDA API call inside the range, in order: its offset from the range's start and duration.
        calls = sorted((a for a in events if a.get("ph") == "X" and a.get("cat") in ("cuda_runtime", "cuda_driver")
                        and start <= a["ts"] <= end), key=lambda a: a["ts"])
        p.setdefault("api sequence", []).append([(a["name"], a["ts"] - start, a["dur"]) for a in calls])
    # Medians, and how many of the calls' ranges the trace matched to a launch and a kernel; the API
    # sequence as median offsets and durations over the samples that made the most common sequence.
    out = {}
    for name, p in parts.items():
        sequences = p.pop("api sequence", [])
        row = {**{part: round(float(np.median(v)), 2) for part, v in p.items()}, "samples": len(p["host"])}
        if sequences:
            names = [tuple(n for n, _, _ in q) for q in sequences]
            common = max(set(names), key=names.count)
            same = [q for q, n in zip(sequences, names) if n == common]
            row["apis"] = [(api, round(float(np.median([q[i][1] for q in same])), 2),
                            round(float(np.median([q[i][2] for q in same])), 2)) for i, api in enumerate(common)]
        out[name] = row
    return out


def balanced_calls() -> dict:
    """Decode 64 x 4096: the default call (balanced on the device), num_splits=1, cuDNN."""
    calls, peers = bench_calls.decode_calls(64, 4096)
    return {f"decode 64x4096 {name}": call for name, call in
            ((bench_calls.OURS_TORCH, calls[bench_calls.OURS_TORCH]),
             (bench_calls.OURS_KERNEL, calls[bench_calls.OURS_KERNEL]), (bench_calls.CUDNN, peers[bench_calls.CUDNN]))}


def mixed_calls(case: str = "step chunk512@1536 + 255 decodes@2048") -> dict:
    """The mixed step of ``bench_mixed`` through ``StepPlan.attention`` on its path (split) and on the
    ragged launch, and the split path as two public calls, torch tensors."""
    import bench_mixed

    cached, new = bench_mixed.CASES[case]
    step = bench_mixed.Step(cached, new, seed=len(case))
    return {"mixed step ours (plan's path)": step.ours(step.plan()),
            "mixed step ours ragged": step.ours(step.plan("ragged")),
            "mixed step split (public calls)": step.split()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", default=str(HERE / "results" / "trace_call.json"))
    parser.add_argument("--mixed-only", action="store_true", help="only the mixed step (bench_mixed's first case)")
    args = parser.parse_args(argv)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    report = {"date": datetime.date.today().isoformat(), "device": bench_calls.device_name(),
              "versions": bench_calls.versions(), "reps": args.reps, "calls": {}}
    bench_calls.warm_clocks()
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        for make in (mixed_calls,) if args.mixed_only else (decode_calls, chunk_calls, balanced_calls, mixed_calls):
            calls = make()
            report["calls"].update(split(traced(calls, args.reps), calls))
            del calls
            bench_calls.release()
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print("\n| call | launch API at | first kernel at | kernels | gaps | host | launches | samples | each kernel |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for name, p in report["calls"].items():
        each = ", ".join(f"{k[7:]} {v:.2f}" for k, v in p.items() if k.startswith("kernel "))
        print(f"| {name} | {p['launch api']:.2f} | {p['first kernel']:.2f} | {p['kernels']:.2f} | {p['gaps']:.2f} "
              f"| {p['host']:.2f} | {p['launches']:g} | {p['samples']} of {args.reps} | {each} |")
    for name, p in report["calls"].items():
        print(f"\n{name}: CUDA API calls inside the call (start us from the call's start, duration us)")
        for api, at, dur in p.get("apis", []):
            print(f"  {at:9.2f} {dur:8.2f}  {api}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
