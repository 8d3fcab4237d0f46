"""The numba loop that writes a step plan's index arrays.

One pass over the batch with no per-token Python.  ``table`` is the cache's
``[max_seqs, max_blocks_per_seq]`` int32 array of block ids (-1 past a sequence's last
block) and ``rows`` the batch's rows of it.
"""
from __future__ import annotations

import numba
import numpy as np

from .._core.paging import slot_of

# memo_rows value meaning "this output row holds nothing known": it is always rewritten.
UNKNOWN_ROW = -2
# memo_rows value of a padding row (all -1).
PADDING_ROW = -1


@numba.njit(cache=True, nogil=True, inline="always")
def _copy_row(src, dst):
    # An explicit loop: numba compiles it to a tighter copy than slice assignment.
    for j in range(dst.shape[0]):
        dst[j] = src[j]


@numba.njit(cache=True, nogil=True)
def fill_plan(table, versions, rows, num_computed, query_lens, block_size,
              positions, slots, cu_q, cu_k, query_out, cache_seqlens, seqlens_k,
              block_table, memo_rows, memo_versions):
    """Write one step's index arrays; returns ``(max_seqlen_q, max_seqlen_k)``.

    ``num_computed[i]`` is the tokens of ``rows[i]`` already cached; it goes out as
    ``cache_seqlens`` (the decode kernel's argument) and starts the row's new positions.
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
        table_row = table[row]
        seqlen_k = num_computed[i] + query_lens[i]
        for position in range(num_computed[i], seqlen_k):
            positions[t] = position
            slots[t] = slot_of(table_row, position, block_size)
            t += 1
        cu_q[i + 1] = t
        cu_k[i + 1] = cu_k[i] + seqlen_k
        query_out[i] = query_lens[i]
        cache_seqlens[i] = num_computed[i]
        seqlens_k[i] = seqlen_k
        max_q = max(max_q, query_lens[i])
        max_k = max(max_k, seqlen_k)
        if memo_rows[i] != row or memo_versions[i] != versions[row]:
            _copy_row(table_row[:block_table.shape[1]], block_table[i])
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


def query_lengths(query_lens, batch: int) -> np.ndarray:
    """``query_lens`` as ``[batch]`` int64 (one int is every sequence's)."""
    if np.ndim(query_lens) == 0:
        return np.full(batch, query_lens, np.int64)
    query = np.asarray(query_lens, np.int64)
    if query.shape != (batch,):
        raise ValueError(f"query_lens must have shape [batch = {batch}]; got {query.shape}")
    return query


@numba.njit(cache=True, nogil=True)
def _first_unreserved(computed, query, reserved) -> int:
    """The first row with no new token or more than its reserved slots, else -1 (one pass)."""
    for b in range(query.shape[0]):
        if query[b] < 1 or computed[b] + query[b] > reserved[b]:
            return b
    return -1


def check_reserved(seq_ids: list, view, query: np.ndarray) -> None:
    """Every sequence has >= 1 new token, each with a reserved slot."""
    computed, reserved = view.num_computed, view.num_slots
    bad = _first_unreserved(computed, query, reserved)
    if bad >= 0:
        raise ValueError(f"query_lens[{bad}] = {int(query[bad])} must be >= 1 and fit the "
                         f"{int(reserved[bad] - computed[bad])} slots reserved past "
                         f"the {int(computed[bad])} cached tokens of {seq_ids[bad]!r}")
