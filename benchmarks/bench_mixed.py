"""Continuous-batching steps that mix prefill chunks with decodes: one ragged launch against its floor.

Every case is one step of one layer (bf16, 32 query / 8 kv heads, D = 128, paged block 16, the
cache's free list shuffled so that block tables are scattered as in a long-running server):

* ``ours``: ``StepPlan.attention`` with torch tensors for q / k / v and the cache's CuPy arrays,
  the plan from ``build_plan(..., num_heads=32)`` (its own path rule), one eager call; it appends
  the step's new K/V and attends.  ``ours ragged``: the same with ``path="ragged"`` where the rule
  chose another path.
* ``split``: what a user of the public functions would write, eager, torch tensors, defaults:
  ``write_kv_cache`` + ``flash_attn_varlen_func`` over the paged cache for the prefill chunks and
  ``flash_attn_with_kvcache`` (appending) for the decodes.
* ``FA2``: torch's FlashAttention-2 varlen forward (``aten._flash_attention_forward``) over
  contiguous copies of every sequence's keys, one call (what vLLM V1 and Hugging Face run).
* ``floor``: K/V bytes / 4.44 TB/s + causal FLOPs / 700 TFLOP/s (on a card other than the H200,
  its own read-only stream measured in the run instead of 4.44 TB/s: ``ceiling.py``).

Cases: the step of the issue (a 512-token chunk after 1,536 cached tokens plus 255 decodes at
2,048), a sweep of mixes, ragged decode-only batches (long-tailed contexts; one 32k context among
63 short ones; "ragged" in the name), decode-only and prefill-only steps.  Timing is
``bench_calls.time_calls``: the median of CUDA events around one eager call with the GPU idle at
its start (the host path inside), host time per call, and back-to-back calls.

Writes ``benchmarks/results/mixed.json`` (``name, metric, value, floor, peers`` per case and the
per-call detail), ``benchmarks/results/mixed.png`` (time over floor of every case, ours, split,
FA2) and prints a markdown table last.

    python benchmarks/bench_mixed.py [--reps N] [--cases SUBSTRING[,...]] [--list]
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import time
import traceback

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import bench_calls  # noqa: E402  (timing, clocks, versions)
import bench_decode  # noqa: E402  (random bf16)
import ceiling  # noqa: E402  (the read ceiling of the card)

import cupy_paged  # noqa: E402

HEADS, KV_HEADS, DIM = bench_calls.HEADS, bench_calls.KV_HEADS, bench_calls.DIM  # 32, 8, 128; block 16
RESULTS = HERE / "results" / "mixed.json"
OURS, OURS_RAGGED, SPLIT, FA2 = "ours", "ours ragged", "split", "FA2"
# Decode-only cases also time the public calls a framework without host lengths makes
# (flash_attn_with_kvcache is the split path there), beside the same calls on the kernels they replaced.
KV_KERNEL, VARLEN_CALL, VARLEN_KERNEL = "kvcache decode kernel", "varlen call", "varlen kernel"


def floor_ms(cached, new) -> float:
    """K/V bytes / the read ceiling (4.44 TB/s on the H200) + causal FLOPs / 700 TFLOP/s of one step."""
    keys = np.asarray(cached, np.float64) + np.asarray(new, np.float64)
    q = np.asarray(new, np.float64)
    kv_bytes = keys.sum() * KV_HEADS * DIM * 2 * 2
    visible = q * np.asarray(cached, np.float64) + q * (q + 1) / 2  # sum over rows of keys seen
    flops = 4.0 * visible.sum() * HEADS * DIM
    return (kv_bytes / ceiling.read_bytes_per_s() + flops / ceiling.TFLOPS) * 1e3


class Step:
    """One step's cache, plan inputs and random q / k / v (CuPy, with torch views)."""

    def __init__(self, cached, new, seed=0):
        import torch

        self.cached, self.new = list(cached), list(new)
        self.cache, self.ids = bench_calls.filled_cache(cached, new, shuffle_seed=seed)
        tokens = sum(new)
        self.q = bench_decode.randn_bf16((tokens, HEADS, DIM))
        self.k = bench_decode.randn_bf16((tokens, KV_HEADS, DIM))
        self.v = bench_decode.randn_bf16((tokens, KV_HEADS, DIM))
        self.tq, self.tk, self.tv = (torch.from_dlpack(a) for a in (self.q, self.k, self.v))
        self.k_cache, self.v_cache = self.cache.layer(0)

    def plan(self, path=None):
        return cupy_paged.build_plan(self.cache, self.ids, self.new, num_heads=HEADS, path=path)

    def ours(self, plan):
        return lambda: plan.attention(self.tq, self.tk, self.tv, self.k_cache, self.v_cache)

    def split(self):
        """write_kv_cache + flash_attn_varlen_func for the multi-token rows, flash_attn_with_kvcache
        (appending) for the one-token rows: eager public calls, torch tensors, defaults."""
        plan = cupy_paged.build_plan(self.cache, self.ids, self.new)
        new = np.asarray(self.new)
        starts = np.concatenate([[0], np.cumsum(new)[:-1]])
        long_rows, short_rows = np.flatnonzero(new > 1), np.flatnonzero(new == 1)
        calls = []  # (first token, call): the outputs concatenate in token order
        if long_rows.size:
            calls.append((starts[long_rows[0]], self._chunk_call(plan, long_rows, starts)))
        if short_rows.size:
            calls.append((starts[short_rows[0]], self._decode_call(plan, short_rows, starts)))
        calls = [call for _, call in sorted(calls, key=lambda pair: pair[0])]
        return lambda: [call() for call in calls]

    def _chunk_call(self, plan, rows, starts):
        import torch

        t = torch.from_dlpack
        new = np.asarray(self.new)
        tokens = np.concatenate([np.arange(starts[b], starts[b] + new[b]) for b in rows])
        assert (np.diff(tokens) == 1).all(), "the multi-token rows are contiguous here"
        sl = slice(int(tokens[0]), int(tokens[-1]) + 1)
        slots = t(plan.slot_mapping)[sl]
        lens_q = new[rows]
        lens_k = lens_q + np.asarray(self.cached)[rows]
        cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32, device="cuda")
        cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32, device="cuda")
        table = t(plan.block_table)[torch.tensor(rows, device="cuda")]
        kc, vc = t(self.k_cache), t(self.v_cache)
        q, k, v = self.tq[sl], self.tk[sl], self.tv[sl]
        max_q, max_k = int(lens_q.max()), int(lens_k.max())

        def chunks():
            cupy_paged.write_kv_cache(kc, vc, k, v, slots)
            return cupy_paged.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, max_q, max_k, causal=True,
                                                     block_table=table)
        return chunks

    def _decode_call(self, plan, rows, starts):
        import torch

        t = torch.from_dlpack
        first = int(starts[rows[0]])
        assert (starts[rows] == first + np.arange(rows.size)).all(), "the decodes are contiguous here"
        sl = slice(first, first + rows.size)
        q, k, v = self.tq[sl, None], self.tk[sl, None], self.tv[sl, None]
        seqlens = torch.tensor(np.asarray(self.cached)[rows], dtype=torch.int32, device="cuda")
        table = t(plan.block_table)[torch.tensor(rows, device="cuda")]
        kc, vc = t(self.k_cache), t(self.v_cache)
        return lambda: cupy_paged.flash_attn_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=seqlens,
                                                          block_table=table, causal=True)

    def decode_only_peers(self) -> dict:
        """For a step of one-token rows, public calls with torch tensors: ``KV_KERNEL``,
        ``flash_attn_with_kvcache`` (appending) as the split path calls it but with ``num_splits=1``,
        the decode kernel's launch that the default made before it balanced on the device;
        ``VARLEN_CALL``, ``flash_attn_varlen_func`` over the paged cache with every row's new key
        already in it (as Hugging Face calls it on a decode step); ``VARLEN_KERNEL``, the same call
        with the short-row path off (``kernels.ragged.BALANCE = False``), i.e. the varlen kernel."""
        import torch

        from cupy_paged.kernels import ragged

        t = torch.from_dlpack
        plan = cupy_paged.build_plan(self.cache, self.ids, self.new)
        rows = len(self.new)
        seqlens = torch.tensor(np.asarray(self.cached, np.int32), device="cuda")
        lens_k = np.asarray(self.cached) + 1
        cu_q = torch.arange(rows + 1, dtype=torch.int32, device="cuda")
        cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32, device="cuda")
        kc, vc, table = t(self.k_cache), t(self.v_cache), t(plan.block_table)[:rows]
        q, k, v = self.tq[:, None], self.tk[:, None], self.tv[:, None]

        def kv_kernel():
            return cupy_paged.flash_attn_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=seqlens, block_table=table,
                                                      causal=True, num_splits=1)

        def varlen():
            return cupy_paged.flash_attn_varlen_func(self.tq, kc, vc, cu_q, cu_k, 1, int(lens_k.max()), causal=True,
                                                     block_table=table)

        def varlen_kernel():
            before, ragged.BALANCE = ragged.BALANCE, False
            try:
                return varlen()
            finally:
                ragged.BALANCE = before

        return {KV_KERNEL: kv_kernel, VARLEN_CALL: varlen, VARLEN_KERNEL: varlen_kernel}

    def fa2(self):
        """torch FA2 varlen over contiguous copies of each sequence's keys (the new ones included)."""
        import torch

        plan = cupy_paged.build_plan(self.cache, self.ids, self.new)
        plan.attention(self.q, self.k, self.v, self.k_cache, self.v_cache)  # the new keys in the cache
        index = plan.read_index
        t = torch.from_dlpack
        k = t(self.k_cache).reshape(-1, KV_HEADS, DIM)[torch.tensor(index, device="cuda")]
        v = t(self.v_cache).reshape(-1, KV_HEADS, DIM)[torch.tensor(index, device="cuda")]
        cu_q, cu_k = t(plan.cu_seqlens_q), t(plan.cu_seqlens_k)
        max_q, max_k = plan.max_seqlen_q, plan.max_seqlen_k
        return lambda: torch.ops.aten._flash_attention_forward(self.tq, k, v, cu_q, cu_k, max_q, max_k, 0.0, True,
                                                               False)


