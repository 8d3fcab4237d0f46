"""Paged addressing: the cache slot of a token position through a block-table row.

A paged cache ``[num_blocks, block_size, Hkv, D]`` seen as ``[num_blocks * block_size, Hkv, D]``
holds position ``p`` of a sequence at slot ``table_row[p // block_size] * block_size + p % block_size``.
This module is the one place that formula is written: ``slot_of`` for numba loops,
``slots_of`` for whole arrays (NumPy or CuPy), ``gather_slots`` for runs of positions.
"""
from __future__ import annotations

import numba


@numba.njit(cache=True, nogil=True, inline="always")
def slot_of(table_row, position, block_size):
    """The slot of ``position`` through ``table_row`` (numba and Python callers alike).

    Examples
    --------
    >>> import numpy as np; from cupy_paged._core.paging import slot_of
    >>> int(slot_of(np.array([3, 5], np.int32), 9, 8))
    41
    """
    return table_row[position // block_size] * block_size + position % block_size


def slots_of(blocks, positions, block_size: int):
    """Slots of ``positions`` whose blocks (``table_row[positions // block_size]``) are looked up
    already: elementwise, on NumPy or CuPy arrays of the same shape.

    Examples
    --------
    >>> import numpy as np; from cupy_paged._core.paging import slots_of
    >>> slots_of(np.array([3, 5]), np.array([1, 9]), 8).tolist()
    [25, 41]
    """
    return blocks * block_size + positions % block_size


@numba.njit(cache=True, nogil=True)
def gather_slots(table, rows, starts, counts, block_size, out):
    """Slots of positions ``starts[i] .. starts[i] + counts[i] - 1`` of each ``table[rows[i]]``,
    concatenated into ``out``.

    Examples
    --------
    >>> import numpy as np; from cupy_paged._core.paging import gather_slots
    >>> out = np.empty(3, np.int32)
    >>> gather_slots(np.array([[2, 4], [1, -1]], np.int32), np.array([0, 1]), np.array([7, 0]),
    ...              np.array([2, 1]), 8, out)
    >>> out.tolist()
    [23, 32, 8]
    """
    t = 0
    for i in range(rows.shape[0]):
        table_row = table[rows[i]]
        for position in range(starts[i], starts[i] + counts[i]):
            out[t] = slot_of(table_row, position, block_size)
            t += 1
