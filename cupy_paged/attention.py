"""The public attention functions, with FlashAttention-2's names, argument order and meaning.

A call reads its arrays at the one boundary (``_arrays``), checks them (``_checks``), then
runs the CPU reference backend (``reference``) for NumPy inputs or launches the CUDA kernels
(``ops.<family>``) for device inputs.  Everything a device call's shapes, strides, dtypes and
scalar arguments decide -- the checks' verdict, the kernel, grid, split count and packed
scalars -- is kept per such signature (``_MEMO``), so a repeated call (the next layer, the next
step at the same shapes) reads its arguments' pointers and launches: a few microseconds of
host time, no device synchronisation, no host copy.
"""
from __future__ import annotations

import numbers

import numpy as np

from . import _errors, ops, reference
from ._arrays import _KIND_OF_TYPE, CPU, CUPY, NUMPY, TORCH, Array, cupy, data_ptr, kind_of, on_stream, read, signature
from ._checks import BF16, prepare_decode, prepare_varlen, prepare_write
from ._streams import handle

_MEMO: dict = {}         # call signature -> resolved launch (ops.*.Launch)
_MEMO_LIMIT = 4096
_FAST_KINDS = (CUPY, TORCH)


def _remember(key, launch) -> None:
    if key is None:
        return
    if len(_MEMO) >= _MEMO_LIMIT:
        _MEMO.clear()
    _MEMO[key] = launch


def _current_device() -> int:
    return cupy.cuda.runtime.getDevice()


def _on_device(device: int):
    """The device's context for a slow-path launch (a no-op when it is the current one)."""
    import contextlib

    import cupy

    return contextlib.nullcontext() if device == _current_device() else cupy.cuda.Device(device)


def _device_copy(array: Array, stream: int) -> Array:
    """A C-contiguous device copy of ``array`` made on ``stream`` (for inputs the kernels cannot
    read as they are: misaligned or strided rows, strided index arrays)."""
    import cupy

    with cupy.cuda.ExternalStream(stream):
        return read(cupy.ascontiguousarray(array.cupy()), "copy")


def _readable(array, vectors: bool, stream: int):
    """``(array, copied)``: a device array the kernels can read as it is (16-byte rows when
    ``vectors``, else dense), or a copy of it made on ``stream``."""
    if not isinstance(array, Array):
        return array, False
    fine = array.vectorised() if vectors else array.c_contiguous()
    return (array, False) if fine else (_device_copy(array, stream), True)


def _alloc_stream(stream, kind: str, handle_: int):
    """The stream outputs are allocated for: the call's own when the caller named one."""
    return handle_ if stream is not None and kind in _FAST_KINDS else None


