"""Launch glue of ``cuda_src/kv_write.cu`` (``write_kv_cache`` on CUDA arrays)."""
from __future__ import annotations

import numpy as np

from .._checks import HEAD_DIMS
from .._compiler import KernelKey, get_function, register_family
from ._common import vectorised

SOURCE = "kv_write.cu"
THREADS = 128  # kThreads of cuda_src/kv_write.cu


def kernel_key(head_dim: int) -> KernelKey:
    # The kernel moves raw 16-byte vectors: one specialization per head dim serves every 2-byte dtype.
    return KernelKey(SOURCE, (("HEAD_DIM", head_dim),))


def all_keys():
    return [kernel_key(d) for d in HEAD_DIMS]


register_family("kv_write", all_keys)


def _vector_rows(array, name: str):
    """``array`` [tokens, Hkv, D] as the kernel reads it (``vectorised``: a copy of a view whose last
    axis is not dense, too), its token stride (int64) and head stride (int32, as write_kv_cache
    takes it) in 16-byte vectors."""
    array = vectorised(array)
    head = array.strides[1] // 16
    if not -2 ** 31 <= head < 2 ** 31:
        raise ValueError(f"{name}: heads more than 2**31 16-byte vectors apart; pass a [tokens, Hkv, D] "
                         "array with the heads closer together (e.g. contiguous)")
    return array, np.int64(array.strides[0] // 16), np.int32(head)


def run(k_cache, v_cache, k, v, slot_mapping) -> None:
    """Scatter ``k``/``v`` [num_tokens, Hkv, D] into the caches at ``slot_mapping`` (checked)."""
    num_tokens, num_kv_heads, head_dim = (int(s) for s in k.shape)
    if num_tokens == 0:
        return
    function = get_function(kernel_key(head_dim), "write_kv_cache")
    k, k_token, k_head = _vector_rows(k, "k")
    v, v_token, v_head = _vector_rows(v, "v")
    num_slots = np.int64(k_cache.shape[0] * k_cache.shape[1])
    function((num_tokens,), (THREADS,),
             (k, v, k_cache, v_cache, slot_mapping, np.int32(num_kv_heads), num_slots,
              k_token, k_head, v_token, v_head))
