"""`flash_attn_varlen_func`: packed variable-length batches, over contiguous K/V or the paged cache."""
from __future__ import annotations

import numpy as np

from .. import kernels, reference
from .._core import errors
from .._core.arrays import _KIND_OF_TYPE, CPU, CUPY, TORCH, Array, memo_lookup, backend_of, kind_of, read, to_host
from .._core.problems import VarlenProblem
from .._core.streams import handle
from .._core.types import (as_read, check_alibi, check_block_size, check_block_table_values, check_bool,
                           check_cache_pair, check_dense_last, check_float, check_head_dim, check_heads, check_index,
                           check_int, check_lse, check_out, check_rank, check_same_dtype, check_same_shape,
                           check_scalars, check_values_mode, check_window, host_checked, INT32_MAX)
from ._call import (FAST_KINDS, MEMO, alloc_stream, check_fa2_flags, current_device, host_outputs, on_device,
                    readable, remember, reshaped, served_empty)

def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None,
                           *, out=None, lse_out=None, return_softmax_lse=False, stream=None, check_values=None):
    """Attention over a batch of variable-length sequences packed along one token axis.

    Sequence ``b`` owns query tokens ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and key
    tokens ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``.  With ``block_table`` the keys and
    values are read straight from paged caches instead: key ``j`` of sequence ``b``
    sits at ``k[block_table[b, j // block_size], j % block_size]``.  The positional
    arguments are FlashAttention-2's (``flash_attn_varlen_func`` of flash_attn 2.7).

    Parameters
    ----------
    q : array, ``[total_q, num_heads, head_dim]`` (or ``[1, total_q, ...]``), float16/bfloat16
    k, v : array, ``[total_k, num_kv_heads, head_dim]`` (or ``[1, total_k, ...]``); with
        ``block_table``, paged caches ``[num_blocks, block_size, num_kv_heads, head_dim]``
        with ``block_size`` a power of two from 8 to 256.  ``num_heads % num_kv_heads == 0``.
    cu_seqlens_q, cu_seqlens_k : int32 array, ``[batch_size + 1]``, starting at 0, non-decreasing,
        the last entry at most q's (k's) token count: rows of q past it (padding) are not written,
        as in FlashAttention-2
    max_seqlen_q, max_seqlen_k : int, at least the longest query / key sequence
    dropout_p : float, must be 0 (inference only)
    softmax_scale : float, default ``1 / sqrt(head_dim)``
    causal : bool, bottom-right aligned: query ``i`` sees key ``j`` iff ``j <= i + Lk - Lq``
    window_size : (int, int), ``(left, right)`` band around that diagonal; -1 is unbounded
    softcap : float, ``s = softcap * tanh(s / softcap)`` on the scaled score when > 0
    alibi_slopes : float32 array ``[num_heads]`` or ``[batch_size, num_heads]``; adds
        ``-slope * |i + Lk - Lq - j|``
    deterministic : bool, accepted for FlashAttention-2 compatibility (the forward pass is
        always deterministic)
    return_attn_probs : bool, also return the LSE and ``None`` in the place of the attention
        probabilities (which are never materialised): ``(out, lse, None)``
    block_table : int32 array ``[batch_size, max_blocks_per_seq]``, -1 where unallocated
    out : array like ``q``, optional, keyword only; written in place and returned
    lse_out : float32 array ``[num_heads, total_q]``, optional, keyword only; the LSE is
        written there (and returned) instead of into a new array
    return_softmax_lse : bool, keyword only: return ``(out, lse)``
    stream : optional, keyword only: an int ``cudaStream_t``, a CuPy or torch stream or an
        object with ``__cuda_stream__``; default torch's current stream for torch inputs, else
        CuPy's current stream
    check_values : bool or None, keyword only.  None (default): index values of NumPy arrays are
        checked on the host, those of device arrays by the kernels (a bad value is a hole, reported
        by :func:`cupy_paged.check_errors`); True: device index arrays are copied to the host and
        checked before any work (a sync); False: no host value check at all.

    Returns
    -------
    out : array ``[total_q, num_heads, head_dim]`` (with ``q``'s leading axis, if any) of the
    caller's kind; ``(out, lse)`` with ``return_softmax_lse``; ``(out, lse, None)`` with
    ``return_attn_probs``.  The LSE is the natural-log ``[num_heads, total_q]``, float32.  Rows
    that see no key are zero with LSE ``-inf``.

    Raises
    ------
    TypeError, ValueError
        Naming the argument, for any shape, dtype or host value that does not fit.

    Examples
    --------
    >>> import numpy as np, cupy_paged
    >>> cu_q, max_q = cupy_paged.cu_seqlens_from_lengths([10, 3, 1])
    >>> cu_k, max_k = cupy_paged.cu_seqlens_from_lengths([0, 1, 7])
    >>> q = np.ones((14, 4, 64), np.float16); k = v = np.ones((8, 2, 64), np.float16)
    >>> cupy_paged.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True).shape
    (14, 4, 64)
    """
    kind = _KIND_OF_TYPE.get(type(q)) or kind_of(q)
    if (kind is TORCH or kind is CUPY) and check_values is not True and not errors._debug:
        key, launch, ptr = memo_lookup(MEMO, kind, _memo_key, q, k, v, cu_seqlens_q, cu_seqlens_k, block_table,
                                       alibi_slopes, out, lse_out, dropout_p, softmax_scale, causal, window_size,
                                       softcap, deterministic, return_attn_probs, return_softmax_lse)
        if (launch is not None and type(max_seqlen_q) is int and type(max_seqlen_k) is int
                and 0 <= max_seqlen_q <= INT32_MAX and 0 <= max_seqlen_k <= INT32_MAX
                and launch.device == current_device()):
            q_ptr, k_ptr, v_ptr = ptr(q), ptr(k), ptr(v)
            o_ptr = 0 if out is None else ptr(out)
            l_ptr = 0 if lse_out is None else ptr(lse_out)
            # out and lse_out as the first call checked them: the kernels store 16 bytes at a time.
            if not (q_ptr | k_ptr | v_ptr | o_ptr | l_ptr) & 15:
                h = handle(stream, kind, launch.device)
                result = launch.run(kind, q, (q_ptr, k_ptr, v_ptr, ptr(cu_seqlens_q), ptr(cu_seqlens_k),
                                              0 if block_table is None else ptr(block_table),
                                              0 if alibi_slopes is None else ptr(alibi_slopes)),
                                    max_seqlen_q, None if out is None else (out, o_ptr),
                                    None if lse_out is None else (lse_out, l_ptr), h,
                                    None if stream is None else h)
                return _varlen_result(result, q, launch.want_lse, return_attn_probs)
    else:
        key = None
    return _varlen_slow(key, kind, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                        softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                        return_attn_probs, block_table, out, lse_out, return_softmax_lse, stream, check_values)


