"""Four kernel launches for ``ncu``: where does paged K/V cost time?

1. decode, 64 x 4096, block size 16, table in address order;
2. decode, the same keys at block size 256, table in address order (both read exactly the same
   addresses, so any difference between 1 and 2 is the kernel's, not the memory's);
3. varlen (registered kernel), causal D=128, 8 x 4096, contiguous K/V;
4. the same keys through a shuffled block table, block size 16.

Each is run once untimed (compilation), then once more: profile with
``ncu --clock-control none -k regex:"paged_decode|varlen_fwd" --launch-skip 4 --launch-count 4
--section SpeedOfLight --section WarpStateStats --section InstructionStats --section MemoryWorkloadAnalysis
python3 benchmarks/profile_paged.py``.
"""
from __future__ import annotations

import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import bench_decode  # noqa: E402
import bench_varlen  # noqa: E402

import cupy_paged  # noqa: E402


def main() -> int:
    import cupy

    rng = np.random.default_rng(0)
    calls = []
    for block_size in (16, 256):
        (q, k, v, table, lens), = bench_decode.make_paged(rng, 64, 4096, block_size, shuffle=False)
        out = cupy.empty_like(q)
        calls.append(lambda q=q, k=k, v=v, t=table, n=lens, o=out: cupy_paged.flash_attn_with_kvcache(
            q, k, v, cache_seqlens=n, block_table=t, out=o, check_values=False))
    batch = bench_varlen.Batch([4096] * 8, [4096] * 8, 128)
    calls.append(batch.ours())
    calls.append(batch.ours(paged=batch.paged(16)))
    for rounds in range(2):  # the first round compiles and warms; ncu skips its 4 launches
        for call in calls:
            call()
        cupy.cuda.get_current_stream().synchronize()
    print("4 x 2 launches done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
