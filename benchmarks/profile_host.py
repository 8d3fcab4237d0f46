"""Where a call's host microseconds go: each part of the decode fast path timed alone.

For a decode call of 64 x 128 (bf16, 32/8 heads, D=128, block 16) with torch tensors and with
CuPy arrays, times each step the fast path takes (attribute reads, the memo key, the output
allocation, the stream, the argument packing, the driver launch) as the mean of many
repetitions, then the whole call, and prints a cProfile of the whole call.
Run: ``python benchmarks/profile_host.py`` on a GPU machine.
"""
from __future__ import annotations

import cProfile
import io
import pathlib
import pstats
import sys
import time

sys.path.insert(0, pathlib.Path(__file__).resolve().parents[1].as_posix())

import cupy  # noqa: E402

import cupy_paged  # noqa: E402
from cupy_paged._core import arrays as _arrays, streams as _streams  # noqa: E402
from cupy_paged.api import _call  # noqa: E402

sys.path.insert(0, pathlib.Path(__file__).resolve().parent.as_posix())
from bench_calls import _spin_kernel, busy as keep_busy, plan_call  # noqa: E402  (benchmarks/ on the path)

N = 20000


def mean_us(fn, n: int = N, busy: bool = False) -> float:
    """Mean host time of ``fn()``; with ``busy``, in rounds of 100 calls queued behind a kernel that
    keeps the GPU busy (so launches never wait for the GPU), the GPU drained between rounds."""
    for _ in range(200):
        fn()
    if not busy:
        start = time.perf_counter_ns()
        for _ in range(n):
            fn()
        return (time.perf_counter_ns() - start) / n / 1e3
    total, calls = 0, 0
    for _ in range(max(1, n // 100)):
        cupy.cuda.Device().synchronize()
        keep_busy(cupy.cuda.get_current_stream().ptr, 0.005)
        start = time.perf_counter_ns()
        for _ in range(100):
            fn()
        total += time.perf_counter_ns() - start
        calls += 100
    cupy.cuda.Device().synchronize()
    return total / calls / 1e3


def ragged_layer(kind: str, torch):
    """One ``StepPlan.attention`` call of a ragged decode-only step (CuPy arrays or torch views)."""
    from bench_calls import filled_cache
    from bench_decode import randn_bf16

    cache, ids = filled_cache([32768] + [512] * 63, [1] * 64, shuffle_seed=0)
    plan = cupy_paged.build_plan(cache, ids, [1] * 64, num_heads=32)
    assert plan.path == "ragged", plan.path
    q, k, v = randn_bf16((64, 32, 128)), randn_bf16((64, 8, 128)), randn_bf16((64, 8, 128))
    if kind == "torch":
        q, k, v = (torch.from_dlpack(x) for x in (q, k, v))
    k_cache, v_cache = cache.layer(0)
    return lambda: plan.attention(q, k, v, k_cache, v_cache)


def print_profile(label: str, fn, calls: int) -> None:
    """A cProfile (tottime) of ``calls`` calls of ``fn``, queued behind a busy GPU in rounds of 100."""
    profiler = cProfile.Profile()
    for _ in range(max(1, calls // 100)):
        cupy.cuda.Device().synchronize()
        keep_busy(cupy.cuda.get_current_stream().ptr, 0.02)
        profiler.enable()
        for _ in range(100):
            fn()
        profiler.disable()
    cupy.cuda.Device().synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
    print(f"--- cProfile, {label}, {calls} calls (tottime)")
    print("\n".join(text.getvalue().splitlines()[:40]))


def main() -> None:
    import torch

    batch, context, heads, kv_heads, dim, block = 64, 128, 32, 8, 128, 16
    blocks = batch * context // block
    table = torch.randperm(blocks, dtype=torch.int32, device="cuda").reshape(batch, -1)
    kc = torch.randn(blocks, block, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    vc = torch.randn_like(kc)
    q = torch.randn(batch, 1, heads, dim, dtype=torch.bfloat16, device="cuda")
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    cq, ckc, cvc = (_arrays.read(x, "x").cupy() for x in (q, kc, vc))  # bfloat16 views of the same memory
    ctable, clens = cupy.asarray(table), cupy.asarray(lens)

    rows = []
    for kind, (q_, kc_, vc_, table_, lens_) in (("torch", (q, kc, vc, table, lens)),
                                                ("cupy", (cq, ckc, cvc, ctable, clens))):
        call = lambda: cupy_paged.flash_attn_with_kvcache(q_, kc_, vc_, cache_seqlens=lens_, block_table=table_)  # noqa: E731
        call()
        torch.cuda.synchronize()
        key, sig = None, _arrays.FAST_READERS[kind][0]
        for k, v in _call.MEMO.items():
            if k[0] == "decode" and k[1] == _arrays.signature(q_):
                key, launch = k, v
        parts = {
            "kind_of(q)": lambda: _arrays.kind_of(q_),
            "signature(q)": lambda: _arrays.signature(q_),
            "data_ptr(q)": lambda: _arrays.data_ptr(q_),
            "fast signature(q)": lambda: _arrays.FAST_READERS[kind][0](q_),
            "key (28 entries)": lambda: ("decode", sig(q_), sig(kc_), sig(vc_), None, None, None, None, sig(lens_),
                                         None, None, sig(table_), None, False, (-1, -1), 0.0, True, None, 0, False,
                                         None, None, bool, bool, bool, int, int, int),
            "memo get": lambda: _call.MEMO.get(key),
            "current device": _call.current_device,
            "stream handle": lambda: _streams.handle(None, kind, 0),
            "empty out": lambda: _arrays.empty(kind, q_, launch.out_shape, launch.dtype),
        }
        ptrs = (_arrays.data_ptr(q_), _arrays.data_ptr(kc_), _arrays.data_ptr(vc_), 0, 0, _arrays.data_ptr(lens_),
                _arrays.data_ptr(table_), 0, 0, 0, 0, 0)
        out = _arrays.empty(kind, q_, launch.out_shape, launch.dtype)
        out_arg = (out, _arrays.data_ptr(out))
        stream = _streams.handle(None, kind, 0)
        parts["launch.run (out given)"] = lambda: launch.run(kind, q_, ptrs, 0, out_arg, None, stream)
        l = launch.launch
        args = l._struct.unpack_from(l._buffer, 0)  # as many values as the launcher's struct holds
        parts["struct.pack_into"] = lambda: l._struct.pack_into(l._buffer, 0, *args)
        parts["whole call"] = call
        parts["whole call, out="] = lambda: cupy_paged.flash_attn_with_kvcache(q_, kc_, vc_, cache_seqlens=lens_,
                                                                              block_table=table_, out=out)
        from cupy_paged.kernels._launch import Launcher

        _spin = _spin_kernel()

        bare = Launcher(_spin, "Q")
        parts["bare launch of an empty kernel (GPU busy)"] = lambda: bare((1, 1, 1), 1, 0, stream, 0)
        parts["CuPy RawKernel call of it (GPU busy)"] = lambda: _spin((1,), (1,), (cupy.uint64(0),))
        parts["torch.empty(shape, device)"] = (lambda: torch.empty(launch.out_shape, dtype=torch.bfloat16,
                                                                   device=q.device)) if kind == "torch" else (lambda: None)
        parts["torch.empty_like(q)"] = (lambda: torch.empty_like(q_)) if kind == "torch" else (lambda: None)
        for name, fn in parts.items():
            busy = "GPU busy" in name or "call" in name or "launch" in name
            label = name if "GPU busy" in name or not busy else name + " (GPU busy)"
            rows.append((kind, label, mean_us(fn, 3000 if busy else N, busy)))
            torch.cuda.synchronize()
        if kind == "cupy":  # one layer through the step plan (decode path: one new token each), steady state
            layer, plan = plan_call([context] * batch, [1] * batch)
            rows.append((kind, f"StepPlan.attention, one {plan.path} layer (GPU busy)", mean_us(layer, 3000, True)))
            layer_out, _ = plan_call([context] * batch, [1] * batch, out=True)
            rows.append((kind, f"StepPlan.attention, one {plan.path} layer, out= given (GPU busy)",
                         mean_us(layer_out, 3000, True)))
            chunk_layer, chunk_plan = plan_call([1536] + [context] * 15, [512] + [1] * 15)
            rows.append((kind, f"StepPlan.attention, one {chunk_plan.path} layer: write + attention (GPU busy)",
                         mean_us(chunk_layer, 1000, True)))
        # A decode-only step through the ragged launch (a plan with num_heads): one 32k context among 63
        # of 512, as bench_mixed.py's "ragged decode 1x32k + 63x512" (one launch; the splits merged in it).
        ragged = ragged_layer(kind, torch)
        rows.append((kind, "StepPlan.attention, one ragged layer, 1x32k + 63x512 (GPU busy)",
                     mean_us(ragged, 300, True)))
        print_profile(f"ragged layer, {kind}", ragged, 300)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(3000):
            call()
        profiler.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
        print(f"--- cProfile, {kind}, 3000 calls (tottime)")
        print("\n".join(text.getvalue().splitlines()[:40]))
    # The varlen TMA shapes' tensor maps (v16b): a call whose K/V moved encodes two maps through the
    # driver; one whose K/V stayed put finds them in the memo.
    from cupy_paged._core import tma
    from cupy_paged._core.types import BF16

    if tma.available():
        maps = tma.KvMaps(BF16, dim, kv_heads, (kv_heads * dim, dim, kv_heads * dim, dim), blocks * block,
                          tma.CONTIGUOUS_BOX_ROWS)
        base, moved = _arrays.data_ptr(kc), iter(range(1 << 40))
        rows.append(("-", "tensor maps, K/V at new addresses (two encodings)",
                     mean_us(lambda: maps.maps(base + 16 * next(moved), base), N)))
        rows.append(("-", "tensor maps, K/V where they were (memo)", mean_us(lambda: maps.maps(base, base), N)))
    print("| kind | part | mean us |")
    print("| --- | --- | ---: |")
    for kind, name, us in rows:
        print(f"| {kind} | {name} | {us:.2f} |")


if __name__ == "__main__":
    main()
