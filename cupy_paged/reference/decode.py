"""The CPU reference of `flash_attn_with_kvcache`."""
from __future__ import annotations

import numpy as np

from .._core.problems import DecodeProblem
from ._attend import _rows, _slopes_of, accumulator_dtype, attend, paged_slots, rotary
from .kv_write import run as write_kv_cache

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


def run(p: DecodeProblem) -> None:
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
    if batch == 0:  # no sequence: nothing to attend, nothing to append
        return
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


