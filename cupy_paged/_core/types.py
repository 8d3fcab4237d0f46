"""Argument checks shared by the CPU reference backend and the CUDA kernels.

Each ``prepare_*`` function takes the public arguments (NumPy arrays or device
:class:`~cupy_paged._core.arrays.Array` descriptors, see ``_arrays``), checks everything that
can be checked on the host without touching device memory and returns a problem
description that both backends run from.  Every failure is a ``ValueError`` or
``TypeError`` whose message starts with the argument's name.  Nothing is converted
silently: integers must be integers, flags must be bools, index arrays int32 (NumPy
int64 index arrays are range-checked before the cast).

Values inside index arrays (``cu_seqlens``, ``block_table``, ``cache_seqlens``, slots) are
checked on the host when they are NumPy arrays (no copy needed), and on device arrays only
with ``check_values=True`` (a copy and a sync).  By default the kernels check them
instead: a bad entry is a hole, recorded in the device error word (``_errors``).
"""
from __future__ import annotations

import math
import numbers

import ml_dtypes
import numpy as np

from .arrays import CUDA, Array, read

BF16 = np.dtype(ml_dtypes.bfloat16)
KERNEL_DTYPES = (np.dtype(np.float16), BF16)
REFERENCE_DTYPES = KERNEL_DTYPES + (np.dtype(np.float32), np.dtype(np.float64))
HEAD_DIMS = (32, 64, 96, 128, 256)
BLOCK_SIZES = tuple(2 ** i for i in range(3, 9))  # 8 .. 256
WINDOW_CAP = 1 << 30  # windows are clamped to this: wider than any sequence, int32-safe
INT32, INT64 = np.dtype(np.int32), np.dtype(np.int64)
INT32_MAX = 2 ** 31 - 1


def dtype_name(dtype) -> str:
    return "bfloat16" if np.dtype(dtype) == BF16 else np.dtype(dtype).name


def c_contiguous(array) -> bool:
    return array.c_contiguous() if isinstance(array, Array) else array.flags.c_contiguous


