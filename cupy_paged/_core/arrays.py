"""The one array boundary: every public function reads its array arguments here.

NumPy arrays (and torch CPU tensors, viewed as NumPy arrays) run on the CPU reference
backend.  Device arrays -- CuPy arrays, torch CUDA tensors, anything exposing
``__cuda_array_interface__`` (numba) or ``__dlpack__`` on a CUDA device (JAX) -- are read as
an :class:`Array`: pointer, shape, strides, dtype and device, taken from the object's own
attributes, never through a DLPack import (which costs tens of microseconds a tensor).
Nothing is copied; writes (``out=``, cache appends) are seen by the caller.  Outputs are made
in the caller's kind: torch tensors for torch inputs, CuPy arrays otherwise, NumPy arrays for
NumPy inputs.  Mixing host and device arrays in one call raises.
"""
from __future__ import annotations

import functools
import operator
import sys

import ml_dtypes
import numpy as np

from .grad import warn_no_grad

try:  # CuPy is an extra: the package works on the CPU without it.
    import cupy
except ImportError:  # pragma: no cover - exercised only without the extra
    cupy = None

CPU, CUDA = "cpu", "cuda"
# Kinds of array: where it lives and which framework makes the outputs.
NUMPY, CUPY, TORCH, FOREIGN = "numpy", "cupy", "torch", "foreign"
BF16 = np.dtype(ml_dtypes.bfloat16)


class Array:
    """One device array argument as the kernels see it.

    ``ptr`` (int, the address of element 0), ``shape`` and ``strides`` (tuples, strides in
    elements), ``dtype`` (a NumPy dtype; bfloat16 is ``ml_dtypes.bfloat16``), ``device`` (the
    CUDA device id), ``kind`` (``"cupy"``, ``"torch"`` or ``"foreign"``) and ``obj`` (the caller's
    object).
    """

    __slots__ = ("obj", "kind", "ptr", "shape", "strides", "dtype", "device")

    def __init__(self, obj, kind, ptr, shape, strides, dtype, device):
        self.obj, self.kind, self.ptr = obj, kind, ptr
        self.shape, self.strides, self.dtype, self.device = shape, strides, dtype, device

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def size(self) -> int:
        return functools.reduce(operator.mul, self.shape, 1)

    def c_contiguous(self) -> bool:
        """Row-major dense (axes of length 1 and empty arrays do not count)."""
        if self.size == 0:
            return True
        expected = 1
        for extent, stride in zip(reversed(self.shape), reversed(self.strides)):
            if extent != 1 and stride != expected:
                return False
            expected *= extent
        return True

    def dense_last(self) -> bool:
        return self.size == 0 or self.shape[-1] == 1 or self.strides[-1] == 1

    def vectorised(self) -> bool:
        """Movable 16 bytes at a time: a 16-byte aligned base, every stride but the last a
        multiple of 16 bytes, a dense last axis."""
        item = self.dtype.itemsize
        return (self.ptr % 16 == 0 and self.dense_last()
                and all((s * item) % 16 == 0 for s, n in zip(self.strides[:-1], self.shape[:-1]) if n != 1))

    def cupy(self):
        """A CuPy array sharing this memory (for the few steps that need CuPy's operations)."""
        if self.kind == CUPY:
            return self.obj
        item = self.dtype.itemsize
        extent = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.strides)) if self.size else 0
        memory = cupy.cuda.UnownedMemory(self.ptr, extent * item, self.obj, self.device)
        return cupy.ndarray(self.shape, self.dtype, cupy.cuda.MemoryPointer(memory, 0),
                            tuple(s * item for s in self.strides))


# --------------------------------------------------------------------------- torch, lazily

@functools.cache
def _torch():
    return sys.modules["torch"]


