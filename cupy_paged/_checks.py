"""Argument checks shared by the CPU reference backend and the CUDA kernels.

Each ``prepare_*`` function takes the public arguments (already arrays, see
``_arrays``), checks everything that can be checked on the host and returns a
problem description that both backends run from.  Every failure is a
``ValueError`` or ``TypeError`` whose message starts with the argument's name.

Index arrays that live on the GPU (``cu_seqlens``, ``block_table``,
``cache_seqlens``) are copied to the host for the value checks, unless the
current stream is being captured into a CUDA graph (a copy there would break
the capture) or the caller passed ``check_values=False``.  The kernels never
read or write outside their arrays whatever those values are: they treat a
block id outside ``[0, num_blocks)`` as a hole.
"""
from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np

from ._arrays import CUDA, backend_of, to_host, xp_of

BF16 = np.dtype(ml_dtypes.bfloat16)
KERNEL_DTYPES = (np.dtype(np.float16), BF16)
REFERENCE_DTYPES = KERNEL_DTYPES + (np.dtype(np.float32), np.dtype(np.float64))
HEAD_DIMS = (32, 64, 96, 128, 256)
BLOCK_SIZES = tuple(2 ** i for i in range(3, 9))  # 8 .. 256
WINDOW_CAP = 1 << 30  # windows are clamped to this: wider than any sequence, int32-safe
INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


def dtype_name(dtype) -> str:
    return "bfloat16" if np.dtype(dtype) == BF16 else np.dtype(dtype).name


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
    """An integer index array of rank ``ndim`` as int32 (same side)."""
    if array.ndim != ndim:
        raise ValueError(f"{name} must have shape {layout}; got {tuple(array.shape)}")
    if array.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must have dtype int32 (or int64); got {dtype_name(array.dtype)}")
    return xp_of(array).ascontiguousarray(array, dtype=np.int32)


def check_heads(num_heads: int, num_kv_heads: int, q_name: str, k_name: str) -> None:
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{q_name} has {num_heads} heads, which {k_name}'s {num_kv_heads} kv heads "
                         "must divide (GQA/MQA needs num_heads % num_kv_heads == 0)")


def check_head_dim(head_dim: int, name: str) -> None:
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"{name} has head dim {head_dim}; supported: {HEAD_DIMS}")


def check_block_size(block_size: int, name: str) -> None:
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"{name} has block size {block_size}; supported: powers of two "
                         f"from {BLOCK_SIZES[0]} to {BLOCK_SIZES[-1]}")


def check_window(window_size, causal: bool = False) -> tuple[int, int]:
    """``(left, right)`` of ``window_size``; ``causal`` folds in as a right bound of 0."""
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right) of ints; got {window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= 0, or -1 for unbounded; got {window_size!r}")
    # A window wider than any sequence is no window bound at all; clamped, it fits the kernels'
    # int32 index arithmetic (a row position plus the window never overflows).
    return min(left, WINDOW_CAP), 0 if causal else min(right, WINDOW_CAP)


def check_scalars(softmax_scale, softcap, head_dim: int) -> tuple[float, float]:
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"softmax_scale must be a finite positive number; got {softmax_scale!r}")
    softcap = float(softcap)
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 disables it); got {softcap!r}")
    return scale, softcap


def check_alibi(alibi_slopes, num_heads: int):
    if alibi_slopes is None:
        return None
    if alibi_slopes.shape not in ((num_heads,), (1, num_heads)):
        raise ValueError(f"alibi_slopes must have shape [num_heads] = [{num_heads}] (or "
                         f"[1, {num_heads}]); got {tuple(alibi_slopes.shape)}")
    if alibi_slopes.dtype.kind != "f":
        raise TypeError(f"alibi_slopes must be floating point; got {dtype_name(alibi_slopes.dtype)}")
    return xp_of(alibi_slopes).ascontiguousarray(alibi_slopes.reshape(num_heads), dtype=np.float32)


def check_out(out, name: str, shape: tuple, dtype, like):
    """The output array: ``out`` checked, or a new one on ``like``'s side."""
    xp = xp_of(like)
    if out is None:
        return xp.empty(shape, dtype=dtype)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}; got {tuple(out.shape)}")
    if out.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype_name(dtype)}; got {dtype_name(out.dtype)}")
    if not out.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    return out