def _host_result(value, kind: str):
    """A NumPy result in the caller's kind: a torch CPU tensor for torch inputs."""
    if kind is not TORCH or value is None:
        return value
    import torch

    if value.dtype == BF16:
        return torch.from_numpy(value.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(value)


def _host_outputs(p, out, lse_out, kind: str) -> tuple:
    """The CPU backend's (out, lse) in the caller's kind: the caller's own arrays where given."""
    host_kind = kind if kind is TORCH else NUMPY
    return (out if out is not None else _host_result(p.out, host_kind),
            lse_out if lse_out is not None else _host_result(p.lse, host_kind))


def _reshaped(obj, shape):
    if obj is None or tuple(obj.shape) == tuple(shape):
        return obj
    return obj.reshape(shape)


def _ptr(obj) -> int:
    return 0 if obj is None else data_ptr(obj)


# --------------------------------------------------------------------------- varlen

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
    cu_seqlens_q, cu_seqlens_k : int32 array, ``[batch_size + 1]``, starting at 0, non-decreasing
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
    if (kind is TORCH or kind is CUPY) and check_values is not True and not _errors._debug:
        try:
            s = signature
            key = ("varlen", s(q), s(k), s(v), s(cu_seqlens_q), s(cu_seqlens_k),
                   None if block_table is None else s(block_table), None if alibi_slopes is None else s(alibi_slopes),
                   None if out is None else s(out), None if lse_out is None else s(lse_out), dropout_p,
                   softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs, return_softmax_lse)
            launch = _MEMO.get(key)
        except TypeError:
            key = launch = None
        if (launch is not None and type(max_seqlen_q) is int and type(max_seqlen_k) is int
                and 0 <= max_seqlen_q and 0 <= max_seqlen_k and launch.device == _current_device()):
            q_ptr, k_ptr, v_ptr = data_ptr(q), data_ptr(k), data_ptr(v)
            if not (q_ptr | k_ptr | v_ptr) & 15:
                h = handle(stream, kind, launch.device)
                result = launch.run(kind, q, (q_ptr, k_ptr, v_ptr, data_ptr(cu_seqlens_q), data_ptr(cu_seqlens_k),
                                              _ptr(block_table), _ptr(alibi_slopes)),
                                    max_seqlen_q, None if out is None else (out, data_ptr(out)),
                                    None if lse_out is None else (lse_out, data_ptr(lse_out)), h,
                                    None if stream is None else h)
                return _varlen_result(result, q, launch.want_lse, return_attn_probs)
    else:
        key = None
    return _varlen_slow(key, kind, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                        softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                        return_attn_probs, block_table, out, lse_out, return_softmax_lse, stream, check_values)


def _check_fa2_flags(dropout_p, deterministic, return_attn_probs):
    from ._checks import check_bool, check_real

    if check_real(dropout_p, "dropout_p") != 0.0:
        raise ValueError(f"dropout_p must be 0: cupy_paged computes the inference forward pass only; got {dropout_p!r}")
    check_bool(deterministic, "deterministic")
    return check_bool(return_attn_probs, "return_attn_probs")


def _varlen_result(result, q, want_lse: bool, return_attn_probs: bool):
    out, lse = result
    if len(q.shape) == 4:
        out = _reshaped(out, tuple(q.shape))
    if return_attn_probs:
        return out, lse, None
    return (out, lse) if want_lse else out


def _varlen_slow(key, kind, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                 softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                 block_table, out, lse_out, return_softmax_lse, stream, check_values):
    attn_probs = _check_fa2_flags(dropout_p, deterministic, return_attn_probs)
    a = {name: None if obj is None else read(obj, name) for name, obj in dict(
        q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, alibi_slopes=alibi_slopes,
        block_table=block_table, out=out, lse_out=lse_out).items()}
    p = prepare_varlen(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], max_seqlen_q, max_seqlen_k,
                       softmax_scale, causal, window_size, softcap, a["alibi_slopes"], a["block_table"],
                       return_softmax_lse or attn_probs, a["out"], check_values, a["lse_out"])
    if p.backend == CPU:
        reference.varlen(p)
        return _varlen_result(_host_outputs(p, out, lse_out, kind), q, p.lse is not None, attn_probs)
    copied = False
    h = handle(stream, kind, p.q.device)
    names = ("q",) + (() if p.block_table is not None else ("k", "v"))
    for name in names + ("cu_seqlens_q", "cu_seqlens_k", "block_table"):
        value, c = _readable(getattr(p, name), name in names, h)
        setattr(p, name, value)
        copied |= c
    with _on_device(p.q.device):
        launch = ops.varlen.VarlenLaunch(p)
        if not copied:
            _remember(key, launch)
        result = launch.run(kind if kind in _FAST_KINDS else CUPY, q if kind in _FAST_KINDS else None,
                            *ops.varlen.problem_args(p), h, _alloc_stream(stream, kind, h))
    _errors.after_launch()
    return _varlen_result(result, q, p.want_lse, attn_probs)


