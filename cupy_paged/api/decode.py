"""`flash_attn_with_kvcache`: decode (and short query rows) over a paged or contiguous cache."""
from __future__ import annotations

import numbers

import numpy as np

from .. import kernels, reference
from .._core import errors
from .._core.arrays import _KIND_OF_TYPE, CPU, CUDA, CUPY, TORCH, Array, memo_lookup, backend_of, kind_of, read, to_host
from .._core.problems import DecodeProblem
from .._core.streams import handle
from .._core.types import (REFERENCE_DTYPES, as_read, check_alibi, check_block_size,
                           check_block_table_values, check_bool, check_cache_pair, check_dense_last, check_float,
                           check_head_dim, check_heads, check_index, check_int, check_lse, check_out, check_rank,
                           check_same_dtype, check_same_shape, check_scalars, check_values_mode, check_window,
                           check_writable, dtype_name, host_checked)
from ._call import FAST_KINDS, MEMO, alloc_stream, current_device, host_outputs, on_device, readable, remember, served_empty

def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            *, out=None, lse_out=None, stream=None, check_values=None):
    """Decode attention over a KV cache, appending new tokens to it in place first.

    Every sequence has ``seqlen_q`` query tokens (1 for plain decoding, more for
    speculative decoding).  With ``k``/``v``, their ``seqlen_new`` tokens are written
    into the cache at positions ``cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1``
    through ``block_table``, then attended to together with the cached keys.  The positional
    arguments are FlashAttention-2's (``flash_attn_with_kvcache`` of flash_attn 2.7).

    Parameters
    ----------
    q : array ``[batch_size, seqlen_q, num_heads, head_dim]``, float16/bfloat16
    k_cache, v_cache : array ``[num_blocks, block_size, num_kv_heads, head_dim]`` with
        ``block_table`` (block size a power of two, 8 to 256), else contiguous
        ``[batch_size_cache, seqlen_cache, num_kv_heads, head_dim]``; updated in place
    k, v : array ``[batch_size, seqlen_new, num_kv_heads, head_dim]``, optional new tokens
    rotary_cos, rotary_sin : array ``[seqlen_ro, rotary_dim / 2]`` (q's dtype), optional: rotate q
        and the new k (written rotated into the cache) at their positions ``cache_seqlens[b] + t``;
        q at ``cache_seqlens[b] + i`` when causal or local (FlashAttention-2's rule), else at ``cache_seqlens[b]``.
        ``rotary_dim`` a multiple of 16, at most ``head_dim``; needs ``k``/``v``
    cache_seqlens : int or int32 array ``[batch_size]``, tokens cached before the append (the end
        position, ``cache_leftpad`` included); default: the full contiguous cache less the new tokens
    cache_batch_idx : int32 array ``[batch_size]``, optional: the row of a contiguous cache each
        sequence uses (default ``b``)
    cache_leftpad : int32 array ``[batch_size]``, optional: the first valid position of each row of a
        contiguous cache (keys ``cache_leftpad[b] .. cache_seqlens[b] - 1``)
    block_table : int32 array ``[batch_size, max_blocks_per_seq]``, -1 where unallocated
    softmax_scale, causal, window_size, softcap, alibi_slopes : as in
        :func:`flash_attn_varlen_func`, with ``Lk = cache_seqlens[b] - cache_leftpad[b] + seqlen_new``,
        ``Lq = seqlen_q``
    rotary_interleaved : bool, True: GPT-J pairs ``(2i, 2i + 1)``; False: GPT-NeoX pairs
        ``(i, i + rotary_dim / 2)``
    num_splits : int, split-KV parts per sequence; 0 lets a heuristic choose (a paged batch of a full
        wave or two: each sequence's keys shared out by length on the device; 1: never split)
    return_softmax_lse : bool, also return the LSE ``[batch_size, num_heads, seqlen_q]`` (float32)
    out : array like ``q``, optional, keyword only; written in place and returned
    lse_out : float32 array ``[batch_size, num_heads, seqlen_q]``, optional, keyword only
    stream, check_values : keyword only, as in :func:`flash_attn_varlen_func`

    Returns
    -------
    out : array ``[batch_size, seqlen_q, num_heads, head_dim]`` of the caller's kind, or
    ``(out, lse)``.

    Raises
    ------
    TypeError, ValueError
        Naming the argument, for any shape, dtype or host value that does not fit; device index
        values are reported by :func:`cupy_paged.check_errors`.

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
    kind = _KIND_OF_TYPE.get(type(q)) or kind_of(q)
    if (kind is TORCH or kind is CUPY) and check_values is not True and not errors._debug:
        int_length = type(cache_seqlens) is int
        key, launch, ptr = memo_lookup(MEMO, kind, _memo_key, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin,
                                       cache_seqlens, int_length, cache_batch_idx, cache_leftpad, block_table,
                                       softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes,
                                       num_splits, return_softmax_lse, out, lse_out)
        if launch is not None and launch.device == current_device():
            if int_length:
                cached_all = cache_seqlens
                fits = 0 <= cached_all <= launch.int_length_max
            else:
                cached_all, fits = launch.cached_default, True
            q_ptr, kc_ptr, vc_ptr = ptr(q), ptr(k_cache), ptr(v_cache)
            kn_ptr, vn_ptr = (0, 0) if k is None else (ptr(k), ptr(v))
            o_ptr, l_ptr = 0 if out is None else ptr(out), 0 if lse_out is None else ptr(lse_out)
            if fits and not (q_ptr | kc_ptr | vc_ptr | kn_ptr | vn_ptr | o_ptr | l_ptr) & 15:
                ptrs = (q_ptr, kc_ptr, vc_ptr, kn_ptr, vn_ptr,
                        0 if int_length or cache_seqlens is None else ptr(cache_seqlens),
                        0 if block_table is None else ptr(block_table),
                        0 if cache_batch_idx is None else ptr(cache_batch_idx),
                        0 if cache_leftpad is None else ptr(cache_leftpad),
                        0 if rotary_cos is None else ptr(rotary_cos), 0 if rotary_sin is None else ptr(rotary_sin),
                        0 if alibi_slopes is None else ptr(alibi_slopes))
                h = handle(stream, kind, launch.device)
                out_obj, lse = launch.run(kind, q, ptrs, cached_all, None if out is None else (out, o_ptr),
                                          None if lse_out is None else (lse_out, l_ptr), h,
                                          None if stream is None else h)
                return (out_obj, lse) if launch.want_lse else out_obj
    else:
        key = None
    return _decode_slow(key, kind, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                        cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                        rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, out, lse_out, stream,
                        check_values)


def _memo_key(s, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, int_length, cache_batch_idx,
              cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved,
              alibi_slopes, num_splits, return_softmax_lse, out, lse_out) -> tuple:
    """What decides a call's launch, its arrays read by ``s`` (``memo_lookup``); the None checks
    inline, since most optional arguments are None; an int ``cache_seqlens`` keys as "int"."""
    return ("decode", s(q), s(k_cache), s(v_cache), None if k is None else s(k), None if v is None else s(v),
            None if rotary_cos is None else s(rotary_cos), None if rotary_sin is None else s(rotary_sin),
            "int" if int_length else None if cache_seqlens is None else s(cache_seqlens),
            None if cache_batch_idx is None else s(cache_batch_idx),
            None if cache_leftpad is None else s(cache_leftpad),
            None if block_table is None else s(block_table), softmax_scale, causal, window_size, softcap,
            rotary_interleaved, None if alibi_slopes is None else s(alibi_slopes), num_splits,
            return_softmax_lse, None if out is None else s(out), None if lse_out is None else s(lse_out),
            # Types too: causal=1 equals True, (1.0, 0) equals (1, 0) and softcap=False equals 0.0,
            # which the checks refuse.
            causal.__class__, rotary_interleaved.__class__, return_softmax_lse.__class__,
            num_splits.__class__, softmax_scale.__class__, softcap.__class__, *map(type, window_size))


def serves_step(batch_size: int, num_tokens: int, max_seqlen_q: int) -> bool:
    """Whether a step of ``batch_size`` sequence rows and ``num_tokens`` new tokens runs on
    ``flash_attn_with_kvcache``: the decode kernel takes the token of row ``i`` as token ``i``,
    so every row has at most one new token and there are as many tokens as rows (padding
    rows and tokens counted).

    Examples
    --------
    >>> from cupy_paged.api.decode import serves_step; serves_step(4, 4, 1), serves_step(4, 8, 1), serves_step(2, 3, 2)
    (True, False, False)
    """
    return max_seqlen_q == 1 and num_tokens == batch_size


def _decode_slow(key, kind, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                 cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved,
                 alibi_slopes, num_splits, return_softmax_lse, out, lse_out, stream, check_values):
    named = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                 cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table,
                 alibi_slopes=alibi_slopes, out=out, lse_out=lse_out)
    if cache_seqlens is not None and not isinstance(cache_seqlens, numbers.Number):
        named["cache_seqlens"] = cache_seqlens
    a = {name: None if obj is None else read(obj, name) for name, obj in named.items()}
    seqlens = a.get("cache_seqlens", cache_seqlens)
    p = prepare_decode(a["q"], a["k_cache"], a["v_cache"], a["k"], a["v"], a["rotary_cos"], a["rotary_sin"],
                       seqlens, a["cache_batch_idx"], a["cache_leftpad"], a["block_table"], softmax_scale, causal,
                       window_size, softcap, rotary_interleaved, a["alibi_slopes"], num_splits, return_softmax_lse,
                       a["out"], a["lse_out"], check_values)
    if p.backend == CPU:
        reference.decode.run(p)
        result = host_outputs(p, out, lse_out, kind)
        return result if p.lse is not None else result[0]
    h = handle(stream, kind, p.q.device)
    if p.batch == 0:  # no sequence: outputs only, no launch
        result = served_empty(kind, q, out, lse_out, p.q.shape, (0, p.num_heads, p.seqlen_q), p.q.dtype,
                              p.want_lse or p.lse is not None, p.q.device, alloc_stream(stream, kind, h))
        return result if p.want_lse or p.lse is not None else result[0]
    copied = False
    for name in ("q", "k_new", "v_new", "cache_seqlens", "block_table", "cache_batch_idx", "cache_leftpad",
                 "rotary_cos", "rotary_sin"):
        value, c = readable(getattr(p, name), name in ("q", "k_new", "v_new"), h)
        setattr(p, name, value)
        copied |= c
    with on_device(p.q.device):
        launch = kernels.decode.launch_for(p)
        if not copied and (cache_seqlens is None or type(cache_seqlens) is int or isinstance(p.cache_seqlens, Array)):
            remember(key, launch)
        ptrs, cached_all, out_arg, lse_arg = kernels.decode.problem_args(p)
        result = launch.run(kind if kind in FAST_KINDS else CUPY, q if kind in FAST_KINDS else None, ptrs,
                            cached_all, out_arg, lse_arg, h, alloc_stream(stream, kind, h))
    errors.after_launch()
    return result if launch.want_lse else result[0]


def _check_rotary(rotary_cos, rotary_sin, q, k, head_dim: int, backend: str):
    if rotary_cos is None and rotary_sin is None:
        return None, None
    if rotary_cos is None or rotary_sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if k is None:
        raise ValueError("rotary_cos needs new tokens k and v: the rotation applies to q and the new keys")
    check_rank(rotary_cos, "rotary_cos", (2,), "[seqlen_ro, rotary_dim / 2]")
    check_same_shape(rotary_cos, rotary_sin, "rotary_cos", "rotary_sin")
    rotary_dim = 2 * int(rotary_cos.shape[1])
    if rotary_dim == 0 or rotary_dim > head_dim or rotary_dim % 16:
        raise ValueError(f"rotary_cos must have shape [seqlen_ro, rotary_dim / 2] with rotary_dim a multiple of "
                         f"16 and at most head_dim = {head_dim}; got {tuple(rotary_cos.shape)}")
    for name, array in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if backend == CUDA:
            if array.dtype != q.dtype:
                raise TypeError(f"{name} must have q's dtype ({dtype_name(q.dtype)}) on a GPU; "
                                f"got {dtype_name(array.dtype)}")
            if not array.c_contiguous():
                raise ValueError(f"{name} must be C-contiguous")
        elif array.dtype not in REFERENCE_DTYPES:
            raise TypeError(f"{name} must be floating point; got {dtype_name(array.dtype)}")
    return rotary_cos, rotary_sin


def prepare_decode(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                   cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                   window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                   return_softmax_lse=False, out=None, lse_out=None, check_values=None) -> DecodeProblem:
    """Check a ``flash_attn_with_kvcache`` call on the host (shapes, dtypes, flags; index values
    of NumPy arrays, or of device arrays with ``check_values=True``) and describe it."""
    q, k_cache, v_cache, k, v = (as_read(a, n) for a, n in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache"),
                                                            (k, "k"), (v, "v")))
    rotary_cos, rotary_sin = as_read(rotary_cos, "rotary_cos"), as_read(rotary_sin, "rotary_sin")
    cache_seqlens, cache_batch_idx = as_read(cache_seqlens, "cache_seqlens"), as_read(cache_batch_idx, "cache_batch_idx")
    cache_leftpad, block_table = as_read(cache_leftpad, "cache_leftpad"), as_read(block_table, "block_table")
    alibi_slopes, out, lse_out = as_read(alibi_slopes, "alibi_slopes"), as_read(out, "out"), as_read(lse_out, "lse_out")
    seqlens_array = None if cache_seqlens is None or isinstance(cache_seqlens, numbers.Number) else cache_seqlens
    backend = backend_of(dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, rotary_cos=rotary_cos,
                              rotary_sin=rotary_sin, cache_seqlens=seqlens_array, cache_batch_idx=cache_batch_idx,
                              cache_leftpad=cache_leftpad, block_table=block_table,
                              alibi_slopes=alibi_slopes, out=out, lse_out=lse_out))
    causal = check_bool(causal, "causal")
    rotary_interleaved = check_bool(rotary_interleaved, "rotary_interleaved")
    return_softmax_lse = check_bool(return_softmax_lse, "return_softmax_lse")
    check_values = check_values_mode(check_values)
    paged = block_table is not None
    batch, seqlen_q, num_heads, head_dim, num_kv_heads = _check_query_and_caches(q, k_cache, v_cache, k, v,
                                                                                 paged, backend)
    seqlen_new = _check_new_tokens(k, v, batch, num_kv_heads, head_dim)
    if k is not None:
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            check_writable(cache, name, "the call appends the new tokens k and v to it")
    rotary_cos, rotary_sin = _check_rotary(rotary_cos, rotary_sin, q, k, head_dim, backend)
    block_table, cache_batch_idx, cache_leftpad = _check_cache_rows(k_cache, block_table, cache_batch_idx,
                                                                    cache_leftpad, batch)
    cache_seqlens, capacity = _check_cache_seqlens(cache_seqlens, k_cache, block_table, seqlen_new, batch)
    index_arrays = [a for a in (cache_seqlens, block_table, cache_batch_idx, cache_leftpad)
                    if a is not None and not isinstance(a, int)]
    if host_checked(check_values, *index_arrays):
        _check_decode_values(cache_seqlens, block_table, cache_batch_idx, cache_leftpad, batch, seqlen_new,
                             k_cache, rotary_cos)

    num_splits = check_int(num_splits, "num_splits")
    left, right = check_window(window_size, causal)
    scale, softcap = check_scalars(softmax_scale, softcap, head_dim)
    slopes = check_alibi(alibi_slopes, num_heads, batch)
    out = check_out(out, "out", (batch, seqlen_q, num_heads, head_dim), q.dtype, backend)
    lse, want_lse = check_lse(lse_out, (batch, num_heads, seqlen_q), backend, return_softmax_lse)
    local = any(0 <= int(side) < capacity for side in window_size)  # FA2's: a side as wide as the cache is none
    return DecodeProblem(backend, q, k_cache, v_cache, k, v, cache_seqlens, block_table, scale,
                         (left, right), softcap, slopes, num_splits, out, lse, rotary_cos, rotary_sin,
                         rotary_interleaved, causal or local, cache_batch_idx, cache_leftpad, want_lse)


def _check_query_and_caches(q, k_cache, v_cache, k, v, paged: bool, backend: str) -> tuple[int, ...]:
    """(batch, seqlen_q, num_heads, head_dim, num_kv_heads) of checked q and caches."""
    check_rank(q, "q", (4,), "[batch_size, seqlen_q, num_heads, head_dim]")
    cache_layout = ("[num_blocks, block_size, num_kv_heads, head_dim]" if paged
                    else "[batch_size, seqlen_cache, num_kv_heads, head_dim]")
    check_rank(k_cache, "k_cache", (4,), cache_layout)
    check_rank(v_cache, "v_cache", (4,), cache_layout)
    for name, array in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_float(array, name, backend)
        check_dense_last(array, name)
    check_same_dtype(q, "q", k_cache=k_cache, v_cache=v_cache, k=k, v=v)
    check_cache_pair(k_cache, v_cache)
    batch, seqlen_q, num_heads, head_dim = (int(s) for s in q.shape)
    if seqlen_q < 1:
        raise ValueError(f"q must hold at least one query token per sequence; got seqlen_q = {seqlen_q}")
    check_head_dim(head_dim, "q")
    if int(k_cache.shape[3]) != head_dim:
        raise ValueError(f"k_cache must have head dim {head_dim} like q; got {int(k_cache.shape[3])}")
    num_kv_heads = int(k_cache.shape[2])
    check_heads(num_heads, num_kv_heads, "q", "k_cache")
    return batch, seqlen_q, num_heads, head_dim, num_kv_heads


def _check_new_tokens(k, v, batch: int, num_kv_heads: int, head_dim: int) -> int:
    """The number of new tokens per sequence in k and v (0 without them)."""
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new tokens to append) or both be None")
    if k is None:
        return 0
    kv_layout = f"[batch_size = {batch}, seqlen_new, num_kv_heads = {num_kv_heads}, head_dim = {head_dim}]"
    for name, array in (("k", k), ("v", v)):
        check_rank(array, name, (4,), kv_layout)
        if (int(array.shape[0]), int(array.shape[2]), int(array.shape[3])) != (batch, num_kv_heads, head_dim):
            raise ValueError(f"{name} must have shape {kv_layout}; got {tuple(array.shape)}")
        check_dense_last(array, name)
    check_same_shape(k, v, "k", "v")
    return int(k.shape[1])


def _check_cache_rows(k_cache, block_table, cache_batch_idx, cache_leftpad, batch: int) -> tuple:
    """How each sequence finds its keys: a block table row (paged), or a contiguous cache row
    (its own, or ``cache_batch_idx``'s) from ``cache_leftpad`` on.  Returns the three index arrays."""
    if block_table is not None:
        check_block_size(int(k_cache.shape[1]), "k_cache")
        block_table = check_index(block_table, "block_table", 2, "[batch_size, max_blocks_per_seq]")
        if int(block_table.shape[0]) != batch:
            raise ValueError(f"block_table must have shape [batch_size = {batch}, max_blocks_per_seq]; "
                             f"got {tuple(block_table.shape)}")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx selects rows of a contiguous cache: pass it without block_table")
        if cache_leftpad is not None:
            raise ValueError("cache_leftpad applies to a contiguous cache: pass it without block_table")
    else:
        rows = int(k_cache.shape[0])
        if cache_batch_idx is None and rows != batch:
            raise ValueError(f"k_cache must have shape [batch_size = {batch}, seqlen_cache, num_kv_heads, "
                             f"head_dim] without block_table (or pass cache_batch_idx); got {tuple(k_cache.shape)}")
        if rows * int(k_cache.shape[1]) >= 2**31:
            raise ValueError(f"k_cache holds {rows * int(k_cache.shape[1])} token rows; the decode kernel "
                             "indexes at most 2**31 - 1 of them")
    checked = []
    for name, array in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if array is not None:
            array = check_index(array, name, 1, f"[batch_size = {batch}]")
            if int(array.shape[0]) != batch:
                raise ValueError(f"{name} must have shape [batch_size = {batch}]; got {tuple(array.shape)}")
        checked.append(array)
    return (block_table, *checked)


def _check_cache_seqlens(cache_seqlens, k_cache, block_table, seqlen_new: int, batch: int):
    """``(cache_seqlens, capacity)``: ``cache_seqlens`` checked, an int array ``[batch]`` or one int for
    every sequence (the whole cache less the new tokens when not given); the keys a sequence can hold."""
    paged = block_table is not None
    # Keys a sequence can hold: its table row's blocks, or the contiguous cache's length.
    capacity = (int(block_table.shape[1]) * int(k_cache.shape[1])) if paged else int(k_cache.shape[1])
    if cache_seqlens is None:
        if paged and block_table.shape[1] != 1:
            raise ValueError("cache_seqlens is required with a paged cache (block_table)")
        cache_seqlens = capacity - seqlen_new
        if cache_seqlens < 0:
            raise ValueError(f"k has {seqlen_new} new tokens, more than the cache's {capacity} slots "
                             "(pass cache_seqlens)")
    elif isinstance(cache_seqlens, numbers.Number):
        cache_seqlens = check_int(cache_seqlens, "cache_seqlens")
        if cache_seqlens + seqlen_new > capacity:
            where = "the block table row" if paged else "k_cache's seqlen_cache axis"
            raise ValueError(f"cache_seqlens = {cache_seqlens} plus {seqlen_new} new tokens is more than the "
                             f"{capacity} keys {where} holds")
    else:
        cache_seqlens = check_index(cache_seqlens, "cache_seqlens", 1, f"[batch_size = {batch}]")
        if int(cache_seqlens.shape[0]) != batch:
            raise ValueError(f"cache_seqlens must have shape [batch_size = {batch}]; "
                             f"got {tuple(cache_seqlens.shape)}")
    return cache_seqlens, capacity


def _check_decode_values(cache_seqlens, block_table, cache_batch_idx, cache_leftpad, batch, seqlen_new,
                         k_cache, rotary_cos) -> None:
    """The host half of the value checks (copies device index arrays: only with check_values)."""
    if isinstance(cache_seqlens, int):
        lengths = np.full(batch, cache_seqlens, np.int64)
    else:
        lengths = to_host(cache_seqlens).astype(np.int64)
        if (lengths < 0).any():
            raise ValueError(f"cache_seqlens must be >= 0; got {lengths.tolist()[:16]}")
    start = np.zeros(batch, np.int64)
    if cache_leftpad is not None:
        start = to_host(cache_leftpad).astype(np.int64)
        if ((start < 0) | (start > lengths)).any():
            b = int(np.argmax((start < 0) | (start > lengths)))
            raise ValueError(f"cache_leftpad[{b}] = {int(start[b])} must be in [0, cache_seqlens[{b}] = "
                             f"{int(lengths[b])}]")
    if rotary_cos is not None and batch:
        top = int((lengths + max(seqlen_new, 1) - 1).max())
        if top >= int(rotary_cos.shape[0]):
            raise ValueError(f"rotary_cos has {int(rotary_cos.shape[0])} rows but position {top} is rotated")
    if block_table is not None:
        check_block_table_values(to_host(block_table), lengths + seqlen_new, int(k_cache.shape[1]),
                                 int(k_cache.shape[0]))
        return
    if cache_batch_idx is not None:
        rows = to_host(cache_batch_idx)
        if ((rows < 0) | (rows >= int(k_cache.shape[0]))).any():
            b = int(np.argmax((rows < 0) | (rows >= int(k_cache.shape[0]))))
            raise ValueError(f"cache_batch_idx[{b}] = {int(rows[b])} is not a row of k_cache "
                             f"(it has {int(k_cache.shape[0])})")
    if batch and int((lengths + seqlen_new).max()) > int(k_cache.shape[1]):
        b = int(np.argmax(lengths + seqlen_new))
        raise ValueError(f"cache_seqlens[{b}] = {int(lengths[b])} plus {seqlen_new} new tokens is more than "
                         f"k_cache's {int(k_cache.shape[1])} positions")
