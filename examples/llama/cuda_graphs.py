"""Decode steps replayed as CUDA graphs (CuPy only; behind ``Engine(cuda_graphs=True)``).

A decode step of ``b`` sequences is padded to the smallest captured size ``B >= b`` and built
into one fixed :class:`cupy_paged.PlanBuffers`, so every step of that size finds its index
arrays at the same device addresses, and the graph captured for ``B`` (embedding, every layer,
final norm, LM head and each row's argmax, all ``B`` rows) replays over them.  Sampling other
than greedy runs after the replay (per-request parameters, uniforms drawn on the host).

Padding: ``build_plan(..., batch_size=B)`` pads with sequences that have no blocks, but the
decode kernel still appends one token per row, finds block id -1 at column 0 of each padding
row and records that in the device error word, so a later ``cupy_paged.check_errors()`` would
raise.  Instead the padding rows repeat one real sequence of this module's own (``PAD_ID``: one
block, one reserved slot, never computed): each writes the same token-0 K/V at position 0 of that
block and attends to it, and their logits rows are dropped.

Memory: every array made while warming up and capturing comes from a memory pool of this object's
own.  The intermediates a graph captured are freed back into that pool when the capture returns,
and only later warm-ups and captures reuse them, which is safe because all replays run one after
another on one stream; the logits each graph writes are kept alive with it.  The eager warm-up
before each capture loads the kernels and sizes the decode kernel's split-KV workspace for this
stream (a capture must not allocate it); it writes into the cache exactly what the replay then
writes again.
"""
from __future__ import annotations

import bisect

import numpy as np

import cupy_paged

from .timing import NoTimer


PAD_ID = ("llama.cuda_graphs", "padding")


class DecodePadding:
    """Decode plans padded to fixed batch sizes, built into one fixed set of plan buffers.

    Parameters
    ----------
    cache : cupy_paged.PagedAttentionCache
        Gives one block to the padding sequence ``PAD_ID`` for as long as this object is used.
    sizes : list of int
        The batch sizes a step pads to.
    num_heads : int, optional
        The model's query heads: the plans take the ragged launch (its work list of fixed
        capacity in the buffers, the keys shared out by length) instead of the decode kernel
        (one CTA per sequence and kv head, splits by the longest possible sequence).

    Examples
    --------
    >>> cache = cupy_paged.PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=4, dtype="float32", device="cpu")
    >>> _ = cache.allocate("a", [1, 2, 3]); cache.mark_computed(["a"], [3]); cache.grow(["a"], 1)
    >>> plan = DecodePadding(cache, [4]).plan(["a"], [9])
    >>> plan.path, plan.input_ids.tolist(), plan.cache_seqlens.tolist(), plan.block_table[:, 0].tolist()
    ('decode', [9, 0, 0, 0], [3, 0, 0, 0], [0, 1, 1, 1])
    """

    def __init__(self, cache, sizes, num_heads: int | None = None):
        self.cache, self.sizes, self.num_heads = cache, sorted(set(sizes)), num_heads
        device = "cpu" if cache.device == "cpu" else "cuda"
        group = None if num_heads is None else num_heads // cache.num_kv_heads
        self.buffers = cupy_paged.PlanBuffers(max_batch=self.sizes[-1], max_tokens=self.sizes[-1],
                                              max_blocks_per_seq=cache.max_blocks_per_seq, device=device,
                                              query_group=group)
        self.path = "decode" if num_heads is None else "ragged"
        if PAD_ID not in cache:
            cache.allocate(PAD_ID, [0])
        self._pad_row = int(cache.rows([PAD_ID])[0])  # its row until release()

    def size_for(self, batch: int) -> int | None:
        """The size a decode batch of ``batch`` pads to, or None when it is too large."""
        at = bisect.bisect_left(self.sizes, batch)
        return self.sizes[at] if at < len(self.sizes) else None

    def plan(self, seq_ids: list, input_ids: list, size: int | None = None, rows=None):
        """The decode plan of ``seq_ids`` (one new token each, slots reserved) padded to ``size``
        rows (default ``size_for(len(seq_ids))``); row ``i < len(seq_ids)`` is ``seq_ids[i]``.
        ``rows``: their cache rows (``cache.rows(seq_ids)``) when the caller has them."""
        size = self.size_for(len(seq_ids)) if size is None else size
        if size is None or size < len(seq_ids):
            raise ValueError(f"a decode batch of {len(seq_ids)} is larger than the largest size {self.sizes[-1]}")
        pad = size - len(seq_ids)
        ids = np.zeros(size, np.int32)
        ids[:len(seq_ids)] = input_ids
        if rows is not None:
            rows = np.concatenate([rows, np.full(pad, self._pad_row, rows.dtype)])
        return cupy_paged.build_plan(self.cache, list(seq_ids) + [PAD_ID] * pad, 1, ids, rows=rows,
                                     buffers=self.buffers, num_heads=self.num_heads, path=self.path)

    def release(self) -> None:
        """Give the padding sequence's block back to the cache."""
        if PAD_ID in self.cache:
            self.cache.free(PAD_ID)