# --------------------------------------------------------------------------- decode

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
        q at ``cache_seqlens[b] + i`` when causal or windowed, else all at ``cache_seqlens[b]``.
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
    num_splits : int, split-KV parts per sequence; 0 lets a heuristic choose
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
    if (kind is TORCH or kind is CUPY) and check_values is not True and not _errors._debug:
        int_length = type(cache_seqlens) is int
        try:
            s = signature  # the None checks inline: most optional arguments are None
            key = ("decode", s(q), s(k_cache), s(v_cache), None if k is None else s(k),
                   None if v is None else s(v), None if rotary_cos is None else s(rotary_cos),
                   None if rotary_sin is None else s(rotary_sin),
                   "int" if int_length else None if cache_seqlens is None else s(cache_seqlens),
                   None if cache_batch_idx is None else s(cache_batch_idx),
                   None if cache_leftpad is None else s(cache_leftpad),
                   None if block_table is None else s(block_table), softmax_scale, causal, window_size, softcap,
                   rotary_interleaved, None if alibi_slopes is None else s(alibi_slopes), num_splits,
                   return_softmax_lse, None if out is None else s(out), None if lse_out is None else s(lse_out))
            launch = _MEMO.get(key)
        except TypeError:
            key = launch = None
        if launch is not None and launch.device == _current_device():
            if int_length:
                cached_all = cache_seqlens
                fits = 0 <= cached_all and cached_all + launch.seqlen_new <= launch.capacity
            else:
                cached_all, fits = launch.cached_default, True
            q_ptr, kc_ptr, vc_ptr, kn_ptr, vn_ptr = (data_ptr(q), data_ptr(k_cache), data_ptr(v_cache),
                                                     _ptr(k), _ptr(v))
            if fits and not (q_ptr | kc_ptr | vc_ptr | kn_ptr | vn_ptr) & 15:
                p = _ptr
                ptrs = (q_ptr, kc_ptr, vc_ptr, kn_ptr, vn_ptr, 0 if int_length else p(cache_seqlens),
                        p(block_table), 0 if cache_batch_idx is None else p(cache_batch_idx),
                        0 if cache_leftpad is None else p(cache_leftpad), 0 if rotary_cos is None else p(rotary_cos),
                        0 if rotary_sin is None else p(rotary_sin), 0 if alibi_slopes is None else p(alibi_slopes))
                h = handle(stream, kind, launch.device)
                out_obj, lse = launch.run(kind, q, ptrs, cached_all, None if out is None else (out, data_ptr(out)),
                                          None if lse_out is None else (lse_out, data_ptr(lse_out)), h,
                                          None if stream is None else h)
                return (out_obj, lse) if launch.want_lse else out_obj
    else:
        key = None
    return _decode_slow(key, kind, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                        cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, window_size, softcap,
                        rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse, out, lse_out, stream,
                        check_values)


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
        reference.decode(p)
        result = _host_outputs(p, out, lse_out, kind)
        return result if p.lse is not None else result[0]
    copied = False
    h = handle(stream, kind, p.q.device)
    for name in ("q", "k_new", "v_new", "cache_seqlens", "block_table", "cache_batch_idx", "cache_leftpad",
                 "rotary_cos", "rotary_sin"):
        value, c = _readable(getattr(p, name), name in ("q", "k_new", "v_new"), h)
        setattr(p, name, value)
        copied |= c
    with _on_device(p.q.device):
        launch = ops.decode.DecodeLaunch(p)
        if not copied and (cache_seqlens is None or type(cache_seqlens) is int or isinstance(p.cache_seqlens, Array)):
            _remember(key, launch)
        ptrs, cached_all, out_arg, lse_arg = ops.decode.problem_args(p)
        result = launch.run(kind if kind in _FAST_KINDS else CUPY, q if kind in _FAST_KINDS else None, ptrs,
                            cached_all, out_arg, lse_arg, h, _alloc_stream(stream, kind, h))
    _errors.after_launch()
    return result if launch.want_lse else result[0]


# --------------------------------------------------------------------------- dense batches

_CU_SEQLENS: dict = {}  # (device, batch, seqlen) -> int32 [batch + 1] on the device


def _uniform_cu_seqlens(batch: int, seqlen: int, device: int | None):
    """``[0, seqlen, 2 * seqlen, ...]`` (int32 ``[batch + 1]``): NumPy for ``device`` None, else one
    device array per (device, batch, seqlen), built once (the first call must be eager)."""
    values = np.arange(batch + 1, dtype=np.int64) * seqlen
    if values[-1] >= 2 ** 31:
        raise ValueError(f"q holds {values[-1]} tokens; the kernels index at most 2**31 - 1")
    if device is None:
        return values.astype(np.int32)
    found = _CU_SEQLENS.get((device, batch, seqlen))
    if found is None:
        import cupy

        with cupy.cuda.Device(device):
            if cupy.cuda.get_current_stream().is_capturing():
                raise RuntimeError("flash_attn_func builds its cu_seqlens once per (batch, seqlen): make one "
                                   "eager call with these shapes before a CUDA graph capture")
            found = cupy.asarray(values.astype(np.int32))
            cupy.cuda.Device(device).synchronize()
        _CU_SEQLENS[(device, batch, seqlen)] = found
    return found


