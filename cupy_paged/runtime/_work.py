"""The work list of a step's one ragged launch (``decode.cu`` with ``RAGGED=1``), built on the host.

The plan knows every sequence's query length and cached keys on the host, so it lists the
kernel's CTAs itself: one item per (sequence, row group, split of its keys), 8 int32 each (the
kernel's ``WorkItem``: b, row group, split, splits, first token, query length, cached keys, first
workspace slot).  A row group is 16 (query head of a kv head's group, query token) rows, so a
decode's whole GQA group shares one read of its K/V.

Balancing: every item should read about the same bytes.  The keys of all row groups together,
shared out over two waves of CTA slots per kv head, give the range an item covers (at least four
tiles); a sequence with more than 1.5 such ranges is split into ranges of that size, unless no
sequence holds more than 1.5 times the keys one wave of slots would give each (a batch about level
enough to run unsplit in one wave, where splits only add a wave and the merges); its partial
rows merged by LSE by the split CTA that finishes last (``decode.cu`` ``merge_if_last``).  Items go
longest first, so the long ones start early and the short ones fill in behind them.
"""
from __future__ import annotations

import functools

import numba
import numpy as np

from .._core.arrays import CUDA
from .._core.types import HEAD_DIMS
from ..api.decode import serves_step
# The rule's constants are the kernels' (decode.cu's build_list builds the same list on the device).
from ..kernels.ragged import MAX_SPLITS, MIN_SPLIT_TILES, ROWS, WAVES, WORK_INTS  # noqa: F401 (re-exported)

# StepPlan.path values (runtime/_layer.py spells them too).
DECODE, VARLEN, RAGGED, SPLIT = "decode", "varlen", "ragged", "split"
PATHS = (DECODE, VARLEN, RAGGED, SPLIT)


@numba.njit(cache=True, nogil=True)
def _row_groups(query_lens, group):
    out = np.empty(query_lens.shape[0], np.int64)
    for b in range(query_lens.shape[0]):
        out[b] = (group * query_lens[b] + ROWS - 1) // ROWS
    return out


