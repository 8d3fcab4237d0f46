"""Kernel fuzzing (issue 16, point 2): random configurations through the public API on CuPy arrays,
each against the CPU reference backend on float32 copies of the same values.

Kernels: ``varlen`` (contiguous K/V), ``varlen_paged`` (block table), ``decode``
(``flash_attn_with_kvcache``: paged or contiguous caches, appends, rotary, splits),
``write_kv_cache``, ``merge`` (``merge_attention_states``) and ``step`` (one layer of
``StepPlan.attention`` over a paged cache: a continuous-batching mix of decodes, short rows and
chunks on the path the plan picks or a forced one, ragged, split, varlen or decode, the appends
compared).  A configuration draws lengths
(0 and 1 among them), float16/bfloat16 (merge: float32 too), head dims 32..256, GQA ratios, block
sizes 8..256, shuffled block tables with spare blocks and -1 columns, holes in needed columns
(then ``check_values=False`` on both sides: the kernels' error word may name ``block_table``,
nothing else), window / causal / softcap / ALiBi / LSE / rotary combinations, split counts, and
``out=`` given (NaN-poisoned, so an unwritten element fails) or not.

Configuration ``i`` of kernel ``K`` is drawn from ``np.random.default_rng([seed, index of K, i])``:
``--seed S --kernels K --only i`` replays it alone.  Every configuration's seed and result go
to the log (``--log``); each failing one is also printed.  A comparison passes when nothing is
NaN, the infinities agree and the norm-wise relative error is under the dtype's tolerance of
``tests/_util.py`` (bfloat16 2e-2, float16 5e-3, float32 1e-5) with every element within 8x
that of the largest reference value; caches written by ``write_kv_cache`` must be equal bit for bit.

``--hostile`` draws another stream of configurations, each with bad index values as device arrays
bring them (``fuzz_hostile.py``: block ids outside the cache, lengths past the table, negative
or decreasing lengths, cache rows and left pads outside the cache, slots past it, a bad id in a
step's own table); the outputs are compared as always and the error word must name the argument
(and the sequence).  Its report goes to ``results/fuzz_hostile.json`` (cases ``<kernel> hostile``).

``--dry-run`` needs no GPU: it draws the configurations and runs the reference side twice, on the
case's own dtype (standing in for the device) and on float32 -- the configuration drawing, the
reference side and the comparison, tested by ``tests/test_fuzz_config.py``.

    python benchmarks/fuzz.py                       # 1000 configurations per kernel, on the GPU
    python benchmarks/fuzz.py --configs 200 --kernels decode merge --time-limit 300
    python benchmarks/fuzz.py --seed 0 --kernels decode --only 17   # replay one configuration
    python benchmarks/fuzz.py --dry-run --configs 20 --out /tmp/fuzz.json
    python benchmarks/fuzz.py --hostile            # 1000 hostile configurations per kernel but merge

Writes ``benchmarks/results/fuzz.json`` (keeping the cases of kernels not drawn this time, when
the file is of the same device): ``{"device", "date", "versions", "cases": [{"name":
kernel, "metric": "configs" | "mismatches" | "worst_rel_err_<dtype>", "value", "peers": {}}]}``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import platform
import re
import sys
import time

import ml_dtypes
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import cupy_paged  # noqa: E402
from cupy_paged._core.types import BLOCK_SIZES, HEAD_DIMS  # noqa: E402
from _util import RTOL  # noqa: E402  (the tests' tolerances, one source)
from fuzz_hostile import CORRUPT  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
F16, F32 = np.dtype(np.float16), np.dtype(np.float32)
# "balanced": flash_attn_with_kvcache on the device-built work list (forced on the GPU side);
# "varlen_short": paged flash_attn_varlen_func with every row short (the same list, from cu_seqlens).
KERNELS = ("varlen", "varlen_paged", "decode", "write_kv_cache", "merge", "step", "balanced", "varlen_short")
WORK_CAP = 4e6  # query-key-head products per configuration: keeps the CPU reference in milliseconds


# --------------------------------------------------------------------------- drawing

def _length(rng, longest: int) -> int:
    """0 (10%), 1 (15%), 2..16 (25%), else up to ``longest``."""
    u = rng.random()
    if u < 0.10:
        return 0
    if u < 0.25:
        return 1
    if u < 0.50 or longest <= 16:
        return int(rng.integers(2, min(16, max(longest, 2)) + 1))
    return int(rng.integers(17, longest + 1))


def _lengths(rng, batch: int, longest: int) -> list[int]:
    return [_length(rng, longest) for _ in range(batch)]


def _values(rng, shape, dtype, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)


def _attention_options(rng, num_heads: int, batch: int, head_dim: int) -> dict:
    """The options varlen and decode share: scale, causal, window, softcap, ALiBi, LSE."""
    options = dict(causal=bool(rng.random() < 0.5), return_softmax_lse=bool(rng.random() < 0.5))
    if rng.random() < 0.3:
        options["softmax_scale"] = float(rng.uniform(0.3, 2.0) / math.sqrt(head_dim))
    if rng.random() < 0.4:
        options["window_size"] = (int(rng.choice([-1, 0, 1, int(rng.integers(2, 80))])),
                                  int(rng.choice([-1, 0, 1, int(rng.integers(2, 80))])))
    if rng.random() < 0.3:
        options["softcap"] = float(rng.uniform(5.0, 50.0))
    if rng.random() < 0.3:
        shape = (num_heads,) if rng.random() < 0.5 or batch == 0 else (batch, num_heads)
        options["alibi_slopes"] = rng.uniform(0.0, 0.5, shape).astype(np.float32)
    return options


def _heads(rng) -> tuple[int, int, int, np.dtype]:
    """(num_heads, num_kv_heads, head_dim, dtype): GQA ratios 1, 2, 4, 8."""
    kv_heads = int(rng.choice([1, 2, 4]))
    ratio = int(rng.choice([1, 2, 4, 8]))
    return kv_heads * ratio, kv_heads, int(rng.choice(HEAD_DIMS)), (F16 if rng.random() < 0.5 else BF16)


def _fit(lengths_q: list, lengths_k: list, heads: int) -> tuple[list, list]:
    """Halve the lengths until the reference's work fits :data:`WORK_CAP`."""
    while sum(max(a, 1) * max(b, 1) for a, b in zip(lengths_q, lengths_k)) * heads > WORK_CAP:
        lengths_q = [n // 2 for n in lengths_q]
        lengths_k = [n // 2 for n in lengths_k]
    return lengths_q, lengths_k


def _paged_table(rng, capacities: list, block_size: int) -> tuple[np.ndarray, int]:
    """A shuffled table: blocks for ``capacities[b]`` tokens each, 0-3 spare blocks nobody owns,
    0-2 extra -1 columns.  Returns (table int32, num_blocks)."""
    counts = [-(-n // block_size) for n in capacities]
    num_blocks = max(sum(counts) + int(rng.integers(0, 4)), 1)
    ids = rng.permutation(num_blocks)
    width = max(counts, default=0) + int(rng.integers(0, 3))
    table = np.full((len(capacities), max(width, 1)), -1, np.int32)
    start = 0
    for b, count in enumerate(counts):
        table[b, :count] = ids[start:start + count]
        start += count
    return table, num_blocks


def _punch_holes(rng, table: np.ndarray, needed_blocks: list, num_blocks: int) -> bool:
    """With probability 0.1, make one needed table entry a hole (-1 or an id past the cache)."""
    candidates = [(b, j) for b, n in enumerate(needed_blocks) for j in range(n)]
    if not candidates or rng.random() >= 0.1:
        return False
    b, j = candidates[int(rng.integers(len(candidates)))]
    table[b, j] = -1 if rng.random() < 0.5 else num_blocks + int(rng.integers(0, 5))
    return True


def _device_list_batch(rng) -> tuple[int, int]:
    """``(batch, longest)`` of a call the device-built list serves: up to 40 sequences of up to 600
    keys, or (15%) 129-320 of up to 160, more than the list builder's CTA has threads (each thread
    then takes several sequences in every pass of decode.cu build_list)."""
    return (int(rng.integers(129, 321)), 160) if rng.random() < 0.15 else (int(rng.integers(1, 41)), 600)


def _one_long(rng, lengths: list, low: int, high: int) -> list:
    """Half the time one of ``lengths`` made ``low..high`` long: a sequence the balance rule splits."""
    if lengths and rng.random() < 0.5:
        lengths[int(rng.integers(len(lengths)))] = int(rng.integers(low, high))
    return lengths


def draw_varlen(rng, paged: bool, short: bool = False) -> dict:
    """``short``: many sequences, every row at most 16 // (query heads per kv head) tokens and
    ``max_seqlen_q`` exact, so that the GPU takes the short-row path (paged only)."""
    num_heads, kv_heads, head_dim, dtype = _heads(rng)
    if short:
        batch, longest = _device_list_batch(rng)
        longest_q = max(1, 16 // (num_heads // kv_heads))
        lengths_q = [int(rng.integers(0, longest_q + 1)) for _ in range(batch)]
        lengths_q, lengths_k = _fit(lengths_q, _one_long(rng, _lengths(rng, batch, longest), 1000, 6000), num_heads)
    else:
        batch = 0 if rng.random() < 0.02 else int(rng.integers(1, 9))
        lengths_q, lengths_k = _fit(_lengths(rng, batch, 96), _lengths(rng, batch, 300), num_heads)
    cu_q = np.concatenate([[0], np.cumsum(lengths_q, dtype=np.int64)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lengths_k, dtype=np.int64)]).astype(np.int32)
    args = dict(q=_values(rng, (int(cu_q[-1]), num_heads, head_dim), dtype),
                cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                max_seqlen_q=max(lengths_q, default=0) + (0 if short else int(rng.choice([0, 0, 0, 3]))),
                max_seqlen_k=max(lengths_k, default=0) + int(rng.choice([0, 0, 0, 5])))
    args.update(_attention_options(rng, num_heads, batch, head_dim))
    holes = False
    if paged:
        block_size = int(rng.choice(BLOCK_SIZES))
        table, num_blocks = _paged_table(rng, lengths_k, block_size)
        holes = _punch_holes(rng, table, [-(-n // block_size) for n in lengths_k], num_blocks)
        args.update(k=_values(rng, (num_blocks, block_size, kv_heads, head_dim), dtype),
                    v=_values(rng, (num_blocks, block_size, kv_heads, head_dim), dtype), block_table=table)
    else:
        args.update(k=_values(rng, (int(cu_k[-1]), kv_heads, head_dim), dtype),
                    v=_values(rng, (int(cu_k[-1]), kv_heads, head_dim), dtype))
    if holes:
        args["check_values"] = False
    out = (int(cu_q[-1]), num_heads, head_dim) if rng.random() < 0.4 else None
    return dict(function="flash_attn_varlen_func", dtype=dtype, args=args, out_shape=out, holes=holes,
                in_place=(), lse_key="return_softmax_lse")


def _decode_cache(rng, args: dict, cached: list, seqlen_new: int, kv_heads: int, head_dim: int, dtype) -> bool:
    """Paged (70%) or contiguous caches for ``cached`` tokens plus the appends; returns holes."""
    batch = len(cached)
    if rng.random() < 0.7:
        block_size = int(rng.choice(BLOCK_SIZES))
        capacities = [n + seqlen_new + int(rng.integers(0, 2 * block_size)) for n in cached]
        table, num_blocks = _paged_table(rng, capacities, block_size)
        holes = _punch_holes(rng, table, [-(-(n + seqlen_new) // block_size) for n in cached], num_blocks)
        shape = (num_blocks, block_size, kv_heads, head_dim)
        args.update(block_table=table)
    else:
        holes = False
        rows = batch + int(rng.integers(0, 3)) if rng.random() < 0.3 else batch
        length = max([n + seqlen_new for n in cached], default=1) + int(rng.integers(0, 8))
        shape = (rows, max(length, 1), kv_heads, head_dim)
        if rows != batch or rng.random() < 0.2:
            args["cache_batch_idx"] = rng.permutation(rows)[:batch].astype(np.int32)
        if rng.random() < 0.15:
            args["cache_leftpad"] = np.array([int(rng.integers(0, n + 1)) for n in cached], np.int32)
    args.update(k_cache=_values(rng, shape, dtype), v_cache=_values(rng, shape, dtype))
    return holes


def draw_decode(rng) -> dict:
    num_heads, kv_heads, head_dim, dtype = _heads(rng)
    batch = 0 if rng.random() < 0.02 else int(rng.integers(1, 9))
    longest = 400
    if rng.random() < 0.1:  # a wide grid of short sequences: about the decode kernel's shape boundaries
        num_heads, kv_heads, head_dim = 32, 8, 128  # (30-70 x 8 CTAs: either side of one main-shape wave)
        batch, longest = int(rng.integers(30, 71)), 160
    seqlen_q = 1 if rng.random() < 0.7 else int(rng.integers(2, 5))
    seqlen_new = 0 if rng.random() < 0.3 else int(rng.choice([1, 1, 1, 2, 3]))
    cached = _fit([seqlen_q] * batch, _lengths(rng, batch, longest), num_heads)[1]
    if batch and rng.random() < 0.15:  # one int for every sequence
        cached = [cached[0]] * batch
    args = dict(q=_values(rng, (batch, seqlen_q, num_heads, head_dim), dtype))
    holes = _decode_cache(rng, args, cached, seqlen_new, kv_heads, head_dim, dtype)
    args["cache_seqlens"] = (cached[0] if batch and len(set(cached)) == 1 and rng.random() < 0.5
                             else np.array(cached, np.int32))
    if seqlen_new:
        args.update(k=_values(rng, (batch, seqlen_new, kv_heads, head_dim), dtype),
                    v=_values(rng, (batch, seqlen_new, kv_heads, head_dim), dtype))
        if rng.random() < 0.3:
            rotary_dim = 16 * int(rng.integers(1, head_dim // 16 + 1))
            rows = max([n + max(seqlen_new, seqlen_q) for n in cached], default=1) + int(rng.integers(0, 16))
            angles = np.arange(rows)[:, None] * rng.uniform(0.001, 0.5, rotary_dim // 2)[None, :]
            args.update(rotary_cos=np.cos(angles).astype(dtype), rotary_sin=np.sin(angles).astype(dtype),
                        rotary_interleaved=bool(rng.random() < 0.5))
    args.update(_attention_options(rng, num_heads, batch, head_dim))
    args["num_splits"] = 0 if rng.random() < 0.5 else int(rng.integers(1, 9))
    if holes:
        args["check_values"] = False
    out = (batch, seqlen_q, num_heads, head_dim) if rng.random() < 0.4 else None
    return dict(function="flash_attn_with_kvcache", dtype=dtype, args=args, out_shape=out, holes=holes,
                in_place=("k_cache", "v_cache") if seqlen_new else (), lse_key="return_softmax_lse")


def draw_balanced(rng) -> dict:
    """``flash_attn_with_kvcache`` as the device-built list serves it (``balanced_decode`` forces
    that path on the GPU side): a paged cache, an int32 ``cache_seqlens`` (``_device_list_batch``) with
    one long one half the time, 1-4 query tokens with or without their appends, no rotary, no LSE."""
    num_heads, kv_heads, head_dim, dtype = _heads(rng)
    batch, longest = _device_list_batch(rng)
    seqlen_q = 1 if rng.random() < 0.7 else int(rng.integers(2, 5))
    seqlen_new = seqlen_q if rng.random() < 0.7 else 0
    cached = _fit([seqlen_q] * batch, _one_long(rng, _lengths(rng, batch, longest), 1000, 6000), num_heads)[1]
    block_size = int(rng.choice(BLOCK_SIZES))
    table, num_blocks = _paged_table(rng, [n + seqlen_new + int(rng.integers(0, 2 * block_size)) for n in cached],
                                     block_size)
    holes = _punch_holes(rng, table, [-(-(n + seqlen_new) // block_size) for n in cached], num_blocks)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    args = dict(q=_values(rng, (batch, seqlen_q, num_heads, head_dim), dtype), k_cache=_values(rng, shape, dtype),
                v_cache=_values(rng, shape, dtype), block_table=table, cache_seqlens=np.array(cached, np.int32))
    if seqlen_new:
        args.update(k=_values(rng, (batch, seqlen_new, kv_heads, head_dim), dtype),
                    v=_values(rng, (batch, seqlen_new, kv_heads, head_dim), dtype))
    args.update(_attention_options(rng, num_heads, batch, head_dim), return_softmax_lse=False)
    if holes:
        args["check_values"] = False
    out = (batch, seqlen_q, num_heads, head_dim) if rng.random() < 0.4 else None
    return dict(function="balanced_decode", dtype=dtype, args=args, out_shape=out, holes=holes,
                in_place=("k_cache", "v_cache") if seqlen_new else (), lse_key=None)


def balanced_decode(**args):
    """``flash_attn_with_kvcache``: on NumPy arrays the reference; on CuPy arrays with the device-built
    list forced (``kernels.ragged.BALANCE``), checked to be the launch that ran."""
    if isinstance(args["q"], np.ndarray):
        return cupy_paged.flash_attn_with_kvcache(**args)
    from cupy_paged.api._call import MEMO
    from cupy_paged.kernels import ragged
    from cupy_paged.kernels.decode import BalancedDecodeLaunch

    before, ragged.BALANCE = ragged.BALANCE, True
    MEMO.clear()
    try:
        result = cupy_paged.flash_attn_with_kvcache(**args)
        if args["q"].shape[0] and args.get("check_values") is not True:
            launch = list(MEMO.values())[-1]
            assert isinstance(launch, BalancedDecodeLaunch), f"the call ran {type(launch).__name__}"
        return result
    finally:
        ragged.BALANCE = before
        MEMO.clear()


def draw_write(rng) -> dict:
    _, kv_heads, head_dim, dtype = _heads(rng)
    block_size = int(rng.choice(BLOCK_SIZES))
    num_blocks = int(rng.integers(1, 17))
    capacity = num_blocks * block_size
    tokens = min(_length(rng, 256), capacity)
    slots = rng.choice(capacity, tokens, replace=False).astype(np.int32)  # distinct: no write race
    slots[rng.random(tokens) < 0.1] = -1  # padding tokens: skipped
    shape = (num_blocks, block_size, kv_heads, head_dim)
    args = dict(k_cache=_values(rng, shape, dtype), v_cache=_values(rng, shape, dtype),
                k=_values(rng, (tokens, kv_heads, head_dim), dtype), v=_values(rng, (tokens, kv_heads, head_dim), dtype),
                slot_mapping=slots)
    return dict(function="write_kv_cache", dtype=dtype, args=args, out_shape=None, holes=False,
                in_place=("k_cache", "v_cache"), lse_key=None, exact=True)


def draw_merge(rng) -> dict:
    num_heads, _, head_dim, dtype = _heads(rng)
    dtype = F32 if rng.random() < 0.1 else dtype
    if rng.random() < 0.5:
        tokens = _length(rng, 64)
        shape, lse_shape, lse_rows = (tokens, num_heads, head_dim), (num_heads, tokens), (1, 0)
    else:
        batch, seqlen = int(rng.integers(0, 5)), int(rng.integers(1, 5))
        shape, lse_shape, lse_rows = (batch, seqlen, num_heads, head_dim), (batch, num_heads, seqlen), (0, 2, 1)
    lse = [(rng.standard_normal(lse_shape) * 3).astype(np.float32) for _ in range(2)]
    outs = [_values(rng, shape, dtype) for _ in range(2)]
    for side in range(2):  # rows that saw no key: LSE -inf, output anything (NaN here)
        empty = rng.random(lse_shape) < (0.15 if rng.random() < 0.5 else 0.0)
        lse[side][empty] = -np.inf
        outs[side][np.transpose(empty, lse_rows) if len(shape) == 4 else empty.T] = np.nan
    args = dict(out_a=outs[0], lse_a=lse[0], out_b=outs[1], lse_b=lse[1])
    where = rng.random()
    return dict(function="merge_attention_states", dtype=dtype, args=args, holes=False, lse_key=None, in_place=(),
                out_shape=shape if where < 0.3 else None, out_is_a=bool(0.3 <= where < 0.45))


def draw_step(rng) -> dict:
    """A continuous-batching step: 1-8 rows, each a decode (one token), a short row (2-16) or a
    chunk (17-96) after 0-300 cached tokens, decodes first as the scheduler orders them (or shuffled),
    on the plan's own path or a forced valid one, with softcap sometimes, out= given or not."""
    num_heads, kv_heads, head_dim, dtype = _heads(rng)
    batch = int(rng.integers(1, 9))
    kinds = rng.choice(3, batch, p=[0.5, 0.25, 0.25])
    new = [1 if k == 0 else int(rng.integers(2, 17)) if k == 1 else int(rng.integers(17, 97)) for k in kinds]
    cached = [int(rng.choice([0, 1, int(rng.integers(2, 301))])) for _ in range(batch)]
    order = np.argsort([n != 1 for n in new], kind="stable") if rng.random() < 0.7 else rng.permutation(batch)
    new, cached = [new[i] for i in order], [cached[i] for i in order]
    new, cached = _fit(new, [c + n for c, n in zip(cached, new)], num_heads)
    new = [max(n, 1) for n in new]
    cached = [max(0, c - n) for c, n in zip(cached, new)]  # _fit halved the totals
    ones = int(np.argmax(np.asarray(new) != 1)) if any(n != 1 for n in new) else batch
    paths = [None, "ragged", "varlen"] + (["split"] if 0 < ones < batch else []) + (["decode"] if ones == batch else [])
    block_size = int(rng.choice(BLOCK_SIZES))
    blocks = sum(-(-(c + n) // block_size) for c, n in zip(cached, new))
    tokens = sum(new)
    args = dict(k_cache=_values(rng, (blocks, block_size, kv_heads, head_dim), dtype),
                v_cache=_values(rng, (blocks, block_size, kv_heads, head_dim), dtype),
                q=_values(rng, (tokens, num_heads, head_dim), dtype), k=_values(rng, (tokens, kv_heads, head_dim), dtype),
                v=_values(rng, (tokens, kv_heads, head_dim), dtype), cached=cached, new=new,
                path=paths[int(rng.integers(len(paths)))], num_heads=num_heads,
                shuffle=int(rng.integers(1 << 30)))
    if rng.random() < 0.2:
        args["softcap"] = float(rng.uniform(5.0, 50.0))
    out = (tokens, num_heads, head_dim) if rng.random() < 0.4 else None
    return dict(function="plan_step", dtype=dtype, args=args, out_shape=out, holes=False,
                in_place=("k_cache", "v_cache"), lse_key=None)


def plan_step(k_cache, v_cache, q, k, v, cached, new, path, num_heads, shuffle, out=None, corrupt=None, **kwargs):
    """One layer of :meth:`cupy_paged.StepPlan.attention` over a one-layer cache (NumPy: the CPU
    backend; CuPy: the GPU) whose blocks come from a free list shuffled by ``shuffle`` and hold
    ``k_cache``/``v_cache``'s values; the caches after the step (the appends) are written back.
    ``corrupt = (sequence, column, block id)``: written into the cache's table before the plan."""
    from bench_calls import sequences_cache

    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    cache, ids = sequences_cache(cached, new, shuffle, block_size=block_size, kv_heads=kv_heads, head_dim=head_dim,
                                 dtype=q.dtype, device="cpu" if isinstance(q, np.ndarray) else "cuda",
                                 num_blocks=num_blocks)
    layer_k, layer_v = cache.layer(0)
    layer_k[...], layer_v[...] = k_cache, v_cache
    if corrupt is not None:
        row = cache.rows([ids[corrupt[0]]])[0]
        cache.tables[row, corrupt[1]] = corrupt[2]
        cache.table_versions[row] += 1
    plan = cupy_paged.build_plan(cache, ids, list(new), num_heads=num_heads if path in (None, "ragged") else None,
                                 path=path)
    result = plan.attention(q, k, v, layer_k, layer_v, out=out, **kwargs)
    k_cache[...], v_cache[...] = layer_k, layer_v
    return result


RUNNERS = {"plan_step": plan_step, "balanced_decode": balanced_decode}


def draw(kernel: str, seed: int, index: int, hostile: bool = False) -> dict:
    """Configuration ``index`` of ``kernel``: a dict (function, dtype, args of NumPy arrays in the
    case's dtype, out_shape, holes, in_place outputs...).  ``hostile``: another stream of draws,
    each with bad index values (``fuzz_hostile.py``; drawn again until one can be made bad)."""
    rng = np.random.default_rng([seed, KERNELS.index(kernel), index] + ([1] if hostile else []))
    drawer = {"varlen": lambda: draw_varlen(rng, False), "varlen_paged": lambda: draw_varlen(rng, True),
              "decode": lambda: draw_decode(rng), "write_kv_cache": lambda: draw_write(rng),
              "merge": lambda: draw_merge(rng), "step": lambda: draw_step(rng),
              "balanced": lambda: draw_balanced(rng), "varlen_short": lambda: draw_varlen(rng, True, short=True)}[kernel]
    case = drawer()
    if hostile:
        if kernel not in CORRUPT:
            raise ValueError(f"--hostile has no bad index values for {kernel} (kernels: {sorted(CORRUPT)})")
        while case["holes"] or not CORRUPT[kernel](case, rng):  # one bad value: its report alone
            case = drawer()
    case.update(kernel=kernel, seed=seed, index=index, hostile=hostile)
    return case


def describe(case: dict) -> str:
    """A one-line summary of a configuration: shapes, dtypes and scalar options."""
    parts = []
    for name, value in case["args"].items():
        if isinstance(value, np.ndarray):
            parts.append(f"{name}={list(value.shape)}" if value.ndim > 1 or value.size > 8 else
                         f"{name}={value.tolist()}")
        else:
            parts.append(f"{name}={value!r}")
    extra = " out=" + ("out_a" if case.get("out_is_a") else "given" if case.get("out_shape") else "none")
    return f"{case['dtype'].name if case['dtype'] != BF16 else 'bfloat16'} " + " ".join(parts) + extra


# --------------------------------------------------------------------------- running

LOW = (F16, BF16)


def side_args(case: dict, xp, reference: bool) -> dict:
    """The call's arguments on one side: ``xp`` arrays (NumPy or CuPy); on the reference side the
    float arrays in float32 (exact copies of the case's values), every array a fresh copy (the
    calls write caches and outputs in place)."""
    args = {}
    for name, value in case["args"].items():
        if isinstance(value, np.ndarray):
            value = value.astype(np.float32) if reference and value.dtype in LOW else value.copy()
            value = xp.asarray(value)
        args[name] = value
    out_dtype = F32 if reference else case["dtype"]
    if case.get("out_is_a"):
        args["out"] = args["out_a"]
    elif case.get("out_shape") is not None:
        args["out"] = xp.full(case["out_shape"], np.nan, np.float32).astype(out_dtype)  # poisoned
    return args


def _host(array) -> np.ndarray:
    if isinstance(array, np.ndarray):
        return array
    import cupy

    return cupy.asnumpy(array)


def run_side(case: dict, xp, reference: bool) -> dict:
    """Run the case's public function on one side; returns {output name: float64 NumPy array}."""
    args = side_args(case, xp, reference)
    function = RUNNERS.get(case["function"]) or getattr(cupy_paged, case["function"])
    result = function(**args)
    outputs = {}
    if case["function"] == "merge_attention_states":
        outputs["out"], outputs["lse"] = result
    elif case["function"] != "write_kv_cache":
        wants_lse = case["lse_key"] and args.get(case["lse_key"])
        outputs["out"], outputs["lse"] = result if wants_lse else (result, None)
        if case.get("out_shape") is not None and outputs["out"] is not args["out"]:
            raise AssertionError("out= was given but another array came back")
    for name in case["in_place"]:
        outputs[name] = args[name]
    return {name: _host(value).astype(np.float64) for name, value in outputs.items() if value is not None}


def compare(actual: np.ndarray, expected: np.ndarray, dtype, exact: bool = False) -> tuple[float, str | None]:
    """(relative error, None or why it fails): the rules of ``tests/_util.py``'s ``assert_close``
    (NaN never passes; infinities must agree; norm-wise error under the dtype's tolerance, every
    element within 8x that of the largest value); ``exact``: bit-equal values."""
    if actual.shape != expected.shape:
        return math.inf, f"shape {actual.shape} != {expected.shape}"
    if np.isnan(actual).any():
        return math.inf, f"{int(np.isnan(actual).sum())} NaN elements"
    finite = np.isfinite(expected)
    if (np.isfinite(actual) != finite).any() or (actual[~finite] != expected[~finite]).any():
        return math.inf, "infinities differ from the reference"
    a, e = actual[finite], expected[finite]
    norm = float(np.linalg.norm(e)) or 1.0
    rel = float(np.linalg.norm(a - e)) / norm
    if exact:
        return rel, None if np.array_equal(a, e) else f"{int((a != e).sum())} elements differ"
    tol = RTOL[np.dtype(dtype)]
    scale = max(float(np.abs(e).max(initial=0.0)), 1e-6)
    worst = float(np.abs(a - e).max(initial=0.0))
    if rel > tol:
        return rel, f"relative error {rel:.2e} > {tol:.0e}"
    if worst > 8 * tol * scale:
        return rel, f"worst element error {worst:.3e} > {8 * tol * scale:.3e}"
    return rel, None


def _error_word(case: dict, dry_run: bool) -> str | None:
    """The kernels' error word after the call: empty for a clean configuration; for one with holes
    it may name ``block_table`` and nothing else; a hostile one must be reported, naming one of the
    arguments it may trip (and the sequence or token, when one alone is bad).  None when fine, else
    why not."""
    if dry_run:
        return None
    try:
        cupy_paged.check_errors()
    except ValueError as error:
        text = str(error)
        if case.get("hostile"):
            if not text.startswith(case["expect"]):
                return f"check_errors named another argument than {case['expect']}: {text}"
            if case["where"] and not re.search(rf"\b{case['where']}\b", text):
                return f"check_errors did not name {case['where']}: {text}"
            return None
        if case["holes"] and text.startswith("block_table"):
            return None
        return f"check_errors: {text}"
    if case.get("hostile"):
        return f"check_errors raised nothing: the kernels did not report the bad {case['expect'][0]}"
    return None


def check_case(case: dict, dry_run: bool) -> tuple[dict, list]:
    """Run one configuration on both sides.  Returns ({output: rel err}, [failure messages])."""
    if dry_run:
        device_xp = np
    else:
        import cupy as device_xp
    failures = []
    try:
        expected = run_side(case, np, reference=True)
        actual = run_side(case, device_xp, reference=False)
        if not dry_run:
            device_xp.cuda.get_current_stream().synchronize()
    except Exception as error:  # a valid configuration must run: any exception is a failure
        if not dry_run:
            try:  # the next configuration must not read this one's report
                cupy_paged.check_errors()
            except ValueError:
                pass
        return {}, [f"raised {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"]
    word = _error_word(case, dry_run)
    if word:
        failures.append(word)
    errors = {}
    for name, want in expected.items():
        rel, why = compare(actual[name], want, case["dtype"], exact=case.get("exact", False))
        errors[name] = rel
        if why:
            failures.append(f"{name}: {why}")
    return errors, failures


def replay(case: dict) -> str:
    return f"--seed {case['seed']} --kernels {case['kernel']} --only {case['index']}" + \
        (" --hostile" if case.get("hostile") else "")


# --------------------------------------------------------------------------- the run and the report

def dtype_label(dtype) -> str:
    return "bfloat16" if np.dtype(dtype) == BF16 else np.dtype(dtype).name


def summary_line(kernel: str, entry: dict, note: str = "") -> str:
    """One kernel's line of a run's summary: configurations, mismatches, worst error per dtype."""
    worst = ", ".join(f"{k} {v:.2e}" for k, v in sorted(entry["worst"].items()))
    return f"{kernel:15} {entry['configs']:5} configs{note}, {entry['mismatches']} mismatches, worst rel err: " \
           f"{worst or '-'}{' (time limit reached)' if entry.get('stopped') else ''}"


def fuzz(kernels, configs: int, seed: int, time_limit: float | None, dry_run: bool, only: int | None = None,
         log=None, quiet: bool = False, hostile: bool = False, shard: tuple[int, int] = (0, 1)) -> dict:
    """Draw and check configurations kernel by kernel.  Returns {kernel: {"configs", "mismatches",
    "worst": {dtype: rel err}, "failed": [replay arguments]}}; stops drawing at ``time_limit``
    seconds (what ran is reported).  ``shard`` ``(i, n)``: only the configurations whose index is i
    modulo n (one of n processes sharing a kernel's draws)."""
    start = time.perf_counter()
    stats = {}
    indices = range(shard[0], configs, shard[1]) if only is None else [only]
    for kernel in kernels:
        entry = stats[kernel] = {"configs": 0, "mismatches": 0, "worst": {}, "failed": []}
        for index in indices:
            if time_limit is not None and time.perf_counter() - start > time_limit:
                entry["stopped"] = True
                break
            case = draw(kernel, seed, index, hostile)
            errors, failures = check_case(case, dry_run)
            entry["configs"] += 1
            label = dtype_label(case["dtype"])
            worst = max(errors.values(), default=0.0)
            entry["worst"][label] = max(entry["worst"].get(label, 0.0), worst)
            line = f"{kernel} #{index} ({replay(case)}) {'FAIL' if failures else 'ok'} rel={worst:.2e} " \
                   f"{describe(case)}"
            if log is not None:
                print(line + ("" if not failures else " :: " + "; ".join(failures)), file=log)
            if failures:
                entry["mismatches"] += 1
                entry["failed"].append(replay(case))
                print(f"MISMATCH {kernel} #{index}: {'; '.join(failures)}\n  replay: python benchmarks/fuzz.py "
                      f"{replay(case)}\n  config: {describe(case)}", flush=True)
        if not quiet:
            print(summary_line(kernel, entry), flush=True)
    return stats


def report(stats: dict, dry_run: bool, hostile: bool = False) -> dict:
    """The results file's content (``{"device", "date", "versions", "cases"}``)."""
    versions = {"python": platform.python_version(), "numpy": np.__version__, "cupy_paged": cupy_paged.__version__}
    device = "CPU reference only (--dry-run)"
    if not dry_run:
        import cupy

        versions["cupy"] = cupy.__version__
        versions["cuda_runtime"] = str(cupy.cuda.runtime.runtimeGetVersion())
        name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
        device = name.decode() if isinstance(name, bytes) else name
    cases = []
    for kernel, entry in stats.items():
        name = f"{kernel} hostile" if hostile else kernel
        cases.append({"name": name, "metric": "configs", "value": entry["configs"], "peers": {}})
        cases.append({"name": name, "metric": "mismatches", "value": entry["mismatches"], "peers": {}})
        for label, worst in sorted(entry["worst"].items()):
            cases.append({"name": name, "metric": f"worst_rel_err_{label}", "value": float(f"{worst:.4g}"),
                          "peers": {}})
    return {"device": device, "date": datetime.date.today().isoformat(), "versions": versions, "cases": cases}


def merged(result: dict, path: pathlib.Path) -> dict:
    """``result`` with the cases of kernels this run did not draw kept from the results file at
    ``path`` (a run of some kernels replaces only theirs), when that file is of the same device."""
    if not path.exists():
        return result
    earlier = json.loads(path.read_text())
    if earlier.get("device") != result["device"]:
        return result
    ran = {case["name"] for case in result["cases"]}
    kept = [case for case in earlier.get("cases", []) if case["name"] not in ran]
    return dict(result, cases=kept + result["cases"])


def in_processes(args, argv: list) -> tuple[dict, dict]:
    """The kernels of ``args.kernels`` in ``fuzz.py`` processes, ``args.jobs`` at a time: one per
    kernel, or, with more jobs than kernels, ``args.jobs // len(kernels)`` per kernel, each drawing
    every n-th configuration (``--shard``; the reference side is CPU work, so shards scale with the
    CPUs).  ``--time-limit`` stays one limit for the whole run: a process gets the time left when
    it starts.  Each writes its log beside ``args.log`` as it goes (``<log>.<kernel>.<shard>``,
    joined into ``args.log`` in kernel order at the end) and its own report; returns ``(report,
    stats)`` of those that reported (``stats`` as :func:`fuzz` gives it, the shards' counts summed
    and worst errors the largest, without the replay lists: the processes printed those); a kernel
    one of whose processes wrote no report counts a mismatch."""
    import subprocess
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    own = {"--kernels", "--out", "--log", "--jobs", "--time-limit", "--shard"}
    base, skip = [], False
    for arg in argv:  # the caller's arguments less those each process gets its own of
        if skip and not arg.startswith("--"):
            continue
        skip = arg.split("=")[0] in own and "=" not in arg
        if arg.split("=")[0] not in own:
            base.append(arg)
    deadline = None if args.time_limit is None else time.perf_counter() + args.time_limit
    kernels = list(dict.fromkeys(args.kernels))
    shards = max(1, args.jobs // len(kernels))
    units = [(k, i) for k in kernels for i in range(shards)]
    logs = {u: pathlib.Path(f"{args.log}.{u[0]}.{u[1]}") for u in units}
    with tempfile.TemporaryDirectory() as tmp:
        reports = {u: pathlib.Path(tmp) / f"{u[0]}.{u[1]}.json" for u in units}

        def run(unit: tuple) -> int:  # in a pool thread: the time left is read as the process starts
            limit = [] if deadline is None else ["--time-limit", f"{max(0.0, deadline - time.perf_counter()):.1f}"]
            return subprocess.run([sys.executable, __file__, *base, *limit, "--kernels", unit[0], "--jobs", "1",
                                   "--shard", f"{unit[1]}/{shards}", "--out", str(reports[unit]),
                                   "--log", str(logs[unit])]).returncode

        with ThreadPoolExecutor(args.jobs) as pool:
            codes = dict(zip(units, pool.map(run, units)))
        found = {u: json.loads(reports[u].read_text()) for u in units if reports[u].exists()}
    with open(args.log, "w") as log:
        for unit in units:
            if logs[unit].exists():
                log.write(logs[unit].read_text())
                logs[unit].unlink()
    stats = {k: {"configs": 0, "mismatches": 0, "worst": {}} for k in kernels}
    for unit in units:
        entry = stats[unit[0]]
        if unit not in found:
            print(f"fuzz.py: no report from the process of {unit[0]} shard {unit[1]} (exit code {codes[unit]})",
                  flush=True)
            entry["mismatches"] += 1  # no report: the run cannot pass
            continue
        for case in found[unit]["cases"]:
            metric, value = case["metric"], case["value"]
            if metric in ("configs", "mismatches"):
                entry[metric] += value
            else:
                label = metric.removeprefix("worst_rel_err_")
                entry["worst"][label] = max(entry["worst"].get(label, 0.0), value)
    if shards > 1:
        for kernel in kernels:
            print(summary_line(kernel, stats[kernel], f" in {shards} shards"), flush=True)
    reported = [k for k in kernels if any(u in found for u in units if u[0] == k)]
    return report({k: stats[k] for k in reported}, args.dry_run, args.hostile), stats


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", type=int, default=1000, help="configurations per kernel (default 1000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=None,
                        help="default: all (with --hostile, all but merge)")
    parser.add_argument("--time-limit", type=float, default=None, help="stop drawing after this many seconds")
    parser.add_argument("--only", type=int, default=None, help="replay configuration ONLY alone")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: draw and run the reference side only")
    parser.add_argument("--hostile", action="store_true",
                        help="every configuration with bad index values (fuzz_hostile.py; not merge); "
                             "default --out results/fuzz_hostile.json")
    parser.add_argument("--out", default=None, help="default results/fuzz.json (--hostile: results/fuzz_hostile.json)")
    parser.add_argument("--log", default=str(ROOT / "benchmarks" / "logs" / "fuzz.log"),
                        help="every configuration's seed, shapes and result")
    parser.add_argument("--jobs", type=int, default=1,
                        help="processes at once: one per kernel, or with more jobs than kernels, shards of each "
                             "kernel's draws (the reference side is CPU work)")
    parser.add_argument("--shard", default="0/1", help=argparse.SUPPRESS)  # i/n: the i-th of n processes of a kernel
    args = parser.parse_args(argv)
    if args.kernels is None:
        args.kernels = [k for k in KERNELS if not args.hostile or k in CORRUPT]
    if args.out is None:
        args.out = str(ROOT / "benchmarks" / "results" / ("fuzz_hostile.json" if args.hostile else "fuzz.json"))
    if args.configs < 1 or args.seed < 0 or (args.only is not None and args.only < 0):
        parser.error("--configs must be >= 1, --seed and --only >= 0")
    if not args.dry_run and not cupy_paged._core.arrays.gpu_available():
        parser.error("no CUDA GPU answers: run on the GPU, or pass --dry-run")
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    pathlib.Path(args.log).parent.mkdir(parents=True, exist_ok=True)
    shard = tuple(int(part) for part in args.shard.split("/") if part.isdigit())
    if len(shard) != 2 or args.shard.count("/") != 1 or not shard[0] < shard[1]:
        parser.error("--shard must be i/n with 0 <= i < n")
    if args.jobs > 1 and args.only is None:
        result, stats = in_processes(args, argv if argv is not None else sys.argv[1:])
    else:
        with open(args.log, "w") as log:
            stats = fuzz(args.kernels, args.configs, args.seed, args.time_limit, args.dry_run, args.only, log,
                         hostile=args.hostile, shard=shard)
        result = report(stats, args.dry_run, args.hostile)
    result = merged(result, pathlib.Path(args.out))
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    total = sum(entry["mismatches"] for entry in stats.values())
    print(f"{sum(e['configs'] for e in stats.values())} configurations, {total} mismatches; wrote {args.out}")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
