"""The launches of one layer shape of a step plan: resolved on the first layer, replayed by the rest."""
from __future__ import annotations

import numpy as np

from .._core.arrays import Array, data_ptr, read
from .._core.streams import handle
from ..api._call import alloc_stream
from ..api.decode import prepare_decode
from ..api.varlen import prepare_varlen
from ..kernels._launch import outputs, q_is_the_callers_dense_tensor
from ._calls import check_step_rows
# StepPlan.path values: the decode kernel (flash_attn_with_kvcache),
# the paged varlen one, or the ragged work-list kernel (kernels/ragged.py) for a whole step.
from ._work import DECODE, RAGGED, SPLIT


def with_token_axis(array: Array) -> Array:
    """``[T, H, D]`` as ``[T, 1, H, D]`` (the decode kernel's one token per sequence), no copy."""
    return Array(array.obj, array.kind, array.ptr, (array.shape[0], 1) + tuple(array.shape[1:]),
                 (array.strides[0],) + tuple(array.strides), array.dtype, array.device)


def row_range(array: Array, start: int, stop: int) -> Array:
    """Rows ``[start, stop)`` of ``array`` along its first axis, no copy."""
    offset = start * array.strides[0] * array.itemsize
    return Array(array.obj, array.kind, array.ptr + offset, (stop - start,) + tuple(array.shape[1:]),
                 tuple(array.strides), array.dtype, array.device)