@numba.njit(cache=True, nogil=True)
def _splits(query_lens, cached, row_groups, tile_keys, slots_per_head, max_items, max_slots):
    """Each sequence's split count: ranges of one common size, fewer splits when the items would
    not fit ``max_items`` or the split rows ``max_slots`` workspace slots."""
    batch = query_lens.shape[0]
    total = 0
    base_items = 0
    longest = 0
    for b in range(batch):
        total += row_groups[b] * (cached[b] + query_lens[b])
        base_items += row_groups[b]
        if row_groups[b]:
            longest = max(longest, cached[b] + query_lens[b])
    splits = np.ones(batch, np.int64)
    # Level enough for one wave (the longest at most 1.5 times one wave's share): nothing splits.
    if 2 * longest <= 3 * -(-total // max(slots_per_head, 1)):
        return splits
    chunk = max(MIN_SPLIT_TILES * tile_keys, -(-total // max(WAVES * slots_per_head, 1)))
    while True:
        chunk = -(-chunk // tile_keys) * tile_keys
        items = slots = 0
        for b in range(batch):
            keys = cached[b] + query_lens[b]
            n = 1
            if 2 * keys > 3 * chunk:  # a range up to 1.5 chunks stays whole
                n = min(-(-keys // chunk), MAX_SPLITS)
            splits[b] = n
            items += row_groups[b] * n
            if n > 1:
                slots += row_groups[b] * n
        if (items <= max_items and slots <= max_slots) or items == base_items:
            return splits
        chunk *= 2


@numba.njit(cache=True, nogil=True)
def _longest_first(span, tile_keys):
    """Item indices by tiles covered, most first, in list order among equals: a counting sort, O(n)
    (a comparison sort of 1,024 items cost more than the rest of the list together)."""
    n = span.shape[0]
    top = 0
    for i in range(n):
        top = max(top, span[i] // tile_keys)
    starts = np.zeros(top + 2, np.int64)
    for i in range(n):
        starts[top - span[i] // tile_keys + 1] += 1
    for k in range(1, top + 2):
        starts[k] += starts[k - 1]
    order = np.empty(n, np.int64)
    for i in range(n):
        k = top - span[i] // tile_keys
        order[starts[k]] = i
        starts[k] += 1
    return order


@numba.njit(cache=True, nogil=True)
def plan_work(query_lens, cached, group, tile_keys, slots_per_head, max_items, max_slots):
    """The step's list in outline: ``(row_groups, splits, items, slots)``, each sequence's row
    groups and split count, and the list's item and workspace-slot counts."""
    row_groups = _row_groups(query_lens, group)
    splits = _splits(query_lens, cached, row_groups, tile_keys, slots_per_head, max_items, max_slots)
    items = slots = 0
    for b in range(query_lens.shape[0]):
        items += row_groups[b] * splits[b]
        if splits[b] > 1:
            slots += row_groups[b] * splits[b]
    return row_groups, splits, items, slots


@numba.njit(cache=True, nogil=True)
def fill_work(query_lens, cached, group, tile_keys, row_groups, splits, items, work, stale=1 << 62):
    """Write the work list of :func:`plan_work`'s outline; rows past it are padding (query length
    0).  ``stale``: how many rows may hold a previous list (fixed buffers: the last fill's count;
    zeros past it stay zeros), by default all.  Returns the item count.

    Order: the items of multi-row groups (prefill chunks: tensor-core work) and of the rest
    (decodes: K/V streaming) each longest first (in whole tiles), merged in proportion, so that the
    CTAs resident on an SM mix both kinds instead of a wave of one kind then a wave of the other."""
    batch = query_lens.shape[0]
    cu_seqlens_q = np.zeros(batch + 1, np.int64)
    for b in range(batch):
        cu_seqlens_q[b + 1] = cu_seqlens_q[b] + query_lens[b]
    span = np.empty(items, np.int64)     # keys an item covers, to order them
    dense = np.empty(items, np.bool_)    # whether its row group holds more than one token's rows
    staged = np.empty((items, WORK_INTS), np.int32)
    n = slot = 0
    for b in range(batch):
        keys = cached[b] + query_lens[b]
        for rg in range(row_groups[b]):
            first_slot = slot if splits[b] > 1 else 0
            for s in range(splits[b]):
                row = staged[n]
                row[0] = b
                row[1] = rg
                row[2] = s
                row[3] = splits[b]
                row[4] = cu_seqlens_q[b]
                row[5] = query_lens[b]
                row[6] = cached[b]
                row[7] = first_slot
                span[n] = -(-keys // splits[b])
                dense[n] = group * query_lens[b] > ROWS
                n += 1
            if splits[b] > 1:
                slot += splits[b]
    order = _longest_first(span, tile_keys)
    num_dense = 0
    for i in range(items):
        num_dense += dense[i]
    # Two cursors over `order`: the next dense and the next other item; take a dense one while the
    # dense share taken so far is below its share of the whole.
    next_dense = next_other = taken_dense = 0
    for i in range(items):
        while next_dense < items and not dense[order[next_dense]]:
            next_dense += 1
        while next_other < items and dense[order[next_other]]:
            next_other += 1
        take_dense = next_other >= items or (next_dense < items and taken_dense * items < num_dense * (i + 1))
        if take_dense:
            work[i, :] = staged[order[next_dense]]
            next_dense += 1
            taken_dense += 1
        else:
            work[i, :] = staged[order[next_other]]
            next_other += 1
    work[items:max(items, min(stale, work.shape[0])), :] = 0
    return items


# What the ragged launch reaches on the H200 (benchmarks/NOTES_mixed.md): K/V streamed at about
# 4 TB/s, the tensor-core work of 16-row tiles at about 150 TFLOP/s.
_READ_RATE, _TILE_FLOPS = 4.0e12, 150e12
# Longest row the ragged launch takes: longer chunks beside decodes run faster on the split path
# (the measurements: benchmarks/NOTES_mixed.md).
LONGEST_RAGGED_ROW = 256


@numba.njit(cache=True, nogil=True)
def prefers_ragged(query_lens, cached, group, num_kv_heads, head_dim) -> bool:
    """Whether the ragged launch should take a step: when no row is longer than
    ``LONGEST_RAGGED_ROW`` tokens and its 16-row tiles' work on the long rows (prefill chunks)
    hides behind the K/V reads of the whole step.  Other steps go to the prefill kernels, whose
    64- and 128-row tiles do that work three times as fast (the split path beside decodes)."""
    keys = 0.0
    long_work = 0.0
    for b in range(query_lens.shape[0]):
        if query_lens[b] > LONGEST_RAGGED_ROW:
            return False
        total = cached[b] + query_lens[b]
        keys += total
        if query_lens[b] * group > ROWS:
            long_work += float(query_lens[b]) * total
    kv_bytes = keys * num_kv_heads * 4 * head_dim
    flops = 4.0 * long_work * group * num_kv_heads * head_dim
    return flops / _TILE_FLOPS <= max(kv_bytes / _READ_RATE, 20e-6)


def work_group(cache, num_heads, buffers=None) -> int:
    """Query heads per kv head of ``num_heads`` over ``cache``; ``ValueError`` unless a positive
    multiple of its kv heads, or when ``buffers`` hold the work list of another ratio."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, (int, np.integer)) or num_heads < 1 \
            or num_heads % cache.num_kv_heads:
        raise ValueError(f"num_heads must be a positive multiple of the cache's {cache.num_kv_heads} kv heads; "
                         f"got {num_heads!r}")
    group = int(num_heads) // cache.num_kv_heads
    if buffers is not None and buffers.query_group != group:
        raise ValueError(f"num_heads = {num_heads} makes {group} query heads per kv head: the buffers need "
                         f"PlanBuffers(..., query_group={group}); they hold a work list for query_group = "
                         f"{buffers.query_group}")
    return group


def choose_path(cache, query: np.ndarray, cached: np.ndarray, num_heads, path, buffers):
    """``(path, work-list arguments)`` of a plan: ``path`` None leaves the choice between
    ``"decode"`` and ``"varlen"`` to the plan; the arguments (group, tile keys, CTA slots per kv
    head, most items) are None unless the path is ``"ragged"``."""
    if path is not None and path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}; got {path!r}")
    if num_heads is None:
        if path == RAGGED:
            raise ValueError("path='ragged' needs num_heads")
        return path, None
    group = work_group(cache, num_heads, buffers)
    if cache.head_dim not in HEAD_DIMS:  # no kernel for it: the reference backend's paths only
        if path == RAGGED:
            raise ValueError(f"path='ragged' needs a head dim the kernels take ({HEAD_DIMS}); the cache's is "
                             f"{cache.head_dim}")
        return path, None
    if path is None:
        path = RAGGED if prefers_ragged(query, cached, group, cache.num_kv_heads, cache.head_dim) else None
    if path != RAGGED:
        return path, None
    tile, slots = _work_shape(cache.device, cache.dtype, cache.head_dim, cache.num_kv_heads)
    if buffers is not None:
        return RAGGED, (group, tile, slots, *buffers.work_capacity)
    return RAGGED, (group, tile, slots, 1 << 20, 1 << 20)


@functools.lru_cache(maxsize=64)
def _work_shape(device: str, dtype, head_dim: int, num_kv_heads: int) -> tuple[int, int]:
    """(keys per tile, CTA slots per kv head) of the ragged kernel on this device; on the CPU the
    H200's (132 SMs, two CTAs each), so a CPU plan lists what the GPU would run."""
    from ..kernels import ragged

    if device == CUDA:
        import cupy

        device_id = cupy.cuda.runtime.getDevice()
        return ragged.tile_keys(head_dim), ragged.slots_per_head(device_id, np.dtype(dtype), head_dim, num_kv_heads)
    return ragged.tile_keys(head_dim), max(1, 264 // num_kv_heads)


def final_path(path, query: np.ndarray, batch_size: int, num_tokens: int, max_q: int) -> tuple[str, int]:
    """``(path, num_split)``: the path asked for (checked) or, when None, ``"decode"`` for one
    token per row, ``"split"`` for leading one-token rows before longer ones, else ``"varlen"``."""
    if path == RAGGED:
        return path, 0
    decode = serves_step(batch_size, num_tokens, max_q)
    if path == DECODE and not decode:
        raise ValueError("path='decode' takes steps of one new token per sequence")
    if path == DECODE or (path is None and decode):
        return DECODE, 0
    longer = query != 1
    ones = int(np.argmax(longer)) if longer.any() else 0  # the leading one-token rows
    if path == SPLIT and ones == 0:
        raise ValueError("path='split' takes steps that start with one-token rows and end with longer ones")
    if path == SPLIT or (path is None and ones):
        return SPLIT, ones
    return VARLEN, 0
