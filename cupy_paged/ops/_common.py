"""What the launch glue of every kernel family shares: argument layout and naming rules."""
from __future__ import annotations

import functools

import numpy as np

from .._checks import BF16

_CUDA_SCALAR = {np.dtype(np.float16): "__half", BF16: "__nv_bfloat16"}


def cuda_scalar(dtype) -> str:
    """The CUDA type (``SCALAR_T``) of a kernel dtype: float16 or bfloat16."""
    return _CUDA_SCALAR[np.dtype(dtype)]


def is_vectorised(array) -> bool:
    """Whether the kernels can move ``array`` 16 bytes at a time: a 16-byte aligned base, every
    stride but the last a multiple of 16 bytes, a dense last axis."""
    return (array.data.ptr % 16 == 0 and array.strides[-1] == array.itemsize
            and all(s % 16 == 0 for s in array.strides[:-1]))


def vectorised(array):
    """``array``, or a C-contiguous copy of it when it is not ``is_vectorised``."""
    import cupy

    return array if is_vectorised(array) else cupy.ascontiguousarray(array)


def element_strides(array, count: int | None = None) -> tuple[np.int64, ...]:
    """The first ``count`` (default all) strides of ``array`` in elements."""
    return tuple(np.int64(s // array.itemsize) for s in array.strides[:count])


def smem_row_bytes(head_dim: int) -> int:
    """Bytes of one row of head_dim 2-byte elements in a ``cp::SmemTile`` (mma.cuh): swizzled when
    the row is a multiple of 128 bytes, else padded by one 16-byte chunk."""
    chunks = head_dim // 8
    return 16 * (chunks if chunks % 8 == 0 else chunks + 1)


@functools.cache
def device_property(device: int, name: str):
    """One entry of CUDA's device properties (``multiProcessorCount``, ``major``, ...) of
    ``device``, read once per process."""
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(device)[name]