def element_strides(array) -> tuple:
    if isinstance(array, Array):
        return array.strides
    return tuple(s // array.itemsize for s in array.strides)


def as_read(obj, name: str):
    """An argument as the checks take it: NumPy arrays and :class:`Array` descriptors as they are,
    any other array read at the boundary (for direct callers of the ``prepare_*`` functions)."""
    if obj is None or isinstance(obj, (np.ndarray, Array, numbers.Number)):
        return obj
    return read(obj, name)


# --------------------------------------------------------------------------- scalars

def check_bool(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool; got {value!r}")
    return bool(value)


def check_int(value, name: str, minimum: int | None = 0, maximum: int | None = None) -> int:
    """An integer (Python or NumPy, never a bool or a float), at least ``minimum`` and at most
    ``maximum``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int; got {value!r}")
    value = int(value)  # an Integral: exact
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}; got {value}")
    return value


def check_real(value, name: str) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number; got {value!r}")
    return float(value)  # a Real: a float (at most rounded to the nearest double)


def check_counts(values, size: int, name: str) -> np.ndarray:
    """``values`` -- one int for every sequence, or ``[size]`` ints -- as int64 ``[size]``: a
    TypeError for what is not ints (1.5 is no count) and a ValueError for another length, both
    naming ``name``, before any cast."""
    array = np.asarray(values)
    if array.size and array.dtype.kind not in "iu":
        raise TypeError(f"{name} must be ints; got {values!r}")
    if array.ndim == 0:
        return np.full(size, int(array), np.int64)
    if array.shape != (size,):
        raise ValueError(f"{name} must have shape [{size}] (one per sequence) or be one int; got {array.shape}")
    return np.ascontiguousarray(array, np.int64)  # no copy when it is one already


# --------------------------------------------------------------------------- small checks

def check_rank(array, name: str, ranks: tuple[int, ...], layout: str) -> None:
    if array.ndim not in ranks:
        raise ValueError(f"{name} must have shape {layout}; got {tuple(array.shape)}")


def check_float(array, name: str, backend: str) -> None:
    allowed = KERNEL_DTYPES if backend == CUDA else REFERENCE_DTYPES
    if array.dtype not in allowed:
        names = ", ".join(dtype_name(d) for d in allowed)
        raise TypeError(f"{name} must have dtype {names} on {backend}; got {dtype_name(array.dtype)}")


def check_same_dtype(reference, name_ref: str, **others) -> None:
    for name, array in others.items():
        if array is not None and array.dtype != reference.dtype:
            raise TypeError(f"{name} must have the dtype of {name_ref} ({dtype_name(reference.dtype)}); "
                            f"got {dtype_name(array.dtype)}")


def check_index(array, name: str, ndim: int, layout: str):
    """An int32 index array of rank ``ndim``.  Device arrays must be int32 already; a NumPy int64
    array is range-checked, then cast (a host copy, no device work)."""
    if array.ndim != ndim:
        raise ValueError(f"{name} must have shape {layout}; got {tuple(array.shape)}")
    if isinstance(array, Array):
        if array.dtype != INT32:
            raise TypeError(f"{name} must have dtype int32 on a GPU; got {dtype_name(array.dtype)}")
        return array
    if array.dtype == INT64:
        if array.size and (int(array.min()) < -2 ** 31 or int(array.max()) >= 2 ** 31):
            raise ValueError(f"{name} holds values outside int32's range")
    elif array.dtype != INT32:
        raise TypeError(f"{name} must have dtype int32 (or int64 on the CPU); got {dtype_name(array.dtype)}")
    return np.ascontiguousarray(array, dtype=np.int32)


def check_heads(num_heads: int, num_kv_heads: int, q_name: str, k_name: str) -> None:
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{q_name} has {num_heads} heads, which {k_name}'s {num_kv_heads} kv heads "
                         "must divide (GQA/MQA needs num_heads % num_kv_heads == 0)")


def check_head_dim(head_dim: int, name: str) -> None:
    if head_dim not in HEAD_DIMS:
        what = "head_dim must be" if name == "head_dim" else f"{name}'s last axis (head_dim) must be"
        raise ValueError(f"{what} one of the supported head dims {HEAD_DIMS}; got {head_dim}")


def check_block_size(block_size: int, name: str) -> None:
    if block_size not in BLOCK_SIZES:
        what = "block_size" if name == "block_size" else f"{name}'s block size (axis 1)"
        raise ValueError(f"{what} {block_size} is not supported; block sizes are powers of two "
                         f"from {BLOCK_SIZES[0]} to {BLOCK_SIZES[-1]}")


def check_window(window_size, causal: bool = False) -> tuple[int, int]:
    """``(left, right)`` of ``window_size``; ``causal`` folds in as a right bound of 0."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right) of ints; got {window_size!r}") from None
    for w in (left, right):
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, numbers.Integral):
            raise TypeError(f"window_size must be a pair (left, right) of ints; got {window_size!r}")
    left, right = int(left), int(right)
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= 0, or -1 for unbounded; got {window_size!r}")
    # A window wider than any sequence is no window bound at all; clamped, it fits the kernels'
    # int32 index arithmetic (a row position plus the window never overflows).
    return min(left, WINDOW_CAP), 0 if causal else min(right, WINDOW_CAP)


def check_scalars(softmax_scale, softcap, head_dim: int) -> tuple[float, float]:
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else check_real(softmax_scale, "softmax_scale")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"softmax_scale must be a finite positive number; got {softmax_scale!r}")
    softcap = check_real(softcap, "softcap")
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 disables it); got {softcap!r}")
    return scale, softcap


def check_alibi(alibi_slopes, num_heads: int, batch: int):
    """ALiBi slopes ``[num_heads]`` or ``[batch, num_heads]``, float32 (a float32 NumPy copy on
    the CPU; a device array must be float32 and contiguous already)."""
    if alibi_slopes is None:
        return None
    if tuple(alibi_slopes.shape) not in ((num_heads,), (1, num_heads), (batch, num_heads)):
        raise ValueError(f"alibi_slopes must have shape [num_heads] = [{num_heads}] or [batch_size, num_heads] "
                         f"= [{batch}, {num_heads}]; got {tuple(alibi_slopes.shape)}")
    if isinstance(alibi_slopes, Array):
        if alibi_slopes.dtype != np.float32:
            raise TypeError(f"alibi_slopes must have dtype float32 on a GPU; got {dtype_name(alibi_slopes.dtype)}")
        if not alibi_slopes.c_contiguous():
            raise ValueError("alibi_slopes must be contiguous")
        return alibi_slopes
    if alibi_slopes.dtype.kind != "f":
        raise TypeError(f"alibi_slopes must be floating point; got {dtype_name(alibi_slopes.dtype)}")
    slopes = np.ascontiguousarray(alibi_slopes, dtype=np.float32)
    return slopes.reshape(num_heads) if slopes.shape == (1, num_heads) else slopes


