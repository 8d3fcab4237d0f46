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


@numba.njit(cache=True, nogil=True)
def count_decode_growth(table, rows, num_blocks, num_slots, ref_counts, block_size, max_blocks, seen):
    """Blocks a one-token ``grow`` of every row in ``rows`` takes, or a code telling the caller to
    take the general path: -1 a row is listed twice, -2 a row would pass ``max_blocks``, -3 a row
    writes into a block it shares (copy-on-write).  ``seen`` is scratch, all False, left so."""
    need = 0
    code = 0
    for i in range(rows.shape[0]):
        row = rows[i]
        if seen[row]:
            code = -1
            break
        seen[row] = True
        slots = num_slots[row]
        if slots % block_size == 0:
            if num_blocks[row] >= max_blocks:
                code = -2
                break
            need += 1
        elif ref_counts[table[row, num_blocks[row] - 1]] > 1:
            code = -3
            break
    for i in range(rows.shape[0]):
        seen[rows[i]] = False
    return need if code == 0 else code


@numba.njit(cache=True, nogil=True)
def grow_decodes_from_stack(table, rows, num_blocks, num_slots, ref_counts, versions, block_size, max_blocks,
                            seen, stack, top, room):
    """:func:`count_decode_growth` then :func:`grow_decodes` with the new blocks popped from the
    pool's free ``stack`` (its first ``top`` entries), in one pass each.  Returns the blocks taken,
    or without changing anything: ``count_decode_growth``'s codes, -4 when they would be more than
    ``room`` (the free blocks less the reserve), -5 when more than the plain free ``top`` (the
    prefix cache's free blocks must be evicted: the caller's path)."""
    need = count_decode_growth(table, rows, num_blocks, num_slots, ref_counts, block_size, max_blocks, seen)
    if need < 0:
        return need
    if need > room:
        return -4
    if need > top:
        return -5
    taken = 0
    for i in range(rows.shape[0]):
        row = rows[i]
        if num_slots[row] % block_size == 0:
            block = stack[top - 1 - taken]
            ref_counts[block] = 1
            table[row, num_blocks[row]] = block
            num_blocks[row] += 1
            versions[row] += 1
            taken += 1
        num_slots[row] += 1
    return taken


@numba.njit(cache=True, nogil=True)
def grow_decodes(table, rows, num_blocks, num_slots, versions, fresh, block_size):
    """One more slot for every row; a row whose last block is full takes the next of ``fresh``."""
    taken = 0
    for i in range(rows.shape[0]):
        row = rows[i]
        if num_slots[row] % block_size == 0:
            table[row, num_blocks[row]] = fresh[taken]
            num_blocks[row] += 1
            versions[row] += 1
            taken += 1
        num_slots[row] += 1


@numba.njit(cache=True, nogil=True)
def set_computed(rows, counts, num_computed, num_slots, num_hashed, block_size, to_hash):
    """``num_computed[rows[i]] = counts[i]`` (``num_slots`` when ``counts`` is empty); the rows whose
    full blocks outgrew ``num_hashed`` go into ``to_hash``.  Returns (their number, -1), or
    (0, i) for the first ``i`` whose count is out of [num_computed, num_slots] (nothing changed)."""
    full = counts.shape[0] == 0
    for i in range(rows.shape[0]):
        row = rows[i]
        count = num_slots[row] if full else counts[i]
        if count < num_computed[row] or count > num_slots[row]:
            return 0, i
    k = 0
    for i in range(rows.shape[0]):
        row = rows[i]
        count = num_slots[row] if full else counts[i]
        num_computed[row] = count
        if count // block_size > num_hashed[row]:
            to_hash[k] = row
            k += 1
    return k, -1
