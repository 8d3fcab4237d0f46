"""Launch glue of ``decode.cu``'s ``RAGGED`` specialization: one launch for a whole step.

A continuous-batching step mixes prefill chunks, one-token decodes and short multi-token rows.
``paged_decode`` with ``RAGGED=1`` takes them all in one launch over the packed tokens
(``q`` ``[T, H, D]``, the new keys and values ``[T, Hkv, D]``), one CTA per (work item, kv head):
the step plan lists the items on the host (``runtime/_work.py``) and uploads them with its other
index arrays.  Each item appends its share of the new tokens to the paged cache and attends its
rows; the sequences split over several items are merged by ``combine_ragged`` (a second launch,
only when some sequence is split).  Both launches read the item list's pointer and count from the
plan, so a CUDA graph replays them with another list of the same length.
"""
from __future__ import annotations

from .._core.errors import word
from .._core.types import alibi_batch_stride, element_strides
from .._core.compiler import get_function
from ._launch import Launcher
from ._workspace import split_workspace
from .decode import _DECODE_LAYOUT, COMBINE_THREADS, ROWS_PER_CTA, TILES, kernel_key, slots

_RAGGED_LAYOUT = _DECODE_LAYOUT + "P"  # paged_decode's arguments, then the work list
# combine_ragged(entries, part_out, part_lse, num_heads, total_q, out, lse)
_COMBINE_LAYOUT = "PPPiiPP"


def tile_keys(head_dim: int) -> int:
    """Keys per pipeline stage of the ragged kernel (the plan's split ranges are whole tiles)."""
    return TILES[head_dim].keys


def slots_per_head(device: int, dtype, head_dim: int, num_kv_heads: int) -> int:
    """CTA slots of one wave per kv head: what the plan shares the keys out over."""
    return max(1, slots(device, dtype, head_dim, TILES[head_dim], ragged=True) // max(num_kv_heads, 1))


def workspace_floats(slots: int, num_kv_heads: int, head_dim: int) -> int:
    """Floats of the split workspace: each slot's partial rows ``[Hkv][16][D]`` and their LSEs."""
    return slots * num_kv_heads * ROWS_PER_CTA * (head_dim + 1)


class RaggedLaunch:
    """One layer shape of a ragged step, resolved: kernels, scalars packed once; :meth:`run` adds
    the pointers and launches.

    Parameters
    ----------
    q : Array
        ``[T, H, D]`` with 16-byte aligned rows.
    k_cache : Array
        ``[num_blocks, block_size, Hkv, D]``.
    k_new, v_new : Array or None
        ``[T, Hkv, D]``: the query tokens' keys and values, appended to the cache; None when the
        cache already holds them (query token i of a sequence is then its key cached - q_len + i).
    max_blocks : int
        Block table width.
    softmax_scale, softcap : float
    window : tuple of int
    alibi_slopes : Array or None
    """

    def __init__(self, q, k_cache, k_new, v_new, max_blocks: int, softmax_scale: float, window=(-1, -1),
                 softcap: float = 0.0, alibi_slopes=None):
        total, num_heads, head_dim = (int(x) for x in q.shape)
        num_blocks, block_size, num_kv_heads = (int(x) for x in k_cache.shape[:3])
        self.device, self.dtype = q.device, q.dtype
        self.out_shape, self.lse_shape = (total, num_heads, head_dim), (num_heads, total)
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        tiles = TILES[head_dim]
        self.threads, self.smem = tiles.threads, tiles.smem_bytes(head_dim)
        key = kernel_key(q.dtype, head_dim, ragged=True)
        decode = get_function(key, "paged_decode", self.smem)
        q_strides = tuple(int(s) for s in element_strides(q)[:2])
        kn = tuple(int(s) for s in element_strides(k_new)[:2]) if k_new is not None else (0, 0)
        vn = tuple(int(s) for s in element_strides(v_new)[:2]) if v_new is not None else (0, 0)
        left, right = window
        params = [0, *q_strides, 0, *kn, 0, *vn, max_blocks, num_blocks, block_size.bit_length() - 1, 0,
                  total, int(k_new is not None), num_heads, num_kv_heads, 0, 0, left, right, 0, 0, 0, 0, 0,
                  alibi_batch_stride(alibi_slopes), 0, 0, float(softmax_scale), float(softcap)]
        self.launch = Launcher(decode, _RAGGED_LAYOUT)
        self.launch.pack(*params, *([0] * 20))
        self._pointer_span = self.launch.span(len(params), 20)
        self.combine = Launcher(get_function(key, "combine_ragged"), _COMBINE_LAYOUT)
        self.num_heads, self.total = num_heads, total
        self.errors = word(self.device)

    def run(self, ptrs: tuple, work: tuple, out_ptr: int, lse_ptr: int, stream: int) -> None:
        """Launch on ``stream``.  ``ptrs``: q, k_cache, v_cache, k_new, v_new, block_table,
        alibi_slopes (0 for none); ``work``: (work pointer, items, entries pointer, entries,
        slots) of the plan."""
        q, k_cache, v_cache, k_new, v_new, table, alibi = ptrs
        work_ptr, items, entries_ptr, entries, slots = work
        if items == 0:
            return
        part_out = part_lse = 0
        if entries:
            floats = workspace_floats(slots, self.num_kv_heads, self.head_dim)
            part_out = split_workspace(floats, self.device, stream).data.ptr
            part_lse = part_out + 4 * slots * self.num_kv_heads * ROWS_PER_CTA * self.head_dim
        struct_, at = self._pointer_span
        self.launch.launch((items, self.num_kv_heads, 1), self.threads, self.smem, stream,
                           (struct_, at, (q, k_cache, v_cache, k_cache, v_cache, k_new, v_new, 0, table, 0, 0,
                                          0, 0, alibi, out_ptr, lse_ptr, part_out, part_lse, self.errors,
                                          work_ptr)))
        if entries:
            self.combine((entries, self.num_kv_heads, ROWS_PER_CTA), COMBINE_THREADS, 0, stream, entries_ptr, part_out,
                         part_lse, self.num_heads, self.total, out_ptr, lse_ptr)
