"""The CPU reference backend: NumPy + numba, the ground truth the kernels are tested against.

It runs every public function when the inputs are NumPy arrays.  Arithmetic is
float32 (like the kernels' accumulators) for float16/bfloat16/float32 inputs and
float64 for float64 inputs, which the tests use as exact ground truth.  The
functions here take the checked problems of ``_checks`` and fill their outputs;
call them through the public API (``cupy_paged.flash_attn_varlen_func`` ...).

Index values that the checks let through (``check_values=False``) never make it
read or write outside an array, and give what the kernels give: a slot that cannot
be found (a block id outside ``[0, num_blocks)``, -1 included, a block-table column
past the row) is a hole: a cached key there is masked, a new token there is attended
(from k/v) but not written.  A masked key keeps its place among the keys, so the
causal diagonal, the window and the ALiBi distances of the other keys do not move.
"""
from __future__ import annotations

import numba
import numpy as np

from ._checks import DecodeProblem, VarlenProblem

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
    return np.where(found, blocks * block_size + positions % block_size, -1)


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


# --------------------------------------------------------------------------- public ops

def varlen(p: VarlenProblem) -> None:
    """Fill ``p.out`` (and ``p.lse``) for a checked varlen problem.

    Unchecked lengths, as the kernels take them: a negative length is an empty sequence; query
    rows past ``max_seqlen_q`` are not computed (the kernels' grid ends there) and rows outside q
    are neither read nor written, though the sequence keeps its length for the diagonal; a key
    past k's end (every key when ``cu_seqlens_k[b] < 0``) or behind a bad block id is a hole.
    """
    acc = accumulator_dtype(p.q.dtype)
    cu_q, cu_k = p.cu_seqlens_q, p.cu_seqlens_k
    total_q = p.q.shape[0]
    for b in range(p.batch):
        q_start, k_start = int(cu_q[b]), int(cu_k[b])
        length_q, length_k = _length(cu_q, b), _length(cu_k, b)
        first, last = max(0, -q_start), min(length_q, p.max_seqlen_q, total_q - q_start)  # rows computed
        if first >= last:
            continue
        if p.block_table is None:
            loadable = 0 if k_start < 0 else max(0, min(length_k, p.k.shape[0] - k_start))
            found = np.arange(loadable)
            k_b, v_b = p.k[k_start + found], p.v[k_start + found]
        else:
            # Keys past the table's last column are holes: only those before it can be found.
            width = p.block_table.shape[1] * p.block_size
            slots = paged_slots(p.block_table[b], np.arange(min(length_k, width)), p.block_size, p.k.shape[0])
            found = np.flatnonzero(slots >= 0)
            k_b, v_b = _rows(p.k)[slots[found]], _rows(p.v)[slots[found]]
        rows = slice(q_start + first, q_start + last)
        out, lse = attend(p.q[rows], k_b, v_b, p.softmax_scale, p.window, p.softcap, _slopes_of(p.alibi_slopes, b),
                          acc, key_index=found, offset=length_k - length_q + first)
        p.out[rows] = out.astype(p.out.dtype)
        if p.lse is not None:
            p.lse[:, rows] = lse


def _decode_table(p: DecodeProblem, b: int):
    """Sequence b's (table row, block size, block count), or None when its contiguous-cache row
    (``cache_batch_idx[b]``) is outside the cache.  A contiguous cache ``[Bc, S, Hkv, D]`` is
    ``Bc * S`` blocks of one token, row r's table being ``r * S + [0, S)``."""
    if p.block_table is not None:
        return p.block_table[b], p.block_size, int(p.k_cache.shape[0])
    num_rows, length = int(p.k_cache.shape[0]), int(p.k_cache.shape[1])
    row = b if p.cache_batch_idx is None else int(p.cache_batch_idx[b])
    if not 0 <= row < num_rows:
        return None
    return row * length + np.arange(length), 1, num_rows * length


