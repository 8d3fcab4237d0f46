"""`flash_attn_func`: dense `[batch, seqlen, heads, head_dim]` batches through the varlen kernels."""
from __future__ import annotations

import numpy as np

from .. import kernels, reference
from .._core import errors
from .._core.arrays import CPU, CUDA, CUPY, NUMPY, TORCH, Array, cupy_stream, kind_of, on_stream, read
from .._core.streams import handle, is_capturing, stream_key
from .._core.types import c_contiguous, check_bool, check_same_shape, check_scalars, check_window
from ._call import (FAST_KINDS, alloc_stream, check_fa2_flags, device_copy, host_result, on_device, readable,
                    reshaped, served_empty)
from .varlen import check_qkv, prepare_varlen

# (device, stream, batch, seqlen) -> int32 [batch + 1] on the device.  Kept, never freed: later calls
# on the stream and the CUDA graphs that captured one read it (some hundred bytes each).
_CU_SEQLENS: dict = {}


def _uniform_cu_seqlens(batch: int, seqlen: int, device: int | None, stream: int | None = None):
    """``[0, seqlen, 2 * seqlen, ...]`` (int32 ``[batch + 1]``): NumPy for ``device`` None, else a
    device array written by a kernel on ``stream`` (no host copy, no sync), kept for the later calls
    on that stream, which read it after it is written.  None is made inside a CUDA graph capture (it
    would allocate there): one eager call with the shapes on the capturing stream comes first."""
    values = np.arange(batch + 1, dtype=np.int64) * seqlen
    if values[-1] >= 2 ** 31:
        raise ValueError(f"q holds {values[-1]} tokens; the kernels index at most 2**31 - 1")
    if device is None:
        return values.astype(np.int32)
    key = (device, stream_key(stream), batch, seqlen)
    found = _CU_SEQLENS.get(key)
    if found is None:
        if is_capturing(stream):
            raise RuntimeError("flash_attn_func makes its cu_seqlens once per (batch, seqlen) and stream: make one "
                               "eager call with these shapes on the capturing stream before the CUDA graph capture "
                               "(torch.cuda.graph(..., stream=that_stream))")
        import cupy

        with cupy.cuda.Device(device), cupy_stream(stream):
            found = (cupy.arange(0, int(values[-1]) + 1, seqlen, dtype=cupy.int32) if seqlen
                     else cupy.zeros(batch + 1, cupy.int32))
        _CU_SEQLENS[key] = found
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
        array = device_copy(array, stream)
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
    stream : keyword only, as in :func:`flash_attn_varlen_func`.  Each new (batch_size, seqlen) on a
        stream makes a small index array there (one kernel, no sync); a CUDA graph capture needs one
        eager call with its shapes on the capturing stream first

    Returns
    -------
    out : array ``[batch_size, seqlen_q, num_heads, head_dim]`` of the caller's kind, or
    ``(out, lse, None)`` with ``return_attn_probs``.

    Raises
    ------
    TypeError, ValueError
        Naming the argument, for any shape, dtype or host value that does not fit.

    Examples
    --------
    >>> import numpy as np, cupy_paged
    >>> q = np.ones((2, 5, 4, 64), np.float16); k = v = np.ones((2, 7, 2, 64), np.float16)
    >>> cupy_paged.flash_attn_func(q, k, v, causal=True).shape
    (2, 5, 4, 64)
    """
    attn_probs = check_fa2_flags(dropout_p, deterministic, return_attn_probs)
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
    check_same_shape(ak, av, "k [batch_size, seqlen_k, num_kv_heads, head_dim]", "v")
    seqlen_k = int(ak.shape[1])
    device = aq.device if isinstance(aq, Array) else None
    # What the shapes, dtypes and scalars decide is checked before any work: the index arrays below
    # may launch a kernel and q/k/v with unmergeable strides are copied (prepare_varlen checks again).
    check_qkv(aq, ak, av, CPU if device is None else CUDA)
    check_window(window_size, check_bool(causal, "causal"))
    check_scalars(softmax_scale, softcap, int(aq.shape[3]))
    h = None if device is None else handle(stream, kind, device)
    cu_q = _uniform_cu_seqlens(batch, seqlen_q, device, h)
    cu_k = _uniform_cu_seqlens(batch, seqlen_k, device, h)
    flat_out = None
    if arrays["out"] is not None:
        if tuple(arrays["out"].shape) != tuple(aq.shape):
            raise ValueError(f"out must have shape {list(aq.shape)}; got {tuple(arrays['out'].shape)}")
        if not c_contiguous(arrays["out"]):  # flattened, it would be a copy the caller never sees
            raise ValueError("out must be C-contiguous")
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
        reference.varlen.run(p)
        host_kind = kind if kind is TORCH else NUMPY
        result = out if out is not None else host_result(p.out.reshape(aq.shape), host_kind)
        lse = None if p.lse is None else np.ascontiguousarray(
            p.lse.reshape(p.num_heads, batch, seqlen_q).transpose(1, 0, 2))
        return (result, host_result(lse, host_kind), None) if attn_probs else result
    if batch == 0 or seqlen_q == 0:  # no query token: outputs only, no launch
        result, lse = served_empty(kind, q, out, None, tuple(aq.shape), (batch, p.num_heads, seqlen_q), aq.dtype,
                                   attn_probs, p.q.device, alloc_stream(stream, kind, h))
        return (result, lse, None) if attn_probs else result
    for name in ("q", "k", "v"):
        setattr(p, name, readable(getattr(p, name), True, h)[0])
    fast = kind if kind in FAST_KINDS else CUPY
    with on_device(p.q.device):
        launch = kernels.varlen.VarlenLaunch(p)
        result, lse = launch.run(fast, q if kind in FAST_KINDS else None, *kernels.varlen.problem_args(p), h,
                                 alloc_stream(stream, kind, h))
    errors.after_launch()
    result = out if out is not None else reshaped(result, tuple(aq.shape))
    if not attn_probs:
        return result
    lse = lse.reshape(p.num_heads, batch, seqlen_q)
    if stream is None:  # h is the framework's current stream: the copy goes there after the kernel
        return result, _batch_major(lse, fast), None
    with on_stream(fast, h):  # the copy on the caller's stream=, after the kernel
        return result, _batch_major(lse, fast), None


def _batch_major(lse, kind: str):
    """``[H, B, S]`` -> a ``[B, H, S]`` copy, on the framework's current stream."""
    return lse.permute(1, 0, 2).contiguous() if kind is TORCH else lse.transpose(1, 0, 2).copy()