def check_same_shape(a, b, a_name: str, b_name: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{b_name} must have the shape of {a_name} {tuple(a.shape)}; got {tuple(b.shape)}")


def check_cache_pair(k_cache, v_cache, k_name: str = "k_cache", v_name: str = "v_cache") -> None:
    """Paged caches: the same shape, C-contiguous, so that the kernels reach every slot
    (block * block_size + offset) with one stride, and on a GPU 16-byte aligned, as the kernels
    read and write them 16 bytes at a time (a cache is never copied to fix either)."""
    check_same_shape(k_cache, v_cache, k_name, v_name)
    for name, cache in ((k_name, k_cache), (v_name, v_cache)):
        if not cache.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous")
        if backend_of({name: cache}) == CUDA and cache.data.ptr % 16:
            raise ValueError(f"{name} must start on a 16-byte boundary")


def check_lse(lse_out, shape: tuple, like, wanted: bool):
    """The LSE buffer: ``lse_out`` checked (float32, ``shape``), a new one if wanted, else None."""
    if lse_out is None and not wanted:
        return None
    return check_out(lse_out, "lse_out", shape, np.dtype(np.float32), like)


def check_contiguous_last(array, name: str) -> None:
    """Kernels read rows of head_dim elements with vector loads: the last axis must be dense."""
    if array.strides[-1] != array.itemsize:
        raise ValueError(f"{name} must be contiguous in its last (head_dim) axis")


def values_checkable(*arrays) -> bool:
    """False while the current CUDA stream is capturing a graph (no host copies allowed then)."""
    if all(a is None or isinstance(a, np.ndarray) for a in arrays):
        return True
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
    ``window`` folds ``causal`` in: causal means right = 0.  ``lse`` is
    ``[H, total_q]`` float32 or None.
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


def _drop_unit_batch(array):
    """Accept the ``[1, total, H, D]`` form of the source document."""
    if array is not None and array.ndim == 4 and array.shape[0] == 1:
        return array[0]
    return array


def prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, block_table,
                   return_softmax_lse, out, check_values=True, lse_out=None) -> VarlenProblem:
    backend = backend_of(dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                              alibi_slopes=alibi_slopes, block_table=block_table, out=out, lse_out=lse_out))
    paged = block_table is not None
    unbatched = q.ndim == 4
    q = _drop_unit_batch(q)
    check_rank(q, "q", (3,), "[total_q, num_heads, head_dim] (or [1, total_q, num_heads, head_dim])")
    if paged:
        check_rank(k, "k", (4,), "[num_blocks, block_size, num_kv_heads, head_dim] with block_table")
        check_rank(v, "v", (4,), "[num_blocks, block_size, num_kv_heads, head_dim] with block_table")
    else:
        k, v = _drop_unit_batch(k), _drop_unit_batch(v)
        check_rank(k, "k", (3,), "[total_k, num_kv_heads, head_dim] (or [1, total_k, num_kv_heads, head_dim])")
        check_rank(v, "v", (3,), "[total_k, num_kv_heads, head_dim] (or [1, total_k, num_kv_heads, head_dim])")
    for name, array in (("q", q), ("k", k), ("v", v)):
        check_float(array, name, backend)
        check_contiguous_last(array, name)
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
    if cu_k.shape != cu_q.shape:
        raise ValueError(f"cu_seqlens_k must have shape [batch_size + 1] = {tuple(cu_q.shape)} "
                         f"like cu_seqlens_q; got {tuple(cu_k.shape)}")
    batch = int(cu_q.shape[0]) - 1
    max_seqlen_q, max_seqlen_k = int(max_seqlen_q), int(max_seqlen_k)
    if max_seqlen_q < 0:
        raise ValueError(f"max_seqlen_q must be >= 0; got {max_seqlen_q}")
    if max_seqlen_k < 0:
        raise ValueError(f"max_seqlen_k must be >= 0; got {max_seqlen_k}")
    if paged:
        block_table = check_index(block_table, "block_table", 2, "[batch_size, max_blocks_per_seq]")
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table must have shape [batch_size = {batch}, max_blocks_per_seq]; "
                             f"got {tuple(block_table.shape)}")

    if check_values and values_checkable(cu_q, cu_k, block_table):
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
    slopes = check_alibi(alibi_slopes, num_heads)
    if unbatched:
        out = _drop_unit_batch(out)
    out = check_out(out, "out", (total_q, num_heads, head_dim), q.dtype, q)
    lse = check_lse(lse_out, (num_heads, total_q), q, return_softmax_lse)
    return VarlenProblem(backend, q, k, v, cu_q, cu_k, max_seqlen_q, block_table,
                         scale, (left, right), softcap, slopes, out, lse)


# --------------------------------------------------------------------------- decode

