"""Hostile device metadata for ``benchmarks/fuzz.py --hostile`` (issue 16, point 4).

Each configuration is a normal draw of its kernel with one sequence's (or token's) index values
made bad, as device arrays reach the kernels on the CUDA-graph path (``check_values=False`` on
both sides, so the host checks nothing):

* a block id outside ``[0, num_blocks)`` (-1, other negatives, ids past the cache, the int32
  maximum) in a block-table column the sequence reads;
* a length past the block table (``cache_seqlens``, or ``cu_seqlens_k`` with a table) or past a
  contiguous cache; a negative ``cache_seqlens``; a decreasing ``cu_seqlens_k``, or one past k's
  end;
* a ``cache_batch_idx`` outside the cache's batch, a ``cache_leftpad`` past its sequence;
* a ``slot_mapping`` entry past the cache;
* in a continuous-batching step, a bad id in the cache's own block table, which the plan copies.

The reference backend defines what each gives (``cupy_paged/reference``: a slot that cannot be
found is a hole, a negative length an empty sequence, a cache row outside the cache sees no key),
so the outputs are compared whole, as for clean configurations.  The kernels must also report the
value in the device error word: ``check_errors()`` must raise, naming one of the arguments the
corruption may trip (``case["expect"]``) and, where one sequence (or token) alone is bad, that one.
"""
from __future__ import annotations

import numpy as np

INT32_MAX = 2 ** 31 - 1


def _bad_id(rng, num_blocks: int) -> int:
    return int(rng.choice([-1, -2, -int(rng.integers(3, 1 << 20)), num_blocks, num_blocks + int(rng.integers(1, 1000)),
                           INT32_MAX]))


def _expect(case: dict, arguments, where: str | None) -> bool:
    case.update(holes=True, hostile=True, expect=tuple(arguments), where=where)
    case["args"]["check_values"] = False
    case["args"].pop("window_size", None)  # every key of the bad sequence is then read
    return True


def _lengths(cu) -> np.ndarray:
    return np.diff(np.asarray(cu, np.int64))


