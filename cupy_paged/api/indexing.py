"""Index helpers: cumulative lengths, block tables and slot mappings, built vectorised."""
from __future__ import annotations

import numpy as np

from .._core.arrays import to_host, xp_of
from .._core.paging import slots_of


def cu_seqlens_from_lengths(lengths, xp=None):
    """Cumulative sequence lengths and the longest length.

    Parameters
    ----------
    lengths : sequence of int or int array ``[batch_size]``
    xp : module, optional; ``numpy`` (default for lists) or ``cupy``

    Returns
    -------
    (cu_seqlens int32 ``[batch_size + 1]``, max_seqlen int)

    Examples
    --------
    >>> cu, longest = cu_seqlens_from_lengths([10, 3, 1])
    >>> cu.tolist(), longest
    ([0, 10, 13, 14], 10)
    """
    on_device = hasattr(lengths, "dtype") and not isinstance(lengths, np.ndarray)
    xp = xp or (xp_of(lengths) if on_device else np)
    host = np.asarray(to_host(lengths) if on_device else lengths, dtype=np.int64)
    if host.ndim != 1 or (host < 0).any():
        raise ValueError(f"lengths must be a 1-D list of non-negative ints; got {host.tolist()[:16]}")
    cu = np.zeros(host.size + 1, np.int32)
    np.cumsum(host, out=cu[1:])
    return xp.asarray(cu), int(host.max(initial=0))


def block_table_from_lists(block_lists, max_blocks=None, xp=np):
    """An int32 block table ``[batch_size, max_blocks]`` padded with -1.

    Parameters
    ----------
    block_lists : list of lists of int, the blocks of each request in order
    max_blocks : int, optional; default the longest list
    xp : module, ``numpy`` (default) or ``cupy``

    Examples
    --------
    >>> block_table_from_lists([[2], [0, 1], [3, 5, 6]], max_blocks=4).tolist()
    [[2, -1, -1, -1], [0, 1, -1, -1], [3, 5, 6, -1]]
    """
    counts = np.fromiter((len(blocks) for blocks in block_lists), np.int64, len(block_lists))
    width = int(counts.max(initial=0)) if max_blocks is None else int(max_blocks)
    if counts.size and int(counts.max()) > width:
        raise ValueError(f"max_blocks = {width} is less than the longest block list ({int(counts.max())})")
    table = np.full((len(block_lists), width), -1, np.int32)
    flat = np.fromiter((b for blocks in block_lists for b in blocks), np.int64, int(counts.sum()))
    rows = np.repeat(np.arange(len(block_lists)), counts)
    cols = np.arange(flat.size) - np.repeat(np.cumsum(counts) - counts, counts)
    table[rows, cols] = flat
    return xp.asarray(table)


def slot_mapping_from_positions(block_table, seq_ids, positions, block_size: int):
    """Cache slots ``block * block_size + offset`` of tokens given by sequence and position.

    Parameters
    ----------
    block_table : int array ``[batch_size, max_blocks]``
    seq_ids, positions : int arrays ``[num_tokens]``, on the side of ``block_table``
    block_size : int

    Returns
    -------
    int32 array ``[num_tokens]``; -1 where the block is unallocated (-1 in the table).

    Examples
    --------
    >>> table = block_table_from_lists([[2], [0, 1], [3, 5, 6]], max_blocks=4)
    >>> slot_mapping_from_positions(table, np.array([0, 1, 2]), np.array([30, 32, 70]), 32).tolist()
    [94, 32, 198]
    """
    xp = xp_of(block_table)
    seq_ids = xp.asarray(seq_ids, dtype=np.int64)
    positions = xp.asarray(positions, dtype=np.int64)
    blocks = block_table[seq_ids, positions // block_size].astype(np.int64)
    slots = slots_of(blocks, positions, block_size)
    return xp.where(blocks < 0, -1, slots).astype(np.int32)
