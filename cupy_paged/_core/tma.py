"""Tensor maps for the Hopper tensor-memory accelerator (TMA), encoded through the CUDA driver.

A tensor map (``CUtensorMap``, 128 opaque bytes) tells the TMA unit where a tensor lies, its sizes
and strides, the box one copy moves and how shared memory is swizzled.  The varlen wgmma kernel's
TMA specialization (``cuda_src/varlen_ws.cuh``, ``TMA = 1``) takes one for K and one for V by
value as its first parameter.  CuPy does not bind ``cuTensorMapEncodeTiled``, so it is called
from the driver library through ctypes; the maps are memoised per address and layout, so a call
with the same cache (or a recycled allocation) encodes nothing.
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np

from .types import BF16

MAP_BYTES = 128
# cuda.h: CUtensorMapDataType, CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
# CUtensorMapFloatOOBfill.
_DATA_TYPE = {np.dtype(np.float16): 6, BF16: 9}
_INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_256B, _OOB_FILL_ZEROS = 0, 3, 3, 0
# The box of one copy: 64 elements of the head dim (128 bytes, the swizzle's span), one kv head, and
# rows: a paged cache's 16 (a box lies inside one block of 16 keys or more; varlen_ws.cuh kBoxRows),
# contiguous K/V a whole key tile's 128 (kBlockN: a tile is then one copy a column block).
BOX_COLUMNS = 64
PAGED_BOX_ROWS, CONTIGUOUS_BOX_ROWS = 16, 128
_MEMO_LIMIT = 256  # (K, V) address pairs: a model's layers' caches and then some


@functools.cache
def _encoder():
    """``cuTensorMapEncodeTiled`` of the driver library (libcuda), or None where there is none."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            library = ctypes.CDLL(name)
        except OSError:
            continue
        encode = getattr(library, "cuTensorMapEncodeTiled", None)
        if encode is None:
            return None
        u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
        encode.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                           ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        encode.restype = ctypes.c_int
        return encode
    return None


def available() -> bool:
    """Whether tensor maps can be encoded here (a CUDA 12+ driver library)."""
    return _encoder() is not None


def kv_map_fits(dtype, head_dim: int, heads: int, head_stride: int, slots: int, slot_stride: int) -> bool:
    """Whether a K or V array of ``slots`` rows (``slot_stride`` elements apart) of ``heads`` kv
    heads (``head_stride`` apart) of ``head_dim`` elements has a map :class:`KvMaps` can encode:
    a 16-bit dtype, whole 64-element column blocks, strides of multiples of 16 bytes that nest
    (heads inside a row), and rows that int32 coordinates reach."""
    itemsize = 2
    return (np.dtype(dtype) in _DATA_TYPE and head_dim % 64 == 0 and 0 < slots < 2 ** 31
            and (head_stride * itemsize) % 16 == 0 and (slot_stride * itemsize) % 16 == 0
            and head_stride >= head_dim and slot_stride >= heads * head_stride)


class KvMaps:
    """The K and V tensor maps of one launch shape, memoised per (k, v) address.

    Parameters
    ----------
    dtype : float16 or bfloat16
    head_dim, heads : int
        Elements a row of one head, kv heads.
    strides : tuple
        ``(k_slot, k_head, v_slot, v_head)`` in elements.
    slots : int
        Rows of K and V: a contiguous array's rows, or a paged cache's ``num_blocks * block_size``.
    box_rows : int
        Rows a copy moves: :data:`PAGED_BOX_ROWS` or :data:`CONTIGUOUS_BOX_ROWS`, as the kernel
        issues its copies for the layout (``src.table`` null or not).
    """

    def __init__(self, dtype, head_dim: int, heads: int, strides: tuple, slots: int, box_rows: int):
        if box_rows not in (PAGED_BOX_ROWS, CONTIGUOUS_BOX_ROWS):
            raise ValueError(f"box_rows must be {PAGED_BOX_ROWS} or {CONTIGUOUS_BOX_ROWS}, not {box_rows}")
        self._data_type = _DATA_TYPE[np.dtype(dtype)]
        k_slot, k_head, v_slot, v_head = strides
        # Every argument of the two encodings but the address, built once: a call whose K/V moved
        # (a new allocation each call, as a framework's caching allocator hands out) only encodes.
        u64, u32 = ctypes.c_uint64, ctypes.c_uint32
        shape = (u64 * 3)(head_dim, heads, slots)
        box, ones = (u32 * 3)(BOX_COLUMNS, 1, box_rows), (u32 * 3)(1, 1, 1)
        self._args = [(shape, (u64 * 2)(2 * k_head, 2 * k_slot), box, ones),
                      (shape, (u64 * 2)(2 * v_head, 2 * v_slot), box, ones)]
        self._memo: dict = {}

    def maps(self, k_ptr: int, v_ptr: int) -> bytes:
        """The two maps, 256 bytes (K's then V's), for arrays at these addresses."""
        both = self._memo.get((k_ptr, v_ptr))
        if both is None:
            if len(self._memo) >= _MEMO_LIMIT:
                self._memo.clear()
            both = self._memo[(k_ptr, v_ptr)] = (_encode(self._data_type, k_ptr, *self._args[0])
                                                 + _encode(self._data_type, v_ptr, *self._args[1]))
        return both


def _encode(data_type: int, ptr: int, shape, strides, box, element_strides) -> bytes:
    """One 3-d map as bytes: sizes ``shape`` (innermost first), byte ``strides`` of dims 1 and 2,
    copies of ``box``, 128-byte swizzle, zeros outside the tensor.  Its output buffer is its own (the
    driver call releases the GIL: two threads encoding at once must not share one)."""
    out = (ctypes.c_uint64 * 16)()
    encode = _encoder()
    if encode is None:
        raise RuntimeError("the CUDA driver library has no cuTensorMapEncodeTiled (a CUDA 12 driver is needed)")
    result = encode(out, data_type, 3, ptr, shape, strides, box, element_strides, _INTERLEAVE_NONE, _SWIZZLE_128B,
                    _L2_PROMOTION_256B, _OOB_FILL_ZEROS)
    if result != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUDA error {result} (sizes {list(shape)}, byte "
                           f"strides {list(strides)}, address {ptr:#x})")
    return bytes(out)