def _memo_key(s, q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, out, lse_out, dropout_p,
              softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs,
              return_softmax_lse) -> tuple:
    """What decides a call's launch, its arrays read by ``s`` (``memo_lookup``)."""
    return ("varlen", s(q), s(k), s(v), s(cu_seqlens_q), s(cu_seqlens_k),
            None if block_table is None else s(block_table), None if alibi_slopes is None else s(alibi_slopes),
            None if out is None else s(out), None if lse_out is None else s(lse_out), dropout_p,
            softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs, return_softmax_lse,
            # Types too: causal=1 equals True, (1.0, 0) equals (1, 0) and softcap=False equals 0.0,
            # which the checks refuse.
            causal.__class__, deterministic.__class__, return_attn_probs.__class__,
            return_softmax_lse.__class__, dropout_p.__class__, softmax_scale.__class__, softcap.__class__,
            *map(type, window_size))


def _varlen_result(result, q, want_lse: bool, return_attn_probs: bool):
    out, lse = result
    if len(q.shape) == 4:
        out = reshaped(out, tuple(q.shape))
    if return_attn_probs:
        return out, lse, None
    return (out, lse) if want_lse else out


def _varlen_slow(key, kind, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                 softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                 block_table, out, lse_out, return_softmax_lse, stream, check_values):
    attn_probs = check_fa2_flags(dropout_p, deterministic, return_attn_probs)
    a = {name: None if obj is None else read(obj, name) for name, obj in dict(
        q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, alibi_slopes=alibi_slopes,
        block_table=block_table, out=out, lse_out=lse_out).items()}
    p = prepare_varlen(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], max_seqlen_q, max_seqlen_k,
                       softmax_scale, causal, window_size, softcap, a["alibi_slopes"], a["block_table"],
                       return_softmax_lse or attn_probs, a["out"], check_values, a["lse_out"])
    if p.backend == CPU:
        reference.varlen.run(p)
        return _varlen_result(host_outputs(p, out, lse_out, kind), q, p.lse is not None, attn_probs)
    h = handle(stream, kind, p.q.device)
    if p.batch == 0 or p.q.shape[0] == 0:  # nothing to compute: outputs only, no launch
        result = served_empty(kind, q, out, lse_out, p.q.shape, (p.num_heads, p.q.shape[0]), p.q.dtype,
                              p.want_lse or p.lse is not None, p.q.device, alloc_stream(stream, kind, h))
        return _varlen_result(result, q, p.want_lse or p.lse is not None, attn_probs)
    copied = False
    names = ("q",) + (() if p.block_table is not None else ("k", "v"))
    for name in names + ("cu_seqlens_q", "cu_seqlens_k", "block_table"):
        value, c = readable(getattr(p, name), name in names, h)
        setattr(p, name, value)
        copied |= c
    with on_device(p.q.device):
        launch = kernels.varlen.VarlenLaunch(p)
        if not copied:
            remember(key, launch)
        result = launch.run(kind if kind in FAST_KINDS else CUPY, q if kind in FAST_KINDS else None,
                            *kernels.varlen.problem_args(p), h, alloc_stream(stream, kind, h))
    errors.after_launch()
    return _varlen_result(result, q, p.want_lse, attn_probs)



