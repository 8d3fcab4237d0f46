"""Fixed plan buffers, and where a plan's index arrays lie in one flat int32 buffer.

One flat buffer per plan is what moves a plan to the device in one transfer; fixed
buffers keep the arrays' addresses, which a captured CUDA graph replays with.
"""
from __future__ import annotations

import math

import numpy as np

from .._core.arrays import CUDA
from ._fill import UNKNOWN_ROW

__all__ = ["PlanBuffers", "layout", "views"]

# The ragged work list of fixed buffers: workspace slots of split row groups at most; a step that
# would split more splits less (runtime/_work.py).
SPLIT_SLOTS = 512
_WHOLE = ("work",)  # kept at full capacity in every plan: a captured graph's grid is the list's capacity


def layout(batch: int, tokens: int, width: int, items: int = 0) -> tuple[dict, int]:
    """Where the plan's int32 index arrays lie in one flat buffer, name -> (start, stop, shape), and
    the buffer's length (so that a plan moves to the device in one transfer).  ``items``: the rows
    of a ragged plan's work list (8 ints each, first so that its 32-byte rows stay 16-byte
    aligned); none without it.

    Built every step: ``math.prod`` here, as ``np.prod`` costs microseconds on a small tuple.
    """
    shapes = dict(work=(items, 8)) if items else {}
    shapes.update(input_ids=(tokens,), positions=(tokens,), slot_mapping=(tokens,),
                  cu_seqlens_q=(batch + 1,), cu_seqlens_k=(batch + 1,), query_lens=(batch,),
                  cache_seqlens=(batch,), seqlens_k=(batch,), logits_indices=(batch,),
                  tail_cu_seqlens_q=(batch + 1,),
                  block_table=(batch, width))  # last, so an upload of fewer rows stops early
    places, total = {}, 0
    for name, shape in shapes.items():
        stop = total + math.prod(shape)
        places[name] = (total, stop, shape)
        total = stop
    return places, total


def views(buffer, places: dict) -> dict:
    """The named arrays of a flat buffer laid out by :func:`layout`."""
    return {name: buffer[start:stop].reshape(shape) for name, (start, stop, shape) in places.items()}


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
    query_group : int, optional
        Query heads per kv head.  Given, the buffers also hold a ragged work list of fixed
        capacity (``build_plan(..., num_heads=...)`` fills it, padding with items that do
        nothing), so that a ragged step is captured and replayed as a CUDA graph with any mix
        of the same maxima: split row groups over at most ``SPLIT_SLOTS`` workspace slots.

    Examples
    --------
    >>> from cupy_paged import PagedAttentionCache, PlanBuffers, build_plan
    >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=8, device="cpu")
    >>> _ = cache.allocate("a", list(range(3)))
    >>> buffers = PlanBuffers(max_batch=4, max_tokens=8, max_blocks_per_seq=cache.max_blocks_per_seq)
    >>> plan = build_plan(cache, ["a"], [3], buffers=buffers, batch_size=2, num_tokens=4)
    >>> plan.cu_seqlens_q.tolist(), plan.slot_mapping.tolist(), plan.block_table.shape
    ([0, 3, 3], [0, 1, 2, -1], (2, 8))
    """

    def __init__(self, max_batch: int, max_tokens: int, max_blocks_per_seq: int, device: str = "cpu",
                 query_group: int | None = None):
        self.max_batch, self.max_tokens = int(max_batch), int(max_tokens)
        self.max_blocks_per_seq = int(max_blocks_per_seq)
        self.device = device
        self.query_group = None if query_group is None else int(query_group)
        self._done = None
        items = 0
        if self.query_group is not None:
            # Every row group of the most tokens, one per sequence more, and the split items.
            items = -(-self.query_group * self.max_tokens // 16) + self.max_batch + SPLIT_SLOTS
        # (most items, slots) the plan may use; the ragged launch's grid is the items x kv heads.
        self.work_capacity = (items, SPLIT_SLOTS)
        self.work_filled = items  # rows of the work list the last plan wrote
        places, total = layout(self.max_batch, self.max_tokens, self.max_blocks_per_seq, items)
        self._table_offset = places["block_table"][0]  # the last array: an upload stops early
        if device == CUDA:
            import cupy

            # Pinned host memory makes the upload an asynchronous DMA on the current stream.
            pinned = cupy.cuda.alloc_pinned_memory(4 * total)
            self._host = np.frombuffer(pinned, np.int32, total)
            self._host[:] = 0  # the work list's padding rows are zeros from the start (work_filled)
            self._device = cupy.empty(total, np.int32)
        else:
            self._host = self._device = np.zeros(total, np.int32)
        self._host_views = views(self._host, places)
        self._device_views = views(self._device, places)
        self._memo_rows = np.full(self.max_batch, UNKNOWN_ROW, np.int64)
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
            arrays = self._host_views if side == "host" else self._device_views
            lengths = dict(input_ids=num_tokens, positions=num_tokens, slot_mapping=num_tokens,
                           cu_seqlens_q=batch_size + 1, cu_seqlens_k=batch_size + 1,
                           tail_cu_seqlens_q=batch_size + 1)
            self._slices[key] = {name: view if name in _WHOLE else view[:lengths.get(name, batch_size)]
                                 for name, view in arrays.items()}
        return self._slices[key]
