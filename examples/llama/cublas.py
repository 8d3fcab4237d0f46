"""Matrix products of CuPy arrays through cuBLAS called directly, so that CUDA graphs can hold them.

cuBLAS supports stream capture, but CuPy refuses every cuBLAS call while a stream captures (its
``cublasSetStream`` wrapper raises ``NotImplementedError``), so a captured decode step cannot use
``a @ b``.  :class:`Gemm` calls ``cublasGemmEx`` through ctypes on a cuBLAS handle of its own,
with a workspace of its own (cuBLAS must not allocate one inside a capture; ``cublasSetStream``
resets it, so it is set again after every stream change).  The model uses it for every GPU
product, eager and captured alike, so a replay computes exactly what an eager step computes.

:meth:`Gemm.tune` picks a kernel per product shape by timing: cuBLASLt's heuristic candidates
(``cublasLtMatmulAlgoGetHeuristic``) and ``cublasGemmEx``'s own choice, each replayed in a CUDA
graph over weight copies that pass the L2 (a decode step streams its weights from memory), and
keeps the fastest; later calls of that shape launch it through ``cublasLtMatmul``.  cuBLAS's
default for a skinny product (a decode step's ``[64, K] @ [K, N]``) often launches fewer CTAs
than the GPU has SMs (benchmarks/NOTES_e2e.md sections 8 and 12).
"""
from __future__ import annotations

import contextlib
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
# cuBLASLt's workspace for the tuned kernels (split-K partial sums of a [256, 11264] product in
# float32 at 4 splits are 46 MB; the candidates are asked to fit this).
LT_WORKSPACE_BYTES = 32 << 20
# cublasLtMatmulDescAttributes_t / cublasLtMatmulPreferenceAttributes_t values (cublasLt.h).
_LT_DESC_TRANSA, _LT_DESC_TRANSB, _LT_PREF_MAX_WORKSPACE = 3, 4, 1
# Weight copies of at least this many bytes in all are rotated over while timing a candidate, so
# each product reads its weight from memory as a decode step does (the H200's L2 is 60 MiB).
TUNE_ROTATE_BYTES = 150e6
TUNE_CANDIDATES = 16


def _from_float32(x, dtype):
    """A float32 CuPy array in ``dtype``; bfloat16 by truncating to its top 16 bits (no CuPy cast
    to bfloat16 is assumed)."""
    import cupy

    if np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16):
        return (x.view(cupy.uint32) >> 16).astype(cupy.uint16).view(dtype)
    return x.astype(dtype)


def _to_float32(x):
    import cupy

    if x.dtype == np.dtype(ml_dtypes.bfloat16):
        return (x.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)
    return x.astype(cupy.float32)


