"""One launch of each varlen tile shape on a causal batch, for Nsight Compute: where a shape's
time goes (memory traffic, L2 hit rate, warp stalls) beside another's on the same data.

    ncu --profile-from-start off --section ... python benchmarks/ncu_varlen.py [--lens 1024x16 4096x8]

Each (batch, shape) pair runs once untimed (module load, warm caches), then once inside
``cudaProfilerStart`` / ``cudaProfilerStop``, so ncu sees exactly one launch of each.  The shapes are
the registered one of head dim 128, the persistent candidate of the GPU tests (NOTES_varlen.md, v10) and
the softmax-under-P V candidate (v12), and the TMA loader's candidates with and without it (v16);
``--shapes`` picks some.  ``--peers`` profiles torch's FlashAttention-2 varlen and cuDNN SDPA on the same
batch the same way (bench_varlen's peer calls; cuDNN's on the dense batch with K/V repeated to every
query head, as its call there).
"""
from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_varlen  # noqa: E402
from cupy_paged.kernels.varlen_wgmma import WGMMA_TILES, WgmmaTiles, registered_tiles  # noqa: E402

# "registered": what a contiguous D = 128 call runs (the TMA loader with the softmax under P V since
# v16b); "cp_async": the shape registered before it, which paged blocks of 8 keys still run.
SHAPES = {"registered": registered_tiles(128, False), "cp_async": WGMMA_TILES[128],
          "persistent": WgmmaTiles(128, 2, producer=True, persistent=True),
          # v12's schedule: a warpgroup's softmax of tile t under its own P V of tile t - 1 (lean producer)
          "overlap": WgmmaTiles(128, 2, producer=True, staged_store=True, pv_overlap=True),
          "tma": WgmmaTiles(128, 2, producer=True, staged_store=True, tma=True),
          "tma_overlap": WgmmaTiles(128, 2, producer=True, staged_store=True, pv_overlap=True, tma=True)}


def main() -> None:
    import cupy

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lens", nargs="+", default=["1024x16", "4096x8"],
                        help="causal batches as LENGTHxCOUNT (default 1024x16 4096x8)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES),
                        help="our tile shapes to profile (default all)")
    parser.add_argument("--peers", action="store_true", help="also torch FA2 varlen and cuDNN SDPA")
    args = parser.parse_args()
    for spec in args.lens:
        length, count = map(int, spec.split("x"))
        batch = bench_varlen.Batch([length] * count, [length] * count, 128)
        calls = [(name, batch.ours(SHAPES[name]), SHAPES[name].label()) for name in args.shapes]
        if args.peers:
            calls += [(name, call, "") for name, call in (("torch_fa2_varlen", bench_varlen.torch_fa2(batch)),
                                                          ("cudnn_sdpa", bench_varlen.torch_cudnn(batch)))
                      if call is not None]
        for name, call, label in calls:
            call()
            cupy.cuda.Device().synchronize()
            cupy.cuda.runtime.profilerStart()
            call()
            cupy.cuda.Device().synchronize()
            cupy.cuda.runtime.profilerStop()
            print(f"profiled {spec} {name} {label}", flush=True)


if __name__ == "__main__":
    main()
