"""Merge two partial attentions over the same queries (cascade attention, shared prefixes).

When the keys of a query are split into two disjoint sets A and B (a shared prefix and each
request's own suffix, say), attention over A and over B, each with its log-sum-exp, combine
exactly into attention over A ∪ B.  The split-KV decode kernel does the same inside one call.
"""
from __future__ import annotations

import numpy as np

from .. import kernels, reference
from .._core.arrays import CUDA, as_array, backend_of, empty, kind_of
from .._core.streams import handle
from .._core.types import BF16, check_out
from ._call import alloc_stream, host_result

_FLOAT_OUT = (np.dtype(np.float16), BF16, np.dtype(np.float32))  # cuda_src/merge.cu's entry points


def _lse_layout(out_shape: tuple, lse_shape: tuple) -> tuple[int, int]:
    """(tokens, seqlen) of the LSE layout matching ``out``; ValueError naming lse_a otherwise."""
    if len(out_shape) == 3:  # varlen: out [tokens, H, D], lse [H, tokens]
        tokens, heads, _ = out_shape
        expected, seqlen = (heads, tokens), tokens
    elif len(out_shape) == 4:  # decode: out [B, Sq, H, D], lse [B, H, Sq]
        batch, seqlen, heads, _ = out_shape
        expected, tokens = (batch, heads, seqlen), batch * seqlen
    else:
        raise ValueError(f"out_a must have shape [tokens, num_heads, head_dim] or "
                         f"[batch, seqlen_q, num_heads, head_dim]; got {out_shape}")
    if tuple(lse_shape) != expected:
        raise ValueError(f"lse_a must have shape {list(expected)} for out_a of shape {list(out_shape)}; "
                         f"got {tuple(lse_shape)}")
    return tokens, seqlen


def merge_attention_states(out_a, lse_a, out_b, lse_b, *, out=None, stream=None):
    """Combine two attentions of the same queries over disjoint key sets.

    With ``w_x = exp(lse_x - lse)`` and ``lse = log(exp(lse_a) + exp(lse_b))`` the result is
    ``out = w_a * out_a + w_b * out_b``: exactly the attention over both key sets.  A side whose
    LSE is ``-inf`` (it saw no key) contributes nothing, whatever its output holds; a row that
    neither side saw gives zeros and LSE ``-inf``.

    Parameters
    ----------
    out_a, out_b : array, ``[tokens, num_heads, head_dim]`` (varlen layout) or
        ``[batch, seqlen_q, num_heads, head_dim]`` (decode layout); float16, bfloat16 or float32,
        both the same shape and dtype.
    lse_a, lse_b : array, float32, ``[num_heads, tokens]`` (varlen) or ``[batch, num_heads,
        seqlen_q]`` (decode): the natural-log LSE that ``return_softmax_lse=True`` returns.
    out : array, optional, keyword only
        Where to write the merged output (shape and dtype of ``out_a``, C-contiguous).  It may be
        ``out_a`` or ``out_b`` itself.
    stream : optional, keyword only: as in :func:`flash_attn_varlen_func` (default torch's current
        stream for torch inputs, else CuPy's current stream); NumPy inputs ignore it.

    Returns
    -------
    (out, lse) : the merged output and its float32 LSE in the layout of ``lse_a``.  NumPy inputs
        run on the CPU (float64 arithmetic), CUDA inputs in one kernel on the caller's stream, outputs
        of the caller's kind (torch in, torch out).

    Raises
    ------
    ValueError, TypeError
        On mismatched shapes or dtypes, naming the argument.

    Examples
    --------
    >>> import numpy as np; from cupy_paged import merge_attention_states
    >>> o = np.ones((2, 1, 4), np.float32); lse = np.zeros((1, 2), np.float32)
    >>> merged, merged_lse = merge_attention_states(o, lse, 3 * o, lse)
    >>> float(merged[0, 0, 0]), round(float(merged_lse[0, 0]), 4)
    (2.0, 0.6931)
    """
    kind, like = kind_of(out_a), out_a
    out_a, out_b = as_array(out_a, "out_a"), as_array(out_b, "out_b")
    lse_a, lse_b = as_array(lse_a, "lse_a"), as_array(lse_b, "lse_b")
    out_obj = out
    out = None if out is None else as_array(out, "out")
    backend = backend_of(dict(out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b, out=out))
    if out_a.dtype not in _FLOAT_OUT:
        raise TypeError(f"out_a must have dtype float16, bfloat16 or float32; got {out_a.dtype}")
    if out_b.shape != out_a.shape or out_b.dtype != out_a.dtype:
        raise ValueError(f"out_b must have the shape and dtype of out_a ({tuple(out_a.shape)}, "
                         f"{out_a.dtype}); got {tuple(out_b.shape)}, {out_b.dtype}")
    tokens, seqlen = _lse_layout(tuple(out_a.shape), tuple(lse_a.shape))
    if lse_b.shape != lse_a.shape:
        raise ValueError(f"lse_b must have the shape of lse_a {tuple(lse_a.shape)}; got {tuple(lse_b.shape)}")
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        if lse.dtype != np.float32:
            raise TypeError(f"{name} must have dtype float32; got {lse.dtype}")
    out = check_out(out, "out", tuple(out_a.shape), out_a.dtype, backend)
    if backend == CUDA:
        # Outputs in the caller's kind (torch in, torch out), written through CuPy views.
        h = handle(stream, kind, out_a.data.device_id)
        alloc = alloc_stream(stream, kind, h)
        result = out_obj if out is not None else empty(kind, like, tuple(out_a.shape), out_a.dtype, alloc)
        lse_obj = empty(kind, like, tuple(lse_a.shape), np.float32, alloc)
        kernels.merge.run(out_a, lse_a, out_b, lse_b, as_array(result, "out"), as_array(lse_obj, "lse"), tokens, seqlen,
                          h)
        return result, lse_obj
    merged, merged_lse = reference.merge.run(out_a, lse_a, out_b, lse_b, out)  # check_out made a host out
    # Torch CPU tensors in, torch CPU tensors out (the caller's own out where given).
    return (host_result(merged, kind) if out_obj is None else out_obj), host_result(merged_lse, kind)


