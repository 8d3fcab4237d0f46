"""The CPU reference of `write_kv_cache`."""
from __future__ import annotations

import numba
import numpy as np

@numba.njit(cache=True)
def _scatter_rows(cache_rows, token_rows, slots):
    for t in range(slots.shape[0]):
        slot = slots[t]
        if 0 <= slot < cache_rows.shape[0]:
            cache_rows[slot] = token_rows[t]


def _as_row_bits(array: np.ndarray) -> np.ndarray:
    """``array [tokens, Hkv, D]`` as raw bits ``[tokens, Hkv * D]`` (numba has no bfloat16)."""
    bits = {2: np.uint16, 4: np.uint32, 8: np.uint64}[array.dtype.itemsize]
    return np.ascontiguousarray(array).view(bits).reshape(array.shape[0], int(np.prod(array.shape[1:])))


def run(k_cache, v_cache, k, v, slot_mapping) -> None:
    """Scatter tokens ``k``/``v [tokens, Hkv, D]`` into the caches; negative slots and slots
    past the cache skipped."""
    slots = np.asarray(slot_mapping, dtype=np.int64)
    for cache, tokens in ((k_cache, k), (v_cache, v)):
        rows = _as_row_bits(tokens)
        cache_rows = cache.view(rows.dtype).reshape(-1, rows.shape[1])
        _scatter_rows(cache_rows, rows, slots)
