"""Argument checks shared by the CPU reference backend and the CUDA kernels.

Each ``prepare_*`` function takes the public arguments (NumPy arrays or device
:class:`~cupy_paged._arrays.Array` descriptors, see ``_arrays``), checks everything that
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

import dataclasses
import math
import numbers

import ml_dtypes
import numpy as np

from ._arrays import CUDA, Array, backend_of, read, to_host

BF16 = np.dtype(ml_dtypes.bfloat16)
KERNEL_DTYPES = (np.dtype(np.float16), BF16)
REFERENCE_DTYPES = KERNEL_DTYPES + (np.dtype(np.float32), np.dtype(np.float64))
HEAD_DIMS = (32, 64, 96, 128, 256)
BLOCK_SIZES = tuple(2 ** i for i in range(3, 9))  # 8 .. 256
WINDOW_CAP = 1 << 30  # windows are clamped to this: wider than any sequence, int32-safe
INT32, INT64 = np.dtype(np.int32), np.dtype(np.int64)


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


def check_int(value, name: str, minimum: int | None = 0) -> int:
    """An integer (Python or NumPy, never a bool or a float), at least ``minimum``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int; got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")
    return value


def check_real(value, name: str) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number; got {value!r}")
    return float(value)


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
        raise ValueError(f"{what} one of the supported head dims {HEAD_DIMS}; got head dim {head_dim}")


def check_block_size(block_size: int, name: str) -> None:
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"{name} has block size {block_size}; supported: powers of two "
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
    if not c_contiguous(out):
        raise ValueError(f"{name} must be C-contiguous")
    if isinstance(out, Array) and out.ptr % 16:
        raise ValueError(f"{name} must start on a 16-byte boundary")
    return out


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


# --------------------------------------------------------------------------- varlen

@dataclasses.dataclass
class VarlenProblem:
    """A checked ``flash_attn_varlen_func`` call.

    ``q``/``out`` are ``[total_q, H, D]``; ``k``/``v`` are ``[total_k, Hkv, D]``, or
    paged caches ``[num_blocks, block_size, Hkv, D]`` when ``block_table`` is set.
    ``window`` folds ``causal`` in: causal means right = 0.  ``alibi_slopes`` is float32
    ``[H]`` or ``[B, H]``.  ``lse`` is ``[H, total_q]`` float32 or None; on a GPU ``out`` and
    ``lse`` may be None with ``want_lse`` saying whether the launch makes an LSE.
    """

    backend: str
    q: object
    k: object
    v: object
    cu_seqlens_q: object
    cu_seqlens_k: object
    max_seqlen_q: int
    block_table: object
    softmax_scale: float
    window: tuple[int, int]  # causal is folded in: a right bound of 0
    softcap: float
    alibi_slopes: object
    out: object
    lse: object
    want_lse: bool = False
    max_seqlen_k: int = 0

    @property
    def batch(self) -> int:
        return int(self.cu_seqlens_q.shape[0]) - 1

    @property
    def num_heads(self) -> int:
        return int(self.q.shape[1])

    @property
    def num_kv_heads(self) -> int:
        return int(self.k.shape[-2])

    @property
    def head_dim(self) -> int:
        return int(self.q.shape[-1])

    @property
    def block_size(self) -> int | None:
        return None if self.block_table is None else int(self.k.shape[1])


def drop_unit_batch(array):
    """Accept the ``[1, total, H, D]`` form of a packed batch."""
    if array is not None and array.ndim == 4 and array.shape[0] == 1:
        if isinstance(array, Array):
            return Array(array.obj, array.kind, array.ptr, array.shape[1:], array.strides[1:], array.dtype,
                         array.device)
        return array[0]
    return array


def prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, block_table,
                   return_softmax_lse, out, check_values=None, lse_out=None) -> VarlenProblem:
    q, k, v, out, lse_out = (as_read(a, n) for a, n in ((q, "q"), (k, "k"), (v, "v"), (out, "out"),
                                                        (lse_out, "lse_out")))
    cu_seqlens_q, cu_seqlens_k = as_read(cu_seqlens_q, "cu_seqlens_q"), as_read(cu_seqlens_k, "cu_seqlens_k")
    alibi_slopes, block_table = as_read(alibi_slopes, "alibi_slopes"), as_read(block_table, "block_table")
    backend = backend_of(dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                              alibi_slopes=alibi_slopes, block_table=block_table, out=out, lse_out=lse_out))
    causal = check_bool(causal, "causal")
    return_softmax_lse = check_bool(return_softmax_lse, "return_softmax_lse")
    check_values = check_values_mode(check_values)
    paged = block_table is not None
    q = drop_unit_batch(q)
    check_rank(q, "q", (3,), "[total_q, num_heads, head_dim] (or [1, total_q, num_heads, head_dim])")
    if paged:
        check_rank(k, "k", (4,), "[num_blocks, block_size, num_kv_heads, head_dim] with block_table")
        check_rank(v, "v", (4,), "[num_blocks, block_size, num_kv_heads, head_dim] with block_table")
    else:
        k, v = drop_unit_batch(k), drop_unit_batch(v)
        check_rank(k, "k", (3,), "[total_k, num_kv_heads, head_dim] (or [1, total_k, num_kv_heads, head_dim])")
        check_rank(v, "v", (3,), "[total_k, num_kv_heads, head_dim] (or [1, total_k, num_kv_heads, head_dim])")
    for name, array in (("q", q), ("k", k), ("v", v)):
        check_float(array, name, backend)
        check_dense_last(array, name)
    check_same_dtype(q, "q", k=k, v=v)
    check_same_shape(k, v, "k", "v")
    total_q, num_heads, head_dim = (int(s) for s in q.shape)
    check_head_dim(head_dim, "q")
    if int(k.shape[-1]) != head_dim:
        raise ValueError(f"k must have head dim {head_dim} like q; got {int(k.shape[-1])}")
    check_heads(num_heads, int(k.shape[-2]), "q", "k")
    if paged:
        check_block_size(int(k.shape[1]), "k")
        check_cache_pair(k, v, "k", "v")

    cu_q = check_index(cu_seqlens_q, "cu_seqlens_q", 1, "[batch_size + 1]")
    cu_k = check_index(cu_seqlens_k, "cu_seqlens_k", 1, "[batch_size + 1]")
    if cu_q.shape[0] < 1:
        raise ValueError("cu_seqlens_q must have shape [batch_size + 1] with at least one entry")
    if tuple(cu_k.shape) != tuple(cu_q.shape):
        raise ValueError(f"cu_seqlens_k must have shape [batch_size + 1] = {tuple(cu_q.shape)} "
                         f"like cu_seqlens_q; got {tuple(cu_k.shape)}")
    batch = int(cu_q.shape[0]) - 1
    max_seqlen_q = check_int(max_seqlen_q, "max_seqlen_q")
    max_seqlen_k = check_int(max_seqlen_k, "max_seqlen_k")
    if paged:
        block_table = check_index(block_table, "block_table", 2, "[batch_size, max_blocks_per_seq]")
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table must have shape [batch_size = {batch}, max_blocks_per_seq]; "
                             f"got {tuple(block_table.shape)}")

    if host_checked(check_values, cu_q, cu_k, block_table):
        host_q, host_k = to_host(cu_q), to_host(cu_k)
        for name, cu, max_len in (("cu_seqlens_q", host_q, max_seqlen_q),
                                  ("cu_seqlens_k", host_k, max_seqlen_k)):
            lengths = np.diff(cu)
            if cu[0] != 0 or (lengths < 0).any():
                raise ValueError(f"{name} must start at 0 and never decrease; got {cu.tolist()[:16]}")
            if lengths.size and int(lengths.max()) > max_len:
                short = "max_seqlen_q" if name == "cu_seqlens_q" else "max_seqlen_k"
                raise ValueError(f"{short} = {max_len} is less than the longest sequence "
                                 f"({int(lengths.max())}) in {name}")
        if int(host_q[-1]) != total_q:
            raise ValueError(f"cu_seqlens_q[-1] = {int(host_q[-1])} must equal q's token count {total_q}")
        if paged:
            check_block_table_values(to_host(block_table), np.diff(host_k), int(k.shape[1]), int(k.shape[0]))
        elif int(host_k[-1]) != int(k.shape[0]):
            raise ValueError(f"cu_seqlens_k[-1] = {int(host_k[-1])} must equal k's token count {int(k.shape[0])}")

    left, right = check_window(window_size, causal)
    scale, softcap = check_scalars(softmax_scale, softcap, head_dim)
    slopes = check_alibi(alibi_slopes, num_heads, batch)
    out = check_out(drop_unit_batch(out), "out", (total_q, num_heads, head_dim), q.dtype, backend)
    lse, want_lse = check_lse(lse_out, (num_heads, total_q), backend, return_softmax_lse)
    return VarlenProblem(backend, q, k, v, cu_q, cu_k, max_seqlen_q, block_table,
                         scale, (left, right), softcap, slopes, out, lse, want_lse, max_seqlen_k)


