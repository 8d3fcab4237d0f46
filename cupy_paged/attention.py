"""The public attention functions, with FlashAttention-2's names, arguments and meaning.

Each function turns its inputs into arrays at the one boundary (``_arrays``),
checks them (``_checks``), then runs the CPU reference backend (``reference``)
for NumPy inputs or the CUDA kernels (``ops.<family>.run``) for device inputs.
"""
from __future__ import annotations

import numpy as np

from . import _checks, ops, reference
from ._arrays import CUDA, as_array


def _arrays(**named):
    return {name: None if obj is None else as_array(obj, name) for name, obj in named.items()}


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, block_table=None, return_softmax_lse=False, out=None,
                           *, check_values=True, lse_out=None):
    """Attention over a batch of variable-length sequences packed along one token axis.

    Sequence ``b`` owns query tokens ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and key
    tokens ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``.  With ``block_table`` the keys and
    values are read straight from paged caches instead: key ``j`` of sequence ``b``
    sits at ``k[block_table[b, j // block_size], j % block_size]``.

    Parameters
    ----------
    q : array, ``[total_q, num_heads, head_dim]`` (or ``[1, total_q, ...]``), float16/bfloat16
    k, v : array, ``[total_k, num_kv_heads, head_dim]`` (or ``[1, total_k, ...]``); with
        ``block_table``, paged caches ``[num_blocks, block_size, num_kv_heads, head_dim]``
        with ``block_size`` a power of two from 8 to 256.  ``num_heads % num_kv_heads == 0``.
    cu_seqlens_q, cu_seqlens_k : int32 array, ``[batch_size + 1]``, starting at 0, non-decreasing
    max_seqlen_q, max_seqlen_k : int, at least the longest query / key sequence
    softmax_scale : float, default ``1 / sqrt(head_dim)``
    causal : bool, bottom-right aligned: query ``i`` sees key ``j`` iff ``j <= i + Lk - Lq``
    window_size : (int, int), ``(left, right)`` band around that diagonal; -1 is unbounded
    softcap : float, ``s = softcap * tanh(s / softcap)`` on the scaled score when > 0
    alibi_slopes : float array ``[num_heads]``; adds ``-slope[h] * |i + Lk - Lq - j|``
    block_table : int32 array ``[batch_size, max_blocks_per_seq]``, -1 where unallocated
    return_softmax_lse : bool, also return the natural-log LSE ``[num_heads, total_q]`` (float32)
    out : array like ``q``, optional; written in place and returned
    check_values : bool, copy GPU index arrays to the host to check them (skipped anyway
        while a CUDA graph is being captured)
    lse_out : float32 array ``[num_heads, total_q]``, optional; the LSE is written there
        (and returned) instead of into a new array

    Returns
    -------
    out : array ``[total_q, num_heads, head_dim]`` (with ``q``'s leading axis, if any), or
    (out, lse) with ``return_softmax_lse``.  Rows that see no key are zero with LSE ``-inf``.

    Raises
    ------
    TypeError, ValueError
        Naming the argument, for any shape, dtype or value that does not fit.

    Examples
    --------
    >>> import numpy as np, cupy_paged
    >>> cu_q, max_q = cupy_paged.cu_seqlens_from_lengths([10, 3, 1])
    >>> cu_k, max_k = cupy_paged.cu_seqlens_from_lengths([0, 1, 7])
    >>> q = np.ones((14, 4, 64), np.float16); k = v = np.ones((8, 2, 64), np.float16)
    >>> cupy_paged.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True).shape
    (14, 4, 64)
    """
    a = _arrays(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                alibi_slopes=alibi_slopes, block_table=block_table, out=out, lse_out=lse_out)
    p = _checks.prepare_varlen(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"],
                               max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size,
                               softcap, a["alibi_slopes"], a["block_table"], return_softmax_lse,
                               a["out"], check_values, a["lse_out"])
    if p.backend == CUDA:
        ops.varlen.run(p)
    else:
        reference.varlen(p)
    result = p.out.reshape(a["q"].shape) if a["q"].ndim == 4 else p.out
    return (result, p.lse) if p.lse is not None else result


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                            block_table=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), softcap=0.0, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, out=None, *, check_values=True, lse_out=None):
    """Decode attention over a KV cache, appending new tokens to it in place first.

    Every sequence has ``seqlen_q`` query tokens (1 for plain decoding, more for
    speculative decoding).  With ``k``/``v``, their ``seqlen_new`` tokens are written
    into the cache at positions ``cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1``
    through ``block_table``, then attended to together with the cached keys.

    Parameters
    ----------
    q : array ``[batch_size, seqlen_q, num_heads, head_dim]``, float16/bfloat16
    k_cache, v_cache : array ``[num_blocks, block_size, num_kv_heads, head_dim]`` with
        ``block_table`` (block size a power of two, 8 to 256), else contiguous
        ``[batch_size, seqlen_cache, num_kv_heads, head_dim]``; updated in place
    k, v : array ``[batch_size, seqlen_new, num_kv_heads, head_dim]``, optional new tokens
    cache_seqlens : int or int32 array ``[batch_size]``, tokens cached before the append
    block_table : int32 array ``[batch_size, max_blocks_per_seq]``, -1 where unallocated
    softmax_scale, causal, window_size, softcap, alibi_slopes : as in
        :func:`flash_attn_varlen_func`, with ``Lk = cache_seqlens[b] + seqlen_new``, ``Lq = seqlen_q``
    num_splits : int, split-KV parts per sequence; 0 lets a heuristic choose
    return_softmax_lse : bool, also return the LSE ``[batch_size, num_heads, seqlen_q]`` (float32)
    out : array like ``q``, optional; with it and ``check_values=False`` a CUDA call allocates
        nothing and never syncs (the value checks copy index arrays to the host)
    check_values : bool, as in :func:`flash_attn_varlen_func`
    lse_out : float32 array ``[batch_size, num_heads, seqlen_q]``, optional; a preallocated LSE
        buffer, so that a call asking for the LSE allocates nothing (CUDA graph capture)

    Returns
    -------
    out : array ``[batch_size, seqlen_q, num_heads, head_dim]``, or (out, lse).

    Raises
    ------
    TypeError, ValueError
        Naming the argument, for any shape, dtype or value that does not fit, among them
        a block table too short for ``cache_seqlens + seqlen_new`` or a block id out of range.

    Examples
    --------
    >>> import numpy as np, cupy_paged
    >>> k_cache = np.zeros((8, 32, 2, 64), np.float16); v_cache = np.zeros_like(k_cache)
    >>> table = cupy_paged.block_table_from_lists([[2], [0, 1], [3, 5, 6]], max_blocks=4)
    >>> q = np.ones((3, 1, 4, 64), np.float16); kn = vn = np.ones((3, 1, 2, 64), np.float16)
    >>> out = cupy_paged.flash_attn_with_kvcache(q, k_cache, v_cache, kn, vn,
    ...     cache_seqlens=np.array([30, 32, 70], np.int32), block_table=table, causal=True)
    >>> out.shape
    (3, 1, 4, 64)
    """
    a = _arrays(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, block_table=block_table,
                alibi_slopes=alibi_slopes, out=out, lse_out=lse_out)
    if cache_seqlens is not None and not np.isscalar(cache_seqlens):
        cache_seqlens = as_array(cache_seqlens, "cache_seqlens")
    p = _checks.prepare_decode(a["q"], a["k_cache"], a["v_cache"], a["k"], a["v"], cache_seqlens,
                               a["block_table"], softmax_scale, causal, window_size, softcap,
                               a["alibi_slopes"], num_splits, return_softmax_lse, a["out"],
                               check_values, a["lse_out"])
    if p.backend == CUDA:
        ops.decode.run(p)
    else:
        reference.decode(p)
    return (p.out, p.lse) if p.lse is not None else p.out


