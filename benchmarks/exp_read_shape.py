"""Experiment (NOTES_decode.md, v13): does the shape of a CTA's reads limit 256 x 2048?

Same bytes, same CTA count and work per CTA, two cache layouts for the registered kernel:
GQA 32/8 (a CTA reads 256-byte pieces of 2 KiB key rows) against 4/1 with 8x the batch (a CTA
reads whole 256-byte rows, 4 KiB contiguous per 16-key block).  cuDNN SDPA on each shape.
"""
import sys, pathlib
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import numpy as np
import bench_decode as bd

rng = np.random.default_rng(0)
rows = []
for heads, kv_heads, scale in ((32, 8, 1), (4, 1, 8)):
    bd.HEADS, bd.KV_HEADS = heads, kv_heads
    for batch, context, splits in ((256, 2048, 0), (64, 4096, 0), (8, 32768, 0)):
        for shuffle in (True, False):
            r = bd.bandwidth_case(rng, batch * scale, context, 16, shuffle, 20, splits, shuffle)
            rows.append((f"H{heads}/{kv_heads} " + r["name"], r["value"], r["peers"].get(bd.CUDNN), r["num_splits"]))
for name, value, cudnn, splits in rows:
    print(f"{name:40s} splits={splits:3d} {value:6.3f} TB/s  cuDNN {cudnn}")
