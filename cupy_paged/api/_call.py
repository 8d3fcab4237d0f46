"""What every public function of ``api/`` does around its own checks and launch.

A call reads its arrays at the one boundary (``_core.arrays``), checks them (its module's
``prepare_*``), then runs the CPU reference backend (``reference``) for NumPy inputs or
launches the CUDA kernels (``kernels.<family>``) for device inputs.  Everything a device call's shapes, strides, dtypes and
scalar arguments decide -- the checks' verdict, the kernel, grid, split count and packed
scalars -- is kept per such signature (``MEMO``), so a repeated call (the next layer, the next
step at the same shapes) reads its arguments' pointers and launches: a few microseconds of
host time, no device synchronisation, no host copy.
"""
from __future__ import annotations

import numpy as np

from .._core.arrays import CUPY, NUMPY, TORCH, Array, cupy, cupy_stream, empty, read
from .._core.types import BF16, check_bool, check_real

MEMO: dict = {}         # call signature -> resolved launch (kernels.*.*Launch)
MEMO_LIMIT = 4096
FAST_KINDS = (CUPY, TORCH)


def remember(key, launch) -> None:
    if key is None:
        return
    if len(MEMO) >= MEMO_LIMIT:
        MEMO.clear()
    MEMO[key] = launch


def current_device() -> int:
    return cupy.cuda.runtime.getDevice()


def on_device(device: int):
    """The device's context for a slow-path launch (a no-op when it is the current one)."""
    import contextlib

    import cupy

    return contextlib.nullcontext() if device == current_device() else cupy.cuda.Device(device)


def device_copy(array: Array, stream: int) -> Array:
    """A C-contiguous device copy of ``array`` made on ``stream`` (for inputs the kernels cannot
    read as they are: misaligned or strided rows, strided index arrays)."""
    import cupy

    with cupy_stream(stream):
        return read(cupy.ascontiguousarray(array.cupy()), "copy")


def readable(array, vectors: bool, stream: int):
    """``(array, copied)``: a device array the kernels can read as it is (16-byte rows when
    ``vectors``, else dense), or a copy of it made on ``stream``."""
    if not isinstance(array, Array):
        return array, False
    fine = array.vectorised() if vectors else array.c_contiguous()
    return (array, False) if fine else (device_copy(array, stream), True)


def alloc_stream(stream, kind: str, handle_: int):
    """The stream outputs are allocated for: the call's own when the caller named one."""
    return handle_ if stream is not None and kind in FAST_KINDS else None


def host_result(value, kind: str):
    """A NumPy result in the caller's kind: a torch CPU tensor for torch inputs."""
    if kind is not TORCH or value is None:
        return value
    import torch

    if value.dtype == BF16:
        return torch.from_numpy(value.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(value)


def host_outputs(p, out, lse_out, kind: str) -> tuple:
    """The CPU backend's (out, lse) in the caller's kind: the caller's own arrays where given."""
    host_kind = kind if kind is TORCH else NUMPY
    return (out if out is not None else host_result(p.out, host_kind),
            lse_out if lse_out is not None else host_result(p.lse, host_kind))


def reshaped(obj, shape):
    if obj is None or tuple(obj.shape) == tuple(shape):
        return obj
    return obj.reshape(shape)


def check_fa2_flags(dropout_p, deterministic, return_attn_probs):
    if check_real(dropout_p, "dropout_p") != 0.0:
        raise ValueError(f"dropout_p must be 0: cupy_paged computes the inference forward pass only; got {dropout_p!r}")
    check_bool(deterministic, "deterministic")
    return check_bool(return_attn_probs, "return_attn_probs")


def served_empty(kind: str, like, out, lse_out, out_shape: tuple, lse_shape: tuple, dtype, want_lse: bool,
                 device: int, alloc_stream_: int | None):
    """``(out, lse or None)`` of a device call with nothing to compute (no sequence, or no query
    token): the caller's ``out``/``lse_out`` where given, else new zero-size arrays in the caller's
    kind (CuPy for foreign arrays) on ``device``; no kernel is compiled or launched."""
    fast = kind in FAST_KINDS
    kind, like = (kind, like) if fast else (CUPY, None)
    with on_device(device):
        if out is None:
            out = empty(kind, like, tuple(out_shape), dtype, alloc_stream_)
        if lse_out is None and want_lse:
            lse_out = empty(kind, like, tuple(lse_shape), np.float32, alloc_stream_)
    return out, lse_out
