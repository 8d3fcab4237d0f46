"""A/B of the varlen wgmma kernel's TMA loader against the registered shape (D = 128, bf16).

Each case runs the registered path, the cp.async shape and the TMA shapes on one batch, timed in
turns (``bench_varlen.interleaved_ms``: back to back, CUDA events, medians of round medians), with
the largest difference of the TMA output from the registered one (NaN-poisoned output first).  The
causal 8 x 2048 and 8 x 4096 batches also time torch's FlashAttention-2 varlen op and cuDNN SDPA
(dense, GQA expanded) for scale.  NOTES_varlen.md has the prediction.

Run: ``python benchmarks/ab_tma.py [--reps N] [--out FILE]``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import bench_varlen as bv  # noqa: E402
from cupy_paged.kernels.varlen_wgmma import WGMMA_TILES, WgmmaTiles  # noqa: E402

TMA = WgmmaTiles(128, 2, producer=True, staged_store=True, tma=True)
# The same with v12's softmax under P V (a lean producer, 72 registers, and 216 for the consumers):
# v12 lost to its cp.async producer's slowness, which the TMA takes off the full tiles.
TMA_OVERLAP = WgmmaTiles(128, 2, producer=True, staged_store=True, pv_overlap=True, tma=True)
# The cp.async shape beside them: "registered" is the default path, which since v16 takes a TMA shape
# for contiguous K/V at D = 128 and for paged caches at D = 64.
CP_ASYNC = WGMMA_TILES[128]
VARIANTS = (CP_ASYNC, TMA, TMA_OVERLAP)
TMA_64 = WgmmaTiles(128, 2, producer=True, tma=True)  # the cp.async D = 64 shape with the TMA
D64_VARIANTS = (WGMMA_TILES[64], TMA_64)
CASES = (
    ("causal_8x4096", [4096] * 8, {}),
    ("causal_8x2048", [2048] * 8, {}),
    ("causal_16x1024", [1024] * 16, {}),
    ("causal_lognormal40", None, {}),
    ("paged_bs16_8x4096", [4096] * 8, dict(block_size=16)),
    ("paged_bs64_8x2048", [2048] * 8, dict(block_size=64)),
    ("chunk512_after_32k_bs16", [512], dict(lens_k=[32768 + 512], block_size=16)),
    ("chunk512_after_32k", [512], dict(lens_k=[32768 + 512])),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "ab_tma.json"))
    args = parser.parse_args()
    import cupy

    bv.WGMMA_SWEEP[128] = VARIANTS  # the sweep's variants: the TMA shapes alone
    bv.WGMMA_SWEEP[64] = D64_VARIANTS
    rows = []
    for name, lens, options in CASES:
        lens = lens or bv.lognormal_lengths()
        row = bv.sweep_case(name, lens, 128, args.reps, **options)
        rows.append(row)
    d64 = [bv.sweep_case(name, lens, 64, args.reps, **options) for name, lens, options in (
        ("d64_causal_16x2048", [2048] * 16, {}), ("d64_paged_bs16_16x2048", [2048] * 16, dict(block_size=16)))]
    peers = {}
    for name, lens in (("causal_8x2048", [2048] * 8), ("causal_8x4096", [4096] * 8)):
        batch = bv.Batch(lens, lens, 128)
        work = bv.flops(lens, lens, 128)
        peers[name] = {}
        for peer, make in (("torch_fa2_varlen", bv.torch_fa2), ("cudnn_sdpa", bv.torch_cudnn)):
            fn = make(batch)
            if fn is not None:
                peers[name][peer] = round(work / bv.time_ms(fn, args.reps) / 1e9, 1)
        del batch
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    result = dict(device=props["name"].decode(), date=datetime.date.today().isoformat(),
                  variants=[t.label() for t in VARIANTS], rows=rows, d64=d64, peers=peers)
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    labels = [t.label() for t in VARIANTS]
    print("\n| case | registered TFLOP/s | " + " | ".join(f"{x} (x reg., maxdiff)" for x in labels) + " |")
    print("| --- | ---: |" + " ---: |" * len(labels))
    for row in rows:
        cells = [f"{row['variants'][x]['tflops']} ({row['variants'][x]['tflops'] / row['registered']:.3f}, "
                 f"{row['variants'][x]['maxdiff']:.1e})" for x in labels]
        print(f"| {row['name']} | {row['registered']} | " + " | ".join(cells) + " |")
    by = {row["name"]: row for row in rows}
    for label in ["registered"] + labels:
        def tf(name):
            r = by[name]
            return r["registered"] if label == "registered" else r["variants"][label]["tflops"]
        print(f"chunk after 32k, paged / contiguous ({label}): "
              f"{tf('chunk512_after_32k_bs16') / tf('chunk512_after_32k'):.3f}")
    for row in d64:
        cells = [f"{t.label()} {row['variants'][t.label()]['tflops']} "
                 f"({row['variants'][t.label()]['tflops'] / row['registered']:.3f}, "
                 f"maxdiff {row['variants'][t.label()]['maxdiff']:.1e})" for t in D64_VARIANTS]
        print(f"{row['name']}: registered {row['registered']}, " + ", ".join(cells))
    print("peers (TFLOP/s):", json.dumps(peers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
