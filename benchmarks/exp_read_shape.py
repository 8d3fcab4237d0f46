"""Experiment (NOTES_decode.md, v13): does the shape of a CTA's reads limit 256 x 2048?

Same bytes, same CTA count and work per CTA, two cache layouts for the registered kernel:
GQA 32/8 (a CTA reads 256-byte pieces of 2 KiB key rows) against 4/1 with 8x the batch (a CTA
reads whole 256-byte rows, 4 KiB contiguous per 16-key block).  Each shape runs with a shuffled
and a sorted (address-order) block table, split count by the heuristic; cuDNN SDPA (on contiguous
K/V) is timed once per shape, with the shuffled row (the sorted row prints no peer).

    python benchmarks/exp_read_shape.py
"""
import numpy as np

import bench_decode as bd


def main() -> None:
    rng = np.random.default_rng(0)
    rows = []
    for heads, kv_heads, scale in ((32, 8, 1), (4, 1, 8)):
        bd.HEADS, bd.KV_HEADS = heads, kv_heads
        for batch, context in ((256, 2048), (64, 4096), (8, 32768)):
            for shuffle in (True, False):
                r = bd.bandwidth_case(rng, batch * scale, context, block_size=16, with_peers=shuffle, reps=20,
                                      shuffle=shuffle)
                rows.append((f"H{heads}/{kv_heads} " + r["name"], r["value"], r["peers"].get(bd.CUDNN),
                             r["num_splits"]))
    for name, value, cudnn, splits in rows:
        print(f"{name:40s} splits={splits:3d} {value:6.3f} TB/s  cuDNN {cudnn}")


if __name__ == "__main__":
    main()