def write_kv_cache(k_cache, v_cache, k, v, slot_mapping, *, check_values=True):
    """Scatter new key/value tokens into paged caches, in place.

    Token ``t`` goes to slot ``slot_mapping[t] = block * block_size + offset``, that is
    ``k_cache[block, offset] = k[t]``; negative slots (padding) are skipped.  On CUDA
    arrays this is one kernel with 16-byte accesses on CuPy's current stream.

    Parameters
    ----------
    k_cache, v_cache : array ``[num_blocks, block_size, num_kv_heads, head_dim]``, C-contiguous
    k, v : array ``[num_tokens, num_kv_heads, head_dim]``, the caches' dtype
    slot_mapping : int32 array ``[num_tokens]``
    check_values : bool, copy a GPU ``slot_mapping`` to the host to check its range (one
        sync); the kernel skips slots past the cache either way

    Raises
    ------
    TypeError, ValueError
        Naming the argument, for shapes or dtypes that do not fit or a slot past the cache.

    Examples
    --------
    >>> import numpy as np, cupy_paged
    >>> k_cache = np.zeros((4, 16, 2, 64), np.float16); v_cache = np.zeros_like(k_cache)
    >>> k = np.ones((3, 2, 64), np.float16)
    >>> cupy_paged.write_kv_cache(k_cache, v_cache, k, k, np.array([17, -1, 63], np.int32))
    >>> float(k_cache[1, 1].sum()), float(k_cache[3, 15].sum())
    (128.0, 128.0)
    """
    a = _arrays(k_cache=k_cache, v_cache=v_cache, k=k, v=v, slot_mapping=slot_mapping)
    backend, slots = _checks.prepare_write(a["k_cache"], a["v_cache"], a["k"], a["v"], a["slot_mapping"],
                                           check_values)
    if backend == CUDA:
        ops.kv_write.run(a["k_cache"], a["v_cache"], a["k"], a["v"], slots)
    else:
        reference.write_kv_cache(a["k_cache"], a["v_cache"], a["k"], a["v"], slots)
