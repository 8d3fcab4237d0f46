"""What the launch glue of every kernel family shares: argument layout and naming rules."""
from __future__ import annotations

import functools
import re
import struct

import numpy as np

from .._core.arrays import TORCH, data_ptr, empty
from .._core.types import BF16

_CUDA_SCALAR = {np.dtype(np.float16): "__half", BF16: "__nv_bfloat16"}


def cuda_scalar(dtype) -> str:
    """The CUDA type (``SCALAR_T``) of a kernel dtype: float16 or bfloat16."""
    return _CUDA_SCALAR[np.dtype(dtype)]


def outputs(kind: str, like, out, lse_out, out_shape: tuple, lse_shape: tuple, dtype, want_lse: bool,
            out_like_q: bool, alloc_stream) -> tuple:
    """``(out, out_ptr, lse, lse_ptr)`` of a launch: the caller's ``(object, pointer)`` pairs where
    given, else new arrays in the caller's ``kind`` (``lse`` None and 0 when not wanted).
    ``out_like_q``: the output has ``like``'s shape and dtype and ``like`` is dense, so a torch
    output is ``empty_like`` (the cheapest torch allocation)."""
    if out is not None:
        out_obj, out_ptr = out
    else:
        if kind is TORCH and alloc_stream is None and out_like_q:
            out_obj = _torch_empty_like(like)
        else:
            out_obj = empty(kind, like, out_shape, dtype, alloc_stream)
        out_ptr = data_ptr(out_obj)
    if lse_out is not None:
        return out_obj, out_ptr, *lse_out
    if not want_lse:
        return out_obj, out_ptr, None, 0
    lse_obj = empty(kind, like, lse_shape, np.float32, alloc_stream)
    return out_obj, out_ptr, lse_obj, data_ptr(lse_obj)


def q_is_the_callers_dense_tensor(q) -> bool:
    """Whether ``q`` (an Array) describes the caller's own torch tensor, C-contiguous and in its own
    shape (not a copy, not a view with another shape): then ``empty_like`` of it is the output."""
    return q.kind is TORCH and q.c_contiguous() and tuple(q.shape) == tuple(q.obj.shape)


def _torch_empty_like(tensor):
    import torch

    return torch.empty_like(tensor)


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
    param_pointers : bool
        Launch with ``kernelParams``, one pointer a parameter into the same buffer, instead of the
        buffer itself: for a kernel whose first parameter is aligned past 16 bytes (the TMA shape's
        64-byte aligned tensor maps), which the compiler places where that alignment holds in the
        constant bank (48 bytes into the parameter space on sm_90), so that the buffer's C layout
        is not the kernel's; the driver copies each parameter to the offset the binary records.
    """

    def __init__(self, function, layout: str, param_pointers: bool = False):
        import threading

        from cupy_backends.cuda.api import driver

        self._launch = driver.launchKernel
        self.function = function
        # CuPy's RawKernel holds the driver function as .kernel (a cupy.cuda.Function)
        self._ptr = getattr(function, "kernel", function).ptr
        self._struct = struct.Struct("@" + layout)
        self._buffer = np.zeros(max(self._struct.size, 8), np.uint8)
        self._lock = threading.Lock()
        self._codes = [code for count, code in re.findall(r"(\d*)([a-zA-Z])", layout)
                       for code in ([f"{count}s"] if code == "s" else [code] * int(count or 1))]
        if param_pointers:  # kernelParams: where each argument lies in the buffer
            self._params = np.array([self._buffer.ctypes.data + self._offset(i) for i in range(len(self._codes))],
                                    np.uint64)
            self._kernel_params, self._extra_ptr = int(self._params.ctypes.data), 0
        else:
            self._size = np.array([self._struct.size], np.uint64)
            self._extra = np.array([_LAUNCH_PARAM_BUFFER_POINTER, self._buffer.ctypes.data,
                                    _LAUNCH_PARAM_BUFFER_SIZE, self._size.ctypes.data, _LAUNCH_PARAM_END], np.uint64)
            self._kernel_params, self._extra_ptr = 0, int(self._extra.ctypes.data)

    def _offset(self, i: int) -> int:
        """Where argument ``i`` starts in the buffer (native alignment)."""
        return struct.calcsize("@" + "".join(self._codes[:i + 1])) - struct.calcsize("@" + self._codes[i])

    def __call__(self, grid: tuple, threads: int, smem: int, stream: int, *args) -> None:
        """Pack every argument and launch."""
        with self._lock:  # one buffer: two threads must not pack it at once
            self._struct.pack_into(self._buffer, 0, *args)
            self._launch(self._ptr, grid[0], grid[1], grid[2], threads, 1, 1, smem, stream, self._kernel_params,
                         self._extra_ptr)

    def pack(self, *args) -> None:
        """Pack every argument once (the values that never change between launches)."""
        with self._lock:
            self._struct.pack_into(self._buffer, 0, *args)

    def span(self, first: int, count: int) -> tuple:
        """``(struct, offset)`` of arguments ``first .. first + count - 1``, to rewrite only those
        before :meth:`launch`."""
        offset = self._offset
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
            self._launch(self._ptr, grid[0], grid[1], grid[2], threads, 1, 1, smem, stream, self._kernel_params,
                         self._extra_ptr)
