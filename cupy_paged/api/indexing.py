"""Index helpers: cumulative lengths, block tables and slot mappings, built vectorised."""
from __future__ import annotations

import numpy as np

from .._core.arrays import TORCH, as_array, kind_of, to_host, xp_of
from .._core.paging import slots_of
from .._core.types import INT32_MAX, check_int, dtype_name


def _int_values(values, name: str) -> np.ndarray:
    """``values`` (a list of ints or an integer array, host or device) as an int64 NumPy array; a
    float, a bool or a value past int64 is a ``TypeError``/``ValueError`` naming ``name``, never
    truncated."""
    if hasattr(values, "dtype") and not isinstance(values, np.ndarray):
        values = to_host(values)  # a device array: one copy
    try:
        array = np.asarray(values)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{name} must be a list or array of ints; got {type(values).__name__} ({error})") from None
    if array.size == 0:
        return array.astype(np.int64)  # an empty list is float64 in NumPy: no value to cast
    if array.dtype.kind == "O" and all(isinstance(v, int) and not isinstance(v, bool) for v in array.flat):
        raise ValueError(f"{name} holds values outside int64's range")
    if array.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold ints; got dtype {dtype_name(array.dtype)}")
    if array.dtype == np.uint64 and int(array.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{name} holds values outside int64's range")
    return array.astype(np.int64)


def cu_seqlens_from_lengths(lengths, xp=None):
    """Cumulative sequence lengths and the longest length.

    Parameters
    ----------
    lengths : sequence of int or int array ``[batch_size]``
    xp : module, optional; ``numpy`` (default for lists) or ``cupy``; default for an array: its own
        kind (a torch tensor gives a torch tensor on its device)

    Returns
    -------
    (cu_seqlens int32 ``[batch_size + 1]``, max_seqlen int)

    Examples
    --------
    >>> from cupy_paged import cu_seqlens_from_lengths
    >>> cu, longest = cu_seqlens_from_lengths([10, 3, 1])
    >>> cu.tolist(), longest
    ([0, 10, 13, 14], 10)
    """
    if xp is None and kind_of(lengths) is TORCH:  # torch in, torch out, on the tensor's device
        import torch

        cu, longest = cu_seqlens_from_lengths(to_host(lengths))
        return torch.as_tensor(cu, device=lengths.device), longest
    on_device = hasattr(lengths, "dtype") and not isinstance(lengths, np.ndarray)
    xp = xp or (xp_of(lengths) if on_device else np)
    host = _int_values(lengths, "lengths")
    if host.ndim != 1 or (host < 0).any():
        raise ValueError(f"lengths must be a 1-D list of non-negative ints; got {host.tolist()[:16]}")
    if int(host.sum()) > INT32_MAX:
        raise ValueError(f"lengths sum to {int(host.sum())} tokens; cu_seqlens are int32 (at most {INT32_MAX})")
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
    >>> from cupy_paged import block_table_from_lists
    >>> block_table_from_lists([[2], [0, 1], [3, 5, 6]], max_blocks=4).tolist()
    [[2, -1, -1, -1], [0, 1, -1, -1], [3, 5, 6, -1]]
    """
    try:
        counts = np.fromiter((len(blocks) for blocks in block_lists), np.int64, len(block_lists))
    except TypeError:
        raise TypeError(f"block_lists must be a list of lists of block ids; got {block_lists!r:.80}") from None
    width = int(counts.max(initial=0)) if max_blocks is None else check_int(max_blocks, "max_blocks")
    if counts.size and int(counts.max()) > width:
        raise ValueError(f"max_blocks = {width} is less than the longest block list ({int(counts.max())})")
    flat = _int_values([b for blocks in block_lists for b in blocks], "block_lists")
    if flat.size and (int(flat.min()) < -1 or int(flat.max()) > INT32_MAX):
        bad = int(flat[(flat < -1) | (flat > INT32_MAX)][0])
        raise ValueError(f"block_lists holds {bad}, which is not a block id (an int32 >= 0, or -1 for a hole)")
    table = np.full((len(block_lists), width), -1, np.int32)
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

    Raises
    ------
    TypeError, ValueError
        Naming the argument: non-integer arrays, and (NumPy inputs) a sequence or position
        outside the table.

    Examples
    --------
    >>> import numpy as np; from cupy_paged import block_table_from_lists, slot_mapping_from_positions
    >>> table = block_table_from_lists([[2], [0, 1], [3, 5, 6]], max_blocks=4)
    >>> slot_mapping_from_positions(table, np.array([0, 1, 2]), np.array([30, 32, 70]), 32).tolist()
    [94, 32, 198]
    """
    block_size = check_int(block_size, "block_size", 1)
    if kind_of(block_table) is TORCH:  # torch in, torch out: the same work on zero-copy NumPy / CuPy views
        import torch

        views = [as_array(a, n) if kind_of(a) is TORCH else a
                 for a, n in ((block_table, "block_table"), (seq_ids, "seq_ids"), (positions, "positions"))]
        slots = slot_mapping_from_positions(*views, block_size)
        return torch.from_numpy(slots) if isinstance(slots, np.ndarray) else torch.from_dlpack(slots)
    if not hasattr(block_table, "dtype") or block_table.ndim != 2 or block_table.dtype.kind not in "iu":
        raise TypeError(f"block_table must be a 2-D integer array [batch_size, max_blocks]; got "
                        f"{getattr(block_table, 'dtype', type(block_table).__name__)} of shape "
                        f"{getattr(block_table, 'shape', None)}")
    xp = xp_of(block_table)
    checked = []
    for name, values in (("seq_ids", seq_ids), ("positions", positions)):
        if hasattr(values, "dtype"):  # an array: integer, on block_table's side (values checked on the host)
            if values.dtype.kind not in "iu":
                raise TypeError(f"{name} must hold ints; got dtype {dtype_name(values.dtype)}")
            checked.append(values)
        else:
            checked.append(_int_values(values, name))
    seq_ids, positions = (xp.asarray(a).astype(np.int64) for a in checked)
    if seq_ids.ndim != 1 or seq_ids.shape != positions.shape:
        raise ValueError(f"seq_ids and positions must be 1-D of the same length; got {tuple(seq_ids.shape)} "
                         f"and {tuple(positions.shape)}")
    if xp is np and seq_ids.size:
        batch, width = block_table.shape
        if int(seq_ids.min()) < 0 or int(seq_ids.max()) >= batch:
            raise ValueError(f"seq_ids must be rows of block_table, in [0, {batch}); got {seq_ids.tolist()[:16]}")
        if int(positions.min()) < 0 or int(positions.max()) >= width * block_size:
            raise ValueError(f"positions must be in [0, {width * block_size}) (max_blocks * block_size); "
                             f"got {positions.tolist()[:16]}")
    blocks = block_table[seq_ids, positions // block_size].astype(np.int64)
    slots = slots_of(blocks, positions, block_size)
    return xp.where(blocks < 0, -1, slots).astype(np.int32)
