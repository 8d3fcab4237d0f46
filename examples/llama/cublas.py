"""Matrix products of CuPy arrays through cuBLAS called directly, so that CUDA graphs can hold them.

cuBLAS supports stream capture, but CuPy refuses every cuBLAS call while a stream captures (its
``cublasSetStream`` wrapper raises ``NotImplementedError``), so a captured decode step cannot use
``a @ b``.  :class:`Gemm` calls ``cublasGemmEx`` through ctypes on a cuBLAS handle of its own,
with a workspace of its own (cuBLAS must not allocate one inside a capture; ``cublasSetStream``
resets it, so it is set again after every stream change).  The model uses it for every GPU
product, eager and captured alike, so a replay computes exactly what an eager step computes.
"""
from __future__ import annotations

import ctypes
import os

import ml_dtypes
import numpy as np

# cudaDataType_t and cublasComputeType_t values (cuBLAS' library_types.h / cublas_api.h).
_DATA_TYPE = {np.dtype(np.float16): 2, np.dtype(ml_dtypes.bfloat16): 14, np.dtype(np.float32): 0,
              np.dtype(np.float64): 1}
_COMPUTE_32F, _COMPUTE_64F = 68, 70
_OP_N, _OP_T, _GEMM_DEFAULT = 0, 1, -1
# On the H200 a 32 MiB workspace made each bf16 [64, 2048] x [2048, 3072] call cost 49 us of host
# time against 28 us with 4 MiB (and 24 us for CuPy's own matmul): 4 MiB it is.
WORKSPACE_BYTES = 4 << 20


def _library():
    """The libcublas CuPy has loaded (after it made its own handle), else the one cuda-pathfinder finds."""
    import cupy

    cupy.cuda.device.get_cublas_handle()  # makes CuPy load its cuBLAS first
    for name in ("libcublas.so.13", "libcublas.so.12"):
        try:
            return ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
        except OSError:
            continue
    from cuda.pathfinder import load_nvidia_dynamic_lib

    return ctypes.CDLL(load_nvidia_dynamic_lib("cublas").abs_path)


class Gemm:
    """``a @ b`` of C-contiguous 2-D CuPy arrays on the current stream, capturable.

    Examples
    --------
    >>> import cupy                                     # doctest: +SKIP
    >>> gemm = Gemm()                                   # doctest: +SKIP
    >>> gemm(cupy.ones((2, 3), cupy.float32), cupy.ones((3, 4), cupy.float32)).tolist()[0]  # doctest: +SKIP
    [3.0, 3.0, 3.0, 3.0]
    """

    # Zero each product's output before cuBLAS writes it.  compute-sanitizer's initcheck does not
    # see what cuBLAS's bf16 kernels write (benchmarks/sanitizer_control.py engine: every report of
    # the engine's tests under it was a read of a product's output), so the tests set this under
    # initcheck; the tool then checks every other kernel's reads.
    zero_outputs = False

    def __init__(self, workspace_bytes: int = WORKSPACE_BYTES):
        import cupy

        lib = _library()
        self._gemm = lib.cublasGemmEx
        self._gemm.restype = ctypes.c_int
        p, i = ctypes.c_void_p, ctypes.c_int
        self._gemm.argtypes = [p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i]
        self._set_stream, self._set_workspace = lib.cublasSetStream_v2, lib.cublasSetWorkspace_v2
        self._set_stream.argtypes = [p, p]
        self._set_workspace.argtypes = [p, p, ctypes.c_size_t]
        self._handle = ctypes.c_void_p()
        self._check(lib.cublasCreate_v2(ctypes.byref(self._handle)), "cublasCreate")
        self._destroy = lib.cublasDestroy_v2
        self._workspace = cupy.empty(workspace_bytes, cupy.uint8)
        self._stream = None
        # alpha = 1, beta = 0 in the compute type, read by cuBLAS from the host at each call.
        self._scalars = {_COMPUTE_32F: (ctypes.c_float(1.0), ctypes.c_float(0.0)),
                         _COMPUTE_64F: (ctypes.c_double(1.0), ctypes.c_double(0.0))}

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed with cuBLAS status {status}")

    def _bind(self, stream: int) -> None:
        if stream != self._stream:
            self._check(self._set_stream(self._handle, stream), "cublasSetStream")
            self._check(self._set_workspace(self._handle, self._workspace.data.ptr, self._workspace.nbytes),
                        "cublasSetWorkspace")
            self._stream = stream

    def __call__(self, a, b, out_dtype=None, b_rows_out: bool = False):
        """``a [M, K] @ b [K, N]`` -> a new ``[M, N]`` array of ``out_dtype`` (default ``a``'s dtype;
        float32 for half-precision inputs is the other choice), float32 or float64 accumulation;
        both C-contiguous, of one dtype.  ``b_rows_out``: ``b`` is ``[N, K]`` (a linear layer's
        weight as checkpoints store it, torch's ``F.linear`` layout) and the product is ``a @ b.T``."""
        import cupy

        k_axis = 1 if b_rows_out else 0  # of b
        if a.dtype != b.dtype or a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[k_axis]:
            layout = "[N, K]" if b_rows_out else "[K, N]"
            raise ValueError(f"need [M, K] @ {layout} of one dtype; got {a.shape} {a.dtype} @ {b.shape} {b.dtype}")
        if not (a.flags.c_contiguous and b.flags.c_contiguous):
            a, b = cupy.ascontiguousarray(a), cupy.ascontiguousarray(b)
        (m, k), n = a.shape, b.shape[1 - k_axis]
        out_dtype = np.dtype(a.dtype if out_dtype is None else out_dtype)
        if out_dtype != a.dtype and not (out_dtype == np.float32 and a.dtype.itemsize == 2):
            raise ValueError(f"a {a.dtype} product can be written as {a.dtype} or, for half precision, float32; "
                             f"got out_dtype {out_dtype}")
        out = (cupy.zeros if self.zero_outputs else cupy.empty)((m, n), out_dtype)
        if m == 0 or n == 0:
            return out
        self._bind(cupy.cuda.get_current_stream().ptr)
        data = _DATA_TYPE[np.dtype(a.dtype)]
        compute = _COMPUTE_64F if data == 1 else _COMPUTE_32F
        alpha, beta = self._scalars[compute]
        # Row-major C = A B is column-major C^T = B^T A^T: cuBLAS multiplies b by a.  A row-major
        # [N, K] b is a column-major [K, N] matrix, which cuBLAS reads transposed.
        op_b, ld_b = (_OP_T, k) if b_rows_out else (_OP_N, n)
        self._check(self._gemm(self._handle, op_b, _OP_N, n, m, k, ctypes.addressof(alpha), b.data.ptr, data, ld_b,
                               a.data.ptr, data, k, ctypes.addressof(beta), out.data.ptr, _DATA_TYPE[out_dtype], n,
                               compute,
                               _GEMM_DEFAULT), "cublasGemmEx")
        return out

    def __del__(self):
        handle = getattr(self, "_handle", None)
        if handle is not None and handle.value:
            self._destroy(handle)
