"""The CPU reference backend: NumPy + numba, the ground truth the kernels are tested against.

It runs every public function when the inputs are NumPy arrays.  Arithmetic is
float32 (like the kernels' accumulators) for float16/bfloat16/float32 inputs and
float64 for float64 inputs, which the tests use as exact ground truth.  The
functions here take the checked problems of ``_checks`` and fill their outputs;
call them through the public API (``cupy_paged.flash_attn_varlen_func`` ...).
"""
from __future__ import annotations

import numba
import numpy as np

from ._checks import DecodeProblem, VarlenProblem
from .layout import slot_mapping_from_positions

# Query rows handled at once: bounds the [H, rows, Lk] score matrix to a few hundred MB.
_ROW_CHUNK_ELEMS = 1 << 25


def accumulator_dtype(dtype) -> np.dtype:
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def attend(q, k, v, scale, window, softcap, slopes, acc):
    """Attention of one sequence.

    q ``[Lq, H, D]``, k/v ``[Lk, Hkv, D]`` (any float dtype, computed in ``acc``),
    bottom-right aligned ``window = (left, right)`` (-1 unbounded), ``softcap``
    (0 off) and ALiBi ``slopes [H]`` or None.  Returns out ``[Lq, H, D]`` and the
    natural-log LSE ``[H, Lq]`` (``-inf`` and zero output for rows with no key).
    """
    num_q, num_heads, head_dim = q.shape
    num_k, num_kv_heads = k.shape[0], k.shape[1]
    group = num_heads // num_kv_heads
    out = np.zeros((num_q, num_heads, head_dim), acc)
    lse = np.full((num_heads, num_q), -np.inf, acc)
    if num_q == 0 or num_k == 0:
        return out, lse
    # Query head h reads kv head h // group: regroup q as [Hkv, group, Lq, D].
    qg = q.astype(acc).transpose(1, 0, 2).reshape(num_kv_heads, group, num_q, head_dim)
    kt = k.astype(acc).transpose(1, 0, 2)  # [Hkv, Lk, D]
    vt = v.astype(acc).transpose(1, 0, 2)
    left, right = window
    keys = np.arange(num_k)
    rows = max(1, _ROW_CHUNK_ELEMS // max(1, num_heads * num_k))
    for start in range(0, num_q, rows):
        stop = min(num_q, start + rows)
        # Distance of key j behind query i on the bottom-right aligned diagonal.
        shift = (np.arange(start, stop) + num_k - num_q)[:, None] - keys[None, :]
        visible = np.ones(shift.shape, bool)
        if left >= 0:
            visible &= shift <= left
        if right >= 0:
            visible &= shift >= -right
        s = np.einsum("xgqd,xkd->xgqk", qg[:, :, start:stop], kt) * acc.type(scale)
        if softcap > 0:
            s = acc.type(softcap) * np.tanh(s / acc.type(softcap))
        if slopes is not None:
            bias = np.abs(shift).astype(acc)[None, None] * slopes.astype(acc).reshape(num_kv_heads, group, 1, 1)
            s = s - bias
        s = np.where(visible[None, None], s, -np.inf)
        row_max = s.max(axis=-1, keepdims=True)
        seen = np.isfinite(row_max)
        p = np.exp(s - np.where(seen, row_max, 0))
        row_sum = p.sum(axis=-1, keepdims=True)
        o = np.einsum("xgqk,xkd->xgqd", p, vt) / np.where(seen, row_sum, 1)
        out[start:stop] = o.reshape(num_heads, stop - start, head_dim).transpose(1, 0, 2)
        with np.errstate(divide="ignore"):
            chunk_lse = np.where(seen, row_max + np.log(row_sum), -np.inf)
        lse[:, start:stop] = chunk_lse.reshape(num_heads, stop - start)
    return out, lse


def gather_paged(cache: np.ndarray, table_row: np.ndarray, num_keys: int) -> np.ndarray:
    """The first ``num_keys`` rows of a sequence from ``cache [blocks, block_size, Hkv, D]``."""
    block_size = cache.shape[1]
    positions = np.arange(num_keys)
    blocks = table_row[positions // block_size]
    return cache[blocks, positions % block_size]


# --------------------------------------------------------------------------- public ops

def varlen(p: VarlenProblem) -> None:
    """Fill ``p.out`` (and ``p.lse``) for a checked varlen problem."""
    acc = accumulator_dtype(p.q.dtype)
    cu_q, cu_k = p.cu_seqlens_q, p.cu_seqlens_k
    for b in range(p.batch):
        q0, q1 = int(cu_q[b]), int(cu_q[b + 1])
        num_k = int(cu_k[b + 1] - cu_k[b])
        if p.block_table is None:
            k_b, v_b = p.k[cu_k[b]:cu_k[b + 1]], p.v[cu_k[b]:cu_k[b + 1]]
        else:
            k_b = gather_paged(p.k, p.block_table[b], num_k)
            v_b = gather_paged(p.v, p.block_table[b], num_k)
        out, lse = attend(p.q[q0:q1], k_b, v_b, p.softmax_scale, p.window, p.softcap, p.alibi_slopes, acc)
        p.out[q0:q1] = out.astype(p.out.dtype)
        if p.lse is not None:
            p.lse[:, q0:q1] = lse


def decode(p: DecodeProblem) -> None:
    """Append ``p.k_new``/``p.v_new`` to the caches, then fill ``p.out`` (and ``p.lse``)."""
    acc = accumulator_dtype(p.q.dtype)
    block_size = p.block_size
    # A contiguous cache (no table) is block b per sequence b; an int length holds for every sequence.
    table = p.block_table if p.block_table is not None else np.arange(p.batch, dtype=np.int32)[:, None]
    seqlens = np.broadcast_to(np.asarray(p.cache_seqlens, np.int64), (p.batch,))
    if p.k_new is not None and p.seqlen_new:
        positions = (seqlens[:, None] + np.arange(p.seqlen_new)[None, :]).reshape(-1)
        seq_ids = np.repeat(np.arange(p.batch), p.seqlen_new)
        slots = slot_mapping_from_positions(table, seq_ids, positions, block_size)
        shape = (-1,) + tuple(p.k_new.shape[2:])
        write_kv_cache(p.k_cache, p.v_cache, p.k_new.reshape(shape), p.v_new.reshape(shape), slots)
    for b in range(p.batch):
        num_k = int(seqlens[b]) + p.seqlen_new
        k_b = gather_paged(p.k_cache, table[b], num_k)
        v_b = gather_paged(p.v_cache, table[b], num_k)
        out, lse = attend(p.q[b], k_b, v_b, p.softmax_scale, p.window, p.softcap, p.alibi_slopes, acc)
        p.out[b] = out.astype(p.out.dtype)
        if p.lse is not None:
            p.lse[b] = lse


@numba.njit(cache=True)
def _scatter_rows(cache_rows, token_rows, slots):
    for t in range(slots.shape[0]):
        slot = slots[t]
        if 0 <= slot < cache_rows.shape[0]:
            cache_rows[slot] = token_rows[t]


def _as_row_bits(array: np.ndarray) -> np.ndarray:
    """``array [tokens, Hkv, D]`` as raw bits ``[tokens, Hkv * D]`` (numba has no bfloat16)."""
    bits = {2: np.uint16, 4: np.uint32, 8: np.uint64}[array.dtype.itemsize]
    return np.ascontiguousarray(array).view(bits).reshape(array.shape[0], -1)


def write_kv_cache(k_cache, v_cache, k, v, slot_mapping) -> None:
    """Scatter tokens ``k``/``v [tokens, Hkv, D]`` into the caches; negative slots skipped."""
    slots = np.asarray(slot_mapping, dtype=np.int64)
    for cache, tokens in ((k_cache, k), (v_cache, v)):
        rows = _as_row_bits(tokens)
        cache_rows = cache.view(rows.dtype).reshape(-1, rows.shape[1])
        _scatter_rows(cache_rows, rows, slots)
