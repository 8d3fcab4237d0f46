"""A fluid model of a ragged decode launch's waves: what the order and size of the work items cost.

The CTA slots of one wave are a pool; each item (one sequence range of one kv head) takes a slot
in list order, spends a fixed prologue ``P`` (its lengths, Q, block ids and first tiles: no bytes
streamed), then reads its keys' bytes at ``min(r, B / CTAs streaming)``, then a fixed epilogue.
Calibrated against `trace_list.py`'s CTA stamps on an H100 (twenty-ninth session, NOTES_mixed.md):
P = 4.5 us, r = 25 KB/us, B = 3,060 KB/us reproduce the host-listed launches of 1 x 32k + 63 x 512
and lognormal64 within 1%.  It prints each batch's time for the rule's list (the plan's
``plan_work`` / ``fill_work``) in its order and in others, and for other common range sizes.

    python benchmarks/model_waves.py [--slots 264] [--bandwidth 3060] [--rate 25] [--prologue 4.5]
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_mixed import lognormal_contexts  # noqa: E402  (the benchmark's long-tailed contexts)
from cupy_paged.runtime._work import fill_work, plan_work  # noqa: E402

KV_HEADS, GROUP, TILE = 8, 4, 64
KB_PER_KEY = 0.5  # K and V of one key of one kv head, D 128, 2-byte elements
BATCHES = {"1x32k+63x512": [32768] + [512] * 63, "lognormal64": list(lognormal_contexts())}


def simulate(keys: np.ndarray, slots: int, bandwidth: float, rate: float, prologue: float,
             epilogue: float = 0.8) -> float:
    """Time (us) until the last of ``keys`` (keys of each item, in list order, each for every kv
    head in turn) has ended."""
    items = [float(k) * KB_PER_KEY for k in keys for _ in range(KV_HEADS)]
    active, nxt, t = [], 0, 0.0  # [phase (0 prologue, 1 stream, 2 epilogue), left (us or KB), KB]
    while active or nxt < len(items):
        while len(active) < slots and nxt < len(items):
            active.append([0, prologue, items[nxt]])
            nxt += 1
        streaming = sum(a[0] == 1 for a in active)
        share = min(rate, bandwidth / streaming) if streaming else 0.0
        dt = min(a[1] / share if a[0] == 1 else a[1] for a in active)
        t += dt
        for a in active:
            a[1] -= share * dt if a[0] == 1 else dt
        kept = []
        for a in active:
            if a[1] > 1e-9:
                kept.append(a)
            elif a[0] < 2:
                kept.append([a[0] + 1, a[2] if a[0] == 0 else epilogue, a[2]])
        active = kept
    return t


def rule_items(contexts: list, slots_per_head: int, waves: float | None = None) -> np.ndarray:
    """Keys of each item of the plan's list for one-token decodes of ``contexts``, in its order;
    ``waves``: share the keys over this many waves instead of the rule's (ranges as the rule
    rounds them)."""
    query = np.ones(len(contexts), np.int64)
    cached = np.asarray(contexts, np.int64) - 1
    per_head = slots_per_head if waves is None else max(1, round(waves * slots_per_head / 2))
    row_groups, splits, items, _ = plan_work(query, cached, GROUP, TILE, per_head, 1 << 20, 1 << 20)
    work = np.zeros((items, 8), np.int32)
    fill_work(query, cached, GROUP, TILE, row_groups, splits, items, work)
    keys = np.asarray(contexts, np.int64)
    out = []
    for b, _, s, n in work[:, :4]:
        if n == 1:
            out.append(keys[b])
            continue
        chunk = -(-(-(-keys[b] // n)) // TILE) * TILE
        out.append(min(keys[b], (s + 1) * chunk) - s * chunk)
    return np.asarray(out)


def alternate(keys: np.ndarray) -> np.ndarray:
    """Longest, shortest, second longest, second shortest, ..."""
    order = np.argsort(-keys, kind="stable")
    picked = [order[i // 2] if i % 2 == 0 else order[-1 - i // 2] for i in range(len(order))]
    return keys[np.asarray(picked)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=264, help="CTA slots of a wave (H100/H200: 132 SMs x 2)")
    parser.add_argument("--bandwidth", type=float, default=3060.0, help="KB/us (H100 about 3,060, H200 4,440)")
    parser.add_argument("--rate", type=float, default=25.0, help="KB/us one CTA reads at most")
    parser.add_argument("--prologue", type=float, default=4.5, help="us from a CTA's start to its first tile")
    args = parser.parse_args(argv)
    model = dict(slots=args.slots, bandwidth=args.bandwidth, rate=args.rate, prologue=args.prologue)
    per_head = args.slots // KV_HEADS
    print("| batch | floor us | rule (longest first) | alternating | shortest first | "
          "one wave | 1.5 waves | three waves | four waves |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, contexts in BATCHES.items():
        keys = rule_items(contexts, per_head)
        floor = keys.sum() * KV_HEADS * KB_PER_KEY / args.bandwidth
        times = [simulate(keys, **model), simulate(alternate(keys), **model), simulate(np.sort(keys), **model)]
        times += [simulate(rule_items(contexts, per_head, waves), **model) for waves in (1, 1.5, 3, 4)]
        print(f"| {name} | {floor:.1f} | " + " | ".join(f"{t:.1f}" for t in times) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
