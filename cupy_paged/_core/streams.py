"""Which CUDA stream a call's work goes on.

The caller's: ``stream=`` when given (an int handle, a CuPy stream, a torch stream, or any
object with ``__cuda_stream__``); else torch's current stream for torch inputs and CuPy's
current stream for everything else, so that the work is ordered after whatever the caller
queued before the call and before whatever it queues after.
"""
from __future__ import annotations

import functools
import numbers
import sys
import threading

from .arrays import TORCH, cupy


@functools.cache
def _torch_current_raw():
    torch = sys.modules["torch"]
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda device: torch.cuda.current_stream(device).cuda_stream


def handle(stream, kind: str, device: int) -> int:
    """The ``cudaStream_t`` (an int) of ``stream``, or of the caller's current stream when None."""
    if stream is None:
        if kind is TORCH:
            return _torch_current_raw()(device)
        return cupy.cuda.get_current_stream().ptr
    if isinstance(stream, bool):
        raise TypeError(f"stream must be a stream handle (int) or a stream object; got {stream!r}")
    if isinstance(stream, int):
        if stream < 0:
            raise ValueError(f"stream must be a non-negative cudaStream_t handle; got {stream}")
        return stream
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        value = protocol() if callable(protocol) else protocol
        value = value[1] if isinstance(value, tuple) and len(value) == 2 else value
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise TypeError(f"stream's __cuda_stream__ must give a cudaStream_t handle (a non-negative int); "
                            f"got {value!r}")
        return int(value)
    for attribute in ("ptr", "cuda_stream"):  # CuPy streams; torch streams
        value = getattr(stream, attribute, None)
        if isinstance(value, int):
            return value
    raise TypeError("stream must be an int handle, a CuPy stream, a torch stream or an object with "
                    f"__cuda_stream__; got {type(stream).__name__}")


PER_THREAD_STREAM = 2  # cudaStreamPerThread: one handle, a different stream in each host thread


def stream_key(stream: int):
    """What keeps per-stream state (buffers a launch keeps, arrays made on a stream) apart: the
    handle, and for ``cudaStreamPerThread`` (handle 2, each host thread's own default stream, as
    CuPy's ``Stream.ptds``) the thread too, since one handle names a stream per thread there.

    Examples
    --------
    >>> import threading; from cupy_paged._core.streams import stream_key
    >>> stream_key(0), stream_key(1234)
    (0, 1234)
    >>> stream_key(2) == (2, threading.get_ident())
    True
    """
    return stream if stream != PER_THREAD_STREAM else (stream, threading.get_ident())


def is_capturing(stream: int) -> bool:
    """Whether ``stream`` is being captured into a CUDA graph."""
    return cupy.cuda.runtime.streamIsCapturing(stream) != 0
