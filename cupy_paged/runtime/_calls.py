"""One layer of a step plan through the public functions: the CPU backend's way, and the GPU's for
keyword arguments that key no resolved launch (``_layer.py`` is the launch path).

Every path reads a step as its kernels do.  The decode and ragged launches append each new token
and attend it from k/v in one pass; the varlen launch reads every key back from the cache after
the write.  So a new token whose cache slot is a hole (a bad block id in the table) is attended
on the former and masked on the latter, and the CPU backend, path by path, gives the same.
Arrays of other frameworks (neither CuPy nor torch) take write + varlen on the split and ragged
paths.
"""
from __future__ import annotations

import numpy as np

from .._core.arrays import CUPY, NUMPY, TORCH, empty, read
from .._core.streams import handle
from .._core.types import check_out
from ..api._call import alloc_stream, host_result, on_device
from ..api.decode import flash_attn_with_kvcache
from ..api.kv_write import write_kv_cache
from ..api.varlen import flash_attn_varlen_func, prepare_varlen
from ._work import DECODE, RAGGED, SPLIT


def check_step_rows(plan, q, k, v) -> None:
    """``q``, ``k`` and ``v`` hold one row per token of the step, ``[plan.num_tokens, heads,
    head_dim]``: a ValueError naming the first that does not, before any work."""
    tokens = plan.num_tokens
    for name, array in (("q", q), ("k", k), ("v", v)):
        shape = tuple(array.shape)
        if len(shape) != 3 or int(shape[0]) != tokens:
            raise ValueError(f"{name} must have shape [num_tokens, heads, head_dim] with the plan's num_tokens = "
                             f"{tokens}; got {shape}")


def layer_through_calls(plan, kind, q, k, v, k_cache, v_cache, softmax_scale, out, stream, options: dict):
    """:meth:`StepPlan.attention` of ``plan`` through the public functions (``options``: its
    checked keyword arguments)."""
    check_step_rows(plan, q, k, v)
    if plan.path == DECODE:
        return decode_rows(plan, q, k, v, k_cache, v_cache, softmax_scale, out, stream, options)
    aq = read(q, "q")  # a NumPy array on the CPU backend (a torch CPU tensor's memory too), else an Array
    if out is not None:  # the other paths write the cache first: an out the attention refuses is refused before
        check_out(read(out, "out"), "out", tuple(aq.shape), aq.dtype, None)
    if plan.path == SPLIT and kind in (NUMPY, CUPY, TORCH):
        return split_rows(plan, kind, aq, q, k, v, k_cache, v_cache, softmax_scale, out, stream, options)
    if plan.path == RAGGED and isinstance(aq, np.ndarray) and kind in (NUMPY, TORCH):
        return ragged_reference(plan, kind, q, k, v, k_cache, v_cache, softmax_scale, out, options)
    write_kv_cache(k_cache, v_cache, k, v, plan.slot_mapping, check_values=False, stream=stream)
    return flash_attn_varlen_func(q, k_cache, v_cache, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_seqlen_q,
                                  plan.max_seqlen_k, softmax_scale=softmax_scale, causal=True,
                                  block_table=plan.block_table, check_values=False, out=out, stream=stream,
                                  **options)


def decode_rows(plan, q, k, v, k_cache, v_cache, softmax_scale, out, stream, options, rows=slice(None)):
    """One-token rows ``rows`` of the step through ``flash_attn_with_kvcache``; returns ``out``
    itself when given, as the launch path does."""
    out4 = None if out is None else out[:, None]
    result = flash_attn_with_kvcache(q[:, None], k_cache, v_cache, k=k[:, None], v=v[:, None],
                                     cache_seqlens=plan.cache_seqlens[rows], block_table=plan.block_table[rows],
                                     softmax_scale=softmax_scale, causal=True, check_values=False, out=out4,
                                     stream=stream, **options)
    return result[:, 0] if out is None else out


def split_rows(plan, kind, aq, q, k, v, k_cache, v_cache, softmax_scale, out, stream, options):
    """The split path: the leading ``plan.num_split`` one-token rows through
    ``flash_attn_with_kvcache``, the rest through ``write_kv_cache`` and ``flash_attn_varlen_func``
    (what the two launches of ``_layer.LayerLaunch._split`` do).  ALiBi slopes ``[batch, heads]``
    go to each part by sequence."""
    ns, tokens = plan.num_split, int(q.shape[0])
    head, tail = dict(options), dict(options)
    slopes = options.get("alibi_slopes")
    if slopes is not None and len(slopes.shape) == 2 and slopes.shape[0] == plan.batch_size > 1:
        head["alibi_slopes"], tail["alibi_slopes"] = slopes[:ns], slopes[ns:]
    if out is None:
        if isinstance(aq, np.ndarray):  # the CPU backend: a NumPy array, or a torch CPU tensor's memory
            out = host_result(np.empty(aq.shape, aq.dtype), kind)
        else:
            with on_device(aq.device):
                out = empty(kind, q, tuple(aq.shape), aq.dtype,
                            alloc_stream(stream, kind, handle(stream, kind, aq.device)))
    rows = slice(ns, tokens)
    decode_rows(plan, q[:ns], k[:ns], v[:ns], k_cache, v_cache, softmax_scale, out[:ns], stream, head,
                rows=slice(0, ns))
    write_kv_cache(k_cache, v_cache, k[rows], v[rows], plan.slot_mapping[rows], check_values=False, stream=stream)
    flash_attn_varlen_func(q[rows], k_cache, v_cache, plan.tail_cu_seqlens_q, plan.cu_seqlens_k[ns:],
                           plan.max_seqlen_q, plan.max_seqlen_k, softmax_scale=softmax_scale, causal=True,
                           block_table=plan.block_table[ns:], check_values=False, out=out[rows], stream=stream, **tail)
    return out


def ragged_reference(plan, kind, q, k, v, k_cache, v_cache, softmax_scale, out, options):
    """The ragged launch on the CPU backend: the K/V write, then the varlen reference with each
    sequence's new tokens read from ``k``/``v``; a new output in the caller's ``kind`` (NumPy or a
    torch CPU tensor)."""
    from .. import reference

    p = prepare_varlen(q, k_cache, v_cache, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_seqlen_q,
                       plan.max_seqlen_k, softmax_scale, True, options.get("window_size", (-1, -1)),
                       options.get("softcap", 0.0), options.get("alibi_slopes"), plan.block_table, False, out, False)
    write_kv_cache(k_cache, v_cache, k, v, plan.slot_mapping, check_values=False)
    reference.varlen.run(p, new_k=read(k, "k"), new_v=read(v, "v"))
    return host_result(p.out, kind) if out is None else out
