"""Attention over explicit keys, rotary embeddings and paged slots: what every reference
function is made of.

Index values that the checks let through (``check_values=False``) never make it
read or write outside an array, and give what the kernels give: a slot that cannot
be found (a block id outside ``[0, num_blocks)``, -1 included, a block-table column
past the row) is a hole: a cached key there is masked, a new token there is attended
(from k/v) but not written.  A masked key keeps its place among the keys, so the
causal diagonal, the window and the ALiBi distances of the other keys do not move.
"""
from __future__ import annotations

import numpy as np

from .._core.paging import slots_of


# Query rows handled at once: bounds the [H, rows, Lk] score matrix to a few hundred MB.
_ROW_CHUNK_ELEMS = 1 << 25


def accumulator_dtype(dtype) -> np.dtype:
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def attend(q, k, v, scale, window, softcap, slopes, acc, key_index=None, offset=None):
    """Attention of one sequence.

    q ``[Lq, H, D]``, k/v ``[n, Hkv, D]`` (any float dtype, computed in ``acc``),
    ``window = (left, right)`` around the diagonal (-1 unbounded), ``softcap`` (0 off)
    and ALiBi ``slopes [H]`` or None.  Query ``i`` sits on the diagonal at key
    ``i + offset`` (default ``n - Lq``: bottom-right aligned).  k/v hold the keys that
    exist, key ``r`` of them being key ``key_index[r]`` of the sequence (default
    ``r``); the others are holes.  Returns out ``[Lq, H, D]`` and the natural-log LSE
    ``[H, Lq]`` (``-inf`` and zero output for rows with no key).
    """
    num_q, num_heads, head_dim = q.shape
    present, num_kv_heads = k.shape[0], k.shape[1]
    offset = present - num_q if offset is None else offset
    keys = np.arange(present) if key_index is None else np.asarray(key_index, np.int64)
    group = num_heads // num_kv_heads
    out = np.zeros((num_q, num_heads, head_dim), acc)
    lse = np.full((num_heads, num_q), -np.inf, acc)
    if num_q == 0 or present == 0:
        return out, lse
    # Query head h reads kv head h // group: regroup q as [Hkv, group, Lq, D].
    qg = q.astype(acc).transpose(1, 0, 2).reshape(num_kv_heads, group, num_q, head_dim)
    kt = k.astype(acc).transpose(1, 0, 2)  # [Hkv, n, D]
    vt = v.astype(acc).transpose(1, 0, 2)
    left, right = window
    rows = max(1, _ROW_CHUNK_ELEMS // max(1, num_heads * present))
    for start in range(0, num_q, rows):
        stop = min(num_q, start + rows)
        # Distance of key j behind query i on the diagonal.
        shift = (np.arange(start, stop) + offset)[:, None] - keys[None, :]
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


def rotary(x, cos, sin, positions, interleaved: bool, acc):
    """FlashAttention-2's rotary embedding of ``x [L, H, D]``: token ``l`` at position
    ``positions[l]`` (cos/sin ``[seqlen_ro, rotary_dim / 2]``).  Pair ``i`` is dims
    ``(2i, 2i + 1)`` when ``interleaved`` (GPT-J), else ``(i, i + rotary_dim / 2)``
    (GPT-NeoX); ``(x, y) -> (x cos - y sin, x sin + y cos)`` with cos/sin at
    ``[position, i]``, computed in ``acc`` and rounded to x's dtype, as a kernel does.
    Dims from rotary_dim on, and a token whose position is past cos's rows, are left as
    they are."""
    half = cos.shape[1]
    out = x.astype(acc)
    positions = np.asarray(positions, np.int64)
    rotated = (positions >= 0) & (positions < cos.shape[0])
    c = cos[positions[rotated]].astype(acc)[:, None, :]  # [tokens, 1, rotary_dim / 2]
    s = sin[positions[rotated]].astype(acc)[:, None, :]
    first, second = (slice(0, 2 * half, 2), slice(1, 2 * half, 2)) if interleaved else \
                    (slice(0, half), slice(half, 2 * half))
    xs, ys = out[rotated, :, first], out[rotated, :, second]
    out[rotated, :, first] = xs * c - ys * s
    out[rotated, :, second] = xs * s + ys * c
    return out.astype(x.dtype)


def paged_slots(table_row, positions, block_size: int, num_blocks: int) -> np.ndarray:
    """Cache slots ``block * block_size + offset`` of a sequence's key ``positions`` (>= 0)
    through its block-table row, -1 for a hole: a column past the row, or a block id outside
    ``[0, num_blocks)``."""
    positions = np.asarray(positions, np.int64)
    width = len(table_row)
    padded = np.append(np.asarray(table_row, np.int64), -1)  # column `width` stands for "past the row"
    blocks = padded[np.minimum(positions // block_size, width)]
    found = (blocks >= 0) & (blocks < num_blocks)
    return np.where(found, slots_of(blocks, positions, block_size), -1)


def _rows(cache: np.ndarray) -> np.ndarray:
    """A ``[blocks, block_size, Hkv, D]`` cache as its slots ``[blocks * block_size, Hkv, D]`` (a view)."""
    return cache.reshape((-1,) + tuple(cache.shape[2:]))


def gather_paged(cache: np.ndarray, table_row: np.ndarray, num_keys: int) -> np.ndarray:
    """The first ``num_keys`` rows of a sequence from ``cache [blocks, block_size, Hkv, D]``;
    zeros where the table has a hole."""
    slots = paged_slots(table_row, np.arange(num_keys), cache.shape[1], cache.shape[0])
    rows = np.zeros((num_keys,) + tuple(cache.shape[2:]), cache.dtype)
    rows[slots >= 0] = _rows(cache)[slots[slots >= 0]]
    return rows


def _length(cu, b: int) -> int:
    """``cu[b + 1] - cu[b]`` as the kernels' int32 arithmetic has it (wrapping); 0 if negative."""
    difference = (int(cu[b + 1]) - int(cu[b]) + 2**31) % 2**32 - 2**31
    return max(difference, 0)


def _slopes_of(slopes, b: int):
    """ALiBi slopes of sequence ``b``: the ``[H]`` of every sequence, or row b of ``[B, H]``."""
    if slopes is None or slopes.ndim == 1:
        return slopes
    return slopes[b] if slopes.shape[0] > 1 else slopes[0]