@functools.cache
def torch_dtypes() -> dict:
    """torch dtype -> NumPy dtype, for the float and integer dtypes the package reads."""
    torch = _torch()
    return {torch.float16: np.dtype(np.float16), torch.bfloat16: BF16, torch.float32: np.dtype(np.float32),
            torch.float64: np.dtype(np.float64), torch.int32: np.dtype(np.int32),
            torch.int64: np.dtype(np.int64), torch.bool: np.dtype(np.bool_),
            torch.int16: np.dtype(np.int16), torch.uint8: np.dtype(np.uint8), torch.int8: np.dtype(np.int8)}


@functools.cache
def numpy_to_torch() -> dict:
    return {v: k for k, v in torch_dtypes().items()}


_KIND_OF_TYPE: dict = {}


def kind_of(obj) -> str | None:
    """``"numpy"``, ``"cupy"``, ``"torch"``, ``"foreign"`` (a CUDA array by protocol) or None."""
    t = type(obj)
    kind = _KIND_OF_TYPE.get(t)
    if kind is None:
        if issubclass(t, np.ndarray):
            kind = NUMPY
        elif cupy is not None and issubclass(t, cupy.ndarray):
            kind = CUPY
        elif "torch" in sys.modules and isinstance(obj, sys.modules["torch"].Tensor):
            kind = TORCH
        elif hasattr(obj, "__cuda_array_interface__") or hasattr(obj, "__dlpack__"):
            kind = FOREIGN
        else:
            return None
        _KIND_OF_TYPE[t] = kind
    return kind


def _cupy_signature(obj):
    return (obj.shape, obj.strides, obj.dtype, obj.data.device_id)


def _torch_signature(obj):
    return (obj.shape, obj.stride(), obj.dtype, obj.get_device())


def _cupy_ptr(obj) -> int:
    return obj.data.ptr


def _torch_ptr(obj) -> int:
    return obj.data_ptr()


# ``(signature, pointer)`` readers of one kind, for the memoised call paths: a call reads every
# array as its q's kind, without looking each one's kind up.  An object of another kind fails
# there with one of ``OTHER_KIND`` (a CuPy array has no ``stride()``, a torch tensor no
# ``strides``, a NumPy array's ``data`` no ``device_id``, and for a bfloat16 NumPy array no buffer
# at all: ValueError); the call then reads each array as its own kind (``signature``,
# ``data_ptr``: torch tensors beside a CuPy cache, say), which raises TypeError for what no memo
# can key.
FAST_READERS = {CUPY: (_cupy_signature, _cupy_ptr), TORCH: (_torch_signature, _torch_ptr)}
OTHER_KIND = (AttributeError, ValueError)


def signature(obj):
    """What of a torch tensor or CuPy array decides a launch, cheaply: (shape, strides, dtype,
    device); None for None.  Equal signatures mean the same checks pass and the same launch fits
    (only pointers differ).  ``TypeError`` for anything else: it cannot key a memo."""
    if obj is None:
        return None
    kind = _KIND_OF_TYPE.get(type(obj)) or kind_of(obj)
    if kind is TORCH:
        return _torch_signature(obj)
    if kind is CUPY:
        return _cupy_signature(obj)
    raise TypeError(f"no launch signature for {type(obj).__name__}")


def data_ptr(obj) -> int:
    """The address of a CuPy array's or torch tensor's element 0."""
    return obj.data_ptr() if _KIND_OF_TYPE.get(type(obj)) is TORCH else obj.data.ptr


# The readers a memoised call tries in turn, by the kind of its first array.
READERS = {kind: (FAST_READERS[kind], (signature, data_ptr)) for kind in FAST_READERS}
# The call paths (key function, kind) whose calls needed each array's own reader (torch tensors
# beside a CuPy cache, say: an application keeps its mix): they start with it, skipping the first
# kind's pass that fails part-way (about 3 us); their same-kind calls pay each array's kind lookup
# (about 0.1 us an array).  Empty in a process that never mixes, so the usual call tests it only.
_MIXED: set = set()


