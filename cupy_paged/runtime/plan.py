"""The step plan: host metadata built once per step and reused by every layer.

FlashInfer's plan/run split: ``build_plan`` turns "these sequences, this many new
tokens each" into every index array the kernels need; ``StepPlan.attention`` runs
one layer from it.  ``PlanBuffers`` (``buffers.py``) keeps fixed device buffers so a
captured CUDA graph can be replayed with each step's plan copied in by one transfer.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from .._core.arrays import _KIND_OF_TYPE, CUDA, CUPY, TORCH, kind_of, memo_lookup, to_host
from .._core.paging import gather_slots
from ..api._call import current_device, on_device
from ._calls import layer_through_calls
from ._fill import UNKNOWN_ROW, check_reserved, decode_plan_fields, fill_plan, query_lengths
from ._layer import LayerLaunch
from ._work import DECODE, RAGGED, SPLIT, VARLEN, choose_path, final_path, fill_work, plan_work
from .buffers import PlanBuffers, layout, views

__all__ = ["StepPlan", "build_plan", "PlanBuffers", "DECODE", "VARLEN", "RAGGED", "SPLIT"]

# The keyword arguments StepPlan.attention passes on (the ragged launch takes them itself).
_STEP_OPTIONS = frozenset({"softcap", "window_size", "alibi_slopes"})


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
    query_lens : array
        ``[batch]`` int32 new tokens of each sequence.
    cache_seqlens : array
        ``[batch]`` int32 tokens already cached: each sequence's ``num_computed``, under the
        name of the ``flash_attn_with_kvcache`` argument it is passed as.
    seqlens_k : array
        ``[batch]`` int32 ``cache_seqlens + query_lens``.
    cu_seqlens_q, cu_seqlens_k : array
        ``[batch + 1]`` int32 prefix sums of ``query_lens`` and ``seqlens_k``.
    max_seqlen_q, max_seqlen_k : int
        Longest query and key length.
    slot_mapping : array
        ``[num_tokens]`` int32 cache slot (``block * block_size + offset``) of each new token.
    block_table : array
        ``[batch, max_blocks]`` int32, -1 padded.
    work, num_items, num_slots : array, int, int
        The ``"ragged"`` launch's work list (``runtime/_work.py``), items, split rows' slots.
    logits_indices : array
        ``[num_sampled]`` int32 rows of the model output to sample: the last token of each
        sequence that finishes its prompt (or decodes) this step.
    sample_mask : numpy.ndarray
        ``[batch]`` bool, which sequences sample.
    path : str
        ``"ragged"``: one launch of the work-list kernel for the whole step, whatever its mix
        (the plan was built with ``num_heads`` and the step is not prefill-heavy, see
        ``build_plan``); ``"decode"`` when ``cupy_paged.api.decode.serves_step`` says the decode
        kernel (``flash_attn_with_kvcache``) takes the step: one new token per row, as many tokens
        as rows, padding counted; ``"split"`` when the step starts with one-token rows (the
        scheduler's decodes) followed by longer ones: the decode kernel takes the first
        ``num_split`` rows and the paged varlen kernel the rest (two launches, so no one-token row
        fills a prefill tile); ``"varlen"`` otherwise (paged ``flash_attn_varlen_func``).
    block_size : int
    sample_requests : list or None
        Set by ``cupy_paged.Scheduler``: ``[num_samples]`` the request each sampled token is for
        (its ``sampling`` parameters, its ``sample_index`` among parallel samples).
    sample_rows : numpy.ndarray or None
        Set by ``cupy_paged.Scheduler``: ``[num_samples]`` which row of ``logits_indices`` each
        sample reads (a prompt of ``n`` parallel samples is read ``n`` times); None: each once.
    num_split : int
        On the ``"split"`` path, the leading one-token rows the decode kernel takes; else 0.
    read_index : numpy.ndarray
        ``[sum(seqlens_k)]`` int32 cache slot of every key of every sequence, in order: the
        ``read_index`` of ``PagedAttentionCache.update`` (built on first use).
    tail_cu_seqlens_q : array
        ``[batch + 1 - num_split]`` int32 prefix sums of the query lengths of the rows after the
        first ``num_split``, from 0 (``cu_seqlens_q`` itself when ``num_split`` is 0).
    num_decodes : int or None
        Set by ``cupy_paged.Scheduler``: the first ``num_decodes`` sequences decode (one
        generated token each); the rest feed prompt (or recomputed) tokens.
    input_ids_pending : bool
        Set by ``cupy_paged.Scheduler.schedule_ahead``: the step was scheduled before the
        previous step's tokens were known, so ``input_ids`` hold zeros; row ``i`` feeds the
        previous step's sampled token ``i``, which the caller writes into ``input_ids`` on the
        device before the forward pass.
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
    tail_cu_seqlens_q: object = None
    num_split: int = 0
    sample_requests: list | None = None
    sample_rows: np.ndarray | None = None
    num_decodes: int | None = None
    input_ids_pending: bool = False
    work: object = None
    num_items: int = 0
    num_slots: int = 0

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

        Built on first use (once per step): only the manual gather/scatter path needs it."""
        table = np.asarray(to_host(self.block_table))
        lengths = np.asarray(to_host(self.seqlens_k), np.int64)
        out = np.empty(int(lengths.sum()), np.int32)
        gather_slots(table, np.arange(table.shape[0]), np.zeros_like(lengths), lengths, self.block_size, out)
        return out

    def attention(self, q, k, v, k_cache, v_cache, softmax_scale=None, *, out=None, stream=None, **kwargs):
        """Causal attention of one layer for this step, through the plan's kernel path.

        Writes the new ``k``/``v`` into the paged caches and attends each new token to its sequence's
        cached and new keys.  On the GPU the launch of each layer shape is resolved once per step (the
        first layer, on q's device); every further layer reads its arrays' pointers and launches.

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
            ``softcap``, ``window_size``, ``alibi_slopes`` (``[num_heads]`` or ``[batch, num_heads]``): the
            ragged launch takes them itself; the other paths pass them to the public functions, resolved
            per call.  Any other keyword is a ``TypeError`` before any work.

        Returns
        -------
        array
            ``[num_tokens, num_heads, head_dim]``, of the caller's kind.

        Examples
        --------
        >>> import numpy as np; from cupy_paged import PagedAttentionCache, build_plan
        >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=4, dtype="float32", device="cpu")
        >>> cache.allocate("a", list(range(5)))
        0
        >>> plan = build_plan(cache, ["a"], [5])
        >>> x = np.ones((5, 1, 32), np.float32)
        >>> plan.attention(x, x, x, *cache.layer(0)).shape
        (5, 1, 32)
        """
        kind = _KIND_OF_TYPE.get(type(q)) or kind_of(q)
        fast = kind is TORCH or kind is CUPY
        alibi = kwargs.get("alibi_slopes")
        if kwargs and not _STEP_OPTIONS.issuperset(kwargs):
            raise TypeError(f"StepPlan.attention got unexpected keyword arguments {sorted(set(kwargs) - _STEP_OPTIONS)}"
                            f" (it takes {sorted(_STEP_OPTIONS)})")
        # The ragged launch takes softcap, window and ALiBi itself, so its layers are resolved once per
        # step with them too; the other paths hand keyword arguments to the public functions.
        if fast and (not kwargs or self.path == RAGGED):
            key, layer, ptr = memo_lookup(self._layers, kind, _layer_key, q, k, v, k_cache, v_cache, out,
                                          softmax_scale, kwargs)
            if key is not None and 0 <= key[0][3] != current_device():  # built and launched on q's device
                with on_device(key[0][3]):
                    return self.attention(q, k, v, k_cache, v_cache, softmax_scale, out=out, stream=stream, **kwargs)
            # A torch CPU tensor (its key's device -1 finds no launch) takes the CPU backend below.
            if layer is None and key is not None and (kind is CUPY or q.is_cuda):
                layer = LayerLaunch(self, q, k, v, k_cache, v_cache, softmax_scale, out, **kwargs)
                self._layers[key] = layer
            if layer is not None:
                return layer.run(kind, q, k, v, k_cache, v_cache, out, stream, alibi, ptr)
        # Index arrays built by build_plan are consistent: no host checks.  Arguments that key no
        # memo (and the CPU backend) take the public functions, path by path (_calls.py).
        if self.path == RAGGED and fast and (kind is CUPY or q.is_cuda):
            return LayerLaunch(self, q, k, v, k_cache, v_cache, softmax_scale, out, **kwargs).run(
                kind, q, k, v, k_cache, v_cache, out, stream, alibi)
        return layer_through_calls(self, kind, q, k, v, k_cache, v_cache, softmax_scale, out, stream, kwargs)

    @functools.cached_property
    def _layers(self) -> dict:
        return {}


