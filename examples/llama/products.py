"""The products of a decode step (at most 64 rows) on ``products.cu`` instead of cuBLAS.

At 64 rows a product reads its weight once and is bound by that read, yet cuBLAS's kernels for
these shapes sit about 4-5 us over it each (``benchmarks/NOTES_e2e.md`` sections 12 and 14: too few
CTAs for the small products, a separate split-K reduction for ``down``), 33 products a step.
:class:`DecodeProducts` spreads each product over about two CTAs per SM: column tiles of 64 or
128, and where those are too few, the K range split over a thread block cluster whose CTAs add
their sums through distributed shared memory (no workspace, no second launch, the same sums in
the same order every time).  Hopper (sm_90) and later only; every other product, and every GPU
before Hopper, keeps cuBLAS (:meth:`DecodeProducts.serves`).
"""
from __future__ import annotations

import functools
import pathlib

import ml_dtypes
import numpy as np

SOURCE = pathlib.Path(__file__).with_name("products.cu")
SCALARS = {np.dtype(ml_dtypes.bfloat16): "__nv_bfloat16", np.dtype(np.float16): "__half"}
BK = 64           # products.cu kBK: K of a pipeline stage
THREADS = 128
MAX_ROWS = 64     # rows of A one CTA holds (M_TILES = 4)
STAGES = 4
SPLITS = (8, 4, 2, 1)


def options(dtype, out_dtype, m_tiles: int, bn: int, splits: int, stages: int = STAGES) -> tuple[str, ...]:
    """NVRTC options of ``products.cu`` for one specialization."""
    dtype, out_dtype = np.dtype(dtype), np.dtype(out_dtype)
    scalar = SCALARS[dtype]
    out = "float" if out_dtype == np.float32 else scalar
    return ("-std=c++17", f"-DSCALAR_T={scalar}", f"-DOUT_T={out}", f"-DM_TILES={m_tiles}", f"-DBN={bn}",
            f"-DSPLITS={splits}", f"-DSTAGES={stages}", *(("-DSCALAR_IS_BF16",) if scalar == "__nv_bfloat16" else ()))


def smem_bytes(m_tiles: int, bn: int, stages: int = STAGES) -> int:
    """Dynamic shared memory of a launch: the stages of A (16 m_tiles rows) and W (bn columns)."""
    return stages * (16 * m_tiles * BK + BK * bn) * 2


def choose(m: int, n: int, k: int, sms: int) -> tuple[int, int, int]:
    """``(m_tiles, bn, splits)`` of a product: enough 16-row tiles for ``m``; of the column tiles
    (128 or 64 wide) and splits (8, 4, 2, 1: K ranges of at least two stages), the grid nearest
    to two CTAs per SM without going over it, the wider tile on a tie.

    >>> choose(64, 3072, 2048, 132), choose(64, 2048, 2048, 132), choose(64, 11264, 2048, 132)
    ((4, 128, 8), (4, 64, 8), (4, 128, 2))
    >>> choose(64, 2048, 5632, 132), choose(64, 32000, 2048, 132), choose(5, 2048, 2048, 132)
    ((4, 64, 8), (4, 128, 1), (1, 64, 8))
    """
    m_tiles = next(t for t in (1, 2, 4) if m <= 16 * t)
    target, best = 2 * sms, None
    for bn in (128, 64):
        if n % bn:
            continue
        tiles = n // bn
        for splits in SPLITS:
            if k // BK < 2 * splits and splits > 1:
                continue
            ctas = tiles * splits
            score = (ctas > target, abs(target - ctas))
            if best is None or score < best[0]:
                best = (score, (m_tiles, bn, splits))
    return best[1]


@functools.cache
def _function(device: int, dtype, out_dtype, m_tiles: int, bn: int, splits: int):
    """One specialization, loaded on ``device`` (the current one)."""
    import cupy

    module = cupy.RawModule(code=SOURCE.read_text(), options=options(dtype, out_dtype, m_tiles, bn, splits))
    function = module.get_function("decode_product")
    function.max_dynamic_shared_size_bytes = smem_bytes(m_tiles, bn)
    return function


class DecodeProducts:
    """``a [M, K] @ w [K, N]`` for M at most 64, on the current stream (capturable), or None where
    cuBLAS should run it.

    Parameters
    ----------
    device : int
        The CUDA device the weights live on (its compute capability decides :meth:`serves`).
    """

    def __init__(self, device: int | None = None):
        import cupy

        device = cupy.cuda.runtime.getDevice() if device is None else device
        self.device = device
        props = cupy.cuda.runtime.getDeviceProperties(device)
        self.hopper = props["major"] >= 9
        self.sms = props["multiProcessorCount"]

    def serves(self, a, w, out_dtype) -> bool:
        """Whether :meth:`__call__` runs this product: Hopper, at most 64 rows, bf16/fp16 operands
        of one dtype, both C-contiguous, ``w`` as ``[K, N]`` with N a multiple of 64 and K of 64,
        16-byte aligned rows and an output in their dtype or float32."""
        return (self.hopper and a.ndim == 2 and w.ndim == 2 and 0 < a.shape[0] <= MAX_ROWS
                and a.dtype == w.dtype and np.dtype(a.dtype) in SCALARS and a.shape[1] == w.shape[0]
                and w.shape[1] % 64 == 0 and w.shape[0] % BK == 0
                and np.dtype(out_dtype) in (np.dtype(a.dtype), np.dtype(np.float32))
                and a.flags.c_contiguous and w.flags.c_contiguous and a.data.device_id == self.device
                and a.data.ptr % 16 == 0 and w.data.ptr % 16 == 0)

    def __call__(self, a, w, out_dtype=None, out=None, variant=None):
        """The product into a new ``[M, N]`` array of ``out_dtype`` (default ``a``'s), or ``out``.
        ``variant``: ``(bn, splits)`` instead of :func:`choose`'s (tests, benchmarks)."""
        import cupy

        out_dtype = np.dtype(a.dtype if out_dtype is None else out_dtype)
        if not self.serves(a, w, out_dtype):
            raise ValueError(f"DecodeProducts does not serve {a.shape} {a.dtype} @ {w.shape} {w.dtype} -> {out_dtype}")
        (m, k), n = a.shape, w.shape[1]
        if out is None:
            out = cupy.empty((m, n), out_dtype)
        elif (out.shape != (m, n) or out.dtype != out_dtype or not out.flags.c_contiguous
              or out.data.ptr % 8):
            raise ValueError(f"out must be a C-contiguous, 8-byte aligned {(m, n)} {out_dtype} array; "
                             f"got {out.shape} {out.dtype}")
        m_tiles, bn, splits = choose(m, n, k, self.sms)
        if variant is not None:
            bn, splits = variant
            if n % bn or splits not in SPLITS or (splits > 1 and k // BK < splits):
                raise ValueError(f"variant {variant} does not fit N {n}, K {k}")
        function = _function(self.device, np.dtype(a.dtype), out_dtype, m_tiles, bn, splits)
        function((n // bn, splits), (THREADS,), (a, w, out, np.int32(m), np.int32(n), np.int32(k)),
                 shared_mem=smem_bytes(m_tiles, bn))
        return out