def _flatten_batch(array, name: str, stream: int | None = None):
    """``[B, S, H, D]`` -> ``[B * S, H, D]``: a view where the strides allow, else a copy (made on
    ``stream``)."""
    if array.ndim != 4:
        raise ValueError(f"{name} must have shape [batch_size, seqlen, num_heads, head_dim]; got {tuple(array.shape)}")
    batch, seqlen, heads, dim = (int(s) for s in array.shape)
    if isinstance(array, np.ndarray):
        return array.reshape(batch * seqlen, heads, dim)
    strides = array.strides
    if batch > 1 and seqlen > 0 and strides[0] != seqlen * strides[1]:
        array = _device_copy(array, stream)
        strides = array.strides
    return Array(array.obj, array.kind, array.ptr, (batch * seqlen, heads, dim), strides[1:], array.dtype,
                 array.device)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, out=None, stream=None):
    """Attention of a dense batch: every sequence has the same query and key lengths.

    FlashAttention-2's ``flash_attn_func``: the varlen kernel over ``[batch, seqlen]`` packed
    without padding.

    Parameters
    ----------
    q : array ``[batch_size, seqlen_q, num_heads, head_dim]``, float16/bfloat16
    k, v : array ``[batch_size, seqlen_k, num_kv_heads, head_dim]``
    dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic :
        as in :func:`flash_attn_varlen_func`
    return_attn_probs : bool, return ``(out, lse [batch_size, num_heads, seqlen_q], None)``
    out : array like ``q``, optional, keyword only
    stream : keyword only, as in :func:`flash_attn_varlen_func`

    Returns
    -------
    out : array ``[batch_size, seqlen_q, num_heads, head_dim]`` of the caller's kind, or
    ``(out, lse, None)`` with ``return_attn_probs``.

    Examples
    --------
    >>> import numpy as np, cupy_paged
    >>> q = np.ones((2, 5, 4, 64), np.float16); k = v = np.ones((2, 7, 2, 64), np.float16)
    >>> cupy_paged.flash_attn_func(q, k, v, causal=True).shape
    (2, 5, 4, 64)
    """
    attn_probs = _check_fa2_flags(dropout_p, deterministic, return_attn_probs)
    kind = kind_of(q)
    arrays = {name: None if obj is None else read(obj, name) for name, obj in
              dict(q=q, k=k, v=v, out=out, alibi_slopes=alibi_slopes).items()}
    aq, ak, av = arrays["q"], arrays["k"], arrays["v"]
    for name, array in (("q", aq), ("k", ak), ("v", av)):
        if array.ndim != 4:
            raise ValueError(f"{name} must have shape [batch_size, seqlen, heads, head_dim]; got {tuple(array.shape)}")
    batch, seqlen_q = int(aq.shape[0]), int(aq.shape[1])
    if int(ak.shape[0]) != batch:
        raise ValueError(f"k must have batch_size {batch} like q; got {tuple(ak.shape)}")
    seqlen_k = int(ak.shape[1])
    device = aq.device if isinstance(aq, Array) else None
    h = None if device is None else handle(stream, kind, device)
    cu_q = _uniform_cu_seqlens(batch, seqlen_q, device)
    cu_k = _uniform_cu_seqlens(batch, seqlen_k, device)
    flat_out = None
    if arrays["out"] is not None:
        if tuple(arrays["out"].shape) != tuple(aq.shape):
            raise ValueError(f"out must have shape {list(aq.shape)}; got {tuple(arrays['out'].shape)}")
        flat_out = _flatten_batch(arrays["out"], "out", h)
    if device is None:
        args = (aq.reshape(-1, *aq.shape[2:]), ak.reshape(-1, *ak.shape[2:]), av.reshape(-1, *av.shape[2:]))
    else:
        args = (_flatten_batch(aq, "q", h), _flatten_batch(ak, "k", h), _flatten_batch(av, "v", h))
    # Already read: the Array descriptors go straight to the varlen path's checks and launch.
    p = prepare_varlen(*args, cu_q if device is None else read(cu_q, "cu_seqlens_q"),
                       cu_k if device is None else read(cu_k, "cu_seqlens_k"), seqlen_q, seqlen_k, softmax_scale,
                       causal, window_size, softcap, arrays["alibi_slopes"], None, attn_probs, flat_out, None, None)
    if p.backend == CPU:
        reference.varlen(p)
        host_kind = kind if kind is TORCH else NUMPY
        result = out if out is not None else _host_result(p.out.reshape(aq.shape), host_kind)
        lse = None if p.lse is None else np.ascontiguousarray(
            p.lse.reshape(p.num_heads, batch, seqlen_q).transpose(1, 0, 2))
        return (result, _host_result(lse, host_kind), None) if attn_probs else result
    for name in ("q", "k", "v"):
        setattr(p, name, _readable(getattr(p, name), True, h)[0])
    fast = kind if kind in _FAST_KINDS else CUPY
    with _on_device(p.q.device):
        launch = ops.varlen.VarlenLaunch(p)
        result, lse = launch.run(fast, q if kind in _FAST_KINDS else None, *ops.varlen.problem_args(p), h,
                                 _alloc_stream(stream, kind, h))
    _errors.after_launch()
    result = out if out is not None else _reshaped(result, tuple(aq.shape))
    if not attn_probs:
        return result
    lse = lse.reshape(p.num_heads, batch, seqlen_q)
    with on_stream(fast, h):  # the transpose copy is ordered after the kernel, on the call's stream
        lse = lse.permute(1, 0, 2).contiguous() if fast is TORCH else lse.transpose(1, 0, 2).copy()
    return result, lse, None