def drop_unit_batch(array):
    """Accept the ``[1, total, H, D]`` form of a packed batch."""
    if array is not None and array.ndim == 4 and array.shape[0] == 1:
        if isinstance(array, Array):
            return Array(array.obj, array.kind, array.ptr, array.shape[1:], array.strides[1:], array.dtype,
                         array.device)
        return array[0]
    return array


def check_qkv(q, k, v, backend: str) -> None:
    """q, k and v of one attention, by their last two axes (heads, head_dim) whatever the leading
    ones: a kernel dtype of ``backend`` shared by all three, dense rows, a supported head dim that k
    shares, and q's heads a multiple of k's."""
    for name, array in (("q", q), ("k", k), ("v", v)):
        check_float(array, name, backend)
        check_dense_last(array, name)
    check_same_dtype(q, "q", k=k, v=v)
    head_dim = int(q.shape[-1])
    check_head_dim(head_dim, "q")
    if int(k.shape[-1]) != head_dim:
        raise ValueError(f"k must have head dim {head_dim} like q; got {int(k.shape[-1])}")
    check_heads(int(q.shape[-2]), int(k.shape[-2]), "q", "k")


def prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, block_table,
                   return_softmax_lse, out, check_values=None, lse_out=None) -> VarlenProblem:
    q, k, v, out, lse_out = (as_read(a, n) for a, n in ((q, "q"), (k, "k"), (v, "v"), (out, "out"),
                                                        (lse_out, "lse_out")))
    cu_seqlens_q, cu_seqlens_k = as_read(cu_seqlens_q, "cu_seqlens_q"), as_read(cu_seqlens_k, "cu_seqlens_k")
    alibi_slopes, block_table = as_read(alibi_slopes, "alibi_slopes"), as_read(block_table, "block_table")
    backend = backend_of(dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                              alibi_slopes=alibi_slopes, block_table=block_table, out=out, lse_out=lse_out))
    causal = check_bool(causal, "causal")
    return_softmax_lse = check_bool(return_softmax_lse, "return_softmax_lse")
    check_values = check_values_mode(check_values)
    paged = block_table is not None
    q = drop_unit_batch(q)
    check_rank(q, "q", (3,), "[total_q, num_heads, head_dim] (or [1, total_q, num_heads, head_dim])")
    if paged:
        check_rank(k, "k", (4,), "[num_blocks, block_size, num_kv_heads, head_dim] with block_table")
        check_rank(v, "v", (4,), "[num_blocks, block_size, num_kv_heads, head_dim] with block_table")
    else:
        k, v = drop_unit_batch(k), drop_unit_batch(v)
        check_rank(k, "k", (3,), "[total_k, num_kv_heads, head_dim] (or [1, total_k, num_kv_heads, head_dim])")
        check_rank(v, "v", (3,), "[total_k, num_kv_heads, head_dim] (or [1, total_k, num_kv_heads, head_dim])")
    check_qkv(q, k, v, backend)
    check_same_shape(k, v, "k", "v")
    total_q, num_heads, head_dim = (int(s) for s in q.shape)
    if paged:
        check_block_size(int(k.shape[1]), "k")
        check_cache_pair(k, v, "k", "v")

    cu_q = check_index(cu_seqlens_q, "cu_seqlens_q", 1, "[batch_size + 1]")
    cu_k = check_index(cu_seqlens_k, "cu_seqlens_k", 1, "[batch_size + 1]")
    if cu_q.shape[0] < 1:
        raise ValueError("cu_seqlens_q must have shape [batch_size + 1] with at least one entry")
    if tuple(cu_k.shape) != tuple(cu_q.shape):
        raise ValueError(f"cu_seqlens_k must have shape [batch_size + 1] = {tuple(cu_q.shape)} "
                         f"like cu_seqlens_q; got {tuple(cu_k.shape)}")
    batch = int(cu_q.shape[0]) - 1
    max_seqlen_q = check_int(max_seqlen_q, "max_seqlen_q", 0, INT32_MAX)
    max_seqlen_k = check_int(max_seqlen_k, "max_seqlen_k", 0, INT32_MAX)
    if paged:
        block_table = check_index(block_table, "block_table", 2, "[batch_size, max_blocks_per_seq]")
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table must have shape [batch_size = {batch}, max_blocks_per_seq]; "
                             f"got {tuple(block_table.shape)}")

    if host_checked(check_values, cu_q, cu_k, block_table):
        host_q, host_k = to_host(cu_q), to_host(cu_k)
        for name, cu, max_len in (("cu_seqlens_q", host_q, max_seqlen_q),
                                  ("cu_seqlens_k", host_k, max_seqlen_k)):
            lengths = np.diff(cu)
            if cu[0] != 0 or (lengths < 0).any():
                raise ValueError(f"{name} must start at 0 and never decrease; got {cu.tolist()[:16]}")
            if lengths.size and int(lengths.max()) > max_len:
                short = "max_seqlen_q" if name == "cu_seqlens_q" else "max_seqlen_k"
                raise ValueError(f"{short} = {max_len} is less than the longest sequence "
                                 f"({int(lengths.max())}) in {name}")
        # Trailing rows past the last sequence (a CUDA-graph batch padded to a captured size) are
        # allowed, as FlashAttention-2 allows them: q's are not written, k's and v's not read.
        if int(host_q[-1]) > total_q:
            raise ValueError(f"cu_seqlens_q[-1] = {int(host_q[-1])} exceeds q's token count {total_q}")
        if paged:
            check_block_table_values(to_host(block_table), np.diff(host_k), int(k.shape[1]), int(k.shape[0]))
        elif int(host_k[-1]) > int(k.shape[0]):
            raise ValueError(f"cu_seqlens_k[-1] = {int(host_k[-1])} exceeds k's token count {int(k.shape[0])}")

    left, right = check_window(window_size, causal)
    scale, softcap = check_scalars(softmax_scale, softcap, head_dim)
    slopes = check_alibi(alibi_slopes, num_heads, batch)
    out = check_out(drop_unit_batch(out), "out", (total_q, num_heads, head_dim), q.dtype, backend)
    lse, want_lse = check_lse(lse_out, (num_heads, total_q), backend, return_softmax_lse)
    return VarlenProblem(backend, q, k, v, cu_q, cu_k, max_seqlen_q, block_table,
                         scale, (left, right), softcap, slopes, out, lse, want_lse, max_seqlen_k)


