"""The varlen prefill kernel on the H200 against its peers, in one run.

Cases (bf16, GQA 32 query / 8 kv heads unless named):

* ``causal_d128_8x4096``, ``causal_d128_mixed`` (lengths 512..8192), ``causal_d64_16x2048``,
  ``causal_d256_8x4096``: TFLOP/s of this package's default kernel (contiguous K/V; on an
  H100/H200 the wgmma kernel), with torch's FlashAttention-2 varlen op
  (``aten._flash_attention_forward`` with cum_seq) and cuDNN SDPA (dense, padded batch; uniform
  lengths only) as peers where the machine has them, and this package's other kernel
  (``mma_sync``, the one non-Hopper GPUs run) in the same run;
* ``paged_bs{16,32,128}_d128_8x4096``: the same kernel reading K/V through a shuffled block
  table, as a ratio to the contiguous kernel on the same data (target >= 0.9);
* ``chunk512_after_32k``: a 512-token prefill chunk after a 32k-token cached prefix:
  write the chunk's K/V with ``write_kv_cache`` then attend over the paged cache, against the
  manual path (``PagedAttentionCache.update`` scatter + gather, then the contiguous kernel);
  metric: speed-up (target >= 1.5);
* ``write_kv_cache_8x4096``: GB/s (bytes read + written) of the cache write;
* ``mixed_step_bs16``: one 512-token prefill chunk plus 255 one-token decodes at 2k context,
  paged, block size 16, through the varlen kernel (milliseconds), next to the two-launch split
  (varlen for the chunk, ``flash_attn_with_kvcache`` for the decodes) when that kernel runs.

FLOPs are ``4 Lq Lk D H`` per sequence, halved when causal.  Times are medians of CUDA-event
timings after warm-up.  ``--sweep`` then (after the results are written, so that a failing
candidate loses only the sweep) times on the prefill workloads the candidate tile shapes of
the registered kernel (:data:`WGMMA_SWEEP`), each with its registers as built here
and its largest difference from the registered kernel's output; it adds ``"sweep"`` to the JSON
and prints its table last.
Writes ``benchmarks/results/varlen.json`` and prints a short table last.

Run: ``python benchmarks/bench_varlen.py [--sweep] [--reps N]`` (``--warm`` only compiles).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import platform
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import cupy_paged  # noqa: E402
from cupy_paged._core.types import BF16  # noqa: E402
from cupy_paged._core.compiler import get_function  # noqa: E402
from cupy_paged.kernels import varlen as varlen_ops  # noqa: E402
from cupy_paged.kernels import varlen_wgmma  # noqa: E402
from cupy_paged.kernels.varlen import TILES, WGMMA_TILES  # noqa: E402
from cupy_paged.kernels.varlen_wgmma import WgmmaTiles  # noqa: E402

H, HKV = 32, 8
RESULTS = ROOT / "benchmarks" / "results" / "varlen.json"
# --sweep times these wgmma tile shapes (head dim -> shapes) on the same data as the registered
# kernel (each also checked by tests/test_varlen_gpu.py's WGMMA_CANDIDATES): the defaults before
# v11 (one-warpgroup CTAs at D=64, v9 at D=128), the v12 candidate (the softmax under P V on the
# cp.async producer) and the TMA shapes (v16b registers the last at D = 128 and the D = 64 one for
# paged caches, so beside the registered path they time the other layout's choice); earlier
# sweeps, with their outcomes, are in NOTES_varlen.md.
WGMMA_SWEEP: dict[int, tuple[WgmmaTiles, ...]] = {
    64: (WgmmaTiles(64, 2, groups=1), WgmmaTiles(128, 2, producer=True, pv_overlap=True),
         WgmmaTiles(128, 2, producer=True, tma=True)),
    128: (WgmmaTiles(128, 2, producer=True), WgmmaTiles(128, 2, producer=True, staged_store=True, pv_overlap=True),
          WgmmaTiles(128, 2, producer=True, staged_store=True, tma=True),
          WgmmaTiles(128, 2, producer=True, staged_store=True, pv_overlap=True, tma=True)),
}


def lognormal_lengths(count: int = 40, seed: int = 7) -> list[int]:
    """``count`` lengths lognormal(6.5, 1.0), clipped to 16..16384, truncated to ints (the
    lognormal40 batch of bench_calls.py and of the sweep)."""
    draws = np.random.default_rng(seed).lognormal(6.5, 1.0, count)
    return [int(n) for n in np.clip(draws, 16, 16384)]


def mixed_lengths() -> list[int]:
    return [int(n) for n in np.random.default_rng(0).integers(512, 8193, 12)]


def flops(lens_q, lens_k, head_dim, causal=True) -> float:
    total = sum(4.0 * lq * lk * head_dim * H for lq, lk in zip(lens_q, lens_k))
    return total / 2 if causal else total


def time_ms(fn, reps: int, warmup: int = 3) -> float:
    """Median of per-call CUDA-event timings on the null stream (torch's default stream too)."""
    import cupy

    for _ in range(warmup):
        fn()
    cupy.cuda.runtime.deviceSynchronize()
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(reps)]
    for start, stop in events:
        start.record()
        fn()
        stop.record()
    events[-1][1].synchronize()
    return float(np.median([cupy.cuda.get_elapsed_time(a, b) for a, b in events]))


