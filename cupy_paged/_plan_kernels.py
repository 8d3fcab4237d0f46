"""numba loops behind the cache's block tables and the step plan.

Each function is one pass over the batch with no per-token Python: a plan for a
thousand decodes is built in a few microseconds.  ``table`` is always the cache's
``[max_seqs, max_blocks_per_seq]`` int32 array of block ids (-1 past a sequence's
last block) and ``rows`` the batch's rows of it.
"""
from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def append_blocks(table, rows, num_blocks, need, fresh):
    """Write ``fresh`` block ids after each row's last block: ``need[i]`` for ``rows[i]``."""
    taken = 0
    for i in range(rows.shape[0]):
        row = rows[i]
        start = num_blocks[row]
        for j in range(need[i]):
            table[row, start + j] = fresh[taken]
            taken += 1
        num_blocks[row] = start + need[i]


@numba.njit(cache=True, nogil=True)
def gather_slots(table, rows, starts, counts, block_size, out):
    """Slots of positions ``starts[i] .. starts[i] + counts[i] - 1`` of each row, concatenated."""
    t = 0
    for i in range(rows.shape[0]):
        row = rows[i]
        for position in range(starts[i], starts[i] + counts[i]):
            out[t] = table[row, position // block_size] * block_size + position % block_size
            t += 1
    return t


@numba.njit(cache=True, nogil=True)
def copy_table(table, rows, widths, out):
    """``out[i] = table[rows[i]]`` up to ``widths[i]`` columns, -1 after."""
    for i in range(rows.shape[0]):
        row = rows[i]
        for j in range(widths[i]):
            out[i, j] = table[row, j]
        for j in range(widths[i], out.shape[1]):
            out[i, j] = -1


@numba.njit(cache=True, nogil=True)
def build_plan(table, rows, context_lens, query_lens, block_size):
    """Positions, slot mapping, cu_seqlens and block table of one step.

    Returns ``(positions, slot_mapping, cu_seqlens_q, cu_seqlens_k, block_table,
    max_seqlen_q, max_seqlen_k)``; the table is as wide as the longest sequence needs.
    """
    batch = rows.shape[0]
    cu_q = np.empty(batch + 1, np.int32)
    cu_k = np.empty(batch + 1, np.int32)
    widths = np.empty(batch, np.int64)
    cu_q[0] = 0
    cu_k[0] = 0
    max_q = 0
    max_k = 0
    for i in range(batch):
        seqlen_k = context_lens[i] + query_lens[i]
        cu_q[i + 1] = cu_q[i] + query_lens[i]
        cu_k[i + 1] = cu_k[i] + seqlen_k
        widths[i] = (seqlen_k + block_size - 1) // block_size
        max_q = max(max_q, query_lens[i])
        max_k = max(max_k, seqlen_k)
    total = cu_q[batch]
    positions = np.empty(total, np.int32)
    t = 0
    for i in range(batch):
        for position in range(context_lens[i], context_lens[i] + query_lens[i]):
            positions[t] = position
            t += 1
    slots = np.empty(total, np.int32)
    gather_slots(table, rows, context_lens, query_lens, block_size, slots)
    width = 0
    for i in range(batch):
        width = max(width, widths[i])
    block_table = np.empty((batch, width), np.int32)
    copy_table(table, rows, widths, block_table)
    return positions, slots, cu_q, cu_k, block_table, max_q, max_k