def memo_lookup(memo: dict, kind: str, key_of, *args) -> tuple:
    """``(key, found, ptr)`` of a memoised call whose first array is of ``kind`` (CuPy or torch):
    ``key = key_of(signature_reader, *args)`` read with that kind's readers, else (an array of
    another kind) with each array's own, ``found = memo.get(key)`` and ``ptr`` the pointer reader
    that matches; ``key`` None (and ``found`` None) when no memo can key the call: an unhashable
    argument, or an array that is neither a CuPy array nor a torch tensor.  Where a call of this
    ``key_of`` and ``kind`` needed each array's own reader, later calls start with it."""
    if kind is TORCH and args[0].requires_grad:
        warn_no_grad()
    readers = READERS[kind]
    if _MIXED and (key_of, kind) in _MIXED:
        readers = readers[1:]
    failed = False
    for s, ptr in readers:
        try:
            key = key_of(s, *args)
            found = memo.get(key)
        except OTHER_KIND:
            failed = True
            continue
        except TypeError:  # unhashable, or an array of no kind a memo keys (a host array): no entry
            break
        if failed:  # the kind's readers failed on an array that each array's own reader keyed
            _MIXED.add((key_of, kind))
        return key, found, ptr
    return None, None, data_ptr


def _torch_host(obj):
    """A torch CPU tensor as a NumPy array sharing its memory (bfloat16 through its bits)."""
    torch = _torch()
    tensor = obj.detach()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(BF16)
    if tensor.dtype not in torch_dtypes():
        raise TypeError(f"unsupported torch dtype {tensor.dtype}")
    return tensor.numpy()