# --------------------------------------------------------------------------- decode

@dataclasses.dataclass
class DecodeProblem:
    """A checked ``flash_attn_with_kvcache`` call.

    ``q``/``out`` ``[B, Sq, H, D]``; caches ``[num_blocks, block_size, Hkv, D]`` with
    ``block_table`` int32 ``[B, max_blocks]``, or ``block_table`` None and a contiguous cache
    ``[Bc, S, Hkv, D]`` (sequence b is row ``cache_batch_idx[b]``, default b); ``cache_seqlens``
    int32 ``[B]``, or a Python int for every sequence; ``k_new``/``v_new`` ``[B, Sn, Hkv, D]`` or
    None; ``lse`` ``[B, H, Sq]`` or None (on a GPU, ``want_lse`` says whether the launch makes
    one).  No index array is built for the caller: the kernels take the None and the int as
    they are.
    """

    backend: str
    q: object
    k_cache: object
    v_cache: object
    k_new: object
    v_new: object
    cache_seqlens: object
    block_table: object
    softmax_scale: float
    window: tuple[int, int]  # causal is folded in: a right bound of 0
    softcap: float
    alibi_slopes: object
    num_splits: int
    out: object
    lse: object
    rotary_cos: object = None       # [seqlen_ro, rotary_dim / 2] or None
    rotary_sin: object = None
    rotary_interleaved: bool = True  # GPT-J pairs (2i, 2i + 1); False: GPT-NeoX (i, i + rotary_dim / 2)
    rotary_per_token: bool = False   # q token i at position cache_seqlens[b] + i (causal or windowed)
    cache_batch_idx: object = None   # int32 [B]: the contiguous cache's row of each sequence
    cache_leftpad: object = None     # int32 [B]: each sequence's first valid cache position
    want_lse: bool = False

    @property
    def rotary_dim(self) -> int:
        return 0 if self.rotary_cos is None else 2 * int(self.rotary_cos.shape[1])

    @property
    def batch(self) -> int:
        return int(self.q.shape[0])

    @property
    def seqlen_q(self) -> int:
        return int(self.q.shape[1])

    @property
    def seqlen_new(self) -> int:
        return 0 if self.k_new is None else int(self.k_new.shape[1])

    @property
    def num_heads(self) -> int:
        return int(self.q.shape[2])

    @property
    def num_kv_heads(self) -> int:
        return int(self.k_cache.shape[2])

    @property
    def head_dim(self) -> int:
        return int(self.q.shape[3])

    @property
    def block_size(self) -> int:
        return int(self.k_cache.shape[1])


