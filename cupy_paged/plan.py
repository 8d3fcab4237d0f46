"""The step plan: host metadata built once per step and reused by every layer.

FlashInfer's plan/run split: ``build_plan`` turns "these sequences, this many new
tokens each" into every index array the kernels need; ``StepPlan.attention`` runs
one layer from it.  ``PlanBuffers`` keeps fixed device buffers so a captured CUDA
graph can be replayed with each step's plan copied in by one transfer.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from . import _plan_kernels
from ._arrays import CUDA
from .attention import flash_attn_varlen_func, flash_attn_with_kvcache, write_kv_cache

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
        ``"decode"`` when every sequence has one new token (``flash_attn_with_kvcache``),
        ``"varlen"`` otherwise (paged ``flash_attn_varlen_func``).
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

    @property
    def read_index(self):
        """``[sum(seqlens_k)]`` slots of every key of every sequence, for ``PagedAttentionCache.update``.

        Built on demand: only the manual gather path of the source document needs it.
        """
        table = np.asarray(_to_host(self.block_table))
        lengths = np.asarray(_to_host(self.seqlens_k), np.int64)
        out = np.empty(int(lengths.sum()), np.int32)
        _plan_kernels.gather_slots(table, np.arange(table.shape[0]), np.zeros_like(lengths), lengths,
                                   self.block_size, out)
        return out

    def attention(self, q, k, v, k_cache, v_cache, softmax_scale=None, **kwargs):
        """Causal attention of one layer for this step, through the plan's kernel path.

        Writes the new ``k``/``v`` into the paged caches and attends each new token to
        its sequence's cached and new keys.

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
        **kwargs
            Passed on (``softcap``, ``window_size``, ``alibi_slopes``).

        Returns
        -------
        array
            ``[num_tokens, num_heads, head_dim]``.

        Examples
        --------
        >>> from cupy_paged.cache import PagedAttentionCache
        >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=4, dtype="float32", device="cpu")
        >>> cache.allocate("a", list(range(5)))
        0
        >>> plan = build_plan(cache, ["a"], [5])
        >>> x = np.ones((5, 1, 32), np.float32)
        >>> plan.attention(x, x, x, *cache.layer(0)).shape
        (5, 1, 32)
        """
        if self.path == DECODE:
            out = flash_attn_with_kvcache(q[:, None], k_cache, v_cache, k=k[:, None], v=v[:, None],
                                          cache_seqlens=self.cache_seqlens, block_table=self.block_table,
                                          softmax_scale=softmax_scale, causal=True, **kwargs)
            return out[:, 0]
        write_kv_cache(k_cache, v_cache, k, v, self.slot_mapping)
        return flash_attn_varlen_func(q, k_cache, v_cache, self.cu_seqlens_q, self.cu_seqlens_k,
                                      self.max_seqlen_q, self.max_seqlen_k, softmax_scale=softmax_scale,
                                      causal=True, block_table=self.block_table, **kwargs)


def _to_host(array):
    return array if isinstance(array, np.ndarray) else array.get()


def build_plan(cache, seq_ids, query_lens, input_ids=None, sample_mask=None, rows=None) -> StepPlan:
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

    Returns
    -------
    StepPlan
        NumPy arrays; see ``PlanBuffers.load`` to place them on a device.

    Raises
    ------
    ValueError
        When a query length is < 1 or runs past the slots reserved for the sequence.

    Examples
    --------
    >>> from cupy_paged.cache import PagedAttentionCache
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
    query = np.broadcast_to(np.asarray(query_lens, np.int64), rows.shape)
    context = cache.context_lens(rows)
    if rows.size and (query.min() < 1 or ((context + query) > cache.reserved_lens(rows)).any()):
        bad = int(np.argmax((query < 1) | (context + query > cache.reserved_lens(rows))))
        raise ValueError(f"query_lens[{bad}] = {int(query[bad])} must be >= 1 and fit the "
                         f"{int(cache.reserved_lens(rows)[bad] - context[bad])} slots reserved past "
                         f"the {int(context[bad])} cached tokens of {seq_ids[bad]!r}")
    positions, slots, cu_q, cu_k, table, max_q, max_k = _plan_kernels.build_plan(
        cache.tables, rows, context, query, cache.block_size)
    if input_ids is not None:
        input_ids = np.asarray(input_ids, np.int32)
        if input_ids.shape != positions.shape:
            raise ValueError(f"input_ids must have shape [num_tokens = {positions.size}]; "
                             f"got {input_ids.shape}")
    if sample_mask is None:
        sample_mask = np.ones(rows.size, bool)
        logits_indices = cu_q[1:] - 1
    else:
        sample_mask = np.asarray(sample_mask, bool)
        logits_indices = cu_q[1:][sample_mask] - 1
    query32 = query.astype(np.int32)
    return StepPlan(seq_ids=seq_ids, input_ids=input_ids, positions=positions, query_lens=query32,
                    cache_seqlens=context.astype(np.int32), seqlens_k=np.diff(cu_k),
                    cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=int(max_q),
                    max_seqlen_k=int(max_k), slot_mapping=slots, block_table=table,
                    logits_indices=logits_indices, sample_mask=sample_mask,
                    path=DECODE if max_q == 1 else VARLEN, block_size=cache.block_size)


class PlanBuffers:
    """Fixed buffers a plan is copied into, one host-to-device transfer per step.

    Sized for the largest step, so the arrays' addresses and shapes never change
    and a CUDA graph captured over them replays with each new plan.

    Parameters
    ----------
    max_batch : int
        Most sequences in a step.
    max_tokens : int
        Most new tokens in a step.
    max_blocks_per_seq : int
        Block table width (``PagedAttentionCache.max_blocks_per_seq``).
    device : {"cpu", "cuda"}
        Where the buffers live.

    Examples
    --------
    >>> from cupy_paged.cache import PagedAttentionCache
    >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=8, device="cpu")
    >>> _ = cache.allocate("a", list(range(3)))
    >>> buffers = PlanBuffers(max_batch=4, max_tokens=8, max_blocks_per_seq=8)
    >>> fixed = buffers.load(build_plan(cache, ["a"], [3]), batch_size=2, num_tokens=4)
    >>> fixed.cu_seqlens_q.tolist(), fixed.slot_mapping.tolist(), fixed.block_table.shape
    ([0, 3, 3], [0, 1, 2, -1], (2, 8))
    """

    def __init__(self, max_batch: int, max_tokens: int, max_blocks_per_seq: int, device: str = "cpu"):
        self.max_batch, self.max_tokens = int(max_batch), int(max_tokens)
        self.max_blocks_per_seq = int(max_blocks_per_seq)
        b, t = self.max_batch, self.max_tokens
        sizes = dict(input_ids=t, positions=t, slot_mapping=t, cu_seqlens_q=b + 1, cu_seqlens_k=b + 1,
                     query_lens=b, cache_seqlens=b, seqlens_k=b, logits_indices=b,
                     block_table=b * self.max_blocks_per_seq)
        total = sum(sizes.values())
        self.device = device
        self._done = None
        if device == CUDA:
            import cupy

            # Pinned host memory makes the upload an asynchronous DMA on the current stream.
            pinned = cupy.cuda.alloc_pinned_memory(4 * total)
            self._host = np.frombuffer(pinned, np.int32, total)
            self._device = cupy.empty(total, np.int32)
        else:
            self._host = np.empty(total, np.int32)
            self._device = np.empty(total, np.int32)
        self._host_views, self._device_views, offset = {}, {}, 0
        for name, size in sizes.items():
            shape = (b, self.max_blocks_per_seq) if name == "block_table" else (size,)
            self._host_views[name] = self._host[offset:offset + size].reshape(shape)
            self._device_views[name] = self._device[offset:offset + size].reshape(shape)
            offset += size

    def load(self, plan: StepPlan, batch_size: int | None = None, num_tokens: int | None = None) -> StepPlan:
        """Copy ``plan`` into the buffers, padded to ``batch_size`` sequences and ``num_tokens`` tokens.

        Padding sequences have no tokens, no cached keys and no blocks; padding tokens
        have slot -1 (cache writes skip them).  The block table keeps its full width.

        Returns
        -------
        StepPlan
            The same plan whose arrays are views of the (device) buffers.
        """
        batch_size = plan.batch_size if batch_size is None else int(batch_size)
        num_tokens = plan.num_tokens if num_tokens is None else int(num_tokens)
        b, t = plan.batch_size, plan.num_tokens
        if not (b <= batch_size <= self.max_batch and t <= num_tokens <= self.max_tokens):
            raise ValueError(f"the plan ({b} sequences, {t} tokens) padded to ({batch_size}, {num_tokens}) "
                             f"must fit the buffers ({self.max_batch}, {self.max_tokens})")
        width = plan.block_table.shape[1]
        if width > self.max_blocks_per_seq:
            raise ValueError(f"the plan's block table has {width} columns, more than {self.max_blocks_per_seq}")
        if self._done is not None:
            self._done.synchronize()  # the previous upload must have read the host buffer
        host = self._host_views
        fills = dict(input_ids=0, positions=0, slot_mapping=-1, query_lens=0, cache_seqlens=0,
                     seqlens_k=0, logits_indices=0)
        for name, fill in fills.items():
            value = getattr(plan, name)
            value = np.zeros(t, np.int32) if value is None else value
            host[name][:len(value)] = value
            host[name][len(value):] = fill
        for name in ("cu_seqlens_q", "cu_seqlens_k"):
            host[name][:b + 1] = getattr(plan, name)
            host[name][b + 1:] = getattr(plan, name)[-1]
        host["block_table"][:b, :width] = plan.block_table
        host["block_table"][:b, width:] = -1
        host["block_table"][b:] = -1
        if self.device == CUDA:
            import cupy

            self._device.set(self._host)
            self._done = cupy.cuda.get_current_stream().record()
        else:
            np.copyto(self._device, self._host)
        dev = self._device_views
        return dataclasses.replace(
            plan, input_ids=None if plan.input_ids is None else dev["input_ids"][:num_tokens],
            positions=dev["positions"][:num_tokens], slot_mapping=dev["slot_mapping"][:num_tokens],
            query_lens=dev["query_lens"][:batch_size], cache_seqlens=dev["cache_seqlens"][:batch_size],
            seqlens_k=dev["seqlens_k"][:batch_size], cu_seqlens_q=dev["cu_seqlens_q"][:batch_size + 1],
            cu_seqlens_k=dev["cu_seqlens_k"][:batch_size + 1], block_table=dev["block_table"][:batch_size],
            logits_indices=dev["logits_indices"][:len(plan.logits_indices)],
            seq_ids=plan.seq_ids + [None] * (batch_size - b),
            sample_mask=np.concatenate([plan.sample_mask, np.zeros(batch_size - b, bool)]))