def mix(chunks=(), decodes=(0, 0), spec=(0, 0, 0)):
    """(cached, new) in the order the scheduler gives a step: ``decodes`` = (count, context)
    first, then ``chunks`` of (tokens, cached), then ``spec`` = (rows, q, cached)."""
    cached = [decodes[1] - 1] * decodes[0] + [c for _, c in chunks] + [spec[2]] * spec[0]
    new = [1] * decodes[0] + [n for n, _ in chunks] + [spec[1]] * spec[0]
    return cached, new


def lognormal_contexts(count=64, seed=7):
    draws = np.random.default_rng(seed).lognormal(7.5, 1.2, count)
    return [int(n) for n in np.clip(draws, 16, 32768)]


CASES = {
    "step chunk512@1536 + 255 decodes@2048": mix([(512, 1536)], (255, 2048)),
    "sweep 1x128@0 + 511@512": mix([(128, 0)], (511, 512)),
    "sweep 1x2048@16k + 255@2048": mix([(2048, 16384)], (255, 2048)),
    "sweep 2x1024@4096 + 128@4096": mix([(1024, 4096)] * 2, (128, 4096)),
    "sweep 4x512@1024 + 64@8192": mix([(512, 1024)] * 4, (64, 8192)),
    "sweep 8x256@16k + 32@32k": mix([(256, 16384)] * 8, (32, 32768)),
    "sweep 8x2048@0 + 16@1024": mix([(2048, 0)] * 8, (16, 1024)),
    "sweep 64 rows q=4 @2048": mix(spec=(64, 4, 2048)),
    "sweep 3x128@512 + 64 q=4@1024 + 200@4096": mix([(128, 512)] * 3, (200, 4096), (64, 4, 1024)),
    "ragged decode lognormal64": ([n - 1 for n in lognormal_contexts()], [1] * 64),
    "ragged decode 1x32k + 63x512": ([32767] + [511] * 63, [1] * 64),
    "decode 64x4096": mix(decodes=(64, 4096)),
    "decode 256x2048": mix(decodes=(256, 2048)),
    "prefill 8x4096": mix([(4096, 0)] * 8),
}


