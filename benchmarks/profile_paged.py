"""Kernel launches for ``ncu``: where does paged attention spend its time?

Each argument is one case; without arguments, the four of NOTES_decode.md (v6):
  ``decode:BATCHxCONTEXT:bsN[:splits=S][:sorted][:heads=HQ/HKV][:main]``  flash_attn_with_kvcache,
      bf16, GQA 32/8 unless ``heads`` says otherwise, D=128 (the decode benchmark's inputs);
      ``sorted`` puts each table in address order; ``main`` launches the main pipeline shape where
      ``num_splits=0`` would take the small one (grids of more than one main-shape wave)
  ``varlen``, ``varlen-paged``  causal D=128, 8 x 4096, contiguous K/V or through a shuffled
      block table of block size 16
The defaults (their 512-CTA decode grids take the small shape; ``:main`` for the main one):
decode:64x4096:bs16:sorted decode:64x4096:bs256:sorted varlen varlen-paged
(the two sorted decode cases read exactly the same addresses, so any difference between them
is the kernel's, not the memory's).

Every case runs once untimed (compilation), then once more.  Profile the second round, e.g.
``ncu --clock-control none -k regex:"paged_decode|combine_splits|varlen_fwd" --launch-skip N
--section SpeedOfLight python3 benchmarks/profile_paged.py CASES`` with N the first round's
launch count (printed; a split decode launches two kernels).
"""
from __future__ import annotations

import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import bench_decode  # noqa: E402
import bench_varlen  # noqa: E402

from cupy_paged.kernels import decode as decode_ops  # noqa: E402

DEFAULT = ["decode:64x4096:bs16:sorted", "decode:64x4096:bs256:sorted", "varlen", "varlen-paged"]


def decode_case(rng, spec):
    """(call, launches per call) of one ``decode:...`` spec: the decode benchmark's call (``out``
    given, no host checks, ``num_splits`` forced or 0 for the heuristic)."""
    _, shape, block, *options = spec.split(":")
    batch, context = (int(x) for x in shape.split("x"))
    splits = next((int(o.split("=")[1]) for o in options if o.startswith("splits=")), 0)
    heads = next((o.split("=")[1] for o in options if o.startswith("heads=")),
                 f"{bench_decode.HEADS}/{bench_decode.KV_HEADS}")
    num_heads, num_kv_heads = (int(x) for x in heads.split("/"))
    sets = bench_decode.make_paged(rng, batch, context, int(block[2:]), shuffle="sorted" not in options,
                                   heads=num_heads, kv_heads=num_kv_heads)
    tiles = decode_ops.TILES[bench_decode.DIM] if "main" in options else None
    return (bench_decode.ours(sets, splits, tiles),
            1 + (decode_ops.plan(bench_decode.decode_problem(sets[0], splits), tiles) > 1))


def main(argv: list[str]) -> int:
    import cupy

    rng = np.random.default_rng(0)
    calls, launches = [], 0
    for spec in argv or DEFAULT:
        if spec.startswith("decode:"):
            call, count = decode_case(rng, spec)
        elif spec in ("varlen", "varlen-paged"):
            batch = bench_varlen.Batch([4096] * 8, [4096] * 8, 128)
            call, count = batch.ours(paged=batch.paged(16) if spec == "varlen-paged" else None), 1
        else:
            raise SystemExit(f"unknown case {spec!r}: see the docstring")
        calls.append(call)
        launches += count
    for _ in range(2):  # the first round compiles and warms; ncu skips its launches
        for call in calls:
            call()
        cupy.cuda.get_current_stream().synchronize()
    print(f"{len(calls)} cases x 2 rounds done; launches per round: {launches}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