@dataclasses.dataclass
class DecodeProblem:
    """A checked ``flash_attn_with_kvcache`` call.

    ``q``/``out`` ``[B, Sq, H, D]``; caches ``[num_blocks, block_size, Hkv, D]`` with
    ``block_table`` int32 ``[B, max_blocks]``, or ``block_table`` None and a contiguous cache
    ``[B, S, Hkv, D]`` (sequence b is block b); ``cache_seqlens`` int32 ``[B]``, or a Python int
    for every sequence; ``k_new``/``v_new`` ``[B, Sn, Hkv, D]`` or None; ``lse`` ``[B, H, Sq]`` or
    None.  No index array is built for the caller: the kernels take the None and the int as they
    are.
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


def prepare_decode(q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal,
                   window_size, softcap, alibi_slopes, num_splits, return_softmax_lse, out,
                   check_values=True, lse_out=None) -> DecodeProblem:
    seqlens_array = None if cache_seqlens is None or np.isscalar(cache_seqlens) else cache_seqlens
    backend = backend_of(dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v,
                              cache_seqlens=seqlens_array, block_table=block_table,
                              alibi_slopes=alibi_slopes, out=out, lse_out=lse_out))
    check_rank(q, "q", (4,), "[batch_size, seqlen_q, num_heads, head_dim]")
    cache_layout = ("[num_blocks, block_size, num_kv_heads, head_dim]" if block_table is not None
                    else "[batch_size, seqlen_cache, num_kv_heads, head_dim]")
    check_rank(k_cache, "k_cache", (4,), cache_layout)
    check_rank(v_cache, "v_cache", (4,), cache_layout)
    for name, array in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_float(array, name, backend)
        check_contiguous_last(array, name)
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
            check_contiguous_last(array, name)
        check_same_shape(k, v, "k", "v")
        seqlen_new = int(k.shape[1])

    # A contiguous cache [B, S, Hkv, D] is a paged cache of B blocks of S tokens: its table (one
    # column, b -> b) and an int cache_seqlens are checked from host values and never built on a GPU.
    host_table = host_lengths = None
    if block_table is None:
        if int(k_cache.shape[0]) != batch:
            raise ValueError(f"k_cache must have shape [batch_size = {batch}, seqlen_cache, "
                             f"num_kv_heads, head_dim] without block_table; got {tuple(k_cache.shape)}")
        if batch * int(k_cache.shape[1]) >= 2**31:
            raise ValueError(f"k_cache holds {batch * int(k_cache.shape[1])} token rows; the decode kernel "
                             "indexes at most 2**31 - 1 of them")
        host_table = np.arange(batch, dtype=np.int32).reshape(batch, 1)
    else:
        check_block_size(int(k_cache.shape[1]), "k_cache")
        block_table = check_index(block_table, "block_table", 2, "[batch_size, max_blocks_per_seq]")
        if int(block_table.shape[0]) != batch:
            raise ValueError(f"block_table must have shape [batch_size = {batch}, max_blocks_per_seq]; "
                             f"got {tuple(block_table.shape)}")

    if cache_seqlens is None:
        if block_table is not None and block_table.shape[1] != 1:
            raise ValueError("cache_seqlens is required with a paged cache (block_table)")
        host_lengths = int(k_cache.shape[1]) - seqlen_new
    elif np.isscalar(cache_seqlens):
        if int(cache_seqlens) < 0:
            raise ValueError(f"cache_seqlens must be >= 0; got {cache_seqlens}")
        host_lengths = int(cache_seqlens)
    if host_lengths is not None:
        cache_seqlens = host_lengths
        host_lengths = np.full(batch, host_lengths, np.int64)
    else:
        cache_seqlens = check_index(cache_seqlens, "cache_seqlens", 1, f"[batch_size = {batch}]")
        if int(cache_seqlens.shape[0]) != batch:
            raise ValueError(f"cache_seqlens must have shape [batch_size = {batch}]; "
                             f"got {tuple(cache_seqlens.shape)}")

    if check_values and values_checkable(None if host_lengths is not None else cache_seqlens,
                                         None if host_table is not None else block_table):
        lengths = host_lengths if host_lengths is not None else to_host(cache_seqlens)
        if (lengths < 0).any():
            raise ValueError(f"cache_seqlens must be >= 0; got {lengths.tolist()[:16]}")
        check_block_table_values(host_table if host_table is not None else to_host(block_table),
                                 lengths.astype(np.int64) + seqlen_new, int(k_cache.shape[1]), int(k_cache.shape[0]))

    num_splits = int(num_splits)
    if num_splits < 0:
        raise ValueError(f"num_splits must be >= 0 (0 = chosen by a heuristic); got {num_splits}")
    left, right = check_window(window_size, causal)
    scale, softcap = check_scalars(softmax_scale, softcap, head_dim)
    slopes = check_alibi(alibi_slopes, num_heads)
    out = check_out(out, "out", (batch, seqlen_q, num_heads, head_dim), q.dtype, q)
    lse = check_lse(lse_out, (batch, num_heads, seqlen_q), q, return_softmax_lse)
    return DecodeProblem(backend, q, k_cache, v_cache, k, v, cache_seqlens, block_table, scale,
                         (left, right), softcap, slopes, num_splits, out, lse)


# --------------------------------------------------------------------------- cache writes

def prepare_write(k_cache, v_cache, k, v, slot_mapping, check_values=True):
    """Checks for ``write_kv_cache``; returns (backend, slot_mapping as int32)."""
    backend = backend_of(dict(k_cache=k_cache, v_cache=v_cache, k=k, v=v, slot_mapping=slot_mapping))
    layout = "[num_blocks, block_size, num_kv_heads, head_dim]"
    check_rank(k_cache, "k_cache", (4,), layout)
    check_rank(v_cache, "v_cache", (4,), layout)
    check_cache_pair(k_cache, v_cache)
    check_float(k_cache, "k_cache", backend)
    check_float(v_cache, "v_cache", backend)
    _, _, num_kv_heads, head_dim = (int(s) for s in k_cache.shape)
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
    if check_values and values_checkable(slots) and slots.size:
        top = int(to_host(slots).max())
        if top >= capacity:
            raise ValueError(f"slot_mapping holds slot {top}, past the cache's {capacity} slots "
                             "(num_blocks * block_size); negative slots are skipped")
    return backend, slots