def run_case(name: str, reps: int) -> dict:
    import torch

    cached, new = CASES[name]
    step = Step(cached, new, seed=len(name))
    plan = step.plan()
    calls = {OURS: step.ours(plan)}
    if plan.path != "ragged":
        calls[OURS_RAGGED] = step.ours(step.plan("ragged"))
    peers = {SPLIT: step.split(), FA2: step.fa2()}
    # The outputs agree (ours against the split path, same cache, same new tokens).
    got = calls[OURS]().float()
    want = torch.cat([o.reshape(-1, HEADS, DIM) for o in peers[SPLIT]()]).float()
    diff = float((got - want).abs().max())
    extra = {}
    if max(new) == 1:
        peers.update(step.decode_only_peers())
        # The short-row path and the varlen kernel give the same rows (the new keys are in the cache now).
        extra["max_abs_diff_varlen_paths"] = float((peers[VARLEN_CALL]().float() - peers[VARLEN_KERNEL]().float())
                                                   .abs().max())
    t0 = time.perf_counter()
    for _ in range(20):
        step.plan()
    build_us = (time.perf_counter() - t0) / 20 * 1e6
    timings = bench_calls.time_calls({**calls, **peers}, reps)
    floor = floor_ms(cached, new)
    row = dict(name=name, metric="ms", value=round(timings[OURS].gpu_us / 1e3, 4), floor=round(floor, 4),
               over_floor=round(timings[OURS].gpu_us / 1e3 / floor, 3), path=plan.path,
               peers={k: round(timings[k].gpu_us / 1e3, 4) for k in timings if k != OURS},
               host_us={k: timings[k].host_us for k in timings}, back_to_back_us={k: timings[k].chain_us for k in timings},
               host_us_busy_gpu={k: timings[k].busy_host_us for k in timings},
               build_plan_us=round(build_us, 1), max_abs_diff_vs_split=diff, items=plan.num_items,
               split_items=plan.num_slots, rows=len(new), tokens=int(sum(new)), **extra)
    print(f"  {row['value']:.3f} ms (floor {floor:.3f}, x{row['over_floor']:.2f}, path {plan.path}) "
          f"peers {row['peers']}  diff {diff:.3g}", flush=True)
    return row