def _check_rotary(rotary_cos, rotary_sin, q, k, head_dim: int, backend: str):
    if rotary_cos is None and rotary_sin is None:
        return None, None
    if rotary_cos is None or rotary_sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if k is None:
        raise ValueError("rotary_cos needs new tokens k and v: the rotation applies to q and the new keys")
    check_rank(rotary_cos, "rotary_cos", (2,), "[seqlen_ro, rotary_dim / 2]")
    check_same_shape(rotary_cos, rotary_sin, "rotary_cos", "rotary_sin")
    rotary_dim = 2 * int(rotary_cos.shape[1])
    if rotary_dim == 0 or rotary_dim > head_dim or rotary_dim % 16:
        raise ValueError(f"rotary_cos must have shape [seqlen_ro, rotary_dim / 2] with rotary_dim a multiple of "
                         f"16 and at most head_dim = {head_dim}; got {tuple(rotary_cos.shape)}")
    for name, array in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if backend == CUDA:
            if array.dtype != q.dtype:
                raise TypeError(f"{name} must have q's dtype ({dtype_name(q.dtype)}) on a GPU; "
                                f"got {dtype_name(array.dtype)}")
            if not array.c_contiguous():
                raise ValueError(f"{name} must be C-contiguous")
        elif array.dtype not in REFERENCE_DTYPES:
            raise TypeError(f"{name} must be floating point; got {dtype_name(array.dtype)}")
    return rotary_cos, rotary_sin


