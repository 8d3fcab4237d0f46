"""The cache's storage ``kv[num_layers, 2, num_blocks, block_size, Hkv, D]``: what it may be
(device, dtype, sizes), how many blocks fit, and the storage seen one layer at a time (the K/V
views the kernels take, their DLPack export, the manual gather/scatter path ``update``)."""
from __future__ import annotations

import os

import numpy as np

from .._core.arrays import CPU, CUDA, as_array, gpu_available, xp_of
from .._core.types import KERNEL_DTYPES, REFERENCE_DTYPES, check_int, check_real, dtype_name


def free_memory_bytes(device: str) -> int:
    """Bytes free now on ``device`` (``"cuda"``: the current GPU; ``"cpu"``: available RAM).

    Examples
    --------
    >>> from cupy_paged.serving._storage import free_memory_bytes
    >>> free_memory_bytes("cpu") > 0
    True
    """
    if device == CUDA:
        import cupy

        free, _total = cupy.cuda.runtime.memGetInfo()
        # Blocks CuPy's pool holds but no array uses are free for us too.
        return int(free) + int(cupy.get_default_memory_pool().free_bytes())
    return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))


def check_storage(device: str, dtype: np.dtype, **sizes) -> None:
    """The storage's device and dtype are usable and every size is >= 1."""
    if device not in (CPU, CUDA):
        raise ValueError(f"device must be 'cpu' or 'cuda'; got {device!r}")
    if device == CUDA and not gpu_available():
        raise ValueError("device='cuda' needs CuPy and a CUDA GPU; none answers")
    allowed = KERNEL_DTYPES if device == CUDA else REFERENCE_DTYPES
    if dtype not in allowed:
        raise TypeError(f"dtype must be one of {', '.join(dtype_name(d) for d in allowed)} "
                        f"on {device}; got {dtype_name(dtype)}")
    for name, value in sizes.items():
        check_int(value, name, 1)


def count_blocks(num_blocks, memory_fraction, device: str, bytes_per_block: int) -> int:
    """``num_blocks``, or as many blocks as ``memory_fraction`` of the free memory holds."""
    if (num_blocks is None) == (memory_fraction is None):
        raise ValueError("give exactly one of num_blocks and memory_fraction")
    if memory_fraction is not None:
        if not 0.0 < check_real(memory_fraction, "memory_fraction") <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1]; got {memory_fraction}")
        num_blocks = int(free_memory_bytes(device) * float(memory_fraction)) // bytes_per_block
    num_blocks = check_int(num_blocks, "num_blocks", None)
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1 (memory_fraction too small?); got {num_blocks}")
    return num_blocks


