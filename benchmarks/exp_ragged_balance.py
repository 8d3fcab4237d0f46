"""Experiment: where the ragged launch's time goes on a few bench_mixed cases.

For each case, the ragged plan with the work list's CTA slots per kv head scaled (the split size
the plan chooses: fewer slots, longer ranges), and the step's decode rows and chunk rows each
alone through the same launch, timed back to back (``bench_calls.time_calls``, CuPy arrays).
Prints one line per variant; the conclusions go to NOTES_mixed.md.

    python benchmarks/exp_ragged_balance.py
"""
from __future__ import annotations

import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import bench_calls  # noqa: E402
import bench_mixed  # noqa: E402

from cupy_paged._core.types import BF16  # noqa: E402
from cupy_paged.runtime import _work  # noqa: E402


def ragged_us(cached, new, scale: float = 1.0) -> tuple[float, int, int]:
    step = bench_mixed.Step(cached, new)
    shape = _work._work_shape
    tile, slots = shape("cuda", BF16, bench_mixed.DIM, bench_mixed.KV_HEADS)
    _work._work_shape = lambda *args: (tile, max(1, int(slots * scale)))
    try:
        plan = step.plan("ragged")
    finally:
        _work._work_shape = shape
    call = lambda: plan.attention(step.q, step.k, step.v, step.k_cache, step.v_cache)  # noqa: E731
    timing = bench_calls.time_calls({"ragged": call}, 15)["ragged"]
    bench_calls.release()
    return timing.chain_us, plan.num_items, plan.num_slots


def main() -> int:
    bench_calls.warm_clocks()
    for name in ("ragged decode 1x32k + 63x512", "ragged decode lognormal64",
                 "step chunk512@1536 + 255 decodes@2048", "decode 64x4096"):
        cached, new = bench_mixed.CASES[name]
        floor = bench_mixed.floor_ms(cached, new) * 1e3
        for scale in (0.5, 1.0, 2.0, 4.0, 8.0):
            us, items, split_items = ragged_us(cached, new, scale)
            print(f"{name:40s} slots x{scale:<4} {us:8.1f} us  floor {floor:6.1f}  items {items:5d} split items {split_items}",
                  flush=True)
        if any(n > 1 for n in new):
            rows = [b for b, n in enumerate(new) if n > 1], [b for b, n in enumerate(new) if n == 1]
            for label, keep in zip(("chunk rows alone", "decode rows alone"), rows):
                if keep:
                    us, items, _ = ragged_us([cached[b] for b in keep], [new[b] for b in keep])
                    print(f"{name:40s} {label:18s} {us:8.1f} us  items {items}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
