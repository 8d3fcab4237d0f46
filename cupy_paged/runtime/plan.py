"""The step plan: host metadata built once per step and reused by every layer.

FlashInfer's plan/run split: ``build_plan`` turns "these sequences, this many new
tokens each" into every index array the kernels need; ``StepPlan.attention`` runs
one layer from it.  ``PlanBuffers`` keeps fixed device buffers so a captured CUDA
graph can be replayed with each step's plan copied in by one transfer.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from . import _fill as _plan_kernels
from .._core.arrays import _KIND_OF_TYPE, CUDA, CUPY, TORCH, Array, data_ptr, empty, kind_of, read, signature, to_host
from ..api.decode import prepare_decode
from ..api.varlen import prepare_varlen
from .._core.streams import handle
from ..api.decode import flash_attn_with_kvcache
from ..api.kv_write import write_kv_cache
from ..api.varlen import flash_attn_varlen_func

DECODE, VARLEN = "decode", "varlen"


@dataclasses.dataclass
class StepPlan:
    """Everything the attention kernels need for one step, in batch order.

    Attributes
    ----------
    seq_ids : list
        The scheduled sequences.
    input_ids : array or None
        ``[num_tokens]`` int32 tokens to feed the model.
    positions : array
        ``[num_tokens]`` int32 position of each token in its sequence.
    query_lens, cache_seqlens, seqlens_k : array
        ``[batch]`` int32 new tokens, tokens already cached, and their sum.
    cu_seqlens_q, cu_seqlens_k : array
        ``[batch + 1]`` int32 prefix sums of ``query_lens`` and ``seqlens_k``.
    max_seqlen_q, max_seqlen_k : int
        Longest query and key length.
    slot_mapping : array
        ``[num_tokens]`` int32 cache slot (``block * block_size + offset``) of each new token.
    block_table : array
        ``[batch, max_blocks]`` int32, -1 padded.
    logits_indices : array
        ``[num_sampled]`` int32 rows of the model output to sample: the last token of each
        sequence that finishes its prompt (or decodes) this step.
    sample_mask : numpy.ndarray
        ``[batch]`` bool, which sequences sample.
    path : str
        ``"decode"`` when no sequence has more than one new token and ``num_tokens`` equals
        ``batch_size``, padding rows and tokens counted (``flash_attn_with_kvcache`` takes one
        token per row); ``"varlen"`` otherwise (paged ``flash_attn_varlen_func``).
    block_size : int
    """

    seq_ids: list
    input_ids: object
    positions: object
    query_lens: object
    cache_seqlens: object
    seqlens_k: object
    cu_seqlens_q: object
    cu_seqlens_k: object
    max_seqlen_q: int
    max_seqlen_k: int
    slot_mapping: object
    block_table: object
    logits_indices: object
    sample_mask: np.ndarray
    path: str
    block_size: int

    @property
    def batch_size(self) -> int:
        """Number of sequences."""
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        """Number of new tokens, all sequences together."""
        return int(self.positions.shape[0])

    @functools.cached_property
    def read_index(self):
        """``[sum(seqlens_k)]`` slots of every key of every sequence, for ``PagedAttentionCache.update``.

        Built on first use (once per step, not per layer): only the manual gather path of the
        source document needs it.
        """
        table = np.asarray(to_host(self.block_table))
        lengths = np.asarray(to_host(self.seqlens_k), np.int64)
        out = np.empty(int(lengths.sum()), np.int32)
        _plan_kernels.gather_slots(table, np.arange(table.shape[0]), np.zeros_like(lengths), lengths,
                                   self.block_size, out)
        return out

    def attention(self, q, k, v, k_cache, v_cache, softmax_scale=None, *, out=None, stream=None, **kwargs):
        """Causal attention of one layer for this step, through the plan's kernel path.

        Writes the new ``k``/``v`` into the paged caches and attends each new token to
        its sequence's cached and new keys.  On the GPU the launch of each layer shape is
        resolved once per step (the first layer); every further layer reads its arrays'
        pointers and launches.

        Parameters
        ----------
        q : array
            ``[num_tokens, num_heads, head_dim]``.
        k, v : array
            ``[num_tokens, num_kv_heads, head_dim]``, the new tokens' keys and values.
        k_cache, v_cache : array
            ``[num_blocks, block_size, num_kv_heads, head_dim]``, e.g. ``PagedAttentionCache.layer(i)``.
        softmax_scale : float, optional
            Default ``1 / sqrt(head_dim)``.
        out : array, optional
            ``[num_tokens, num_heads, head_dim]`` like ``q``, written in place.
        stream : optional
            As in ``flash_attn_varlen_func``.
        **kwargs
            Passed on (``softcap``, ``window_size``, ``alibi_slopes``); these take the public
            functions' path, resolved per call.

        Returns
        -------
        array
            ``[num_tokens, num_heads, head_dim]``, of the caller's kind.

        Examples
        --------
        >>> from cupy_paged.serving.kv_cache import PagedAttentionCache
        >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=4, dtype="float32", device="cpu")
        >>> cache.allocate("a", list(range(5)))
        0
        >>> plan = build_plan(cache, ["a"], [5])
        >>> x = np.ones((5, 1, 32), np.float32)
        >>> plan.attention(x, x, x, *cache.layer(0)).shape
        (5, 1, 32)
        """
        kind = _KIND_OF_TYPE.get(type(q)) or kind_of(q)
        if not kwargs and (kind is TORCH or kind is CUPY):
            s = signature
            try:
                key = (s(q), s(k), s(v), s(k_cache), s(v_cache), None if out is None else s(out), softmax_scale)
                layer = self._layers.get(key)
            except TypeError:
                key = layer = None
            if layer is None and key is not None:
                layer = _LayerLaunch(self, q, k, v, k_cache, v_cache, softmax_scale, out)
                self._layers[key] = layer
            if layer is not None:
                return layer.run(kind, q, k, v, k_cache, v_cache, out, stream)
        # The plan's index arrays were built (and are consistent) by build_plan: the layer calls
        # check nothing on the host.
        if self.path == DECODE:
            out4 = None if out is None else out[:, None]
            result = flash_attn_with_kvcache(q[:, None], k_cache, v_cache, k=k[:, None], v=v[:, None],
                                             cache_seqlens=self.cache_seqlens, block_table=self.block_table,
                                             softmax_scale=softmax_scale, causal=True, check_values=False,
                                             out=out4, stream=stream, **kwargs)
            return result[:, 0]
        write_kv_cache(k_cache, v_cache, k, v, self.slot_mapping, check_values=False, stream=stream)
        return flash_attn_varlen_func(q, k_cache, v_cache, self.cu_seqlens_q, self.cu_seqlens_k,
                                      self.max_seqlen_q, self.max_seqlen_k, softmax_scale=softmax_scale,
                                      causal=True, block_table=self.block_table, check_values=False,
                                      out=out, stream=stream, **kwargs)

    @functools.cached_property
    def _layers(self) -> dict:
        return {}


def _with_token_axis(array: Array) -> Array:
    """``[T, H, D]`` as ``[T, 1, H, D]`` (the decode kernel's one token per sequence), no copy."""
    return Array(array.obj, array.kind, array.ptr, (array.shape[0], 1) + tuple(array.shape[1:]),
                 (array.strides[0],) + tuple(array.strides), array.dtype, array.device)


class _LayerLaunch:
    """The launches of one layer shape of a step: built on the first layer, replayed by the rest."""

    def __init__(self, plan: StepPlan, q, k, v, k_cache, v_cache, softmax_scale, out):
        from .. import kernels

        aq, ak, av = read(q, "q"), read(k, "k"), read(v, "v")
        ak_cache, av_cache = read(k_cache, "k_cache"), read(v_cache, "v_cache")
        aout = None if out is None else read(out, "out")
        self.device = aq.device
        self.decode = plan.path == DECODE
        if self.decode:
            p = prepare_decode(_with_token_axis(aq), ak_cache, av_cache, _with_token_axis(ak), _with_token_axis(av),
                               cache_seqlens=read(plan.cache_seqlens, "cache_seqlens"),
                               block_table=read(plan.block_table, "block_table"), softmax_scale=softmax_scale,
                               causal=True, out=None if aout is None else _with_token_axis(aout),
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

    def run(self, kind, q, k, v, k_cache, v_cache, out, stream):
        stream = handle(stream, kind, self.device)
        q_ptr, k_ptr, v_ptr = data_ptr(q), data_ptr(k), data_ptr(v)
        kc_ptr, vc_ptr = data_ptr(k_cache), data_ptr(v_cache)
        if (q_ptr | k_ptr | v_ptr | kc_ptr | vc_ptr) & 15:
            raise ValueError("q, k, v and the caches of a layer must start on 16-byte boundaries")
        if out is None:
            out = empty(kind, q, self.out_shape, self.launch.dtype)
        out_arg = (out, data_ptr(out))
        if self.decode:
            seqlens, table = self.index_ptrs
            self.launch.run(kind, q, (q_ptr, kc_ptr, vc_ptr, k_ptr, v_ptr, seqlens, table, 0, 0, 0, 0, 0), 0,
                            out_arg, None, stream)
        else:
            cu_q, cu_k, table, slots = self.index_ptrs
            self.write.run((kc_ptr, vc_ptr, k_ptr, v_ptr, slots), stream)
            self.launch.run(kind, q, (q_ptr, kc_ptr, vc_ptr, cu_q, cu_k, table, 0), self.max_seqlen_q, out_arg,
                            None, stream)
        return out


def _layout(batch: int, tokens: int, width: int) -> tuple[dict, int]:
    """Where the plan's int32 index arrays lie in one flat buffer, name -> (start, stop, shape), and
    the buffer's length (so that a plan moves to the device in one transfer).

    Built every step: ``math.prod`` here, as ``np.prod`` costs microseconds on a small tuple.
    """
    shapes = dict(input_ids=(tokens,), positions=(tokens,), slot_mapping=(tokens,),
                  cu_seqlens_q=(batch + 1,), cu_seqlens_k=(batch + 1,), query_lens=(batch,),
                  cache_seqlens=(batch,), seqlens_k=(batch,), logits_indices=(batch,),
                  block_table=(batch, width))  # last, so an upload of fewer rows stops early
    layout, total = {}, 0
    for name, shape in shapes.items():
        stop = total + math.prod(shape)
        layout[name] = (total, stop, shape)
        total = stop
    return layout, total


def _views(buffer, layout: dict) -> dict:
    return {name: buffer[start:stop].reshape(shape) for name, (start, stop, shape) in layout.items()}


def build_plan(cache, seq_ids, query_lens, input_ids=None, sample_mask=None, rows=None,
               buffers: "PlanBuffers | None" = None, batch_size: int | None = None,
               num_tokens: int | None = None) -> StepPlan:
    """Build the step plan for sequences whose new tokens already have reserved slots.

    Each sequence ``s`` contributes ``query_lens[i]`` tokens at positions
    ``cache.num_computed(s) ..``; reserve them first with ``allocate`` / ``grow``.

    Parameters
    ----------
    cache : PagedAttentionCache
        The cache the sequences live in.
    seq_ids : sequence
        ``[batch]`` sequence ids, in the order the model sees them.
    query_lens : int or array_like of int
        ``[batch]`` new tokens per sequence, each >= 1.
    input_ids : array_like of int, optional
        ``[num_tokens]`` token ids, carried into the plan.
    sample_mask : array_like of bool, optional
        ``[batch]`` which sequences sample a token this step (default all).
    rows : numpy.ndarray, optional
        ``cache.rows(seq_ids)`` when the caller already has them.
    buffers : PlanBuffers, optional
        Write into these fixed buffers (one upload to the device) instead of new arrays.
    batch_size, num_tokens : int, optional
        With ``buffers``: pad the plan to this many sequences and tokens (CUDA-graph
        replay at a captured size).  Padding sequences have no tokens and no blocks;
        padding tokens have slot -1, which cache writes skip.

    Returns
    -------
    StepPlan
        Index arrays on the cache's side: NumPy for a CPU cache; for a CUDA cache, views of
        ``buffers``' device arrays, or of one device array uploaded here in one transfer.

    Raises
    ------
    ValueError
        When a query length is < 1 or runs past the slots reserved for the sequence,
        or the plan does not fit ``buffers``.

    Examples
    --------
    >>> from cupy_paged.serving.kv_cache import PagedAttentionCache
    >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=8, device="cpu")
    >>> for name, n in (("r0", 10), ("r1", 3), ("r2", 1)):
    ...     _ = cache.allocate(name, list(range(n)))
    >>> plan = build_plan(cache, ["r0", "r1", "r2"], [10, 3, 1])
    >>> plan.cu_seqlens_q.tolist(), plan.max_seqlen_q, plan.path
    ([0, 10, 13, 14], 10, 'varlen')
    >>> plan.block_table.tolist()
    [[0, 1], [2, -1], [3, -1]]
    """
    seq_ids = list(seq_ids)
    rows = cache.rows(seq_ids) if rows is None else rows
    batch = rows.size
    if np.ndim(query_lens) == 0:
        query = np.full(batch, query_lens, np.int64)
    else:
        query = np.asarray(query_lens, np.int64)
        if query.shape != rows.shape:
            raise ValueError(f"query_lens must have shape [batch = {batch}]; got {query.shape}")
    context = cache.context_lens(rows)
    reserved = cache.reserved_lens(rows)
    if batch and (((context + query) > reserved).any() or query.min() < 1):
        bad = int(np.argmax((query < 1) | (context + query > reserved)))
        raise ValueError(f"query_lens[{bad}] = {int(query[bad])} must be >= 1 and fit the "
                         f"{int(reserved[bad] - context[bad])} slots reserved past "
                         f"the {int(context[bad])} cached tokens of {seq_ids[bad]!r}")
    tokens = int(query.sum())
    if buffers is None:
        if batch_size is not None or num_tokens is not None:
            raise ValueError("batch_size and num_tokens pad a plan into buffers; pass buffers too")
        width = -(-int((context + query).max(initial=0)) // cache.block_size)
        layout, total = _layout(batch, tokens, width)
        packed = np.empty(total, np.int32)
        out = _views(packed, layout)
        memo_rows = np.full(batch, _plan_kernels.UNKNOWN_ROW, np.int64)
        memo_versions = np.zeros(batch, np.int64)
    else:
        batch_size = batch if batch_size is None else int(batch_size)
        num_tokens = tokens if num_tokens is None else int(num_tokens)
        out, memo_rows, memo_versions = buffers.host_views(batch, tokens, batch_size, num_tokens,
                                                           cache.max_blocks_per_seq)
    max_q, max_k = _plan_kernels.fill_plan(
        cache.tables, cache.table_versions, rows, context, query, cache.block_size,
        out["positions"], out["slot_mapping"], out["cu_seqlens_q"], out["cu_seqlens_k"],
        out["query_lens"], out["cache_seqlens"], out["seqlens_k"], out["block_table"],
        memo_rows, memo_versions)
    if input_ids is not None:
        input_ids = np.asarray(input_ids)
        if input_ids.shape != (tokens,):
            raise ValueError(f"input_ids must have shape [num_tokens = {tokens}]; got {input_ids.shape}")
        out["input_ids"][:tokens] = input_ids
        out["input_ids"][tokens:] = 0
    ends = out["cu_seqlens_q"][1:batch + 1]
    if sample_mask is None:
        sample_mask = np.ones(batch, bool)
        num_sampled = batch
        np.subtract(ends, 1, out=out["logits_indices"][:batch])
    else:
        sample_mask = np.asarray(sample_mask, bool)
        num_sampled = int(np.count_nonzero(sample_mask))
        out["logits_indices"][:num_sampled] = ends[sample_mask] - 1
    out["logits_indices"][num_sampled:] = 0
    # The decode kernel takes one token per sequence row: padded to more tokens than rows (a
    # captured size), the step runs on the varlen path.
    rows_match = buffers is None or num_tokens == batch_size
    if buffers is not None:
        out = buffers.upload(batch_size, num_tokens)
        if batch_size > batch:
            sample_mask = np.concatenate([sample_mask, np.zeros(batch_size - batch, bool)])
            seq_ids = seq_ids + [None] * (batch_size - batch)
    elif cache.device == CUDA:  # a cache on the GPU: the plan goes there too, in one transfer
        import cupy

        out = _views(cupy.asarray(packed), layout)
    out["logits_indices"] = out["logits_indices"][:num_sampled]
    if input_ids is None:
        out["input_ids"] = None
    return StepPlan(seq_ids=seq_ids, max_seqlen_q=int(max_q), max_seqlen_k=int(max_k),
                    sample_mask=sample_mask, path=DECODE if max_q == 1 and rows_match else VARLEN,
                    block_size=cache.block_size, **out)


class PlanBuffers:
    """Fixed buffers a plan is built into, uploaded to the device in one transfer.

    Sized for the largest step, so the arrays' addresses and shapes never change
    and a CUDA graph captured over them replays with each new plan.  The block
    table keeps its full width, and rows unchanged since the previous step (same
    sequence, no new block) are not rewritten.

    Parameters
    ----------
    max_batch : int
        Most sequences in a step.
    max_tokens : int
        Most new tokens in a step.
    max_blocks_per_seq : int
        Block table width (``PagedAttentionCache.max_blocks_per_seq``).
    device : {"cpu", "cuda"}
        Where the buffers live.  On the CPU the host buffer is the device buffer.

    Examples
    --------
    >>> from cupy_paged.serving.kv_cache import PagedAttentionCache
    >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=8, device="cpu")
    >>> _ = cache.allocate("a", list(range(3)))
    >>> buffers = PlanBuffers(max_batch=4, max_tokens=8, max_blocks_per_seq=cache.max_blocks_per_seq)
    >>> plan = build_plan(cache, ["a"], [3], buffers=buffers, batch_size=2, num_tokens=4)
    >>> plan.cu_seqlens_q.tolist(), plan.slot_mapping.tolist(), plan.block_table.shape
    ([0, 3, 3], [0, 1, 2, -1], (2, 8))
    """

    def __init__(self, max_batch: int, max_tokens: int, max_blocks_per_seq: int, device: str = "cpu"):
        self.max_batch, self.max_tokens = int(max_batch), int(max_tokens)
        self.max_blocks_per_seq = int(max_blocks_per_seq)
        self.device = device
        self._done = None
        layout, total = _layout(self.max_batch, self.max_tokens, self.max_blocks_per_seq)
        self._table_offset = layout["block_table"][0]  # the last array: an upload stops early
        if device == CUDA:
            import cupy

            # Pinned host memory makes the upload an asynchronous DMA on the current stream.
            pinned = cupy.cuda.alloc_pinned_memory(4 * total)
            self._host = np.frombuffer(pinned, np.int32, total)
            self._device = cupy.empty(total, np.int32)
        else:
            self._host = self._device = np.empty(total, np.int32)
        self._host_views = _views(self._host, layout)
        self._device_views = _views(self._device, layout)
        self._memo_rows = np.full(self.max_batch, _plan_kernels.UNKNOWN_ROW, np.int64)
        self._memo_versions = np.zeros(self.max_batch, np.int64)
        self._slices: dict = {}  # (side, batch_size, num_tokens) -> views; steady steps reuse one

    def host_views(self, batch: int, tokens: int, batch_size: int, num_tokens: int, max_blocks_per_seq: int):
        """Host arrays to build a plan of ``batch``/``tokens`` padded to ``batch_size``/``num_tokens``.

        Returns the views and the row memo (which block table rows hold what).
        """
        if not (batch <= batch_size <= self.max_batch and tokens <= num_tokens <= self.max_tokens):
            raise ValueError(f"the plan ({batch} sequences, {tokens} tokens) padded to ({batch_size}, "
                             f"{num_tokens}) must fit the buffers ({self.max_batch}, {self.max_tokens})")
        if max_blocks_per_seq != self.max_blocks_per_seq:
            raise ValueError(f"the buffers' block tables have {self.max_blocks_per_seq} columns but the "
                             f"cache's max_blocks_per_seq is {max_blocks_per_seq}")
        if self._done is not None:
            self._done.synchronize()  # the previous upload must have read the host buffer
        return (self._sliced("host", batch_size, num_tokens),
                self._memo_rows[:batch_size], self._memo_versions[:batch_size])

    def upload(self, batch_size: int, num_tokens: int) -> dict:
        """Copy the host buffer to the device (one transfer, up to the step's last block table
        row); the device views, sliced."""
        if self._device is not self._host:
            import cupy

            end = self._table_offset + batch_size * self.max_blocks_per_seq
            self._device[:end].set(self._host[:end])
            self._done = cupy.cuda.get_current_stream().record()
        return dict(self._sliced("device", batch_size, num_tokens))

    def _sliced(self, side: str, batch_size: int, num_tokens: int) -> dict:
        key = (side, batch_size, num_tokens)
        if key not in self._slices:
            if len(self._slices) > 64:
                self._slices.clear()
            views = self._host_views if side == "host" else self._device_views
            lengths = dict(input_ids=num_tokens, positions=num_tokens, slot_mapping=num_tokens,
                           cu_seqlens_q=batch_size + 1, cu_seqlens_k=batch_size + 1)
            self._slices[key] = {name: view[:lengths.get(name, batch_size)] for name, view in views.items()}
        return self._slices[key]
