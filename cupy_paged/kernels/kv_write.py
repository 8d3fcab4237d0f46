"""Launch glue of ``cuda_src/kv_write.cu`` (``write_kv_cache`` on CUDA arrays)."""
from __future__ import annotations


from .._core.types import HEAD_DIMS, element_strides
from .._core.compiler import KernelKey, get_function
from .._core.errors import word
from .._core.streams import handle
from ._launch import Launcher

SOURCE = "kv_write.cu"
THREADS = 128  # kThreads of cuda_src/kv_write.cu


def kernel_key(head_dim: int) -> KernelKey:
    # The kernel moves raw 16-byte vectors: one specialization per head dim serves every 2-byte dtype.
    return KernelKey(SOURCE, (("HEAD_DIM", head_dim),))


def all_keys():
    return [kernel_key(d) for d in HEAD_DIMS]




# write_kv_cache(k, v, k_cache, v_cache, slot_mapping, num_kv_heads, num_slots, k_token, k_head,
# v_token, v_head, errors): strides in 16-byte vectors.
_LAYOUT = "5P" + "iqqiqi" + "P"


def _vector_strides(array, name: str) -> tuple[int, int]:
    """Token and head strides of ``array [tokens, Hkv, D]`` in 16-byte vectors (the caller made it
    vectorised: 16-byte aligned rows)."""
    token, head, _ = (s * array.itemsize for s in element_strides(array))
    if not -2 ** 31 <= head // 16 < 2 ** 31:
        raise ValueError(f"{name}: heads more than 2**31 16-byte vectors apart; pass a [tokens, Hkv, D] "
                         "array with the heads closer together (e.g. contiguous)")
    return token // 16, head // 16


class WriteLaunch:
    """One ``write_kv_cache`` call shape, resolved: :meth:`run` adds the pointers and launches."""

    def __init__(self, k_cache, k, v):
        self.device = k_cache.device
        num_tokens, num_kv_heads, head_dim = (int(s) for s in k.shape)
        self.num_tokens = num_tokens
        self.launch = Launcher(get_function(kernel_key(head_dim), "write_kv_cache"), _LAYOUT)
        k_token, k_head = _vector_strides(k, "k")
        v_token, v_head = _vector_strides(v, "v")
        self.scalars = (num_kv_heads, int(k_cache.shape[0]) * int(k_cache.shape[1]), k_token, k_head,
                        v_token, v_head)
        self.errors = word(self.device)

    def run(self, ptrs: tuple, stream: int) -> None:
        """``ptrs``: k_cache, v_cache, k, v, slot_mapping."""
        if self.num_tokens == 0:
            return
        k_cache, v_cache, k, v, slots = ptrs
        self.launch((self.num_tokens, 1, 1), THREADS, 0, stream, k, v, k_cache, v_cache, slots, *self.scalars,
                    self.errors)


def run(k_cache, v_cache, k, v, slot_mapping, stream: int | None = None) -> None:
    """Scatter ``k``/``v`` [num_tokens, Hkv, D] (vectorised device Arrays) into the caches at
    ``slot_mapping`` (checked, contiguous int32)."""
    if stream is None:
        stream = handle(None, k_cache.kind, k_cache.device)
    WriteLaunch(k_cache, k, v).run((k_cache.ptr, v_cache.ptr, k.ptr, v.ptr, slot_mapping.ptr), stream)