class LayerAccess:
    """Per-layer methods of :class:`~cupy_paged.serving.kv_cache.PagedAttentionCache`.

    They read the cache's ``kv`` storage ``[num_layers, 2, num_blocks, block_size, Hkv, D]``
    and its shape attributes only.
    """

    def layer(self, layer_idx: int):
        """The K and V caches of one layer.

        Parameters
        ----------
        layer_idx : int
            In ``[0, num_layers)``.

        Returns
        -------
        tuple
            ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``,
            C-contiguous views of the storage (writes land in the cache).

        Examples
        --------
        >>> from cupy_paged import PagedAttentionCache
        >>> cache = PagedAttentionCache(1, 2, 64, block_size=8, num_blocks=3, device="cpu")
        >>> [a.shape for a in cache.layer(0)]
        [(3, 8, 2, 64), (3, 8, 2, 64)]
        """
        layer_idx = check_int(layer_idx, "layer_idx", None)
        if not 0 <= layer_idx < self.num_layers:
            raise IndexError(f"layer_idx must be in [0, {self.num_layers}); got {layer_idx}")
        return self.kv[layer_idx, 0], self.kv[layer_idx, 1]

    def to_dlpack(self, layer_idx: int):
        """DLPack capsules of one layer's K and V caches, for zero-copy use elsewhere.

        Parameters
        ----------
        layer_idx : int
            In ``[0, num_layers)``.

        Returns
        -------
        tuple
            ``(k_capsule, v_capsule)``; e.g. ``torch.from_dlpack(k_capsule)`` shares the memory.

        Examples
        --------
        >>> from cupy_paged import PagedAttentionCache
        >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=2, device="cpu")
        >>> k_capsule, v_capsule = cache.to_dlpack(0)
        >>> type(k_capsule).__name__
        'PyCapsule'
        """
        k_cache, v_cache = self.layer(layer_idx)
        return k_cache.__dlpack__(), v_cache.__dlpack__()

    def update(self, key_states, value_states, layer_idx: int, read_index, write_index):
        """The manual gather/scatter path: scatter new K/V into the cache, gather a contiguous K/V.

        Writes ``key_states[i]`` to slot ``write_index[i]`` of layer ``layer_idx``, then
        returns the K/V at slots ``read_index`` as contiguous arrays for the non-paged
        ``flash_attn_varlen_func``: the baseline the paged varlen path is measured against.
        Both are single array-indexing operations (one GPU gather/scatter each on CuPy),
        never a host loop.

        Parameters
        ----------
        key_states, value_states : array
            ``[num_new, num_kv_heads, head_dim]``, or ``[1, num_new, num_kv_heads, head_dim]``.
        layer_idx : int
            Which layer's cache.
        read_index : array of int
            ``[total_k]`` slots (``block * block_size + offset``) to read, e.g. ``StepPlan.read_index``.
        write_index : array of int
            ``[num_new]`` slots to write, e.g. ``StepPlan.slot_mapping``.

        Returns
        -------
        tuple
            ``(keys, values)``, ``[total_k, num_kv_heads, head_dim]`` (with a leading axis of 1
            when the inputs had one).

        Raises
        ------
        ValueError
            On a shape mismatch or a slot outside ``[0, num_blocks * block_size)``.

        Examples
        --------
        >>> import numpy as np
        >>> from cupy_paged import PagedAttentionCache
        >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=2, dtype="float32", device="cpu")
        >>> new = np.ones((2, 1, 32), np.float32)
        >>> k, v = cache.update(new, 2 * new, 0, read_index=np.array([9, 3]), write_index=np.array([3, 4]))
        >>> k.shape, float(k[1].sum()), float(k[0].sum())
        ((2, 1, 32), 32.0, 0.0)
        """
        key_states, value_states, batched = self._new_states(key_states, value_states)
        capacity = self.num_blocks * self.block_size
        write_index = self._slot_index(write_index, "write_index", key_states.shape[0], capacity)
        read_index = self._slot_index(read_index, "read_index", None, capacity)
        row = (self.num_kv_heads, self.head_dim)
        k_cache, v_cache = (c.reshape(capacity, *row) for c in self.layer(layer_idx))
        k_cache[write_index] = key_states
        v_cache[write_index] = value_states
        keys, values = k_cache[read_index], v_cache[read_index]
        return (keys[None], values[None]) if batched else (keys, values)

    def _new_states(self, key_states, value_states):
        """``update``'s K/V as ``[num_new, Hkv, D]`` arrays, and whether they had a leading 1."""
        key_states = as_array(key_states, "key_states")
        value_states = as_array(value_states, "value_states")
        batched = key_states.ndim == 4
        if batched:  # [1, num_new, Hkv, D] both: a batch of one (another leading size would be dropped)
            for name, states in (("key_states", key_states), ("value_states", value_states)):
                if states.ndim != 4 or states.shape[0] != 1:
                    raise ValueError(f"{name} of four axes must have a leading 1 ([1, num_new, num_kv_heads, "
                                     f"head_dim], as key_states); got {tuple(states.shape)}")
            key_states, value_states = key_states[0], value_states[0]
        row = (self.num_kv_heads, self.head_dim)
        for name, states in (("key_states", key_states), ("value_states", value_states)):
            if states.ndim != 3 or tuple(states.shape[1:]) != row:
                raise ValueError(f"{name} must have shape [num_new, num_kv_heads = {row[0]}, "
                                 f"head_dim = {row[1]}] (or with a leading 1); got {tuple(states.shape)}")
            if states.dtype != self.dtype:
                raise TypeError(f"{name} must have the cache's dtype {dtype_name(self.dtype)}; "
                                f"got {dtype_name(states.dtype)}")
        if key_states.shape != value_states.shape:
            raise ValueError(f"value_states must have the shape of key_states {tuple(key_states.shape)}; "
                             f"got {tuple(value_states.shape)}")
        return key_states, value_states, batched

    def _slot_index(self, index, name: str, length: int | None, capacity: int):
        """``index`` as a 1-D integer array of slots on the storage's side, checked."""
        index = xp_of(self.kv).asarray(as_array(index, name))
        if index.ndim != 1 or index.dtype.kind not in "iu" or (length is not None and index.shape[0] != length):
            raise ValueError(f"{name} must be a 1-D integer array of "
                             f"{'num_new = %d ' % length if length is not None else ''}slots; "
                             f"got shape {tuple(index.shape)} dtype {index.dtype}")
        if index.size and (int(index.min()) < 0 or int(index.max()) >= capacity):
            raise ValueError(f"{name} holds slots outside [0, {capacity}) (num_blocks * block_size)")
        return index
