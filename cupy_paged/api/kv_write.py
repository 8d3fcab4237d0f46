"""`write_kv_cache`: scatter new keys and values into the paged cache by slot."""
from __future__ import annotations

from .. import kernels, reference
from .._core import errors
from .._core.arrays import CPU, CUDA, CUPY, TORCH, memo_lookup, backend_of, kind_of, read, to_host
from .._core.streams import handle
from .._core.types import (as_read, check_cache_pair, check_float, check_head_dim, check_index,
                           check_rank, check_same_dtype, check_same_shape, check_values_mode, check_writable, host_checked)
from ._call import MEMO, current_device, on_device, readable, remember

def write_kv_cache(k_cache, v_cache, k, v, slot_mapping, *, stream=None, check_values=None):
    """Scatter new key/value tokens into paged caches, in place.

    Token ``t`` goes to slot ``slot_mapping[t] = block * block_size + offset``, that is
    ``k_cache[block, offset] = k[t]``; negative slots (padding) are skipped.  On CUDA
    arrays this is one kernel with 16-byte accesses; a slot past the cache is skipped too and
    reported by :func:`cupy_paged.check_errors`.

    Parameters
    ----------
    k_cache, v_cache : array ``[num_blocks, block_size, num_kv_heads, head_dim]``, C-contiguous
    k, v : array ``[num_tokens, num_kv_heads, head_dim]``, the caches' dtype
    slot_mapping : int32 array ``[num_tokens]``
    stream, check_values : keyword only, as in :func:`flash_attn_varlen_func`

    Raises
    ------
    TypeError, ValueError
        Naming the argument, for shapes or dtypes that do not fit or (host-checked) a slot
        past the cache.

    Examples
    --------
    >>> import numpy as np, cupy_paged
    >>> k_cache = np.zeros((4, 16, 2, 64), np.float16); v_cache = np.zeros_like(k_cache)
    >>> k = np.ones((3, 2, 64), np.float16)
    >>> cupy_paged.write_kv_cache(k_cache, v_cache, k, k, np.array([17, -1, 63], np.int32))
    >>> float(k_cache[1, 1].sum()), float(k_cache[3, 15].sum())
    (128.0, 128.0)
    """
    kind = kind_of(k_cache)
    key = None
    if (kind is TORCH or kind is CUPY) and check_values is not True and not errors._debug:
        key, launch, ptr = memo_lookup(MEMO, kind, _memo_key, k_cache, v_cache, k, v, slot_mapping)
        if launch is not None and launch.device == current_device():
            ptrs = (ptr(k_cache), ptr(v_cache), ptr(k), ptr(v), ptr(slot_mapping))
            if not (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3]) & 15:
                launch.run(ptrs, handle(stream, kind, launch.device))
                return
    a = {name: read(obj, name) for name, obj in
         dict(k_cache=k_cache, v_cache=v_cache, k=k, v=v, slot_mapping=slot_mapping).items()}
    backend, slots = prepare_write(a["k_cache"], a["v_cache"], a["k"], a["v"], a["slot_mapping"], check_values)
    if backend == CPU:
        reference.kv_write.run(a["k_cache"], a["v_cache"], a["k"], a["v"], slots)
        return
    if int(a["k"].shape[0]) == 0:  # no token: nothing to write, no launch
        return
    h = handle(stream, kind, a["k_cache"].device)
    (k_dev, c1), (v_dev, c2), (slots, c3) = (readable(a["k"], True, h), readable(a["v"], True, h),
                                             readable(slots, False, h))
    with on_device(a["k_cache"].device):
        launch = kernels.kv_write.WriteLaunch(a["k_cache"], k_dev, v_dev)
        if not (c1 or c2 or c3):
            remember(key, launch)
        launch.run((a["k_cache"].ptr, a["v_cache"].ptr, k_dev.ptr, v_dev.ptr, slots.ptr), h)
    errors.after_launch()


def _memo_key(s, k_cache, v_cache, k, v, slot_mapping) -> tuple:
    """What decides a write's launch, its arrays read by ``s`` (``memo_lookup``)."""
    return ("write", s(k_cache), s(v_cache), s(k), s(v), s(slot_mapping))


def prepare_write(k_cache, v_cache, k, v, slot_mapping, check_values=None):
    """Checks for ``write_kv_cache``; returns (backend, slot_mapping as int32)."""
    k_cache, v_cache, k, v = (as_read(a, n) for a, n in ((k_cache, "k_cache"), (v_cache, "v_cache"), (k, "k"),
                                                         (v, "v")))
    slot_mapping = as_read(slot_mapping, "slot_mapping")
    backend = backend_of(dict(k_cache=k_cache, v_cache=v_cache, k=k, v=v, slot_mapping=slot_mapping))
    check_values = check_values_mode(check_values)
    layout = "[num_blocks, block_size, num_kv_heads, head_dim]"
    check_rank(k_cache, "k_cache", (4,), layout)
    check_rank(v_cache, "v_cache", (4,), layout)
    check_cache_pair(k_cache, v_cache)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_writable(cache, name, "write_kv_cache writes k and v into it")
    check_float(k_cache, "k_cache", backend)
    check_float(v_cache, "v_cache", backend)
    _, _, num_kv_heads, head_dim = (int(s) for s in k_cache.shape)
    if backend == CUDA:
        check_head_dim(head_dim, "k_cache")
    token_layout = f"[num_tokens, num_kv_heads = {num_kv_heads}, head_dim = {head_dim}]"
    for name, array in (("k", k), ("v", v)):
        check_rank(array, name, (3,), token_layout)
        if tuple(int(s) for s in array.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(f"{name} must have shape {token_layout}; got {tuple(array.shape)}")
    check_same_shape(k, v, "k", "v")
    check_same_dtype(k_cache, "k_cache", v_cache=v_cache, k=k, v=v)
    slots = check_index(slot_mapping, "slot_mapping", 1, f"[num_tokens = {int(k.shape[0])}]")
    if int(slots.shape[0]) != int(k.shape[0]):
        raise ValueError(f"slot_mapping must have shape [num_tokens = {int(k.shape[0])}]; "
                         f"got {tuple(slots.shape)}")
    capacity = int(k_cache.shape[0]) * int(k_cache.shape[1])
    if host_checked(check_values, slots) and slots.size:
        top = int(to_host(slots).max())
        if top >= capacity:
            raise ValueError(f"slot_mapping holds slot {top}, past the cache's {capacity} slots "
                             "(num_blocks * block_size); negative slots are skipped")
    return backend, slots