class LayerLaunch:
    """The launches of one layer shape of a step: built on the first layer, replayed by the rest."""

    def __init__(self, plan, q, k, v, k_cache, v_cache, softmax_scale, out, **kwargs):
        from .. import kernels

        aq, ak, av = read(q, "q"), read(k, "k"), read(v, "v")
        ak_cache, av_cache = read(k_cache, "k_cache"), read(v_cache, "v_cache")
        aout = None if out is None else read(out, "out")
        check_step_rows(plan, aq, ak, av)  # once per resolved shape: later layers of the key have these shapes
        self.device = aq.device
        self.decode = plan.path == DECODE
        self.ragged = plan.path == RAGGED
        self.split = None  # on the split path: the varlen launch of the rows after the decodes
        if self.ragged:
            self._ragged(plan, aq, ak, av, ak_cache, av_cache, softmax_scale, aout, kwargs)
        elif plan.path == SPLIT:
            self._split(plan, aq, ak, av, ak_cache, av_cache, softmax_scale, aout)
        elif self.decode:
            p = prepare_decode(with_token_axis(aq), ak_cache, av_cache, with_token_axis(ak), with_token_axis(av),
                               cache_seqlens=read(plan.cache_seqlens, "cache_seqlens"),
                               block_table=read(plan.block_table, "block_table"), softmax_scale=softmax_scale,
                               causal=True, out=None if aout is None else with_token_axis(aout),
                               check_values=False)
            for array in (p.q, p.k_new, p.v_new):
                if not array.vectorised():
                    raise ValueError("q, k and v of a layer must have 16-byte aligned rows")
            self.launch = kernels.decode.DecodeLaunch(p)
            self.index_ptrs = (p.cache_seqlens.ptr, p.block_table.ptr)
        else:
            for name, array in (("k", ak), ("v", av)):
                if not array.vectorised():
                    raise ValueError(f"{name} of a layer must have 16-byte aligned rows")
            self.write = kernels.kv_write.WriteLaunch(ak_cache, ak, av)
            p = prepare_varlen(aq, ak_cache, av_cache, read(plan.cu_seqlens_q, "cu_seqlens_q"),
                               read(plan.cu_seqlens_k, "cu_seqlens_k"), plan.max_seqlen_q, plan.max_seqlen_k,
                               softmax_scale, True, (-1, -1), 0.0, None, read(plan.block_table, "block_table"),
                               False, aout, False)
            if not p.q.vectorised():
                raise ValueError("q of a layer must have 16-byte aligned rows")
            self.launch = kernels.varlen.VarlenLaunch(p)
            self.index_ptrs = (p.cu_seqlens_q.ptr, p.cu_seqlens_k.ptr, p.block_table.ptr,
                               read(plan.slot_mapping, "slot_mapping").ptr)
            self.max_seqlen_q = plan.max_seqlen_q
        self.out_shape = tuple(aq.shape)
        # The output has q's shape and dtype: where q is the caller's dense torch tensor a new one is
        # empty_like(q) (outputs); the memo key holds q's strides, so every layer of this launch has them.
        self.out_like_q = q_is_the_callers_dense_tensor(aq)

    def _split(self, plan, aq, ak, av, ak_cache, av_cache, softmax_scale, aout):
        """The decode kernel over the first ``plan.num_split`` rows, then the K/V write and the
        paged varlen kernel over the rest: the two launches of a split step."""
        from .. import kernels

        ns, tokens, batch = plan.num_split, int(aq.shape[0]), plan.batch_size
        head = (lambda a: row_range(a, 0, ns))
        tail = (lambda a, end: row_range(a, ns, end))
        table = read(plan.block_table, "block_table")
        p = prepare_decode(with_token_axis(head(aq)), ak_cache, av_cache, with_token_axis(head(ak)),
                           with_token_axis(head(av)), cache_seqlens=head(read(plan.cache_seqlens, "cache_seqlens")),
                           block_table=head(table), softmax_scale=softmax_scale, causal=True,
                           out=None if aout is None else with_token_axis(head(aout)), check_values=False)
        tq, tk, tv = tail(aq, tokens), tail(ak, tokens), tail(av, tokens)
        for array in (p.q, p.k_new, p.v_new, tq, tk, tv):
            if not array.vectorised():
                raise ValueError("q, k and v of a layer must have 16-byte aligned rows")
        self.launch = kernels.decode.DecodeLaunch(p)
        self.index_ptrs = (p.cache_seqlens.ptr, p.block_table.ptr)
        self.write = kernels.kv_write.WriteLaunch(ak_cache, tk, tv)
        cu_k = tail(read(plan.cu_seqlens_k, "cu_seqlens_k"), batch + 1)
        pv = prepare_varlen(tq, ak_cache, av_cache, read(plan.tail_cu_seqlens_q, "tail_cu_seqlens_q"), cu_k,
                            plan.max_seqlen_q, plan.max_seqlen_k, softmax_scale, True, (-1, -1), 0.0, None,
                            tail(table, batch), False, None if aout is None else tail(aout, tokens), False)
        self.split = kernels.varlen.VarlenLaunch(pv)
        row_bytes = (lambda a: ns * a.strides[0] * a.itemsize)
        out_row = ns * (aout.strides[0] * aout.itemsize if aout is not None else
                        int(np.prod(aq.shape[1:])) * p.q.itemsize)
        # Byte offsets of the tail's q, k, v and out rows; its index arrays' addresses.
        self.tail_offsets = (row_bytes(aq), row_bytes(ak), row_bytes(av), out_row)
        self.tail_ptrs = (pv.cu_seqlens_q.ptr, pv.cu_seqlens_k.ptr, pv.block_table.ptr,
                          tail(read(plan.slot_mapping, "slot_mapping"), tokens).ptr)
        self.max_seqlen_q = plan.max_seqlen_q
        self.out_shape = tuple(aq.shape)

    def _ragged(self, plan, aq, ak, av, ak_cache, av_cache, softmax_scale, aout, kwargs):
        from ..kernels.ragged import RaggedLaunch

        p = prepare_varlen(aq, ak_cache, av_cache, read(plan.cu_seqlens_q, "cu_seqlens_q"),
                           read(plan.cu_seqlens_k, "cu_seqlens_k"), plan.max_seqlen_q, plan.max_seqlen_k,
                           softmax_scale, True, kwargs.pop("window_size", (-1, -1)), kwargs.pop("softcap", 0.0),
                           kwargs.pop("alibi_slopes", None), read(plan.block_table, "block_table"), False, aout,
                           False)
        for name, array in (("q", p.q), ("k", ak), ("v", av)):
            if not array.vectorised():
                raise ValueError(f"{name} of a layer must have 16-byte aligned rows")
        if aout is not None and not aout.c_contiguous():
            raise ValueError("out of a ragged step must be contiguous")
        self.launch = RaggedLaunch.from_arrays(p.q, p.k, ak, av, int(p.block_table.shape[1]), p.softmax_scale,
                                               p.window, p.softcap, p.alibi_slopes)
        self.work = (read(plan.work, "work").ptr, plan.num_items, plan.num_slots)
        self.index_ptrs = (p.block_table.ptr,)
        self.out_shape = tuple(aq.shape)

    def run(self, kind, q, k, v, k_cache, v_cache, out, stream, alibi_slopes=None, ptr=data_ptr):
        """Launch this layer; ``alibi_slopes``: the ragged launch's, of the signature it was built
        with; ``ptr``: reads an array's address (the plan's memoised layers pass their kind's)."""
        h = handle(stream, kind, self.device)
        q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr = ptr(q), ptr(k), ptr(v), ptr(k_cache), ptr(v_cache)
        if (q_ptr | k_ptr | v_ptr | kc_ptr | vc_ptr) & 15:
            raise ValueError("q, k, v and the caches of a layer must start on 16-byte boundaries")
        if out is not None and ptr(out) & 15:  # the varlen kernels store 16 bytes at a time
            raise ValueError("out of a layer must start on a 16-byte boundary")
        # A new output as the public calls make theirs: on a named stream from that stream's pool.
        out, out_ptr, _, _ = outputs(kind, q, None if out is None else (out, ptr(out)), None, self.out_shape, (),
                                     self.launch.dtype, False, self.out_like_q, alloc_stream(stream, kind, h))
        if self.ragged:
            alibi = 0 if alibi_slopes is None else ptr(alibi_slopes)
            self.launch.run((q_ptr, kc_ptr, vc_ptr, k_ptr, v_ptr, self.index_ptrs[0], alibi), self.work, out_ptr, 0, h)
        elif self.decode or self.split is not None:
            seqlens, table = self.index_ptrs
            self.launch.run(kind, q, (q_ptr, kc_ptr, vc_ptr, k_ptr, v_ptr, seqlens, table, 0, 0, 0, 0, 0), 0,
                            (out, out_ptr), None, h)
            if self.split is not None:
                dq, dk, dv, dout = self.tail_offsets
                cu_q, cu_k, table, slots = self.tail_ptrs
                self.write.run((kc_ptr, vc_ptr, k_ptr + dk, v_ptr + dv, slots), h)
                self.split.run(kind, q, (q_ptr + dq, kc_ptr, vc_ptr, cu_q, cu_k, table, 0), self.max_seqlen_q,
                               (out, out_ptr + dout), None, h)
        else:
            cu_q, cu_k, table, slots = self.index_ptrs
            self.write.run((kc_ptr, vc_ptr, k_ptr, v_ptr, slots), h)
            self.launch.run(kind, q, (q_ptr, kc_ptr, vc_ptr, cu_q, cu_k, table, 0), self.max_seqlen_q, (out, out_ptr),
                            None, h)
        return out