def prepare_decode(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                   cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                   window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                   return_softmax_lse=False, out=None, lse_out=None, check_values=None) -> DecodeProblem:
    q, k_cache, v_cache, k, v = (as_read(a, n) for a, n in ((q, "q"), (k_cache, "k_cache"), (v_cache, "v_cache"),
                                                            (k, "k"), (v, "v")))
    rotary_cos, rotary_sin = as_read(rotary_cos, "rotary_cos"), as_read(rotary_sin, "rotary_sin")
    cache_seqlens, cache_batch_idx = as_read(cache_seqlens, "cache_seqlens"), as_read(cache_batch_idx, "cache_batch_idx")
    cache_leftpad, block_table = as_read(cache_leftpad, "cache_leftpad"), as_read(block_table, "block_table")
    alibi_slopes, out, lse_out = as_read(alibi_slopes, "alibi_slopes"), as_read(out, "out"), as_read(lse_out, "lse_out")
    seqlens_array = None if cache_seqlens is None or isinstance(cache_seqlens, numbers.Number) else cache_seqlens
    backend = backend_of(dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, rotary_cos=rotary_cos,
                              rotary_sin=rotary_sin, cache_seqlens=seqlens_array, cache_batch_idx=cache_batch_idx,
                              cache_leftpad=cache_leftpad, block_table=block_table,
                              alibi_slopes=alibi_slopes, out=out, lse_out=lse_out))
    causal = check_bool(causal, "causal")
    rotary_interleaved = check_bool(rotary_interleaved, "rotary_interleaved")
    return_softmax_lse = check_bool(return_softmax_lse, "return_softmax_lse")
    check_values = check_values_mode(check_values)
    check_rank(q, "q", (4,), "[batch_size, seqlen_q, num_heads, head_dim]")
    cache_layout = ("[num_blocks, block_size, num_kv_heads, head_dim]" if block_table is not None
                    else "[batch_size, seqlen_cache, num_kv_heads, head_dim]")
    check_rank(k_cache, "k_cache", (4,), cache_layout)
    check_rank(v_cache, "v_cache", (4,), cache_layout)
    for name, array in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_float(array, name, backend)
        check_dense_last(array, name)
    check_same_dtype(q, "q", k_cache=k_cache, v_cache=v_cache, k=k, v=v)
    check_cache_pair(k_cache, v_cache)
    batch, seqlen_q, num_heads, head_dim = (int(s) for s in q.shape)
    if seqlen_q < 1:
        raise ValueError(f"q must hold at least one query token per sequence; got seqlen_q = {seqlen_q}")
    check_head_dim(head_dim, "q")
    if int(k_cache.shape[3]) != head_dim:
        raise ValueError(f"k_cache must have head dim {head_dim} like q; got {int(k_cache.shape[3])}")
    num_kv_heads = int(k_cache.shape[2])
    check_heads(num_heads, num_kv_heads, "q", "k_cache")

    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new tokens to append) or both be None")
    seqlen_new = 0
    if k is not None:
        kv_layout = f"[batch_size = {batch}, seqlen_new, num_kv_heads = {num_kv_heads}, head_dim = {head_dim}]"
        for name, array in (("k", k), ("v", v)):
            check_rank(array, name, (4,), kv_layout)
            if (int(array.shape[0]), int(array.shape[2]), int(array.shape[3])) != (batch, num_kv_heads, head_dim):
                raise ValueError(f"{name} must have shape {kv_layout}; got {tuple(array.shape)}")
            check_dense_last(array, name)
        check_same_shape(k, v, "k", "v")
        seqlen_new = int(k.shape[1])
    rotary_cos, rotary_sin = _check_rotary(rotary_cos, rotary_sin, q, k, head_dim, backend)

    paged = block_table is not None
    if paged:
        check_block_size(int(k_cache.shape[1]), "k_cache")
        block_table = check_index(block_table, "block_table", 2, "[batch_size, max_blocks_per_seq]")
        if int(block_table.shape[0]) != batch:
            raise ValueError(f"block_table must have shape [batch_size = {batch}, max_blocks_per_seq]; "
                             f"got {tuple(block_table.shape)}")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx selects rows of a contiguous cache: pass it without block_table")
        if cache_leftpad is not None:
            raise ValueError("cache_leftpad applies to a contiguous cache: pass it without block_table")
    else:
        rows = int(k_cache.shape[0])
        if cache_batch_idx is None and rows != batch:
            raise ValueError(f"k_cache must have shape [batch_size = {batch}, seqlen_cache, num_kv_heads, "
                             f"head_dim] without block_table (or pass cache_batch_idx); got {tuple(k_cache.shape)}")
        if rows * int(k_cache.shape[1]) >= 2**31:
            raise ValueError(f"k_cache holds {rows * int(k_cache.shape[1])} token rows; the decode kernel "
                             "indexes at most 2**31 - 1 of them")
    if cache_batch_idx is not None:
        cache_batch_idx = check_index(cache_batch_idx, "cache_batch_idx", 1, f"[batch_size = {batch}]")
        if int(cache_batch_idx.shape[0]) != batch:
            raise ValueError(f"cache_batch_idx must have shape [batch_size = {batch}]; got {tuple(cache_batch_idx.shape)}")
    if cache_leftpad is not None:
        cache_leftpad = check_index(cache_leftpad, "cache_leftpad", 1, f"[batch_size = {batch}]")
        if int(cache_leftpad.shape[0]) != batch:
            raise ValueError(f"cache_leftpad must have shape [batch_size = {batch}]; got {tuple(cache_leftpad.shape)}")

    # Keys a sequence can hold: its table row's blocks, or the contiguous cache's length.
    capacity = (int(block_table.shape[1]) * int(k_cache.shape[1])) if paged else int(k_cache.shape[1])
    if cache_seqlens is None:
        if paged and block_table.shape[1] != 1:
            raise ValueError("cache_seqlens is required with a paged cache (block_table)")
        cache_seqlens = capacity - seqlen_new
        if cache_seqlens < 0:
            raise ValueError(f"k has {seqlen_new} new tokens, more than the cache's {capacity} slots "
                             "(pass cache_seqlens)")
    elif isinstance(cache_seqlens, numbers.Number):
        cache_seqlens = check_int(cache_seqlens, "cache_seqlens")
        if cache_seqlens + seqlen_new > capacity:
            where = "the block table row" if paged else "k_cache's seqlen_cache axis"
            raise ValueError(f"cache_seqlens = {cache_seqlens} plus {seqlen_new} new tokens is more than the "
                             f"{capacity} keys {where} holds")
    else:
        cache_seqlens = check_index(cache_seqlens, "cache_seqlens", 1, f"[batch_size = {batch}]")
        if int(cache_seqlens.shape[0]) != batch:
            raise ValueError(f"cache_seqlens must have shape [batch_size = {batch}]; "
                             f"got {tuple(cache_seqlens.shape)}")

    index_arrays = [a for a in (cache_seqlens, block_table, cache_batch_idx, cache_leftpad)
                    if a is not None and not isinstance(a, int)]
    if host_checked(check_values, *index_arrays):
        _check_decode_values(cache_seqlens, block_table, cache_batch_idx, cache_leftpad, batch, seqlen_new,
                             k_cache, rotary_cos)

    num_splits = check_int(num_splits, "num_splits")
    left, right = check_window(window_size, causal)
    scale, softcap = check_scalars(softmax_scale, softcap, head_dim)
    slopes = check_alibi(alibi_slopes, num_heads, batch)
    out = check_out(out, "out", (batch, seqlen_q, num_heads, head_dim), q.dtype, backend)
    lse, want_lse = check_lse(lse_out, (batch, num_heads, seqlen_q), backend, return_softmax_lse)
    return DecodeProblem(backend, q, k_cache, v_cache, k, v, cache_seqlens, block_table, scale,
                         (left, right), softcap, slopes, num_splits, out, lse, rotary_cos, rotary_sin,
                         rotary_interleaved, causal or tuple(window_size) != (-1, -1), cache_batch_idx,
                         cache_leftpad, want_lse)


