"""Every kernel specialization the package may launch, family by family.

The list is explicit: :data:`FAMILIES` names each family's ``all_keys``, so the offline
build (``python -m cupy_paged compile``), the cache warmer and the tests see the same keys
without relying on import side effects.
"""
from __future__ import annotations

import os
import re
import sys

from .._core.compiler import ARCHS, KernelKey, get_module
from .._core.nvrtc import compile_offline, format_reports
from . import decode, kv_write, merge, varlen, varlen_wgmma

ARCH_FORM = re.compile(r"sm_[0-9]{2,3}a?")  # what --arch takes: sm_80, sm_90, sm_90a, sm_100a

FAMILIES = {
    "decode": decode.all_keys,
    "kv_write": kv_write.all_keys,
    "merge": merge.all_keys,
    "varlen": varlen.all_keys,
    "varlen_wgmma": varlen_wgmma.all_keys,
}


def all_keys() -> list[KernelKey]:
    """Every specialization of every family, family by family in name order."""
    return [key for name in sorted(FAMILIES) for key in FAMILIES[name]()]


def _build_key(key_text: str) -> str:
    """Worker of :func:`warm` (module level, so spawned processes can import it)."""
    key = next(k for k in all_keys() if str(k) == key_text)
    get_module(key)
    return key_text


def warm(jobs: int, filter_text: str = "") -> int:
    """Fill CuPy's disk cache with every specialization, one process per compile (needs a GPU)."""
    import multiprocessing
    import time

    from .._core.arrays import gpu_available

    if not gpu_available():
        print("warm: no CUDA device answers here; `python -m cupy_paged compile` builds every "
              "specialization through NVRTC without one", file=sys.stderr)
        return 1
    keys = [str(k) for k in all_keys() if filter_text in str(k)]
    start = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        for done in pool.imap_unordered(_build_key, keys):
            print(f"  built {done}", flush=True)
    print(f"{len(keys)} specializations built in {time.perf_counter() - start:.1f} s")
    return 0


def _compile_job(job):
    """One offline compile: its report, or a one-line message naming the key and the arch."""
    key, arch = job
    try:
        return compile_offline(key, arch)
    except ImportError as error:
        return f"compile: NVRTC is not available ({error}); install the cuda13 extra (cupy-cuda13x; cuda12 on a CUDA 12 driver)"
    except Exception as error:  # NVRTC's error for this arch, or a compile error in the source
        lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
        return f"compile: {key} for --arch {arch} failed: " + " ".join(lines[:3])


def main(argv: list[str] | None = None) -> int:
    """``python -m cupy_paged compile``: compile every specialization offline, print resources."""
    import argparse
    from concurrent.futures import ThreadPoolExecutor

    parser = argparse.ArgumentParser(prog="python -m cupy_paged compile", description=main.__doc__)
    parser.add_argument("--arch", action="append", help="repeatable; default sm_80 and sm_90")
    parser.add_argument("--filter", default="", help="only keys whose text contains this")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    for arch in args.arch or ():
        if not ARCH_FORM.fullmatch(arch):
            parser.error(f"--arch must name a CUDA architecture as sm_NN or sm_NNa (sm_80, sm_90a); got {arch!r}")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1; got {args.jobs}")
    jobs = [(key, arch) for key in all_keys() if args.filter in str(key) for arch in key.archs(args.arch or ARCHS)]
    # NVRTC releases the GIL while compiling, so threads compile in parallel.
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(_compile_job, jobs))
    failures = [r for r in results if isinstance(r, str)]
    if failures:
        for line in failures[:8]:
            print(line, file=sys.stderr)
        print(f"compile: {len(failures)} of {len(jobs)} compiles failed", file=sys.stderr)
        return 1
    reports = results
    print(format_reports(reports))
    spills = [(r.key, k.kernel) for r in reports for k in r.kernels if k.spill_stores or k.spill_loads]
    print(f"{len(reports)} compiled ({len(set(k for k, _ in jobs))} keys), {len(spills)} kernels spill")
    return 0