def read(obj, name: str):
    """``obj`` as a NumPy array (host) or an :class:`Array` (device); ``TypeError`` naming
    ``name`` for anything else (a torch tensor that requires grad warns once: ``warn_no_grad``)."""
    kind = kind_of(obj)
    if kind is NUMPY:
        return obj
    if kind is CUPY:
        return Array(obj, CUPY, obj.data.ptr, obj.shape, tuple(s // obj.itemsize for s in obj.strides),
                     obj.dtype, obj.data.device_id)
    if kind is TORCH:
        if obj.requires_grad:
            warn_no_grad()
        device = obj.get_device()
        if device < 0:
            try:
                return _torch_host(obj)
            except TypeError:
                raise TypeError(f"{name} has torch dtype {obj.dtype}, which cupy_paged does not read") from None
        dtype = torch_dtypes().get(obj.dtype)
        if dtype is None:
            raise TypeError(f"{name} has torch dtype {obj.dtype}, which cupy_paged does not read")
        return Array(obj, TORCH, obj.data_ptr(), tuple(obj.shape), tuple(obj.stride()), dtype, device)
    if kind is FOREIGN:
        if cupy is not None and _is_cuda_dlpack(obj):
            # DLPack first: it carries bfloat16 as a type, where a CUDA array interface says only
            # "2-byte void".  The import costs microseconds; CuPy and torch never come this way.
            array = _bfloat16_view(cupy.from_dlpack(obj))
            return Array(obj, FOREIGN, array.data.ptr, array.shape,
                         tuple(s // array.itemsize for s in array.strides), array.dtype, array.data.device_id)
        if cupy is not None and hasattr(obj, "__cuda_array_interface__"):
            array = cupy.asarray(obj)
            return Array(obj, FOREIGN, array.data.ptr, array.shape,
                         tuple(s // array.itemsize for s in array.strides), array.dtype, array.data.device_id)
        if hasattr(obj, "__dlpack__") and not _is_cuda_dlpack(obj):
            return np.from_dlpack(obj)
    raise TypeError(f"{name} must be a NumPy array, a CuPy array, a torch tensor or a CUDA array exposing "
                    f"__dlpack__ or __cuda_array_interface__; got {type(obj).__name__}")


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


def _bfloat16_view(array):
    """CuPy imports a DLPack bfloat16 tensor as raw 2-byte voids ('V2'): view it as bfloat16."""
    if array.dtype.kind == "V" and array.dtype.itemsize == 2:
        return array.view(ml_dtypes.bfloat16)
    return array


def as_array(obj, name: str):
    """``obj`` as a NumPy or CuPy array, zero-copy (for the cache manager and the merge)."""
    value = read(obj, name)
    return value.cupy() if isinstance(value, Array) else value


def backend_of(named: dict) -> str:
    """``"cpu"`` or ``"cuda"`` for a dict of name -> array (``None`` entries ignored).

    Raises ``TypeError`` naming the first argument on the other side when host and
    device arrays are mixed, and ``ValueError`` when device arrays sit on two devices.
    """
    seen: dict[str, str] = {}
    devices: dict[int, str] = {}
    for name, array in named.items():
        if array is None:
            continue
        if isinstance(array, np.ndarray):
            seen.setdefault(CPU, name)
        else:
            seen.setdefault(CUDA, name)
            device = array.device if isinstance(array, Array) else array.data.device_id
            devices.setdefault(device, name)
    if len(seen) == 2:
        raise TypeError(f"{seen[CUDA]} is on a CUDA device but {seen[CPU]} is a NumPy array: "
                        "pass all arrays on the same side")
    if len(devices) > 1:
        (d0, n0), (d1, n1) = list(devices.items())[:2]
        raise ValueError(f"{n1} is on CUDA device {d1} but {n0} is on device {d0}: pass all arrays on one device")
    return next(iter(seen), CPU)


def empty(kind: str, like, shape: tuple, dtype, stream: int | None = None):
    """A new array of ``shape``/``dtype`` in the caller's ``kind`` on ``like``'s device (``like``:
    the caller's object of that kind).  ``stream``: the stream the array is written on when it is
    not the framework's current one (the memory pools hand memory out per stream)."""
    if kind is NUMPY:
        return np.empty(shape, dtype)
    if stream is not None:
        with on_stream(kind, stream):
            return empty(kind, like, shape, dtype)
    if kind is TORCH:
        return like.new_empty(shape, dtype=numpy_to_torch()[np.dtype(dtype)])
    return cupy.empty(shape, dtype)


def on_stream(kind: str, stream: int):
    """A context making ``stream`` the current stream of ``kind``'s framework (for the rare copy or
    allocation a call makes on an explicit ``stream=``)."""
    if kind is TORCH:
        torch = _torch()
        return torch.cuda.stream(torch_stream(torch, stream))
    return cupy_stream(stream)


def torch_stream(torch, handle: int):
    """The torch stream object of the ``cudaStream_t`` ``handle``.  Not ``ExternalStream``: for
    handle 0 (the legacy default stream, torch's own default) it makes a new pooled stream instead
    of wrapping it (pytorch/pytorch#182960), so work put "on stream 0" through it would run
    unordered with work on stream 0 itself (what flash_attn_func's LSE copy did, NOTES_calls.md,
    fourteenth session).  ``get_stream_from_external`` (torch 2.7+) wraps every handle."""
    wrap = getattr(torch.cuda, "get_stream_from_external", None)
    if wrap is not None:
        return wrap(handle)
    return torch.cuda.default_stream() if handle == 0 else torch.cuda.ExternalStream(handle)


class _StreamHandle:
    """A ``cudaStream_t`` handle as an object of the CUDA stream protocol, for CuPy's
    ``Stream.from_external`` (which supersedes ``ExternalStream``, deprecated in CuPy 14)."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


def cupy_stream(handle: int):
    """CuPy's stream object for ``handle`` (not owned: the stream outlives it); the null stream for 0."""
    if handle == 0:
        return cupy.cuda.Stream.null
    return cupy.cuda.Stream.from_external(_StreamHandle(handle))


def to_host(array) -> np.ndarray:
    """A NumPy copy of a small index array (``cu_seqlens``, ``cache_seqlens``...): a sync."""
    if isinstance(array, np.ndarray):
        return array
    if isinstance(array, Array):
        array = array.cupy()
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