def _check_decode_values(cache_seqlens, block_table, cache_batch_idx, cache_leftpad, batch, seqlen_new,
                         k_cache, rotary_cos) -> None:
    """The host half of the value checks (copies device index arrays: only with check_values)."""
    if isinstance(cache_seqlens, int):
        lengths = np.full(batch, cache_seqlens, np.int64)
    else:
        lengths = to_host(cache_seqlens).astype(np.int64)
        if (lengths < 0).any():
            raise ValueError(f"cache_seqlens must be >= 0; got {lengths.tolist()[:16]}")
    start = np.zeros(batch, np.int64)
    if cache_leftpad is not None:
        start = to_host(cache_leftpad).astype(np.int64)
        if ((start < 0) | (start > lengths)).any():
            b = int(np.argmax((start < 0) | (start > lengths)))
            raise ValueError(f"cache_leftpad[{b}] = {int(start[b])} must be in [0, cache_seqlens[{b}] = "
                             f"{int(lengths[b])}]")
    if rotary_cos is not None and batch:
        top = int((lengths + max(seqlen_new, 1) - 1).max())
        if top >= int(rotary_cos.shape[0]):
            raise ValueError(f"rotary_cos has {int(rotary_cos.shape[0])} rows but position {top} is rotated")
    if block_table is not None:
        check_block_table_values(to_host(block_table), lengths + seqlen_new, int(k_cache.shape[1]),
                                 int(k_cache.shape[0]))
        return
    if cache_batch_idx is not None:
        rows = to_host(cache_batch_idx)
        if ((rows < 0) | (rows >= int(k_cache.shape[0]))).any():
            b = int(np.argmax((rows < 0) | (rows >= int(k_cache.shape[0]))))
            raise ValueError(f"cache_batch_idx[{b}] = {int(rows[b])} is not a row of k_cache "
                             f"(it has {int(k_cache.shape[0])})")
    if batch and int((lengths + seqlen_new).max()) > int(k_cache.shape[1]):
        b = int(np.argmax(lengths + seqlen_new))
        raise ValueError(f"cache_seqlens[{b}] = {int(lengths[b])} plus {seqlen_new} new tokens is more than "
                         f"k_cache's {int(k_cache.shape[1])} positions")


# --------------------------------------------------------------------------- cache writes

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