def plot(rows: list, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(12, 5))
    series = [(OURS, [r["value"] for r in rows]), (SPLIT, [r["peers"].get(SPLIT) for r in rows]),
              (FA2, [r["peers"].get(FA2) for r in rows])]
    for i, (label, values) in enumerate(series):
        ratios = [v / r["floor"] if v else np.nan for v, r in zip(values, rows)]
        ax.bar(x + (i - 1) * 0.27, ratios, 0.27, label=label)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.4, color="r", lw=0.8, ls="--", label="target 1.4x")
    ax.set_xticks(x, names, rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("GPU time of one eager call / floor")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("one step of one layer, bf16, 32/8 heads, D 128, block 16 (H200)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--cases", default=None)
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    chosen = bench_calls.select(CASES, args.cases)
    if args.list:
        print("\n".join(chosen))
        return 0
    bench_calls.warm_clocks()
    report = {"device": bench_calls.device_name(), "date": datetime.date.today().isoformat(),
              "versions": bench_calls.versions(), "ceiling": ceiling.describe(), "cases": []}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in chosen:
        print(f"{name}:", flush=True)
        try:
            report["cases"].append(run_case(name, args.reps))
        except Exception as error:  # noqa: BLE001 - a failing case is reported, the run goes on
            traceback.print_exc()
            report.setdefault("failed", {})[name] = f"{type(error).__name__}: {str(error)[:300]}"
        bench_calls.release()
        out.write_text(json.dumps(report, indent=1) + "\n")
    if report["cases"]:
        plot(report["cases"], out.with_suffix(".png"))
    print("\n| case | path | ours ms | floor ms | x floor | split ms | FA2 ms | ours ragged ms | FA2 / ours "
          "| ours host us | split host us | FA2 host us |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in report["cases"]:
        p = r["peers"]
        fa2 = p.get(FA2)
        print(f"| {r['name']} | {r['path']} | {r['value']:.3f} | {r['floor']:.3f} | {r['over_floor']:.2f} "
              f"| {p.get(SPLIT, float('nan')):.3f} | {fa2 or float('nan'):.3f} "
              f"| {p.get(OURS_RAGGED, float('nan')):.3f} | {(fa2 or 0) / r['value']:.2f} "
              f"| {r['host_us'][OURS]:.1f} | {r['host_us'][SPLIT]:.1f} | {r['host_us'][FA2]:.1f} |")
    decode_only = [r for r in report["cases"] if VARLEN_CALL in r["peers"]]
    if decode_only:
        print(f"\n| decode-only case | floor ms | ours (plan) ms | split = {{kvcache call}} ms | {KV_KERNEL} ms "
              f"| {VARLEN_CALL} ms | {VARLEN_KERNEL} ms | FA2 ms | read ceiling fraction: plan / kvcache / varlen |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for r in decode_only:
            p = r["peers"]
            fractions = " / ".join(f"{r['floor'] / v:.2f}" for v in (r["value"], p[SPLIT], p[VARLEN_CALL]))
            print(f"| {r['name']} | {r['floor']:.3f} | {r['value']:.3f} | {p[SPLIT]:.3f} | {p[KV_KERNEL]:.3f} "
                  f"| {p[VARLEN_CALL]:.3f} | {p[VARLEN_KERNEL]:.3f} | {p[FA2]:.3f} | {fractions} |")
    return 1 if report.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