def interleaved_ms(fns: dict, reps: int, rounds: int = 3) -> dict:
    """``{name: ms}``: each call of ``fns`` timed in ``rounds`` rounds that take the calls in turn
    (forward, then backward, ...), ``reps // rounds`` calls a round (at least 3), and the median
    of each call's round medians: a drift of the GPU's clocks or temperature over the run then
    falls on every call alike, where timing one call after another puts it on the later ones."""
    times: dict = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(time_ms(fns[name], max(3, reps // rounds)))
    return {name: float(np.median(values)) for name, values in times.items()}


# --------------------------------------------------------------------------- inputs

def random_bf16(rng, shape):
    """Standard-normal bf16 on the device (never zeros: they time faster than real data)."""
    import cupy

    values = rng.standard_normal(shape, dtype=np.float32)
    try:
        return values.astype(BF16)
    except Exception:  # noqa: BLE001 - a CuPy without bf16 kernels: round on the host
        return cupy.asarray(cupy.asnumpy(values).astype(BF16))


class Batch:
    """Random bf16 q/k/v for given lengths, as CuPy arrays and zero-copy torch views."""

    def __init__(self, lens_q, lens_k, head_dim, seed=0):
        import cupy

        rng = cupy.random.default_rng(seed)
        self.lens_q, self.lens_k, self.head_dim = list(lens_q), list(lens_k), head_dim
        self.cu_q, self.max_q = cupy_paged.cu_seqlens_from_lengths(lens_q, xp=cupy)
        self.cu_k, self.max_k = cupy_paged.cu_seqlens_from_lengths(lens_k, xp=cupy)
        tq, tk = sum(lens_q), sum(lens_k)
        self.q = random_bf16(rng, (tq, H, head_dim))
        self.k = random_bf16(rng, (tk, HKV, head_dim))
        self.v = random_bf16(rng, (tk, HKV, head_dim))
        self.out = cupy.empty_like(self.q)

    def ours(self, tiles=None, paged=None):
        """This kernel as a no-argument call: contiguous K/V, or ``paged = (k_cache, v_cache, table)``."""
        k, v, table = paged if paged is not None else (self.k, self.v, None)
        if tiles is None:
            return lambda: cupy_paged.flash_attn_varlen_func(
                self.q, k, v, self.cu_q, self.cu_k, self.max_q, self.max_k, causal=True,
                block_table=table, out=self.out, check_values=False)
        from cupy_paged.api.varlen import prepare_varlen

        p = prepare_varlen(self.q, k, v, self.cu_q, self.cu_k, self.max_q, self.max_k,
                           None, True, (-1, -1), 0.0, None, table, False, self.out, False)
        launch = varlen_ops.VarlenLaunch(p, tiles)  # resolved once: the closure times the launch
        args = varlen_ops.problem_args(p)
        import cupy as _cupy

        return lambda: launch.run("cupy", None, *args, _cupy.cuda.get_current_stream().ptr)

    def paged(self, block_size, seed=1):
        """(k_cache, v_cache, block_table) holding the same keys behind a shuffled table."""
        import cupy

        counts = [-(-n // block_size) for n in self.lens_k]
        num_blocks = sum(counts)
        order = np.random.default_rng(seed).permutation(num_blocks).astype(np.int32)
        table = np.full((len(counts), max(counts)), -1, np.int32)
        slots, used = [], 0
        for b, (n, c) in enumerate(zip(self.lens_k, counts)):
            table[b, :c] = order[used:used + c]
            used += c
            pos = np.arange(n)
            slots.append(table[b, pos // block_size].astype(np.int64) * block_size + pos % block_size)
        slots = cupy.asarray(np.concatenate(slots))
        caches = []
        for src in (self.k, self.v):
            cache = cupy.zeros((num_blocks, block_size, HKV, self.head_dim), BF16)
            cache.reshape(-1, HKV, self.head_dim)[slots] = src
            caches.append(cache)
        return caches[0], caches[1], cupy.asarray(table)

    def torch_views(self):
        import torch

        t = torch.from_dlpack
        return t(self.q), t(self.k), t(self.v), t(self.cu_q), t(self.cu_k)


def torch_fa2(batch: Batch):
    """torch's FlashAttention-2 varlen forward, or None where torch/its flash op is absent."""
    try:
        import torch

        q, k, v, cu_q, cu_k = batch.torch_views()

        def call():
            return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, batch.max_q, batch.max_k,
                                                           0.0, True, False)
        call()
        return call
    except Exception as error:  # noqa: BLE001 - a peer that cannot run is skipped, with the reason
        print(f"  (torch FA2 varlen skipped: {type(error).__name__}: {str(error)[:120]})")
        return None


def torch_cudnn(batch: Batch):
    """cuDNN SDPA on the dense padded batch (uniform lengths only), or None."""
    if len(set(batch.lens_q)) != 1 or batch.lens_q != batch.lens_k:
        return None
    try:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q, k, v, _, _ = batch.torch_views()
        b, n = len(batch.lens_q), batch.lens_q[0]
        qd = q.view(b, n, H, -1).transpose(1, 2)
        kd = k.view(b, n, HKV, -1).repeat_interleave(H // HKV, dim=2).transpose(1, 2).contiguous()
        vd = v.view(b, n, HKV, -1).repeat_interleave(H // HKV, dim=2).transpose(1, 2).contiguous()

        def call():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
        call()
        return call
    except Exception as error:  # noqa: BLE001
        print(f"  (cuDNN SDPA skipped: {type(error).__name__}: {str(error)[:120]})")
        return None


# --------------------------------------------------------------------------- cases

def prefill_case(name, lens, head_dim, reps, cases):
    batch = Batch(lens, lens, head_dim)
    work = flops(lens, lens, head_dim)
    tflops = lambda ms: round(work / ms / 1e9, 1)  # noqa: E731
    value = tflops(time_ms(batch.ours(), reps))
    peers = {}
    if varlen_ops.wgmma_available(head_dim):  # the package's other kernel, on the same data
        peers["cupy_paged_mma_sync"] = tflops(time_ms(batch.ours(TILES[head_dim]), reps))
    for peer, make in (("torch_fa2_varlen", torch_fa2), ("cudnn_sdpa", torch_cudnn)):
        fn = make(batch)
        if fn is not None:
            peers[peer] = tflops(time_ms(fn, reps))
    cases.append(dict(name=name, metric="TFLOP/s", value=value, peers=peers))
    print(f"{name:28} {value:8.1f} TFLOP/s  {peers}", flush=True)
    return batch, value


def sweep_case(name, lens, head_dim, reps, lens_k=None, block_size=None):
    """The registered kernel and every WGMMA_SWEEP shape of ``head_dim`` on one batch (causal;
    keys ``lens_k``, default ``lens``; through a shuffled block table of ``block_size`` when
    given): TFLOP/s (all timed in turn: interleaved_ms), registers and local memory of the shape
    as built on this machine, and the largest difference of its output from the registered
    kernel's."""
    import cupy

    lens_k = lens_k or lens
    batch = Batch(lens, lens_k, head_dim)
    paged = batch.paged(block_size) if block_size else None
    work = flops(lens, lens_k, head_dim)
    registered = batch.ours(paged=paged)
    registered()
    reference = batch.out.astype(np.float32)
    calls, variants = {"(registered)": registered}, {}
    for tiles in WGMMA_SWEEP.get(head_dim, ()):
        label = tiles.label()
        fn = batch.ours(tiles, paged)
        batch.out.view(np.uint16).fill(0x7FC0)  # NaN: an unwritten output shows
        fn()
        diff = float(cupy.abs(batch.out.astype(np.float32) - reference).max())
        kernel = get_function(*varlen_ops.specialization(BF16, head_dim, tiles), tiles.smem_bytes(head_dim))
        calls[label] = fn
        variants[label] = dict(maxdiff=diff, registers=kernel.num_regs, local_bytes=kernel.local_size_bytes)
    ms = interleaved_ms(calls, reps)
    row = dict(name=name, registered=round(work / ms.pop("(registered)") / 1e9, 1), variants={})
    for label, info in variants.items():
        row["variants"][label] = dict(tflops=round(work / ms[label] / 1e9, 1), **info)
        print(f"  sweep {name:24} {label:22} {row['variants'][label]}", flush=True)
    return row


def paged_cases(batch, contiguous_ms, reps, cases):
    for block_size in (16, 32, 128):
        ms = time_ms(batch.ours(paged=batch.paged(block_size)), reps)
        ratio = round(contiguous_ms / ms, 3)
        cases.append(dict(name=f"paged_bs{block_size}_d128_8x4096", metric="x contiguous", value=ratio,
                          peers={"paged_ms": round(ms, 3), "contiguous_ms": round(contiguous_ms, 3)}))
        print(f"paged bs{block_size:<3}                  {ratio:8.3f} x contiguous ({ms:.3f} ms)", flush=True)


def chunk_after_prefix_case(reps, cases):
    """512 new tokens after 32768 cached ones, one sequence, block size 16."""
    import cupy
    from cupy_paged.serving.kv_cache import PagedAttentionCache

    prefix, chunk, block_size, head_dim = 32768, 512, 16, 128
    total = prefix + chunk
    num_blocks = total // block_size
    cache = PagedAttentionCache(1, HKV, head_dim, block_size=block_size, num_blocks=num_blocks, dtype=BF16,
                                device="cuda", max_seqs=1, max_blocks_per_seq=num_blocks,
                                enable_prefix_caching=False)
    k_cache, v_cache = cache.layer(0)
    rng = cupy.random.default_rng(3)
    k_cache[...] = random_bf16(rng, k_cache.shape)
    v_cache[...] = random_bf16(rng, v_cache.shape)
    table = np.random.default_rng(3).permutation(num_blocks).astype(np.int32)
    pos = np.arange(total)
    slots = (table[pos // block_size].astype(np.int64) * block_size + pos % block_size)
    read_index, write_index = cupy.asarray(slots), cupy.asarray(slots[prefix:])
    write_slots = cupy.asarray(slots[prefix:].astype(np.int32))
    q = random_bf16(rng, (chunk, H, head_dim))
    k_new = random_bf16(rng, (chunk, HKV, head_dim))
    v_new = random_bf16(rng, (chunk, HKV, head_dim))
    cu_q = cupy.asarray([0, chunk], np.int32)
    cu_k = cupy.asarray([0, total], np.int32)
    table_d = cupy.asarray(table[None])
    out = cupy.empty_like(q)

    def manual():  # the manual path: update() scatters and gathers, then the contiguous kernel
        keys, values = cache.update(k_new, v_new, 0, read_index, write_index)
        cupy_paged.flash_attn_varlen_func(q, keys, values, cu_q, cu_k, chunk, total, causal=True, out=out,
                                          check_values=False)

    def paged():  # write, then attend straight from the paged cache
        cupy_paged.write_kv_cache(k_cache, v_cache, k_new, v_new, write_slots, check_values=False)
        cupy_paged.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, chunk, total, causal=True,
                                          block_table=table_d, out=out, check_values=False)
    paged()
    reference = out.copy()
    manual()
    agree = float(cupy.abs(out.astype(np.float32) - reference.astype(np.float32)).max())
    manual_ms, paged_ms = time_ms(manual, reps), time_ms(paged, reps)
    speedup = round(manual_ms / paged_ms, 2)
    cases.append(dict(name="chunk512_after_32k", metric="x manual path", value=speedup,
                      peers={"paged_ms": round(paged_ms, 3), "manual_update_then_contiguous_ms": round(manual_ms, 3)}))
    print(f"chunk512_after_32k           {speedup:8.2f} x manual ({paged_ms:.3f} vs {manual_ms:.3f} ms, "
          f"max |diff| {agree:.2e})", flush=True)


def write_case(reps, cases):
    import cupy

    tokens, block_size, head_dim = 8 * 4096, 16, 128
    rng = cupy.random.default_rng(4)
    k = random_bf16(rng, (tokens, HKV, head_dim))
    v = random_bf16(rng, (tokens, HKV, head_dim))
    num_blocks = tokens // block_size
    k_cache = cupy.empty((num_blocks, block_size, HKV, head_dim), BF16)
    v_cache = cupy.empty_like(k_cache)
    table = np.random.default_rng(4).permutation(num_blocks)
    pos = np.arange(tokens)
    slots = cupy.asarray((table[pos // block_size] * block_size + pos % block_size).astype(np.int32))
    # The kernel alone (check_values=False: no host copy of the slots), and the default call,
    # whose range check of the slots costs a device-to-host copy and a sync.
    ms = time_ms(lambda: cupy_paged.write_kv_cache(k_cache, v_cache, k, v, slots, check_values=False), reps)
    checked_ms = time_ms(lambda: cupy_paged.write_kv_cache(k_cache, v_cache, k, v, slots), reps)
    gbs = round(2 * 2 * k.nbytes / ms / 1e6, 1)
    checked_gbs = round(2 * 2 * k.nbytes / checked_ms / 1e6, 1)
    cases.append(dict(name="write_kv_cache_8x4096", metric="GB/s", value=gbs,
                      peers={"with_host_slot_check": checked_gbs}))
    print(f"write_kv_cache_8x4096        {gbs:8.1f} GB/s (read + written; {checked_gbs} with the host "
          f"slot check)", flush=True)


def mixed_step_case(reps, cases):
    """One 512-token prefill chunk + 255 one-token decodes at 2k context, paged, block size 16."""
    import cupy

    chunk, decodes, context, block_size, head_dim = 512, 255, 2048, 16, 128
    lens_q = [chunk] + [1] * decodes
    lens_k = [chunk] + [context] * decodes
    batch = Batch(lens_q, lens_k, head_dim, seed=5)
    k_cache, v_cache, table = batch.paged(block_size)
    one_launch = batch.ours(paged=(k_cache, v_cache, table))
    ms = time_ms(one_launch, reps)
    peers = {}
    try:  # two launches: varlen for the chunk, the decode kernel for the rest
        q_chunk, out_chunk = batch.q[:chunk], batch.out[:chunk]
        q_dec = batch.q[chunk:].reshape(decodes, 1, H, head_dim)
        out_dec = batch.out[chunk:].reshape(decodes, 1, H, head_dim)
        seqlens = cupy.full((decodes,), context, np.int32)
        cu_chunk = cupy.asarray([0, chunk], np.int32)

        def split():
            cupy_paged.flash_attn_varlen_func(q_chunk, k_cache, v_cache, cu_chunk, cu_chunk, chunk, chunk,
                                              causal=True, block_table=table[:1], out=out_chunk,
                                              check_values=False)
            cupy_paged.flash_attn_with_kvcache(q_dec, k_cache, v_cache, cache_seqlens=seqlens,
                                               block_table=table[1:], causal=True, out=out_dec,
                                               check_values=False)
        one_launch()
        reference = batch.out.copy()
        split()
        diff = float(cupy.abs(batch.out.astype(np.float32) - reference.astype(np.float32)).max())
        peers["varlen_chunk_plus_decode_ms"] = round(time_ms(split, reps), 3)
        print(f"  (split vs one launch: max |diff| {diff:.2e})")
    except Exception as error:  # noqa: BLE001
        print(f"  (two-launch split skipped: {type(error).__name__}: {str(error)[:160]})")
    cases.append(dict(name="mixed_step_bs16", metric="ms", value=round(ms, 3), peers=peers))
    print(f"mixed_step_bs16              {ms:8.3f} ms  {peers}", flush=True)


# --------------------------------------------------------------------------- resources

def resources() -> list[dict]:
    """Registers, shared memory and occupancy (from the limits of the device) per specialization."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    regs_sm, smem_sm = props["regsPerMultiprocessor"], props["sharedMemPerMultiprocessor"]
    rows = []
    wgmma = varlen_ops.wgmma_available(128)
    for key in varlen_ops.all_keys() + (varlen_wgmma.all_keys() if wgmma else []):
        params = dict(key.params)
        head_dim = params["HEAD_DIM"]
        tiles = WGMMA_TILES[head_dim] if key.arch else TILES[head_dim]  # every wgmma key of a head dim: its threads
        smem = params.get("SMEM_BYTES", tiles.smem_bytes(head_dim))
        fn = get_function(key, varlen_ops.WGMMA_KERNEL if key.arch else varlen_ops.KERNEL, smem)
        regs = fn.num_regs
        warps = tiles.threads // 32
        by_regs = regs_sm // (warps * 32 * math.ceil(regs / 8) * 8)
        by_smem = smem_sm // (smem + 1024)
        ctas = min(by_regs, by_smem, 64 // warps)
        rows.append(dict(key=str(key), registers=regs, local_bytes=fn.local_size_bytes, smem=smem,
                         ctas_per_sm=ctas, warps_per_sm=ctas * warps))
    return rows


def warm_all() -> None:
    """Compile the sweep's shapes, one process each (``python -m cupy_paged warm`` builds the
    registered ones)."""
    import multiprocessing

    keys = [varlen_ops.wgmma_key(BF16, d, t) for d, shapes in WGMMA_SWEEP.items() for t in shapes]
    with multiprocessing.get_context("spawn").Pool() as pool:
        pool.map(_warm_one, keys)


def _warm_one(key) -> None:
    from cupy_paged._core.compiler import get_module

    get_module(key)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="also time alternative tile shapes")
    parser.add_argument("--warm", action="store_true", help="only compile every shape, then exit")
    args = parser.parse_args()
    if args.warm:
        warm_all()
        return 0
    import cupy

    start = time.time()
    cases: list[dict] = []
    b, _ = prefill_case("causal_d128_8x4096", [4096] * 8, 128, args.reps, cases)
    contiguous_ms = time_ms(b.ours(), args.reps)
    paged_cases(b, contiguous_ms, args.reps, cases)
    del b
    prefill_case("causal_d128_mixed", mixed_lengths(), 128, args.reps, cases)
    prefill_case("causal_d64_16x2048", [2048] * 16, 64, args.reps, cases)
    prefill_case("causal_d256_8x4096", [4096] * 8, 256, args.reps, cases)
    chunk_after_prefix_case(args.reps, cases)
    write_case(args.reps, cases)
    mixed_step_case(args.reps, cases)
    kernels = resources()

    versions = {"python": platform.python_version(), "numpy": np.__version__, "cupy": cupy.__version__,
                "cupy_paged": cupy_paged.__version__}
    try:
        import torch

        versions["torch"] = torch.__version__
        versions["cudnn"] = str(torch.backends.cudnn.version())
    except ImportError:
        pass
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    result = {"device": props["name"].decode(), "date": datetime.date.today().isoformat(), "versions": versions,
              "cases": cases, "kernels": kernels}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")

    print(f"\n{'specialization':100} regs local  smem  CTA/SM warps/SM")
    for row in kernels:
        print(f"{row['key']:100} {row['registers']:4} {row['local_bytes']:5} {row['smem']:6} "
              f"{row['ctas_per_sm']:6} {row['warps_per_sm']:8}")
    print(f"\n{'case':28} {'metric':14} {'value':>9}  peers   ({time.time() - start:.0f} s)")
    for case in cases:
        peers = ", ".join(f"{k}={v}" for k, v in case["peers"].items())
        print(f"{case['name']:28} {case['metric']:14} {case['value']:9}  {peers}")

    if args.sweep:  # last, after the results are written: a failing candidate loses only the sweep
        sweep: list[dict] = []
        for name, lens, head_dim, options in (
                ("causal_d128_8x4096", [4096] * 8, 128, {}),
                ("causal_d128_mixed", mixed_lengths(), 128, {}),
                ("causal_d128_8x2048", [2048] * 8, 128, {}),
                ("paged_bs16_d128_8x4096", [4096] * 8, 128, dict(block_size=16)),
                ("chunk512_after_32k_bs16", [512], 128, dict(lens_k=[32768 + 512], block_size=16)),
                ("chunk512_after_32k", [512], 128, dict(lens_k=[32768 + 512])),
                ("causal_d128_lognormal40", lognormal_lengths(), 128, {}),
                ("causal_d128_16x1024", [1024] * 16, 128, {}),
                ("causal_d64_16x2048", [2048] * 16, 64, {})):
            sweep.append(sweep_case(name, lens, head_dim, args.reps, **options))
        result["sweep"] = sweep
        RESULTS.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\n{'sweep case':22} {'variant':22} {'TFLOP/s':>8} {'x reg.':>7} {'regs':>5} {'local':>6} maxdiff")
        for row in sweep:
            print(f"{row['name']:22} {'(registered)':22} {row['registered']:8}")
            for label, v in row["variants"].items():
                print(f"{row['name']:22} {label:22} {v['tflops']:8} {v['tflops'] / row['registered']:7.3f} "
                      f"{v['registers']:5} {v['local_bytes']:6} {v['maxdiff']:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
