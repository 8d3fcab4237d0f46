"""What a kernel's first launch pays when its machine code is no longer in the L2.

A decode call in a serving step, or one eager call, runs after other kernels have streamed far
more than the 50 MB L2: its instructions must come from device memory again.  The decode kernel
is 94 KB of SASS (the ragged specialization behind the balanced default 130 KB), and one launch
runs its prologue, loop and epilogue once per CTA.  This measures how much of a launch that is.

Each sample queues, on one stream behind a spinning kernel (so no host time is inside):

    [flush: a kernel reading 256 MB through the L2]  [prep]  e0 [call, input set 1] e1 [call, input set 2] e2

``first`` = e1 - e0: code and data cold; ``second`` = e2 - e1: the same kernel again on its other
input set (data cold: the flush and the first call read other memory), code warm.  ``prep``:

* ``flush``: nothing;
* ``flush+smem``: an empty kernel holding 200 KB of shared memory on every SM, so that the first
  call does not start with a change of the SM's shared-memory carveout after the flush;
* ``flush+prewarm``: our calls only, the same kernel specialization launched on the first sequence
  alone (a few CTAs): its code then sits in the L2, as a launch beside the previous kernel would
  leave it.

Calls: ours with CuPy arrays and default arguments, ours with ``num_splits=1`` where the default
balances (the decode kernel), cuDNN SDPA through torch on contiguous K/V, and a control, CuPy's
elementwise add of two 64 x 2,048 float32 arrays (a small kernel).  Cases (bf16, D = 128, block 16,
shuffled table): decode 64 x 128 and 64 x 4096 at 32 query / 8 kv heads, and 64 x 576 at 16 / 4
(the example engine's decode step shape: 256 CTAs, one wave).

    python benchmarks/exp_cold_code.py [--reps 30] [--out benchmarks/results/cold_code.json]
    python benchmarks/exp_cold_code.py --ncu-target "decode 64x128"   # three of each call of a case, for ncu
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import bench_calls  # noqa: E402  (busy, versions, device name)
import bench_decode  # noqa: E402  (inputs)

import cupy_paged  # noqa: E402
from cupy_paged._core.types import BF16  # noqa: E402

BLOCK, DIM = 16, 128
FLUSH_BYTES = 256 << 20
SMEM_BYTES = 200 << 10
RESULTS = HERE / "results" / "cold_code.json"
CASES = {"decode 64x128": (64, 128, 32, 8), "decode 64x4096": (64, 4096, 32, 8), "decode 64x576 16/4": (64, 576, 16, 4)}
PREPS = ("flush", "flush+smem", "flush+prewarm")

_SOURCE = r"""
extern "C" __global__ void read_all(const uint4* p, long long n, unsigned* sink) {
  unsigned acc = 0;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const uint4 v = __ldcg(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;  // never, in practice: keeps the loads
}
extern "C" __global__ void hold_smem(unsigned* sink) {
  extern __shared__ unsigned held[];
  if (sink == nullptr && threadIdx.x == 0) held[0] = 1u;
}
"""


class Preps:
    """The flush and the shared-memory kernel."""

    def __init__(self):
        import cupy

        module = cupy.RawModule(code=_SOURCE)
        self.read_all = module.get_function("read_all")
        self.hold = module.get_function("hold_smem")
        self.hold.max_dynamic_shared_size_bytes = SMEM_BYTES
        self.buffer = cupy.zeros(FLUSH_BYTES // 16 * 4, np.uint32)
        self.sink = cupy.zeros(1, np.uint32)
        self.sms = cupy.cuda.Device().attributes["MultiProcessorCount"]

    def flush(self):
        self.read_all((self.sms * 8,), (256,), (self.buffer, np.int64(FLUSH_BYTES // 16), self.sink))

    def smem(self):
        self.hold((self.sms,), (128,), (self.sink,), shared_mem=SMEM_BYTES)


def decode_set(batch, context, heads, kv_heads, seed):
    """One input set: CuPy arrays for ours, torch views of contiguous copies for cuDNN."""
    import torch

    (q, k_cache, v_cache, table, lens), = bench_decode.make_paged(np.random.default_rng(seed), batch, context, BLOCK,
                                                                   heads=heads, kv_heads=kv_heads)
    gather = lambda cache: cache.view(np.uint16)[table].reshape(batch, context, kv_heads, DIM).view(BF16)  # noqa: E731
    tq, tk, tv = (torch.from_dlpack(a) for a in (q, gather(k_cache), gather(v_cache)))
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, table=table, lens=lens,
                cudnn=(tq.transpose(1, 2), tk.transpose(1, 2), tv.transpose(1, 2)))


def calls_of(s: dict) -> dict:
    """{name: (call, prewarm or None)} of one input set."""
    import torch.nn.functional as F

    from cupy_paged.api.decode import prepare_decode
    from cupy_paged.kernels import decode

    q, kc, vc, table, lens = s["q"], s["k_cache"], s["v_cache"], s["table"], s["lens"]
    full = prepare_decode(q, kc, vc, cache_seqlens=lens, block_table=table)
    balanced = decode.balances(full)

    def tiny_default():
        cupy_paged.flash_attn_with_kvcache(q[:1], kc, vc, cache_seqlens=lens[:1], block_table=table[:1])

    def tiny_kernel(p_full):
        tiles = decode._problem_shape(p_full, None).tiles
        p = prepare_decode(q[:1], kc, vc, cache_seqlens=lens[:1], block_table=table[:1], num_splits=1)
        return lambda: decode.run(p, tiles)

    found = {"ours default": (lambda: cupy_paged.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens,
                                                                         block_table=table),
                              tiny_default if balanced else tiny_kernel(full))}
    if balanced:
        one = prepare_decode(q, kc, vc, cache_seqlens=lens, block_table=table, num_splits=1)
        found["ours num_splits=1"] = (lambda: cupy_paged.flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=lens, block_table=table, num_splits=1), tiny_kernel(one))
    qt, kt, vt = s["cudnn"]
    found["cuDNN SDPA"] = (lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True), None)
    return found


def control_calls() -> dict:
    import cupy

    a, b, c = (cupy.ones((64, 2048), np.float32) for _ in range(3))
    d, e, f = (cupy.ones((64, 2048), np.float32) for _ in range(3))
    return {"cupy add (control)": ((lambda: cupy.add(a, b, out=c), None), (lambda: cupy.add(d, e, out=f), None))}


def sample(preps: Preps, prep: str, first, second, prewarm) -> tuple:
    """(first, second) in us of one sample (see the module docstring)."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    e0, e1, e2 = cupy.cuda.Event(), cupy.cuda.Event(), cupy.cuda.Event()
    bench_calls.busy(stream.ptr, 0.002)
    preps.flush()
    if prep == "flush+smem":
        preps.smem()
    elif prep == "flush+prewarm":
        prewarm()
    e0.record(stream)
    first()
    e1.record(stream)
    second()
    e2.record(stream)
    e2.synchronize()
    return cupy.cuda.get_elapsed_time(e0, e1) * 1e3, cupy.cuda.get_elapsed_time(e1, e2) * 1e3


def run_case(preps: Preps, pairs: dict, reps: int) -> list:
    rows = []
    for name, ((call1, warm1), (call2, _)) in pairs.items():
        for _ in range(5):
            call1(), call2()
            if warm1 is not None:
                warm1()
        for prep in PREPS:
            if prep == "flush+prewarm" and warm1 is None:
                continue
            firsts, seconds = zip(*(sample(preps, prep, call1, call2, warm1) for _ in range(reps)))
            rows.append({"call": name, "prep": prep, "first_us": round(float(np.median(firsts)), 2),
                         "second_us": round(float(np.median(seconds)), 2),
                         "cold_minus_warm_us": round(float(np.median(np.subtract(firsts, seconds))), 2)})
            r = rows[-1]
            print(f"  {name:<22} {prep:<14} first {r['first_us']:9.2f}  second {r['second_us']:9.2f}  "
                  f"first - second {r['cold_minus_warm_us']:7.2f} us", flush=True)
    return rows


def ncu_target(case: str) -> int:
    """Three of each call of ``case`` (a key of ``CASES``), for ``ncu -k regex:'paged_decode|cudnn'``."""
    import cupy
    from torch.nn.attention import SDPBackend, sdpa_kernel

    s = decode_set(*CASES[case], 1)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        for name, (call, _) in calls_of(s).items():
            print(name, flush=True)
            for _ in range(3):
                call()
    cupy.cuda.get_current_stream().synchronize()
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--ncu-target", metavar="CASE", default=None, help="only make the calls of CASE, for ncu")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if args.ncu_target:
        return ncu_target(args.ncu_target)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    preps = Preps()
    bench_calls.warm_clocks()
    report = {"device": bench_calls.device_name(), "date": datetime.date.today().isoformat(),
              "versions": bench_calls.versions(), "method": __doc__.split("\n\n")[1].strip(), "reps": args.reps,
              "cases": {}}
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        for case, (batch, context, heads, kv_heads) in CASES.items():
            print(f"{case}:", flush=True)
            one, two = calls_of(decode_set(batch, context, heads, kv_heads, 1)), calls_of(
                decode_set(batch, context, heads, kv_heads, 2))
            report["cases"][case] = run_case(preps, {name: (one[name], two[name]) for name in one}, args.reps)
            bench_calls.release()
        print("control:", flush=True)
        report["cases"]["control"] = run_case(preps, control_calls(), args.reps)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print("\n| case | call | prep | first us | second us | first - second |\n| --- | --- | --- | ---: | ---: | ---: |")
    for case, rows in report["cases"].items():
        for r in rows:
            print(f"| {case} | {r['call']} | {r['prep']} | {r['first_us']} | {r['second_us']} | "
                  f"{r['cold_minus_warm_us']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
