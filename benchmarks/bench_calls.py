"""What one call of the public functions costs, called the way a user calls them, against its peers.

Every case is timed in one process with its peers: ``ours torch`` is the public function with
torch tensors and default arguments (``flash_attn_with_kvcache(q, k_cache, v_cache,
cache_seqlens=..., block_table=...)``, ``flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k,
causal=True)``: no ``out``, no ``stream``, no ``check_values``), ``ours cupy`` the same call with
CuPy arrays, ``plan`` one layer through ``StepPlan.attention`` (CuPy arrays, a plan from
``build_plan``), and the peers one eager call each through torch: cuDNN SDPA
(``scaled_dot_product_attention`` under ``sdpa_kernel(CUDNN_ATTENTION)``, entered once around the
timing loop, not per call) and FlashAttention-2's varlen op
(``torch.ops.aten._flash_attention_forward``).

Cases (bf16, 32 query / 8 kv heads, D = 128, block size 16, shuffled block tables):

* ``decode BxS``: B sequences of one query token over S cached keys, for 64 x 4096, 256 x 2048,
  8 x 32768 and 64 x 128; peers on contiguous copies of the same K/V.  Target: ``ours torch`` at
  least 0.95x cuDNN SDPA (1.0x at 64 x 128).  The plan row appends one token (the decode path).
  Also 128 x 128 and 256 x 256 (grids the decode kernel's small pipeline shape takes) and 32 x 2048
  (32 sequences x 8 kv heads: one wave of CTAs, where the balanced default's rule split every
  sequence in two until the twenty-third session), reported beside cuDNN without a ratio target
  (the host targets below apply to every call).
* ``varlen causal 8x4096`` and ``varlen causal lognormal40`` (40 lengths drawn
  lognormal(6.5, 1.0), seed 7, clipped to 16..16384, truncated to ints): causal prefill on
  contiguous K/V against FlashAttention-2 varlen on the same tensors; targets 1.1x and 1.0x.  The
  plan row writes the K/V into a paged cache and attends through it (two launches).
* ``paged chunk512 after 32k``: a 512-token chunk whose keys are a 32768-token prefix plus the
  chunk, read through a shuffled block table, against the same kernel on the same keys
  pre-gathered into contiguous K/V (``ours contiguous``); target 1.0x.

Method, per case, every call of the case interleaved sample by sample (so that a clock drift
hits all of them alike), in a fixed order (``--shuffle-order``: an order drawn for each sample from
its seed, so that every call follows every other), after warm-up:

* GPU time per call: the median over ``--reps`` samples of the CUDA-event time around ONE eager
  call (start event, call, end event, synchronise); the GPU is idle when the call starts, so the
  host's launch path is inside the time, as a user waiting on one call sees it.  In the decode
  cases every call reads its own copy of the K/V (``ours cupy`` a copy of ``ours torch``'s
  cache, FlashAttention-2 a copy of cuDNN's contiguous K/V), so that no call finds in the L2 what
  the call before it read: at 64 x 128 the 33.5 MB of K/V fit in the 50 MB L2;
* host time per call: the median ``time.perf_counter`` around the same call;
* back-to-back: the events around ``CHAIN`` consecutive calls, divided by ``CHAIN`` (what a
  loop of calls sustains), with the host time per call of the same loop.

Every call runs on the legacy default stream (torch's and CuPy's current stream).  A row's
``ratio`` is the named peer's GPU time over ours (above 1: ours is faster).  Host targets:
``ours torch`` <= 30 us, ``ours cupy`` <= 25 us, ``plan`` <= 10 us per layer.  Before the table,
a cProfile of one decode call with torch tensors (64 x 128) shows where the host microseconds go.

Writes ``benchmarks/results/calls.json`` (rows ``name, metric, value, peers, host_us, target,
met`` and more, ``peers`` holding every other call of the case; device, versions, date, and under
``failed`` any case that raised, its traceback in the log) and prints a markdown table last.

    python benchmarks/bench_calls.py [--quick] [--cases SUBSTRING[,SUBSTRING...]] [--list]
                                     [--reps N] [--no-profile] [--shuffle-order]
                                     [--out benchmarks/results/calls.json]
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import functools
import gc
import datetime
import json
import pathlib
import platform
import pstats
import random
import sys
import time
import traceback

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import bench_decode  # noqa: E402  (inputs and names shared with the decode benchmark)
import bench_varlen  # noqa: E402  (inputs and the FlashAttention-2 peer of the varlen benchmark)

import cupy_paged  # noqa: E402
from cupy_paged._core.arrays import gpu_available  # noqa: E402
from cupy_paged._core.types import BF16  # noqa: E402

HEADS, KV_HEADS, DIM = bench_decode.HEADS, bench_decode.KV_HEADS, bench_decode.DIM
BLOCK = 16
CHAIN = 8            # calls between two events in the back-to-back column
WARMUP = 5           # untimed calls of every call of a case first
CLOCK_WARM_S = 1.0   # an idle H200 sits at a low SM clock: run calls this long before the first case
CUDNN, FA2 = bench_decode.CUDNN, bench_decode.FA2   # "cuDNN SDPA", "torch FA2 varlen"
OURS_TORCH, OURS_CUPY, PLAN = "ours torch", "ours cupy", "plan"
# flash_attn_with_kvcache with torch tensors and num_splits=1 (the decode kernel) where the default
# call balances on the device (kernels.decode.balances): what the default call was before.
OURS_KERNEL = "ours torch, decode kernel"
CONTIGUOUS = "ours contiguous"
HOST_TARGET_US = {OURS_TORCH: 30.0, OURS_CUPY: 25.0, PLAN: 10.0, OURS_KERNEL: 30.0}
DECODE_SHAPES = ((64, 4096), (256, 2048), (8, 32768), (64, 128))
# Grids the decode kernel's small pipeline shape takes (fewer waves), and one wave of CTAs: beside cuDNN, no
# ratio target.
DECODE_SHAPES_REPORTED = ((128, 128), (256, 256), (32, 2048))
RESULTS = HERE / "results" / "calls.json"
SHUFFLE = False      # --shuffle-order: each sample runs the calls in an order of its own (sample_order)


# --------------------------------------------------------------------------- timing

@dataclasses.dataclass
class Timing:
    """Medians of one call, in microseconds (see the module docstring for the method)."""

    gpu_us: float
    host_us: float
    chain_us: float
    chain_host_us: float
    busy_host_us: float  # per call, calls queued behind a busy GPU (the host's own cost)


def sample_order(names: list, rep: int, shuffle: bool) -> list:
    """The order of the calls in sample ``rep``: as given, or with ``shuffle`` a permutation drawn
    from the sample's own seed, so that over the samples every call follows every other (a call's
    host path runs warmer after a call that shares its code).

    >>> sample_order(["a", "b", "c"], 2, False)
    ['a', 'b', 'c']
    >>> sorted(sample_order(["a", "b", "c"], 2, True))
    ['a', 'b', 'c']
    """
    names = list(names)
    if shuffle:
        random.Random(rep).shuffle(names)
    return names


def time_calls(calls: dict, reps: int, warmup: int = WARMUP, chain: int = CHAIN, shuffle: bool | None = None) -> dict:
    """{name: Timing} of no-argument ``calls``, sampled round-robin on the current stream (in an
    order drawn for each sample with ``shuffle``, by default ``SHUFFLE``: :func:`sample_order`)."""
    shuffle = SHUFFLE if shuffle is None else shuffle
    import cupy

    stream = cupy.cuda.get_current_stream()
    for call in calls.values():
        for _ in range(warmup):
            call()
    stream.synchronize()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    samples = {name: {"gpu": [], "host": [], "chain": [], "chain_host": []} for name in calls}
    for rep in range(reps):
        for name in sample_order(list(calls), rep, shuffle):
            call = calls[name]
            start.record(stream)
            t0 = time.perf_counter()
            call()
            t1 = time.perf_counter()
            stop.record(stream)
            stop.synchronize()
            samples[name]["gpu"].append(cupy.cuda.get_elapsed_time(start, stop) * 1e3)
            samples[name]["host"].append((t1 - t0) * 1e6)
    for _ in range(reps):
        for name, call in calls.items():
            start.record(stream)
            t0 = time.perf_counter()
            for _ in range(chain):
                call()
            t1 = time.perf_counter()
            stop.record(stream)
            stop.synchronize()
            samples[name]["chain"].append(cupy.cuda.get_elapsed_time(start, stop) * 1e3 / chain)
            samples[name]["chain_host"].append((t1 - t0) * 1e6 / chain)
    # Host time with the GPU busy: the calls queue behind a spinning kernel, so the host's own
    # cost per call is measured, not a wake-up after an idle wait nor the GPU's pace.
    for rep in range(reps):
        for name in sample_order(list(calls), rep, shuffle):
            call = calls[name]
            busy(stream.ptr, BUSY_S)
            t0 = time.perf_counter()
            for _ in range(chain):
                call()
            t1 = time.perf_counter()
            stream.synchronize()
            samples[name].setdefault("busy_host", []).append((t1 - t0) * 1e6 / chain)
    median = lambda values: round(float(np.median(values)), 2)  # noqa: E731
    return {name: Timing(median(s["gpu"]), median(s["host"]), median(s["chain"]), median(s["chain_host"]),
                         median(s["busy_host"])) for name, s in samples.items()}


BUSY_S = 0.003  # long enough to cover a chain of calls' host time
_SPIN = r"""
extern "C" __global__ void spin(unsigned long long nanoseconds) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < nanoseconds);
}
"""


@functools.cache
def _spin_kernel():
    import cupy

    return cupy.RawKernel(_SPIN, "spin")


def busy(stream: int, seconds: float) -> None:
    """Keep ``stream`` busy on the GPU for ``seconds`` (one thread spinning on the global timer)."""
    from cupy_paged._core.arrays import cupy_stream

    with cupy_stream(stream):
        _spin_kernel()((1,), (1,), (np.uint64(int(seconds * 1e9)),))


def warm_clocks(seconds: float = CLOCK_WARM_S) -> None:
    """Run default decode calls (64 x 4096, CuPy) back to back for ``seconds``, synchronising
    every 20 calls: an idle H200 starts at a low SM clock."""
    import cupy

    (q, k_cache, v_cache, table, lens), = bench_decode.make_paged(np.random.default_rng(0), 64, 4096, BLOCK)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            cupy_paged.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table)
        cupy.cuda.get_current_stream().synchronize()


def working_peers(peers: dict) -> dict:
    """The peers that run: each is called once; one that raises is reported and dropped."""
    import torch

    found = {}
    for name, call in peers.items():
        try:
            call()
            torch.cuda.synchronize()
            found[name] = call
        except Exception as error:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
            print(f"  ({name} skipped: {type(error).__name__}: {str(error).splitlines()[0][:160]})", flush=True)
    return found


def max_abs_diff(a, b) -> float:
    """Largest |a - b| of two torch tensors (or CuPy arrays) of the same shape, in float32."""
    import torch

    a = a if isinstance(a, torch.Tensor) else torch.from_dlpack(a)
    b = b if isinstance(b, torch.Tensor) else torch.from_dlpack(b)
    return float((a.float() - b.float().reshape(a.shape)).abs().max())


# --------------------------------------------------------------------------- rows

@dataclasses.dataclass
class Target:
    """What a row must reach: ``ratio`` (the peer ``vs``'s GPU time over ours, at least) and/or a
    host time per call (at most ``host_us``)."""

    vs: str | None = None
    ratio: float | None = None
    host_us: float | None = None

    def describe(self) -> str:
        parts = []
        if self.ratio is not None:
            parts.append(f">= {self.ratio:g}x {self.vs}")
        if self.host_us is not None:
            parts.append(f"host <= {self.host_us:g} us")
        return ", ".join(parts) or "reported"


def make_row(case: str, label: str, timings: dict, vs: str | None, target: Target, **extra) -> dict:
    """The JSON row of call ``label`` of ``case``: its timing, every other call of the case as a
    peer (GPU, host and back-to-back times), the ratio to ``vs`` and whether ``target`` is met
    (None when the peer it names did not run)."""
    own = timings[label]
    others = {name: t for name, t in timings.items() if name != label}
    ratio = None
    if vs in others and own.gpu_us > 0:
        ratio = round(others[vs].gpu_us / own.gpu_us, 3)
    met = True
    if target.ratio is not None:
        met = None if ratio is None else ratio >= target.ratio
    if target.host_us is not None and met is not None:
        met = met and own.host_us <= target.host_us
    return {
        "name": f"{case} {label}", "case": case, "call": label,
        "metric": "GPU us per call (CUDA events around one eager call, median)",
        "value": own.gpu_us, "peers": {name: t.gpu_us for name, t in others.items()},
        "host_us": own.host_us, "target": target.describe(), "met": met,
        "vs": vs, "ratio": ratio,
        "back_to_back_us": own.chain_us, "host_us_back_to_back": own.chain_host_us,
        "host_us_busy_gpu": own.busy_host_us,
        "peers_host_us_busy_gpu": {name: t.busy_host_us for name, t in others.items()},
        "peers_host_us": {name: t.host_us for name, t in others.items()},
        "peers_back_to_back_us": {name: t.chain_us for name, t in others.items()},
        **extra,
    }


def case_rows(case: str, timings: dict, vs: str | None, ratio_target: float | None,
              extra: dict | None = None) -> list:
    """Rows for the calls of ours in ``timings`` (torch, cupy, plan, whichever ran): the GPU ratio
    target applies to ``ours torch``, the host targets to each; ``extra`` adds fields per call."""
    extra = extra or {}
    rows = []
    for label in (OURS_TORCH, OURS_CUPY, PLAN, OURS_KERNEL):
        if label not in timings:
            continue
        target = Target(vs, ratio_target if label == OURS_TORCH else None, HOST_TARGET_US[label])
        row_vs = vs if label != PLAN else (OURS_CUPY if OURS_CUPY in timings else vs)
        rows.append(make_row(case, label, timings, row_vs, target, **extra.get(label, {})))
    for row in rows:
        print(f"  {row['name']:40} {row['value']:9.2f} us GPU  {row['host_us']:7.2f} us host  "
              f"b2b {row['back_to_back_us']:9.2f} us  ratio {row['ratio']} vs {row['vs']}  met={row['met']}",
              flush=True)
    return rows


# --------------------------------------------------------------------------- inputs

def torch_of(*arrays):
    """Zero-copy torch views of CuPy arrays."""
    import torch

    return tuple(torch.from_dlpack(a) for a in arrays)


def random_cache_fill(cache) -> None:
    """Random bf16 in every layer's K and V of a ``PagedAttentionCache`` (zeros time faster)."""
    for layer in range(cache.num_layers):
        for array in cache.layer(layer):
            array[...] = bench_decode.randn_bf16(array.shape)


def sequences_cache(cached, new, shuffle_seed=None, *, block_size=BLOCK, kv_heads=KV_HEADS, head_dim=DIM,
                    dtype=BF16, device="cuda", num_blocks=None):
    """``(cache, ids)``: a one-layer cache holding sequences ``0..`` with ``cached[b]`` computed
    tokens and ``new[b]`` reserved (its K/V as allocated); blocks in allocation order, or with
    ``shuffle_seed`` from a shuffled free list (scattered tables, as after hours of serving)."""
    import random

    from cupy_paged.serving.kv_cache import PagedAttentionCache

    totals = [c + n for c, n in zip(cached, new)]
    blocks = [-(-t // block_size) for t in totals]
    cache = PagedAttentionCache(1, kv_heads, head_dim, block_size=block_size,
                                num_blocks=sum(blocks) + 1 if num_blocks is None else num_blocks, dtype=dtype,
                                device=device, max_seqs=len(totals), max_blocks_per_seq=max(blocks),
                                enable_prefix_caching=False)
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(cache.pool._free)
    ids = list(range(len(totals)))
    for seq, total in zip(ids, totals):
        cache.allocate(seq, list(range(total)))
    cache.mark_computed(ids, list(cached))
    return cache, ids


def filled_cache(cached, new, shuffle_seed=None):
    """:func:`sequences_cache` on the GPU, bf16, its K/V random."""
    cache, ids = sequences_cache(cached, new, shuffle_seed)
    random_cache_fill(cache)
    return cache, ids


def plan_call(cached, new, out=False):
    """(call, plan): one layer of ``StepPlan.attention`` with CuPy arrays for sequences of
    ``cached[b]`` computed tokens and ``new[b]`` new ones, in a one-layer cache of random bf16
    (blocks in allocation order); ``out``: the layer writes into one array made here (as an engine
    that keeps its activations does), else it allocates its output."""
    cache, ids = filled_cache(cached, new)
    plan = cupy_paged.build_plan(cache, ids, list(new))
    tokens = sum(new)
    q = bench_decode.randn_bf16((tokens, HEADS, DIM))
    k = bench_decode.randn_bf16((tokens, KV_HEADS, DIM))
    v = bench_decode.randn_bf16((tokens, KV_HEADS, DIM))
    k_cache, v_cache = cache.layer(0)
    if out:
        result = q.copy()
        return (lambda: plan.attention(q, k, v, k_cache, v_cache, out=result)), plan
    return (lambda: plan.attention(q, k, v, k_cache, v_cache)), plan


def release() -> None:
    """Hand the freed memory of the last case back to the device, CuPy's pool and torch's (the
    next case needs it); without a GPU, only the garbage collection."""
    gc.collect()
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    if gpu_available():
        import cupy

        cupy.cuda.Device().synchronize()
        cupy.get_default_memory_pool().free_all_blocks()


# --------------------------------------------------------------------------- cases

def decode_calls(batch: int, context: int) -> tuple:
    """``(calls, peers)`` of a decode case, one query token over ``context`` cached keys per
    sequence, no append: ours with torch tensors and with CuPy arrays (each its own K/V, see the
    module docstring), cuDNN SDPA and FlashAttention-2 on contiguous copies of the same keys."""
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(batch * 100_003 + context)
    (q, k_cache, v_cache, table, lens), = bench_decode.make_paged(rng, batch, context, BLOCK)
    tq, tk_cache, tv_cache, ttable, tlens = torch_of(q, k_cache, v_cache, table, lens)
    # The peers read the same keys, gathered into contiguous [batch, context, kv_heads, dim].
    gather = lambda cache: cache.view(np.uint16)[table].reshape(batch, context, KV_HEADS, DIM).view(BF16)  # noqa: E731
    k, v = torch_of(gather(k_cache), gather(v_cache))
    q_t, k_t, v_t = tq.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, seq, D] views
    cu_q = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    cu_k = cu_q * context
    k_cache2, v_cache2 = k_cache.copy(), v_cache.copy()  # ours cupy's and FA2's own copies
    q_flat = tq.view(batch, HEADS, DIM)
    k_flat, v_flat = k.clone().view(-1, KV_HEADS, DIM), v.clone().view(-1, KV_HEADS, DIM)
    calls = {
        OURS_TORCH: lambda: cupy_paged.flash_attn_with_kvcache(tq, tk_cache, tv_cache, cache_seqlens=tlens,
                                                               block_table=ttable),
        OURS_CUPY: lambda: cupy_paged.flash_attn_with_kvcache(q, k_cache2, v_cache2, cache_seqlens=lens,
                                                              block_table=table),
    }
    if balanced_by_default(tq, tk_cache, tv_cache, tlens, ttable):
        calls[OURS_KERNEL] = decode_kernel_call(tq, torch_of(k_cache.copy())[0], torch_of(v_cache.copy())[0],
                                                tlens, ttable)
    peers = {
        CUDNN: lambda: F.scaled_dot_product_attention(q_t, k_t, v_t, enable_gqa=True),
        FA2: lambda: torch.ops.aten._flash_attention_forward(q_flat, k_flat, v_flat, cu_q, cu_k, 1, context,
                                                             0.0, False, False),
    }
    return calls, peers


def balanced_by_default(q, k_cache, v_cache, cache_seqlens, block_table) -> bool:
    """Whether ``flash_attn_with_kvcache`` with these arguments (and defaults) balances on the device."""
    from cupy_paged.api.decode import prepare_decode
    from cupy_paged.kernels.decode import balances

    return balances(prepare_decode(q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table))


def decode_kernel_call(q, k_cache, v_cache, cache_seqlens, block_table):
    """The public call on the decode kernel: where the default call balances, the heuristic's split
    count is 1 (``kernels.decode.balances``), so ``num_splits=1`` is the launch the default made before."""
    return lambda: cupy_paged.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                                      block_table=block_table, num_splits=1)


def decode_case(batch: int, context: int, reps: int, target: float | None = None) -> list:
    """Decode, one query token over ``context`` cached keys per sequence, no append."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    name = f"decode {batch}x{context}"
    calls, peers = decode_calls(batch, context)
    extra = {}
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        peers = working_peers(peers)
        ours = calls[OURS_TORCH]()
        if CUDNN in peers:
            extra[OURS_TORCH] = {"max_abs_diff_vs_cudnn": max_abs_diff(ours, peers[CUDNN]().transpose(1, 2))}
        calls[PLAN], plan = plan_call([context] * batch, [1] * batch)
        assert plan.path == "decode", plan.path
        calls.update(peers)
        timings = time_calls(calls, reps)
    extra[PLAN] = {"note": "appends one token per sequence (the decode path of the plan)"}
    return case_rows(name, timings, CUDNN, target, extra)


def varlen_case(name: str, lengths: list, ratio_target: float, reps: int) -> list:
    """Causal prefill on contiguous K/V (q lengths = k lengths) against FlashAttention-2 varlen."""
    batch = bench_varlen.Batch(lengths, lengths, DIM, seed=len(lengths))
    tq, tk, tv, tcu_q, tcu_k = batch.torch_views()
    max_q, max_k = batch.max_q, batch.max_k
    calls = {
        OURS_TORCH: lambda: cupy_paged.flash_attn_varlen_func(tq, tk, tv, tcu_q, tcu_k, max_q, max_k, causal=True),
        OURS_CUPY: lambda: cupy_paged.flash_attn_varlen_func(batch.q, batch.k, batch.v, batch.cu_q, batch.cu_k,
                                                             max_q, max_k, causal=True),
    }
    extra = {}
    fa2 = bench_varlen.torch_fa2(batch)
    if fa2 is not None:
        calls[FA2] = fa2
        extra[OURS_TORCH] = {"max_abs_diff_vs_fa2": max_abs_diff(calls[OURS_TORCH](), fa2()[0])}
    calls[PLAN], plan = plan_call([0] * len(lengths), lengths)
    assert plan.path == "varlen", plan.path
    timings = time_calls(calls, reps)
    info = {"lengths": [int(n) for n in lengths], "tokens": int(sum(lengths))}
    extra = {OURS_TORCH: {**info, **extra.get(OURS_TORCH, {})}, OURS_CUPY: info,
             PLAN: {**info, "note": "write_kv_cache then the paged varlen kernel (two launches)"}}
    return case_rows(name, timings, FA2, ratio_target, extra)


def chunk_calls(prefix: int = 32768, chunk: int = 512) -> tuple:
    """``(calls, batch)`` of the chunk case: a ``chunk``-token prefill chunk after ``prefix``
    cached tokens, ours through a shuffled block table (torch tensors, CuPy arrays) and ours on the
    same keys gathered into contiguous K/V (torch tensors)."""
    total = prefix + chunk
    batch = bench_varlen.Batch([chunk], [total], DIM, seed=3)
    k_cache, v_cache, table = batch.paged(BLOCK)
    tq, tk, tv, tcu_q, tcu_k = batch.torch_views()
    tk_cache, tv_cache, ttable = torch_of(k_cache, v_cache, table)
    calls = {
        OURS_TORCH: lambda: cupy_paged.flash_attn_varlen_func(tq, tk_cache, tv_cache, tcu_q, tcu_k, chunk, total,
                                                              causal=True, block_table=ttable),
        OURS_CUPY: lambda: cupy_paged.flash_attn_varlen_func(batch.q, k_cache, v_cache, batch.cu_q, batch.cu_k,
                                                             chunk, total, causal=True, block_table=table),
        CONTIGUOUS: lambda: cupy_paged.flash_attn_varlen_func(tq, tk, tv, tcu_q, tcu_k, chunk, total, causal=True),
    }
    return calls, batch


def chunk_case(reps: int, prefix: int = 32768, chunk: int = 512) -> list:
    """The chunk case (:func:`chunk_calls`) against the same kernel on contiguous K/V."""
    name = f"paged chunk{chunk} after {prefix // 1024}k"
    calls, batch = chunk_calls(prefix, chunk)
    fa2 = bench_varlen.torch_fa2(batch)
    if fa2 is not None:
        calls[FA2] = fa2
    extra = {OURS_TORCH: {"max_abs_diff_vs_contiguous": max_abs_diff(calls[OURS_TORCH](), calls[CONTIGUOUS]())}}
    calls[PLAN], plan = plan_call([prefix], [chunk])
    assert plan.path == "varlen", plan.path
    timings = time_calls(calls, reps)
    extra[PLAN] = {"note": "write_kv_cache of the chunk then the paged varlen kernel (two launches)"}
    return case_rows(name, timings, CONTIGUOUS, 1.0, extra)


def all_cases(reps: int) -> dict:
    """{case name: no-argument function returning its rows}, in run order."""
    cases = {f"decode {b}x{s}": (lambda b=b, s=s: decode_case(b, s, reps, 1.0 if s <= 128 else 0.95))
             for b, s in DECODE_SHAPES}
    cases.update({f"decode {b}x{s}": (lambda b=b, s=s: decode_case(b, s, reps)) for b, s in DECODE_SHAPES_REPORTED})
    cases["varlen causal 8x4096"] = lambda: varlen_case("varlen causal 8x4096", [4096] * 8, 1.1, reps)
    cases["varlen causal lognormal40"] = lambda: varlen_case("varlen causal lognormal40",
                                                             bench_varlen.lognormal_lengths(), 1.0, reps)
    cases["paged chunk512 after 32k"] = lambda: chunk_case(reps)
    return cases


def select(names, patterns: str | None) -> list:
    """The case names holding any of the comma-separated substrings of ``patterns`` (all for None)."""
    if not patterns:
        return list(names)
    wanted = [p.strip() for p in patterns.split(",") if p.strip()]
    return [name for name in names if any(p in name for p in wanted)]


# --------------------------------------------------------------------------- host profile

def profile_decode_call(calls: int = 2000, batch: int = 64, context: int = 128, top: int = 15) -> list:
    """cProfile of ``calls`` default decode calls with torch tensors: the ``top`` functions by
    cumulative time, in microseconds per call (profiling inflates every number; read the shares)."""
    import torch

    rng = np.random.default_rng(1)
    (q, k_cache, v_cache, table, lens), = bench_decode.make_paged(rng, batch, context, BLOCK)
    tq, tk_cache, tv_cache, ttable, tlens = torch_of(q, k_cache, v_cache, table, lens)

    def call():
        return cupy_paged.flash_attn_with_kvcache(tq, tk_cache, tv_cache, cache_seqlens=tlens, block_table=ttable)

    for _ in range(WARMUP):
        call()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler)
    rows = []
    for (path, line, function), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        rows.append({"function": f"{pathlib.Path(path).name}:{line}({function})",
                     "calls_per_call": round(ncalls / calls, 2), "own_us": round(tottime / calls * 1e6, 2),
                     "cumulative_us": round(cumtime / calls * 1e6, 2)})
    rows.sort(key=lambda r: r["cumulative_us"], reverse=True)
    rows = rows[:top]
    print(f"\nHost profile: cProfile of {calls} calls of flash_attn_with_kvcache, torch tensors, default "
          f"arguments, decode {batch}x{context} (us per call, inflated by the profiler)")
    print(f"{'cumulative':>10} {'own':>8} {'calls':>6}  function")
    for r in rows:
        print(f"{r['cumulative_us']:10.2f} {r['own_us']:8.2f} {r['calls_per_call']:6g}  {r['function']}")
    return rows


# --------------------------------------------------------------------------- report

def versions() -> dict:
    import cupy
    import torch

    found = {"python": platform.python_version(), "numpy": np.__version__, "cupy": cupy.__version__,
             "torch": torch.__version__, "cudnn": str(torch.backends.cudnn.version()),
             "cupy_paged": cupy_paged.__version__, "tree": tree_digest()}
    try:  # the driver's and the runtime's CUDA versions, where a GPU answers
        found["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
        found["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
    except cupy.cuda.runtime.CUDARuntimeError:
        pass
    return found


def tree_digest(root: pathlib.Path = HERE.parent) -> str:
    """The first 12 hex digits of a SHA-256 over the package's and the kernels' sources (path and
    bytes, in path order): which tree a results file measured, where the device machine has no git
    history to name a commit."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted([*root.glob("cupy_paged/**/*.py"), *root.glob("cuda_src/*")]):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def device_name() -> str:
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else name


def fmt(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_table(rows: list) -> None:
    """The markdown table of the run: one line per call of ours, against the peer its target names."""
    print("\n| case | ours GPU us | peer | peer GPU us | ratio | target | met? | ours host us | peer host us "
          "| ours host us, GPU busy | peer host us, GPU busy | ours b2b us | peer b2b us |")
    print("| --- | ---: | --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        vs = r["vs"]
        met = {True: "yes", False: "**no**", None: "?"}[r["met"]]
        print(f"| {r['name']} | {fmt(r['value'])} | {vs or '-'} | {fmt(r['peers'].get(vs))} | {fmt(r['ratio'], 3)} "
              f"| {r['target']} | {met} | {fmt(r['host_us'])} | {fmt(r['peers_host_us'].get(vs))} "
              f"| {fmt(r['host_us_busy_gpu'])} | {fmt(r['peers_host_us_busy_gpu'].get(vs))} "
              f"| {fmt(r['back_to_back_us'])} | {fmt(r['peers_back_to_back_us'].get(vs))} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples (15 instead of 50)")
    parser.add_argument("--reps", type=int, default=None, help="samples per call (overrides --quick)")
    parser.add_argument("--cases", default=None,
                        help="comma-separated substrings: run only the cases whose name holds one")
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    parser.add_argument("--no-profile", action="store_true", help="skip the cProfile of a decode call")
    parser.add_argument("--shuffle-order", action="store_true",
                        help="run each sample's calls in an order drawn from the sample's seed (every call "
                             "follows every other) instead of the fixed order")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    reps = args.reps if args.reps is not None else (15 if args.quick else 50)
    global SHUFFLE
    SHUFFLE = args.shuffle_order
    if reps < 1:
        parser.error("--reps must be >= 1")
    cases = all_cases(reps)
    chosen = select(cases, args.cases)
    if args.list:
        print("\n".join(chosen))
        return 0
    if not chosen:
        parser.error(f"--cases {args.cases!r} matches none of: {', '.join(cases)}")

    import cupy
    import torch

    if torch.cuda.current_stream().cuda_stream != cupy.cuda.get_current_stream().ptr:
        raise SystemExit("torch's and CuPy's current streams differ: the events would time another stream")
    started = time.time()
    warm_clocks()
    release()
    report = {"device": device_name(), "date": datetime.date.today().isoformat(), "versions": versions(),
              "method": {"reps": reps, "chain": CHAIN, "warmup": WARMUP,
                         "gpu": "median of CUDA events around one eager call (GPU idle at the start; "
                                "in the decode cases each call reads its own copy of the K/V)",
                         "host": "median time.perf_counter around the same call",
                         "back_to_back": f"events around {CHAIN} consecutive calls / {CHAIN}",
                         "stream": "legacy default stream (torch's and CuPy's current)",
                         "order": "drawn for each sample" if SHUFFLE else "fixed: the case's calls, then its peers"},
              "cases": []}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():  # after each case, so that a later failure loses only what is left
        out.write_text(json.dumps(report, indent=1) + "\n")

    for name in chosen:
        print(f"{name}:", flush=True)
        try:
            report["cases"].extend(cases[name]())
        except Exception as error:  # noqa: BLE001 - a failing case is reported, the run goes on
            print(f"  FAILED: {type(error).__name__}: {error}", flush=True)
            traceback.print_exc()
            report.setdefault("failed", {})[name] = f"{type(error).__name__}: {str(error)[:300]}"
        release()  # the case's arrays are unreferenced now that its function returned
        save()
    if not args.no_profile:
        try:
            report["profile"] = profile_decode_call()
        except Exception as error:  # noqa: BLE001 - the profile is a diagnostic: report it, keep the table
            print(f"\nhost profile FAILED: {type(error).__name__}: {error}", flush=True)
            traceback.print_exc()
            report.setdefault("failed", {})["profile"] = f"{type(error).__name__}: {str(error)[:300]}"
        release()
        save()
    print(f"\n({time.time() - started:.0f} s, {reps} samples per call)")
    print_table(report["cases"])
    return 1 if report.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