def _layer_key(s, q, k, v, k_cache, v_cache, out, softmax_scale, kwargs) -> tuple:
    """What decides a layer's launches, its arrays read by ``s`` (``memo_lookup``); the scalars'
    types too (``softmax_scale=True`` equals 1.0 and ``window_size=(8.0, 0)`` equals ``(8, 0)``, which
    the checks refuse)."""
    options = () if not kwargs else tuple(
        (name, s(value) if name == "alibi_slopes" and value is not None else value, value.__class__,
         tuple(map(type, value)) if isinstance(value, tuple) else ())
        for name, value in sorted(kwargs.items()))
    return (s(q), s(k), s(v), s(k_cache), s(v_cache), None if out is None else s(out), softmax_scale,
            softmax_scale.__class__, options)


def build_plan(cache, seq_ids, query_lens, input_ids=None, sample_mask=None, rows=None,
               buffers: "PlanBuffers | None" = None, batch_size: int | None = None,
               num_tokens: int | None = None, num_heads: int | None = None, path: str | None = None) -> StepPlan:
    """Build the step plan for sequences whose new tokens already have reserved slots.

    Each sequence ``s`` contributes ``query_lens[i]`` tokens at positions
    ``cache.num_computed(s) ..``; reserve them first with ``allocate`` / ``grow``.  The cache
    is read through ``cache.plan_view(rows)`` only.

    Parameters
    ----------
    cache : PagedAttentionCache
        The cache the sequences live in.
    seq_ids : sequence
        ``[batch]`` sequence ids, in the order the model sees them.  An id listed more than once
        (the padding rows of a CUDA-graph batch, all pointed at one spare sequence) gives rows
        that write the same slots: only for rows whose results are dropped.
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
    num_heads : int, optional
        Query heads of the model.  Given, the plan lists the work of one ragged launch
        (``runtime/_work.py``) and takes the ``"ragged"`` path for every step whose prefill
        work hides behind its K/V reads (decode-only, mixed with short chunks); prefill-heavy
        steps keep the prefill kernels (``"split"`` or ``"varlen"``).  ``buffers`` must have
        been made with ``query_group = num_heads // num_kv_heads``.
    path : {"ragged", "decode", "split", "varlen"}, optional
        Take this path whatever the step (``"ragged"`` needs ``num_heads``; ``"decode"`` a
        step the decode kernel serves; ``"split"`` a step that starts with one-token rows and
        has a longer one after them).

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
    >>> from cupy_paged import PagedAttentionCache, build_plan
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
    if (buffers is not None and sample_mask is None and type(query_lens) is int and query_lens == 1
            and (path == DECODE or (path is None and num_heads is None)) and rows.size):
        fields = decode_plan_fields(cache, seq_ids, rows, input_ids, buffers, batch_size, num_tokens)
        if fields is not None:
            return StepPlan(**fields)
    view = cache.plan_view(rows)
    batch = rows.size
    query = query_lengths(query_lens, batch)
    check_reserved(seq_ids, view, query)
    tokens = int(query.sum())
    packed = places = None
    path, ragged = choose_path(cache, query, view.num_computed, num_heads, path, buffers)
    counts = (0, 0)  # items, slots of the work list
    if ragged is not None:
        outline = plan_work(query, view.num_computed, *ragged)
        counts = outline[2:]
    if buffers is None:
        if batch_size is not None or num_tokens is not None:
            raise ValueError("batch_size and num_tokens pad a plan into buffers; pass buffers too")
        batch_size, num_tokens = batch, tokens
        width = -(-int((view.num_computed + query).max(initial=0)) // view.block_size)
        packed, places, out, memo_rows, memo_versions = _new_arrays(batch, tokens, width, counts[0])
    else:
        batch_size = batch if batch_size is None else int(batch_size)
        num_tokens = tokens if num_tokens is None else int(num_tokens)
        out, memo_rows, memo_versions = buffers.host_views(batch, tokens, batch_size, num_tokens,
                                                           view.max_blocks_per_seq)
    max_q, max_k = fill_plan(
        view.tables, view.table_versions, rows, view.num_computed, query, view.block_size,
        out["positions"], out["slot_mapping"], out["cu_seqlens_q"], out["cu_seqlens_k"],
        out["query_lens"], out["cache_seqlens"], out["seqlens_k"], out["block_table"],
        memo_rows, memo_versions)
    if ragged is not None:
        group, tile = ragged[:2]
        filled = fill_work(query, view.num_computed, group, tile, *outline[:3], out["work"],
                           1 << 62 if buffers is None else buffers.work_filled)
        if buffers is not None:  # the launch covers the whole list: padding items do nothing
            buffers.work_filled = filled
            counts = buffers.work_capacity
    _write_input_ids(out["input_ids"], input_ids, tokens)
    sample_mask, num_sampled = _write_logits_indices(out["logits_indices"], out["cu_seqlens_q"], sample_mask, batch)
    path, num_split = final_path(path, query, batch_size, num_tokens, int(max_q))
    cu_q, tail = out["cu_seqlens_q"], out["tail_cu_seqlens_q"]
    np.subtract(cu_q[num_split:], num_split, out=tail[:batch_size + 1 - num_split])
    out = _device_side(out, packed, places, buffers, view.device, batch_size, num_tokens)
    out["tail_cu_seqlens_q"] = out["tail_cu_seqlens_q"][:batch_size + 1 - num_split]
    out["logits_indices"] = out["logits_indices"][:num_sampled]
    if input_ids is None:
        out["input_ids"] = None
    if batch_size > batch:  # padding sequences: no id, no sample
        sample_mask = np.concatenate([sample_mask, np.zeros(batch_size - batch, bool)])
        seq_ids = seq_ids + [None] * (batch_size - batch)
    work = out.pop("work", None)
    return StepPlan(seq_ids=seq_ids, max_seqlen_q=int(max_q), max_seqlen_k=int(max_k), sample_mask=sample_mask,
                    path=path, block_size=view.block_size, work=work, num_items=counts[0], num_slots=counts[1],
                    num_split=num_split, **out)


def _new_arrays(batch: int, tokens: int, width: int, items: int = 0):
    """An unpadded plan's host arrays, views of one flat buffer, and a row memo that knows no row:
    ``(buffer, places, arrays, memo_rows, memo_versions)``."""
    places, total = layout(batch, tokens, width, items)
    packed = np.empty(total, np.int32)
    return packed, places, views(packed, places), np.full(batch, UNKNOWN_ROW, np.int64), np.zeros(batch, np.int64)


def _device_side(out: dict, packed, places, buffers, device: str, batch_size: int, num_tokens: int) -> dict:
    """The plan's arrays where the kernels read them, each side in one transfer: the buffers'
    device views, a new device buffer for a cache on the GPU, or the host arrays themselves."""
    if buffers is not None:
        return buffers.upload(batch_size, num_tokens)
    if device == CUDA:
        import cupy

        return views(cupy.asarray(packed), places)
    return out


def _write_input_ids(out: np.ndarray, input_ids, tokens: int) -> None:
    """The step's token ids into the plan's host array, padding tokens 0."""
    if input_ids is None:
        return
    input_ids = np.asarray(input_ids)
    if input_ids.shape != (tokens,):
        raise ValueError(f"input_ids must have shape [num_tokens = {tokens}]; got {input_ids.shape}")
    out[:tokens] = input_ids
    out[tokens:] = 0


def _write_logits_indices(out: np.ndarray, cu_seqlens_q: np.ndarray, sample_mask, batch: int):
    """The last token of each sampling sequence into ``out``, the rest 0; returns the
    ``[batch]`` sample mask and the number of sampling sequences."""
    ends = cu_seqlens_q[1:batch + 1]
    if sample_mask is None:
        sample_mask, num_sampled = np.ones(batch, bool), batch
        np.subtract(ends, 1, out=out[:batch])
    else:
        sample_mask = np.asarray(sample_mask, bool)
        num_sampled = int(np.count_nonzero(sample_mask))
        out[:num_sampled] = ends[sample_mask] - 1
    out[num_sampled:] = 0
    return sample_mask, num_sampled