# --------------------------------------------------------------------------- cache writes

def write_kv_cache(k_cache, v_cache, k, v, slot_mapping, *, stream=None, check_values=None):
    """Scatter new key/value tokens into paged caches, in place.

    Token ``t`` goes to slot ``slot_mapping[t] = block * block_size + offset``, that is
    ``k_cache[block, offset] = k[t]``; negative slots (padding) are skipped.  On CUDA
    arrays this is one kernel with 16-byte accesses; a slot past the cache is skipped too and
    reported by :func:`cupy_paged.check_errors`.

    Parameters
    ----------
    k_cache, v_cache : array ``[num_blocks, block_size, num_kv_heads, head_dim]``, C-contiguous
    k, v : array ``[num_tokens, num_kv_heads, head_dim]``, the caches' dtype
    slot_mapping : int32 array ``[num_tokens]``
    stream, check_values : keyword only, as in :func:`flash_attn_varlen_func`

    Raises
    ------
    TypeError, ValueError
        Naming the argument, for shapes or dtypes that do not fit or (host-checked) a slot
        past the cache.

    Examples
    --------
    >>> import numpy as np, cupy_paged
    >>> k_cache = np.zeros((4, 16, 2, 64), np.float16); v_cache = np.zeros_like(k_cache)
    >>> k = np.ones((3, 2, 64), np.float16)
    >>> cupy_paged.write_kv_cache(k_cache, v_cache, k, k, np.array([17, -1, 63], np.int32))
    >>> float(k_cache[1, 1].sum()), float(k_cache[3, 15].sum())
    (128.0, 128.0)
    """
    kind = kind_of(k_cache)
    key = None
    if (kind is TORCH or kind is CUPY) and check_values is not True and not _errors._debug:
        try:
            key = ("write", signature(k_cache), signature(v_cache), signature(k), signature(v), signature(slot_mapping))
            launch = _MEMO.get(key)
        except TypeError:
            key = launch = None
        if launch is not None and launch.device == _current_device():
            ptrs = (data_ptr(k_cache), data_ptr(v_cache), data_ptr(k), data_ptr(v), data_ptr(slot_mapping))
            if not (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3]) & 15:
                launch.run(ptrs, handle(stream, kind, launch.device))
                return
    a = {name: read(obj, name) for name, obj in
         dict(k_cache=k_cache, v_cache=v_cache, k=k, v=v, slot_mapping=slot_mapping).items()}
    backend, slots = prepare_write(a["k_cache"], a["v_cache"], a["k"], a["v"], a["slot_mapping"], check_values)
    if backend == CPU:
        reference.write_kv_cache(a["k_cache"], a["v_cache"], a["k"], a["v"], slots)
        return
    h = handle(stream, kind, a["k_cache"].device)
    (k_dev, c1), (v_dev, c2), (slots, c3) = (_readable(a["k"], True, h), _readable(a["v"], True, h),
                                             _readable(slots, False, h))
    with _on_device(a["k_cache"].device):
        launch = ops.kv_write.WriteLaunch(a["k_cache"], k_dev, v_dev)
        if not (c1 or c2 or c3):
            _remember(key, launch)
        launch.run((a["k_cache"].ptr, a["v_cache"].ptr, k_dev.ptr, v_dev.ptr, slots.ptr), h)
    _errors.after_launch()