class _LtAlgo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _LtHeuristic(ctypes.Structure):
    _fields_ = [("algo", _LtAlgo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _load(stem: str):
    """``lib{stem}`` as already loaded in this process (CuPy loads libcublas, which loads
    libcublasLt), else the one cuda-pathfinder finds."""
    for name in (f"lib{stem}.so.13", f"lib{stem}.so.12"):
        try:
            return ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
        except OSError:
            continue
    from cuda.pathfinder import load_nvidia_dynamic_lib

    return ctypes.CDLL(load_nvidia_dynamic_lib(stem).abs_path)


def _library():
    """The libcublas CuPy has loaded (after it made its own handle), else the one cuda-pathfinder finds."""
    import cupy

    cupy.cuda.device.get_cublas_handle()  # makes CuPy load its cuBLAS first
    return _load("cublas")


def _lt_library():
    """libcublasLt (libcublas loads it)."""
    _library()
    return _load("cublasLt")


class _Lt:
    """One cuBLASLt handle and the entry points :class:`Gemm` uses (made on first tune)."""

    def __init__(self):
        lib = _lt_library()
        p, i, u64, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
        for name, args in (("cublasLtCreate", [p]), ("cublasLtDestroy", [p]),
                           ("cublasLtMatmulDescCreate", [p, i, i]), ("cublasLtMatmulDescDestroy", [p]),
                           ("cublasLtMatmulDescSetAttribute", [p, i, p, sz]),
                           ("cublasLtMatrixLayoutCreate", [p, i, u64, u64, i64]),
                           ("cublasLtMatrixLayoutDestroy", [p]),
                           ("cublasLtMatmulPreferenceCreate", [p]), ("cublasLtMatmulPreferenceDestroy", [p]),
                           ("cublasLtMatmulPreferenceSetAttribute", [p, i, p, sz]),
                           ("cublasLtMatmulAlgoGetHeuristic", [p, p, p, p, p, p, p, i, p, p]),
                           ("cublasLtMatmul", [p, p, p, p, p, p, p, p, p, p, p, p, p, p, sz, p])):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
            setattr(self, name[len("cublasLt"):].lower(), fn)
        self.handle = ctypes.c_void_p()
        Gemm._check(self.create(ctypes.byref(self.handle)), "cublasLtCreate")

    def __del__(self):
        handle = getattr(self, "handle", None)
        if handle is not None and handle.value:
            self.destroy(handle)

    def new(self, create, *args):
        """An opaque descriptor from ``create(&out, *args)``."""
        out = ctypes.c_void_p()
        Gemm._check(create(ctypes.byref(out), *args), "cublasLt descriptor create")
        return out


class _LtShape:
    """The operation and matrix descriptors of one product shape (row-major ``[M, K] @ B``, which
    cuBLASLt sees column-major as ``B^T a^T``), destroyed with it."""

    def __init__(self, lt, m, n, k, data, out_data, compute, b_rows_out):
        self.lt = lt
        self.desc = lt.new(lt.matmuldesccreate, compute, 1 if compute == _COMPUTE_64F else 0)
        trans_a = ctypes.c_int32(_OP_T if b_rows_out else _OP_N)
        trans_b = ctypes.c_int32(_OP_N)
        for attribute, value in ((_LT_DESC_TRANSA, trans_a), (_LT_DESC_TRANSB, trans_b)):
            Gemm._check(lt.matmuldescsetattribute(self.desc, attribute, ctypes.byref(value), 4),
                        "cublasLtMatmulDescSetAttribute")
        # A row-major [N, K] weight is a column-major [K, N] matrix read transposed; a row-major
        # [K, N] one is a column-major [N, K] matrix.
        self.a = lt.new(lt.matrixlayoutcreate, data, *((k, n, k) if b_rows_out else (n, k, n)))
        self.b = lt.new(lt.matrixlayoutcreate, data, k, m, k)
        self.c = lt.new(lt.matrixlayoutcreate, out_data, n, m, n)

    def __del__(self):
        lt = getattr(self, "lt", None)
        if lt is None:
            return
        for layout in (getattr(self, name, None) for name in ("a", "b", "c")):
            if layout is not None:
                lt.matrixlayoutdestroy(layout)
        lt.matmuldescdestroy(self.desc)


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
        # Shapes tuned (``tune``/``use``): key -> (descriptors, cuBLASLt algorithm), or None for
        # cublasGemmEx.  cuBLASLt's handle and workspace are made on the first tune.
        self._tuned: dict = {}
        self._lt = self._lt_workspace = None
        self._lt_shapes: dict = {}

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

    def __call__(self, a, b, out_dtype=None, b_rows_out: bool = False, out=None):
        """``a [M, K] @ b [K, N]`` -> a new ``[M, N]`` array of ``out_dtype`` (default ``a``'s dtype;
        float32 for half-precision inputs is the other choice), float32 or float64 accumulation;
        both C-contiguous, of one dtype.  ``b_rows_out``: ``b`` is ``[N, K]`` (a linear layer's
        weight as checkpoints store it, torch's ``F.linear`` layout) and the product is ``a @ b.T``.
        ``out``: a C-contiguous ``[M, N]`` array of ``out_dtype`` to write instead of a new one.
        A shape :meth:`tune` chose a cuBLASLt kernel for runs that kernel."""
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
        if out is None:
            out = (cupy.zeros if self.zero_outputs else cupy.empty)((m, n), out_dtype)
        elif out.shape != (m, n) or out.dtype != out_dtype or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous {(m, n)} {out_dtype} array; got {out.shape} {out.dtype}")
        if m == 0 or n == 0:
            return out
        data = _DATA_TYPE[np.dtype(a.dtype)]
        compute = _COMPUTE_64F if data == 1 else _COMPUTE_32F
        alpha, beta = self._scalars[compute]
        stream = cupy.cuda.get_current_stream().ptr
        plan = self._tuned.get((m, n, k, data, _DATA_TYPE[out_dtype], b_rows_out)) if self._tuned else None
        if plan is not None:
            shape, algo = plan
            self._check(self._lt.matmul(self._lt.handle, shape.desc, ctypes.addressof(alpha), b.data.ptr, shape.a,
                                        a.data.ptr, shape.b, ctypes.addressof(beta), out.data.ptr, shape.c,
                                        out.data.ptr, shape.c, ctypes.byref(algo), self._lt_workspace.data.ptr,
                                        self._lt_workspace.nbytes, stream), "cublasLtMatmul")
            return out
        self._bind(stream)
        # Row-major C = A B is column-major C^T = B^T A^T: cuBLAS multiplies b by a.  A row-major
        # [N, K] b is a column-major [K, N] matrix, which cuBLAS reads transposed.
        op_b, ld_b = (_OP_T, k) if b_rows_out else (_OP_N, n)
        self._check(self._gemm(self._handle, op_b, _OP_N, n, m, k, ctypes.addressof(alpha), b.data.ptr, data, ld_b,
                               a.data.ptr, data, k, ctypes.addressof(beta), out.data.ptr, _DATA_TYPE[out_dtype], n,
                               compute,
                               _GEMM_DEFAULT), "cublasGemmEx")
        return out

    # (device, key) -> the chosen algorithm's bytes, or None for cublasGemmEx: what any Gemm of this
    # process tuned, so a second engine over the same model does not time the candidates again.
    _choices: dict = {}

    def candidates(self, m, n, k, dtype, out_dtype=None, b_rows_out: bool = False) -> list:
        """cuBLASLt's heuristic algorithms for the product (at most ``TUNE_CANDIDATES``, each
        fitting the workspace), as ``(descriptors, algorithm)`` plans for :meth:`use`."""
        key = self._key(m, n, k, dtype, out_dtype, b_rows_out)
        shape = self._lt_shape(key)
        lt = self._lt
        preference = lt.new(lt.matmulpreferencecreate)
        try:
            limit = ctypes.c_uint64(self._lt_workspace.nbytes)
            self._check(lt.matmulpreferencesetattribute(preference, _LT_PREF_MAX_WORKSPACE, ctypes.byref(limit), 8),
                        "cublasLtMatmulPreferenceSetAttribute")
            results, count = (_LtHeuristic * TUNE_CANDIDATES)(), ctypes.c_int(0)
            status = lt.matmulalgogetheuristic(lt.handle, shape.desc, shape.a, shape.b, shape.c, shape.c, preference,
                                               TUNE_CANDIDATES, results, ctypes.byref(count))
        finally:
            lt.matmulpreferencedestroy(preference)
        if status != 0:
            return []
        return [(shape, _LtAlgo.from_buffer_copy(results[i].algo)) for i in range(count.value)
                if results[i].state == 0 and results[i].workspace_size <= self._lt_workspace.nbytes]

    def use(self, m, n, k, dtype, out_dtype=None, b_rows_out: bool = False, plan=None) -> None:
        """Run the product of this shape with ``plan`` (one of :meth:`candidates`), or through
        ``cublasGemmEx`` with ``plan=None``."""
        self._tuned[self._key(m, n, k, dtype, out_dtype, b_rows_out)] = plan

    def tune(self, m, n, k, dtype, out_dtype=None, b_rows_out: bool = False) -> dict:
        """Time ``cublasGemmEx`` and cuBLASLt's candidates for ``[m, k] @ [k, n]`` (``b [n, k]``
        with ``b_rows_out``) and use the fastest for this shape from now on.  Outside any capture.

        Each candidate runs once on random inputs and must equal ``cublasGemmEx``'s result to the
        output dtype's rounding (else it is dropped); then a CUDA graph of at least 20 products
        over weight copies of ``TUNE_ROTATE_BYTES`` in all (so every product reads its weight from
        memory) is replayed, and the median microseconds a product of three samples decide.
        Returns ``{"gemmex_us", "chosen_us", "chosen", "candidates"}`` (``chosen`` is ``"gemmex"``
        or ``"lt<i>"``, the heuristic's rank), or the earlier choice's ``{"chosen"}`` alone."""
        import cupy

        key = self._key(m, n, k, dtype, out_dtype, b_rows_out)
        known = self._choices.get((cupy.cuda.Device().id, key), False)
        if known is not False:
            self._tuned[key] = None if known is None else (self._lt_shape(key), _LtAlgo.from_buffer_copy(known))
            return {"chosen": "gemmex" if known is None else "lt"}
        dtype = np.dtype(dtype)
        out_dtype = dtype if out_dtype is None else np.dtype(out_dtype)
        plans = self.candidates(m, n, k, dtype, out_dtype, b_rows_out)
        rng = cupy.random.default_rng(0)
        a = _from_float32(rng.standard_normal((m, k), dtype=np.float32), dtype)
        weight = _from_float32(rng.standard_normal((n, k) if b_rows_out else (k, n), dtype=np.float32)
                               / np.float32(np.sqrt(k)), dtype)
        copies = max(2, min(16, int(np.ceil(TUNE_ROTATE_BYTES / weight.nbytes))))
        weights = [weight] + [weight.copy() for _ in range(copies - 1)]
        per_graph = copies * -(-20 // copies)
        out = cupy.empty((m, n), out_dtype)
        stream = cupy.cuda.Stream(non_blocking=True)
        cupy.cuda.runtime.deviceSynchronize()  # the inputs were made on the legacy stream

        def time_us() -> float:
            with stream:
                for w in weights:  # eager first: nothing loads or allocates inside the capture
                    self(a, w, out_dtype, b_rows_out, out=out)
                stream.begin_capture()
                try:
                    for i in range(per_graph):
                        self(a, weights[i % copies], out_dtype, b_rows_out, out=out)
                finally:
                    graph = stream.end_capture()
                samples = []
                for _ in range(3):
                    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
                    graph.launch(stream)  # queued ahead, so no launch latency falls inside the timing
                    start.record(stream)
                    graph.launch(stream)
                    graph.launch(stream)
                    stop.record(stream)
                    stop.synchronize()
                    samples.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3 / (2 * per_graph))
            return float(np.median(samples))

        self._tuned[key] = None
        with stream:
            reference = _to_float32(self(a, weight, out_dtype, b_rows_out))
            stream.synchronize()
        scale = float(cupy.abs(reference).max()) or 1.0
        tolerance = scale * (2e-2 if np.dtype(out_dtype).itemsize == 2 else 1e-4)
        times = {"gemmex": time_us()}
        for rank, plan in enumerate(plans):
            self._tuned[key] = plan
            try:
                with stream:
                    got = _to_float32(self(a, weight, out_dtype, b_rows_out))
                    stream.synchronize()
            except RuntimeError:
                continue
            if not bool(cupy.isfinite(got).all()) or float(cupy.abs(got - reference).max()) > tolerance:
                continue
            times[f"lt{rank}"] = time_us()
        chosen = min(times, key=times.get)
        if chosen != "gemmex" and times[chosen] > 0.98 * times["gemmex"]:
            chosen = "gemmex"  # within the timing's noise: keep cuBLAS's own choice
        plan = None if chosen == "gemmex" else plans[int(chosen[2:])]
        self._tuned[key] = plan
        self._choices[(cupy.cuda.Device().id, key)] = None if plan is None else bytes(plan[1])
        return {"gemmex_us": round(times["gemmex"], 2), "chosen_us": round(times[chosen], 2), "chosen": chosen,
                "candidates": len(plans), "timed": len(times) - 1}

    @contextlib.contextmanager
    def defaults(self):
        """Within: every product runs ``cublasGemmEx``'s own kernel (what tuned stays kept for
        after); a comparison of the tuned kernels against cuBLAS's default."""
        saved, self._tuned = self._tuned, {}
        try:
            yield self
        finally:
            self._tuned = saved

    def _key(self, m, n, k, dtype, out_dtype, b_rows_out) -> tuple:
        dtype = np.dtype(dtype)
        out_dtype = dtype if out_dtype is None else np.dtype(out_dtype)
        return (int(m), int(n), int(k), _DATA_TYPE[dtype], _DATA_TYPE[out_dtype], bool(b_rows_out))

    def _lt_shape(self, key) -> _LtShape:
        import cupy

        if self._lt is None:
            self._lt = _Lt()
            self._lt_workspace = cupy.empty(LT_WORKSPACE_BYTES, cupy.uint8)
        shapes = self._lt_shapes
        if key not in shapes:
            m, n, k, data, out_data, b_rows_out = key
            shapes[key] = _LtShape(self._lt, m, n, k, data, out_data, _COMPUTE_64F if data == 1 else _COMPUTE_32F,
                                   b_rows_out)
        return shapes[key]

    def __del__(self):
        handle = getattr(self, "_handle", None)
        if handle is not None and handle.value:
            self._destroy(handle)
