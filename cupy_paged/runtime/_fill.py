"""numba loops behind the cache's block tables and the step plan.

Each function is one pass over the batch with no per-token Python.  ``table`` is
always the cache's ``[max_seqs, max_blocks_per_seq]`` int32 array of block ids (-1
past a sequence's last block) and ``rows`` the batch's rows of it.
"""
from __future__ import annotations

import numba

# memo_rows value meaning "this output row holds nothing known": it is always rewritten.
UNKNOWN_ROW = -2
# memo_rows value of a padding row (all -1).
PADDING_ROW = -1


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


@numba.njit(cache=True, nogil=True, inline="always")
def _copy_row(src, dst):
    # An explicit loop: numba compiles it to a tighter copy than slice assignment.
    for j in range(dst.shape[0]):
        dst[j] = src[j]


@numba.njit(cache=True, nogil=True)
def fill_plan(table, versions, rows, context_lens, query_lens, block_size,
              positions, slots, cu_q, cu_k, query_out, cache_seqlens, seqlens_k,
              block_table, memo_rows, memo_versions):
    """Write one step's index arrays; returns ``(max_seqlen_q, max_seqlen_k)``.

    Outputs may be longer than the batch (CUDA-graph padding): extra tokens get
    position 0 and slot -1, extra sequences length 0 and an all -1 block table row.
    A block table row is copied only when ``memo_rows`` / ``memo_versions`` say it
    holds another row or an older version of it: in a steady decode batch only
    the rows that gained a block are rewritten.
    """
    batch = rows.shape[0]
    cu_q[0] = 0
    cu_k[0] = 0
    max_q = 0
    max_k = 0
    t = 0
    for i in range(batch):
        row = rows[i]
        seqlen_k = context_lens[i] + query_lens[i]
        for position in range(context_lens[i], seqlen_k):
            positions[t] = position
            slots[t] = table[row, position // block_size] * block_size + position % block_size
            t += 1
        cu_q[i + 1] = t
        cu_k[i + 1] = cu_k[i] + seqlen_k
        query_out[i] = query_lens[i]
        cache_seqlens[i] = context_lens[i]
        seqlens_k[i] = seqlen_k
        max_q = max(max_q, query_lens[i])
        max_k = max(max_k, seqlen_k)
        if memo_rows[i] != row or memo_versions[i] != versions[row]:
            _copy_row(table[row, :block_table.shape[1]], block_table[i])
            memo_rows[i] = row
            memo_versions[i] = versions[row]
    for j in range(t, positions.shape[0]):
        positions[j] = 0
        slots[j] = -1
    for i in range(batch, block_table.shape[0]):
        cu_q[i + 1] = t
        cu_k[i + 1] = cu_k[batch]
        query_out[i] = 0
        cache_seqlens[i] = 0
        seqlens_k[i] = 0
        if memo_rows[i] != PADDING_ROW:
            block_table[i, :] = -1
            memo_rows[i] = PADDING_ROW
    return max_q, max_k