def alibi_batch_stride(slopes) -> int:
    """0 for slopes ``[H]`` (and ``[1, H]``), H for ``[B, H]`` with B > 1."""
    return 0 if slopes is None or slopes.ndim == 1 or slopes.shape[0] == 1 else int(slopes.shape[1])


def check_out(out, name: str, shape: tuple, dtype, backend: str):
    """The output array: ``out`` checked; None stays None on a GPU (the launch makes it in the
    caller's kind), a new NumPy array on the CPU."""
    if out is None:
        return None if backend == CUDA else np.empty(shape, dtype=dtype)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}; got {tuple(out.shape)}")
    if out.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype_name(dtype)}; got {dtype_name(out.dtype)}")
    check_writable(out, name, "the call writes the result into it")
    if not c_contiguous(out):
        raise ValueError(f"{name} must be C-contiguous")
    if isinstance(out, Array) and out.ptr % 16:
        raise ValueError(f"{name} must start on a 16-byte boundary")
    return out


def check_writable(array, name: str, why: str) -> None:
    """A NumPy array the call writes into must be writeable (device arrays always are)."""
    if isinstance(array, np.ndarray) and not array.flags.writeable:
        raise ValueError(f"{name} is read-only, but {why}")


def check_same_shape(a, b, a_name: str, b_name: str) -> None:
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"{b_name} must have the shape of {a_name} {tuple(a.shape)}; got {tuple(b.shape)}")


def check_cache_pair(k_cache, v_cache, k_name: str = "k_cache", v_name: str = "v_cache") -> None:
    """Caches: the same shape, C-contiguous, so that the kernels reach every slot (block *
    block_size + offset) with one stride, and on a GPU 16-byte aligned, as the kernels read and
    write them 16 bytes at a time (a cache is never copied to fix either)."""
    check_same_shape(k_cache, v_cache, k_name, v_name)
    for name, cache in ((k_name, k_cache), (v_name, v_cache)):
        if not c_contiguous(cache):
            raise ValueError(f"{name} must be C-contiguous")
        if isinstance(cache, Array) and cache.ptr % 16:
            raise ValueError(f"{name} must start on a 16-byte boundary")


def check_lse(lse_out, shape: tuple, backend: str, wanted: bool):
    """The LSE buffer: ``lse_out`` checked (float32, ``shape``); else a new one when wanted (on a
    GPU: made by the launch), else None.  Returns (buffer or None, wanted)."""
    if lse_out is None:
        return (np.empty(shape, np.float32) if wanted and backend != CUDA else None), wanted
    return check_out(lse_out, "lse_out", shape, np.dtype(np.float32), backend), True


def check_dense_last(array, name: str) -> None:
    """Kernels read rows of head_dim elements with vector loads: the last axis must be dense."""
    if array.size and array.shape[-1] > 1 and element_strides(array)[-1] != 1:
        raise ValueError(f"{name} must be contiguous in its last (head_dim) axis")


def check_values_mode(check_values) -> bool | None:
    if check_values is not None:
        check_bool(check_values, "check_values")
    return check_values


def host_checked(check_values, *arrays) -> bool:
    """Whether index values are checked on the host: always for NumPy arrays (no copy) unless
    ``check_values=False``; for device arrays only with ``check_values=True``, and never while
    the current stream captures a CUDA graph (a copy there would break the capture)."""
    if check_values is False:
        return False
    device = [a for a in arrays if isinstance(a, Array)]
    if not device:
        return True
    if check_values is None:
        return False
    import cupy

    return not cupy.cuda.get_current_stream().is_capturing()


def check_block_table_values(table: np.ndarray, needed_keys: np.ndarray, block_size: int,
                             num_blocks: int, name: str = "block_table") -> None:
    """Every block a sequence needs for ``needed_keys[b]`` keys is listed and in range."""
    needed_blocks = -(-needed_keys // block_size)
    if table.shape[0] and int(needed_blocks.max(initial=0)) > table.shape[1]:
        b = int(np.argmax(needed_blocks))
        raise ValueError(f"{name} has {table.shape[1]} columns but sequence {b} needs "
                         f"{int(needed_blocks[b])} blocks for {int(needed_keys[b])} keys")
    used = np.arange(table.shape[1])[None, :] < needed_blocks[:, None]
    bad = used & ((table < 0) | (table >= num_blocks))
    if bad.any():
        b, j = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name}[{b}, {j}] = {int(table[b, j])} is not a block id in "
                         f"[0, {num_blocks}) although sequence {b} needs that block")

