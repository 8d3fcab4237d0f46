"""numba loops over the cache's block tables: ``table`` is the cache's
``[max_seqs, max_blocks_per_seq]`` int32 array of block ids (-1 past a sequence's last
block) and ``rows`` a batch's rows of it."""
from __future__ import annotations

import numba


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
