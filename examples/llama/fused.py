"""The model's per-token steps on the GPU as one kernel each (``fused.cu``), instead of the dozens
of CuPy array operations the same NumPy-style expressions launch.

:class:`FusedOps` computes what :class:`llama.model.LlamaModel`'s expressions compute, in the
same dtypes (float sums and residual stream, results rounded once to the weights' dtype), for
bfloat16 and float16 models on CuPy arrays; every call allocates its outputs from CuPy's current
allocator and launches on the current stream, so a CUDA graph can capture it.  One difference of
the fused forward: cuBLAS writes the logits as float32, where the expressions (and Hugging Face)
round them to the weights' dtype first, so near-ties between two tokens can resolve otherwise.
"""
from __future__ import annotations

import functools
import pathlib

import ml_dtypes
import numpy as np

SOURCE = pathlib.Path(__file__).with_name("fused.cu")
SCALAR_TYPES = {np.dtype(ml_dtypes.bfloat16): "__nv_bfloat16", np.dtype(np.float16): "__half"}
MAX_GRID_Y = 65535
ROW_CACHE = 8  # values of a row a thread of add_rms_norm keeps in registers (fused.cu's ROW_CACHE)


def options(dtype) -> tuple[str, ...]:
    """NVRTC options of ``fused.cu`` for weights of ``dtype``."""
    return ("-std=c++17", f"-DSCALAR_T={SCALAR_TYPES[np.dtype(dtype)]}", f"-DROW_CACHE={ROW_CACHE}")


@functools.cache
def _module(dtype):
    import cupy

    module = cupy.RawModule(code=SOURCE.read_text(), options=options(dtype))
    module.compile()
    return module


def row_threads(hidden: int) -> int:
    """Threads of add_rms_norm's block for rows of ``hidden``: enough that each keeps at most
    ``ROW_CACHE`` values (a multiple of 32, from 128 to 1024; longer rows loop).

    >>> row_threads(2048), row_threads(4096), row_threads(320), row_threads(100_000)
    (256, 512, 128, 1024)
    """
    return min(1024, max(128, 32 * -(-hidden // (32 * ROW_CACHE))))


def supported(xp, dtype) -> bool:
    """True when the fused kernels serve a model of ``dtype`` on ``xp``."""
    return xp is not np and np.dtype(dtype) in SCALAR_TYPES


class FusedOps:
    """The fused kernels of one weights dtype.

    Parameters
    ----------
    dtype : dtype
        bfloat16 or float16.
    eps : float
        RMSNorm's epsilon.
    """

    def __init__(self, dtype, eps: float):
        import cupy

        self.cupy, self.dtype, self.eps = cupy, np.dtype(dtype), np.float32(eps)
        module = _module(self.dtype)
        self._add_rms_norm, self._rotary_split, self._swiglu, self._embed_rows = (
            module.get_function(name) for name in ("add_rms_norm", "rotary_split", "swiglu", "embed_rows"))

    def embed(self, table, ids):
        """``table [vocab, hidden]`` rows of ``ids [T]`` (int32, each in range) as float32 ``[T, hidden]``."""
        tokens, hidden = ids.shape[0], table.shape[1]
        out = self.cupy.empty((tokens, hidden), np.float32)
        if tokens:
            self._embed_rows((tokens,), (256,), (table, ids, out, np.int32(hidden)))
        return out

    def add_rms_norm(self, x, delta, weight, out=None):
        """``(x + delta, rms_norm(x + delta) * weight)``: the new residual (float32, into ``out``,
        which may be ``x``) and the normalised rows in the weights' dtype; ``delta`` None adds nothing."""
        tokens, hidden = x.shape
        out = self.cupy.empty_like(x) if out is None else out
        normed = self.cupy.empty((tokens, hidden), self.dtype)
        if tokens:
            self._add_rms_norm((tokens,), (row_threads(hidden),), (x, delta if delta is not None else np.uint64(0), weight, out, normed,
                                                  np.int32(hidden), self.eps))
        return out, normed

    def rotary_split(self, qkv, positions, cos, sin, heads: int, kv_heads: int, head_dim: int):
        """``q [T, heads, D]``, ``k``, ``v [T, kv_heads, D]`` of ``qkv [T, (heads + 2 kv_heads) D]``,
        q and k rotated at ``positions [T]`` (int32) by the float32 tables ``cos``/``sin`` ``[P, D / 2]``."""
        cupy, tokens = self.cupy, qkv.shape[0]
        q = cupy.empty((tokens, heads, head_dim), self.dtype)
        k = cupy.empty((tokens, kv_heads, head_dim), self.dtype)
        v = cupy.empty((tokens, kv_heads, head_dim), self.dtype)
        if tokens:  # one block per (token, head); a thread per rotated pair
            threads = min(128, 32 * -(-(head_dim // 2) // 32))
            self._rotary_split((tokens, heads + 2 * kv_heads), (threads,),
                               (qkv, positions, cos, sin, q, k, v, np.int32(heads), np.int32(kv_heads),
                                np.int32(head_dim)))
        return q, k, v

    def swiglu(self, gate_up):
        """``silu(gate) * up`` of ``gate_up [rows, 2 size]`` (gate first), ``[rows, size]``."""
        rows, size = gate_up.shape[0], gate_up.shape[1] // 2
        out = self.cupy.empty((rows, size), self.dtype)
        for start in range(0, rows, MAX_GRID_Y):  # the grid's y extent is the row
            count = min(MAX_GRID_Y, rows - start)
            self._swiglu((-(-size // 256), count), (256,), (gate_up[start:], out[start:], np.int32(size)))
        return out


@functools.cache
def _argmax_kernel():
    return _module(np.dtype(ml_dtypes.bfloat16)).get_function("argmax_rows")  # reads float32 only


def argmax_rows(logits):
    """``[rows]`` int64 index of each row's largest value of C-contiguous float32 ``logits [rows, vocab]``
    (the first on ties; a NaN counts as largest), one block per row."""
    import cupy

    rows, vocab = logits.shape
    out = cupy.empty(rows, np.int64)
    if rows:
        _argmax_kernel()((rows,), (1024,), (logits, out, np.int32(vocab)))
    return out