def decode(p: DecodeProblem) -> None:
    """Attend ``p.q`` over the cached keys and the new ``p.k_new``/``p.v_new``, filling ``p.out``
    (and ``p.lse``), then append the new tokens to the caches.

    Sequence b's keys are the cache positions ``[L, cache_seqlens[b])`` (``L = cache_leftpad[b]``,
    else 0) followed by its new tokens at positions ``cache_seqlens[b] + t``; ``Lk`` counts them
    all.  With rotary cos/sin, q and the new keys are rotated at their positions first (new key t
    at ``cache_seqlens[b] + t``; query token i at ``cache_seqlens[b] + i`` with
    ``p.rotary_per_token``, else every query token at ``cache_seqlens[b]``), and the cache receives
    the rotated keys.  Every read sees the caches as they were before the call: the kernels append
    in the same launch and take the new tokens from k/v.

    Unchecked values: a negative ``cache_seqlens`` is 0, a leftpad outside ``[0, cache_seqlens[b]]``
    is 0, a hole (see the module's docstring) masks a cached key and keeps a new token out of the
    cache, and a sequence whose cache row is outside the cache sees no key and appends nothing.
    """
    acc = accumulator_dtype(p.q.dtype)
    batch, seqlen_new = p.batch, p.seqlen_new
    seqlens = np.maximum(np.broadcast_to(np.asarray(p.cache_seqlens, np.int64), (batch,)), 0)
    no_tokens = np.empty((batch, 0) + tuple(p.k_cache.shape[2:]), p.k_cache.dtype)
    q = p.q
    k_new = no_tokens if p.k_new is None else p.k_new
    v_new = no_tokens if p.v_new is None else p.v_new
    if p.rotary_dim:
        steps = np.arange(p.seqlen_q) if p.rotary_per_token else np.zeros(p.seqlen_q, np.int64)
        new_steps = np.arange(seqlen_new)
        q = np.stack([rotary(q[b], p.rotary_cos, p.rotary_sin, seqlens[b] + steps, p.rotary_interleaved, acc)
                      for b in range(batch)])
        k_new = np.stack([rotary(k_new[b], p.rotary_cos, p.rotary_sin, seqlens[b] + new_steps,
                                 p.rotary_interleaved, acc) for b in range(batch)]).astype(p.k_cache.dtype)

    k_rows, v_rows = _rows(p.k_cache), _rows(p.v_cache)
    new_slots = np.full((batch, seqlen_new), -1, np.int64)
    for b in range(batch):
        cached = int(seqlens[b])
        first = 0 if p.cache_leftpad is None else int(p.cache_leftpad[b])
        if not 0 <= first <= cached:
            first = 0
        located = _decode_table(p, b)
        if located is None:  # a cache row outside the cache: no key, cached or new, and no append
            p.out[b] = 0
            if p.lse is not None:
                p.lse[b] = -np.inf
            continue
        table_row, block_size, num_blocks = located
        # Positions past the table's last column are holes: only those before it can be found.
        cached_slots = paged_slots(table_row, np.arange(first, min(cached, len(table_row) * block_size)),
                                   block_size, num_blocks)
        new_slots[b] = paged_slots(table_row, cached + np.arange(seqlen_new), block_size, num_blocks)
        found = np.flatnonzero(cached_slots >= 0)  # key index of the cached keys found
        k_b = np.concatenate([k_rows[cached_slots[found]], k_new[b]])
        v_b = np.concatenate([v_rows[cached_slots[found]], v_new[b]])
        num_keys = cached - first + seqlen_new
        key_index = np.concatenate([found, np.arange(num_keys - seqlen_new, num_keys)])
        out, lse = attend(q[b], k_b, v_b, p.softmax_scale, p.window, p.softcap, _slopes_of(p.alibi_slopes, b),
                          acc, key_index=key_index, offset=num_keys - p.seqlen_q)
        p.out[b] = out.astype(p.out.dtype)
        if p.lse is not None:
            p.lse[b] = lse
    if seqlen_new:
        shape = (-1,) + tuple(k_new.shape[2:])
        write_kv_cache(p.k_cache, p.v_cache, k_new.reshape(shape), v_new.reshape(shape), new_slots.reshape(-1))


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
    """Scatter tokens ``k``/``v [tokens, Hkv, D]`` into the caches; negative slots and slots
    past the cache skipped."""
    slots = np.asarray(slot_mapping, dtype=np.int64)
    for cache, tokens in ((k_cache, k), (v_cache, v)):
        rows = _as_row_bits(tokens)
        cache_rows = cache.view(rows.dtype).reshape(-1, rows.shape[1])
        _scatter_rows(cache_rows, rows, slots)
