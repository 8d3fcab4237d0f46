"""What the launch glue of every kernel family shares: argument layout and naming rules."""
from __future__ import annotations

import functools
import re
import struct

import numpy as np

from .._checks import BF16

_CUDA_SCALAR = {np.dtype(np.float16): "__half", BF16: "__nv_bfloat16"}


def cuda_scalar(dtype) -> str:
    """The CUDA type (``SCALAR_T``) of a kernel dtype: float16 or bfloat16."""
    return _CUDA_SCALAR[np.dtype(dtype)]


def is_vectorised(array) -> bool:
    """Whether the kernels can move ``array`` 16 bytes at a time: a 16-byte aligned base, every
    stride but the last a multiple of 16 bytes, a dense last axis."""
    return (array.data.ptr % 16 == 0 and array.strides[-1] == array.itemsize
            and all(s % 16 == 0 for s in array.strides[:-1]))


def vectorised(array):
    """``array``, or a C-contiguous copy of it when it is not ``is_vectorised``."""
    import cupy

    return array if is_vectorised(array) else cupy.ascontiguousarray(array)


def element_strides(array, count: int | None = None) -> tuple[np.int64, ...]:
    """The first ``count`` (default all) strides of ``array`` in elements."""
    return tuple(np.int64(s // array.itemsize) for s in array.strides[:count])


def smem_row_bytes(head_dim: int) -> int:
    """Bytes of one row of head_dim 2-byte elements in a ``cp::SmemTile`` (mma.cuh): swizzled when
    the row is a multiple of 128 bytes, else padded by one 16-byte chunk."""
    chunks = head_dim // 8
    return 16 * (chunks if chunks % 8 == 0 else chunks + 1)


@functools.cache
def device_property(device: int, name: str):
    """One entry of CUDA's device properties (``multiProcessorCount``, ``major``, ...) of
    ``device``, read once per process."""
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(device)[name]


# Pointers and the 8-byte scalars are 8-aligned in a kernel's parameter buffer, 4-byte scalars
# 4-aligned, a struct by value aligned as its widest member: the C layout that struct's native
# mode ("@") also gives, so one format string lays out a kernel's whole argument list.
_LAUNCH_PARAM_END, _LAUNCH_PARAM_BUFFER_POINTER, _LAUNCH_PARAM_BUFFER_SIZE = 0, 1, 2


class Launcher:
    """One kernel launched through ``cuLaunchKernel`` with its whole argument list packed into
    one buffer (the driver's ``CU_LAUNCH_PARAM_BUFFER_POINTER``): a launch is one ``pack_into``
    and one driver call, a few microseconds, where CuPy's per-argument boxing costs about half
    a microsecond an argument.  The driver copies the buffer at the launch (so it is reused, and
    a graph capture records the values of that moment).

    Parameters
    ----------
    function : cupy.cuda.Function
        The kernel, loaded on the device it will run on.
    layout : str
        Its parameters as ``struct`` codes in order, native alignment: ``P`` a pointer, ``q``/``i``
        64/32-bit ints, ``f`` a float, ``{n}s`` a struct of n bytes (8-aligned: put it first).
    """

    def __init__(self, function, layout: str):
        import threading

        from cupy_backends.cuda.api import driver

        self._launch = driver.launchKernel
        self.function = function
        # CuPy's RawKernel holds the driver function as .kernel (a cupy.cuda.Function)
        self._ptr = getattr(function, "kernel", function).ptr
        self._struct = struct.Struct("@" + layout)
        self._buffer = np.zeros(max(self._struct.size, 8), np.uint8)
        self._size = np.array([self._struct.size], np.uint64)
        self._extra = np.array([_LAUNCH_PARAM_BUFFER_POINTER, self._buffer.ctypes.data,
                                _LAUNCH_PARAM_BUFFER_SIZE, self._size.ctypes.data, _LAUNCH_PARAM_END], np.uint64)
        self._extra_ptr = int(self._extra.ctypes.data)
        self._lock = threading.Lock()

        self._codes = [code for count, code in re.findall(r"(\d*)([a-zA-Z])", layout)
                       for code in ([f"{count}s"] if code == "s" else [code] * int(count or 1))]

    def __call__(self, grid: tuple, threads: int, smem: int, stream: int, *args) -> None:
        """Pack every argument and launch."""
        with self._lock:  # one buffer: two threads must not pack it at once
            self._struct.pack_into(self._buffer, 0, *args)
            self._launch(self._ptr, grid[0], grid[1], grid[2], threads, 1, 1, smem, stream, 0, self._extra_ptr)

    def pack(self, *args) -> None:
        """Pack every argument once (the values that never change between launches)."""
        with self._lock:
            self._struct.pack_into(self._buffer, 0, *args)

    def span(self, first: int, count: int) -> tuple:
        """``(struct, offset)`` of arguments ``first .. first + count - 1``, to rewrite only those
        before :meth:`launch`."""
        def offset(i: int) -> int:  # where field i starts in the buffer (native alignment)
            return struct.calcsize("@" + "".join(self._codes[:i + 1])) - struct.calcsize("@" + self._codes[i])

        # Standard sizes, no implicit alignment: the padding is spelled out from the buffer's offsets.
        start = position = offset(first)
        layout = "<"
        for i in range(first, first + count):
            code = "Q" if self._codes[i] == "P" else self._codes[i]
            layout += "x" * (offset(i) - position) + code
            position = offset(i) + struct.calcsize("<" + code)
        return struct.Struct(layout), start

    def launch(self, grid: tuple, threads: int, smem: int, stream: int, *spans) -> None:
        """Rewrite the given spans -- ``(struct, offset, values)`` each -- and launch."""
        with self._lock:
            for layout, offset, values in spans:
                layout.pack_into(self._buffer, offset, *values)
            self._launch(self._ptr, grid[0], grid[1], grid[2], threads, 1, 1, smem, stream, 0, self._extra_ptr)
