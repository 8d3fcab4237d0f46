"""The one array boundary: every public function turns its inputs into arrays here.

NumPy arrays stay NumPy arrays and run on the CPU reference backend.  CuPy arrays,
anything exposing ``__cuda_array_interface__`` (numba device arrays) and anything
exposing ``__dlpack__`` on a CUDA device (PyTorch, JAX) become CuPy arrays that
share the caller's memory: no copy, and writes (``out=``, in-place cache appends)
are seen by the caller.  Mixing host and device arrays in one call raises.
"""
from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

try:  # CuPy is an extra: the package works on the CPU without it.
    import cupy
except ImportError:  # pragma: no cover - exercised only without the extra
    cupy = None

CPU, CUDA = "cpu", "cuda"


def _is_cuda_dlpack(obj) -> bool:
    device = getattr(obj, "__dlpack_device__", None)
    if device is None:
        return False
    try:
        device_type, _ = device()
    except Exception:
        return False
    # DLPack device types taken as GPU memory: 2 = CUDA, 13 = CUDA managed (3, pinned host memory,
    # is host memory and goes the NumPy way).
    return int(device_type) in (2, 13)


def as_array(obj, name: str):
    """``obj`` as a NumPy or CuPy array, zero-copy; ``TypeError`` naming ``name`` otherwise."""
    if isinstance(obj, np.ndarray):
        return obj
    if cupy is not None:
        if isinstance(obj, cupy.ndarray):
            return obj
        # DLPack first: it carries bfloat16 as a type, where the CUDA array interface of
        # PyTorch says only "2-byte void".
        if _is_cuda_dlpack(obj):
            return _bfloat16_view(cupy.from_dlpack(obj))
        if hasattr(obj, "__cuda_array_interface__"):
            return cupy.asarray(obj)
    if hasattr(obj, "__dlpack__") and not _is_cuda_dlpack(obj):
        return np.from_dlpack(obj)
    raise TypeError(f"{name} must be a NumPy array, a CuPy array or a CUDA array exposing "
                    f"__dlpack__ or __cuda_array_interface__; got {type(obj).__name__}")


def _bfloat16_view(array):
    """CuPy imports a DLPack bfloat16 tensor as raw 2-byte voids ('V2'): view it as bfloat16.

    bfloat16 is the only 2-byte DLPack float CuPy has no dtype code for, so a 'V2' array
    from DLPack is bfloat16 (the view shares memory).
    """
    if array.dtype.kind == "V" and array.dtype.itemsize == 2:
        return array.view(ml_dtypes.bfloat16)
    return array


def backend_of(named: dict) -> str:
    """``"cpu"`` or ``"cuda"`` for a dict of name -> array (``None`` entries ignored).

    Raises ``TypeError`` naming the first argument on the other side when host and
    device arrays are mixed.
    """
    seen: dict[str, str] = {}
    for name, array in named.items():
        if array is None:
            continue
        side = CPU if isinstance(array, np.ndarray) else CUDA
        seen.setdefault(side, name)
    if len(seen) == 2:
        raise TypeError(f"{seen[CUDA]} is on a CUDA device but {seen[CPU]} is a NumPy array: "
                        "pass all arrays on the same side")
    return next(iter(seen), CPU)


def to_host(array) -> np.ndarray:
    """A NumPy copy of a small index array (``cu_seqlens``, ``cache_seqlens``...)."""
    if isinstance(array, np.ndarray):
        return array
    return cupy.asnumpy(array)


def xp_of(array):
    """The array module (numpy or cupy) of ``array``."""
    return np if isinstance(array, np.ndarray) else cupy


@functools.cache
def gpu_available() -> bool:
    """True where CuPy is installed and a CUDA device answers (checked once per process)."""
    if cupy is None:
        return False
    try:
        return bool(cupy.cuda.is_available())
    except Exception:
        return False