def corrupt_varlen(case: dict, rng) -> bool:
    a = case["args"]
    lengths_q, lengths_k = _lengths(a["cu_seqlens_q"]), _lengths(a["cu_seqlens_k"])
    reading = np.flatnonzero((lengths_q > 0) & (lengths_k > 0))  # sequences whose keys some query reads
    if not reading.size:
        return False
    b = int(rng.choice(reading))
    table = a.get("block_table")
    kind = rng.choice(["id", "past", "decrease"] if table is not None else ["decrease", "past"])
    if kind == "id":
        bs = a["k"].shape[1]
        table[b, int(rng.integers(0, -(-int(lengths_k[b]) // bs)))] = _bad_id(rng, a["k"].shape[0])
        return _expect(case, ["block_table"], f"sequence {b}")
    cu_k = np.asarray(a["cu_seqlens_k"], np.int64).copy()
    if kind == "past":
        capacity = table.shape[1] * a["k"].shape[1] if table is not None else a["k"].shape[0] - int(cu_k[b])
        lengths_k[b] = capacity + int(rng.integers(1, 64))
        cu_k = np.concatenate([[0], np.cumsum(lengths_k)])
        a["cu_seqlens_k"] = cu_k.astype(np.int32)
        a["max_seqlen_k"] = max(int(a["max_seqlen_k"]), int(lengths_k.max()))
        if table is not None:
            return _expect(case, ["cache_seqlens"], f"sequence {b}")
        # Contiguous k: a length past k's end, and every later sequence starting past it.
        return _expect(case, ["cu_seqlens_k"], None)
    cu_k[b + 1] = cu_k[b] - int(rng.integers(1, 40))
    a["cu_seqlens_k"] = cu_k.astype(np.int32)
    a["max_seqlen_k"] = max(int(a["max_seqlen_k"]), int(_lengths(cu_k).max()))
    # Sequence b + 1 grows by as much: past its table, its CTAs may report first.
    return _expect(case, ["cu_seqlens_k", "cache_seqlens", "block_table"], None)


def corrupt_decode(case: dict, rng) -> bool:
    a = case["args"]
    batch = a["q"].shape[0]
    if not batch:
        return False
    cached = np.broadcast_to(np.asarray(a["cache_seqlens"], np.int32), (batch,)).copy()
    a["cache_seqlens"] = cached  # a device array: the host sees no value
    b = int(rng.integers(0, batch))
    table = a.get("block_table")
    kinds = ["past", "negative"]
    if table is not None and cached[b] > 0:
        kinds.append("id")
    if table is None and "cache_batch_idx" in a:
        kinds.append("batch_idx")
    if table is None and "cache_leftpad" in a:
        kinds.append("leftpad")
    kind = rng.choice(kinds)
    rotary = ["rotary_cos"] if "rotary_cos" in a else []
    if kind == "id":  # a column of cached keys: the attention reads it
        bs = a["k_cache"].shape[1]
        table[b, int(rng.integers(0, -(-int(cached[b]) // bs)))] = _bad_id(rng, a["k_cache"].shape[0])
        return _expect(case, ["block_table"], f"sequence {b}")
    if kind == "negative":
        cached[b] = -int(rng.integers(1, 100))
        a.pop("cache_leftpad", None)
        return _expect(case, ["cache_seqlens"], f"sequence {b}")
    if kind == "batch_idx":
        rows = a["k_cache"].shape[0]
        a["cache_batch_idx"][b] = rows + int(rng.integers(0, 5)) if rng.random() < 0.5 else -int(rng.integers(1, 5))
        return _expect(case, ["cache_batch_idx"], f"sequence {b}")
    if kind == "leftpad":
        a["cache_leftpad"][b] = int(cached[b]) + int(rng.integers(1, 9)) if rng.random() < 0.5 else -1
        return _expect(case, ["cache_leftpad"], f"sequence {b}")
    capacity = table.shape[1] * a["k_cache"].shape[1] if table is not None else a["k_cache"].shape[1]
    cached[b] = capacity + int(rng.integers(1, 64))
    a.pop("cache_leftpad", None)
    # Split CTAs past the first may report the row's -1 padding columns before split 0 reports.
    return _expect(case, ["cache_seqlens", "block_table"] + rotary, f"sequence {b}")


def corrupt_varlen_short(case: dict, rng) -> bool:
    """corrupt_varlen on the short-row path, which runs decode.cu's ragged kernel: a length past the
    table is reported as the decode kernel reports one, by split 0 as the length or by another split
    as the -1 padding columns of the row it then reads (both name the sequence)."""
    if not corrupt_varlen(case, rng):
        return False
    if case["expect"] == ("cache_seqlens",):
        case["expect"] = ("cache_seqlens", "block_table")
    return True


def corrupt_write(case: dict, rng) -> bool:
    a = case["args"]
    slots = a["slot_mapping"]
    if not slots.size:
        return False
    t = int(rng.integers(0, slots.size))
    capacity = a["k_cache"].shape[0] * a["k_cache"].shape[1]
    slots[t] = int(rng.choice([capacity, capacity + int(rng.integers(1, 1 << 20)), INT32_MAX]))
    return _expect(case, ["slot_mapping"], f"token {t}")


def corrupt_step(case: dict, rng) -> bool:
    """A bad id in the cache's own table of a sequence with cached keys (``plan_step`` writes it in
    before the plan is built); the plan's slots of new tokens in that block are bad too."""
    a = case["args"]
    reading = [b for b, c in enumerate(a["cached"]) if c > 0]
    if not reading:
        return False
    b = int(rng.choice(reading))
    bs = a["k_cache"].shape[1]
    a["corrupt"] = (b, int(rng.integers(0, -(-a["cached"][b] // bs))), _bad_id(rng, a["k_cache"].shape[0]))
    case.update(holes=True, hostile=True, expect=("block_table", "slot_mapping"), where=None)
    return True


CORRUPT = {"varlen": corrupt_varlen, "varlen_paged": corrupt_varlen, "decode": corrupt_decode,
           "write_kv_cache": corrupt_write, "step": corrupt_step, "balanced": corrupt_decode,
           "varlen_short": corrupt_varlen_short}