def default_sizes(max_batch: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, then every 8 up to 64, every 16 beyond, ending at ``max_batch``.

    Examples
    --------
    >>> default_sizes(40)
    [1, 2, 4, 8, 16, 24, 32, 40]
    """
    sizes = [s for s in (1, 2, 4) if s < max_batch]
    size = 8
    while size < max_batch:
        sizes.append(size)
        size += 8 if size < 64 else 16
    return sizes + [max_batch]


class DecodeGraphs:
    """One CUDA graph per padded decode batch size, captured on first use.

    Parameters
    ----------
    model : llama.model.LlamaModel
        On CuPy arrays.
    cache : cupy_paged.PagedAttentionCache
        The engine's cache (its layer arrays never move, so a graph may hold their addresses).
    stream : cupy.cuda.Stream
        A non-blocking stream that every step of the engine runs on (capture needs one).
    max_batch : int
        Largest decode batch (the scheduler's ``max_num_seqs``).
    sizes : list of int, optional
        Batch sizes to capture (default :func:`default_sizes`).
    ragged : bool
        Attention through the ragged launch instead of the decode kernel (:class:`DecodePadding`).
    tune_products : bool
        Before capturing a size, time cuBLAS's candidate kernels for that size's products and
        capture the fastest (``LlamaModel.tune_products``); off: the model's products as they are
        (cuBLAS's default kernels, or what was tuned before).
    """

    def __init__(self, model, cache, stream, max_batch: int, sizes=None, ragged: bool = False,
                 tune_products: bool = False):
        import cupy

        self.model, self.cache, self.stream = model, cache, stream
        self.tune_products = tune_products
        heads = model.config.num_attention_heads if ragged else None
        self.padding = DecodePadding(cache, sizes or default_sizes(max_batch), heads)
        self.pool = cupy.cuda.MemoryPool()
        self.graphs: dict = {}  # size -> (graph, logits [size, vocab] float32, argmax [size] int64 it writes)
        self.replays = 0

    def size_for(self, batch: int) -> int | None:
        """The captured size a decode batch of ``batch`` pads to, or None when it is too large."""
        return self.padding.size_for(batch)

    def plan(self, seq_ids: list, input_ids, rows=None) -> "cupy_paged.StepPlan | None":
        """The padded plan of a decode step of ``seq_ids`` (one new token each, slots reserved;
        ``rows`` their cache rows when known), built into the graphs' buffers, or None when the
        batch is larger than every size.  ``plan.graph_rows`` is ``len(seq_ids)``: the rows after
        it are padding."""
        if self.padding.size_for(len(seq_ids)) is None:
            return None
        plan = self.padding.plan(seq_ids, input_ids, rows=rows)
        plan.graph_rows = len(seq_ids)
        return plan

    def replay(self, plan):
        """Replay the graph of ``plan`` (from :meth:`plan`; captured on first use).

        Returns
        -------
        (cupy.ndarray, cupy.ndarray)
            ``[rows, vocab]`` float32 logits and ``[rows]`` int64 argmax of each row, views of the
            graph's outputs: read them (in stream order) before the next replay of this size.
        """
        size, b = plan.batch_size, plan.graph_rows
        if size not in self.graphs:
            self.graphs[size] = self._capture(plan)
        graph, logits, tokens = self.graphs[size]
        graph.launch(stream=self.stream)
        self.replays += 1
        return logits[:b], tokens[:b]

    def capture_all(self) -> None:
        """Capture every size now (over plans of padding rows only), before a timed run."""
        for size in self.padding.sizes:
            if size not in self.graphs:
                self.graphs[size] = self._capture(self.padding.plan([], [], size))

    def _capture(self, plan):
        """Warm up, then capture the model's decode step over ``plan`` (the buffers' views) and
        each row's argmax."""
        import cupy

        from .sampling import row_argmax

        if self.tune_products:
            self.model.tune_products(plan.batch_size)
        with cupy.cuda.using_allocator(self.pool.malloc):
            row_argmax(self.model.forward(plan, self.cache, NoTimer(), all_rows=True))
            self.stream.synchronize()
            self.stream.begin_capture()
            try:
                logits = self.model.forward(plan, self.cache, NoTimer(), all_rows=True)
                tokens = row_argmax(logits)
            finally:
                graph = self.stream.end_capture()
        return graph, logits, tokens
