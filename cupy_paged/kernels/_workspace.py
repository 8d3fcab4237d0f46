"""Device buffers that launches keep between calls and only ever grow: the split-KV workspace of
``paged_decode``, the merge counts of a ragged launch and the work-list buffer of a device-listed
one (per device and stream, as ``streams.stream_key`` tells streams apart), and the identity block
table of a contiguous decode cache (per device).

A per-stream buffer is allocated and filled on the stream that uses it, so it is ready there in
stream order and a call that grows one waits for no other stream (no device sync).  The identity
table is read by every stream of its device (a graph captured on a side stream after a warm-up on
another uses it), so its growth still synchronises the device once, after its fill.  Growing
allocates, which a CUDA graph capture must not do: while the stream captures, a buffer that would
have to grow raises instead.  An outgrown buffer is kept alive, so a graph captured with it never
points at freed memory.
"""
from __future__ import annotations

import numpy as np

from .._core.arrays import cupy_stream
from .._core.streams import is_capturing, stream_key

_WORKSPACES: dict[tuple[int, int], object] = {}
_WORK_LISTS: dict[tuple[int, int], object] = {}
_MERGE_COUNTS: dict[tuple[int, int], object] = {}
_IDENTITIES: dict[int, object] = {}
_RETIRED: list[object] = []  # outgrown buffers: a captured graph may still use them


def _grown(store: dict, key, size: int, create, what: str, device: int, stream: int, shared: bool = False):
    """``store[key]``, replaced by ``create(n)`` (n >= size, at least doubling) when it
    holds fewer than ``size`` elements.  ``create`` runs with ``stream`` current on ``device``:
    the memory pool hands the memory out for that stream and any fill is queued on it, ahead of
    the launch that reads the buffer; a ``shared`` buffer (read by other streams too) is then
    waited for by a device sync.  Growing allocates, so while ``stream`` captures a graph it raises
    instead; an outgrown buffer is kept alive for the graphs captured with it."""
    current = store.get(key)
    if current is None or current.size < size:
        if is_capturing(stream):
            raise RuntimeError(
                f"{what} must hold {size} elements but holds {0 if current is None else current.size}: "
                "make one eager call with the same shapes on this stream before capture (for the "
                "split-KV workspace, cupy_paged.kernels.decode.reserve_workspace(...) also does)")
        if current is not None:
            _RETIRED.append(current)
        import cupy

        with cupy.cuda.Device(device), cupy_stream(stream):
            current = create(max(size, 2 * (0 if current is None else current.size)))
        if shared:
            cupy.cuda.Device(device).synchronize()
        store[key] = current
    return current


def holds(num_floats: int, num_ints: int, num_counts: int, device: int, stream: int) -> bool:
    """Whether (device, stream)'s split workspace, work-list buffer and merge counts already hold
    ``num_floats``, ``num_ints`` and ``num_counts``: a launch that needs them can run without growing
    them (inside a capture)."""
    key = (device, stream_key(stream))
    return all(store.get(key) is not None and store[key].size >= size
               for store, size in ((_WORKSPACES, num_floats), (_WORK_LISTS, num_ints),
                                   (_MERGE_COUNTS, num_counts)))


def split_workspace(num_floats: int, device: int, stream: int):
    """The float32 split-KV workspace of (device, stream), of at least ``num_floats``."""
    import cupy

    return _grown(_WORKSPACES, (device, stream_key(stream)), num_floats, lambda n: cupy.empty(n, np.float32),
                  "the split-KV workspace", device, stream)


def work_buffer(num_ints: int, device: int, stream: int):
    """The int32 buffer of (device, stream), of at least ``num_ints``, zeroed when allocated, that
    a device-built ragged work list lives in (``kernels/ragged.py``, ``DeviceListLaunch``): the
    hand-over's ints first, then the list, written by the first CTA of a launch to start and read by its other CTAs."""
    import cupy

    return _grown(_WORK_LISTS, (device, stream_key(stream)), num_ints, lambda n: cupy.zeros(n, np.int32),
                  "the ragged work-list buffer", device, stream)


def merge_counts(num_counts: int, device: int, stream: int):
    """The int32 counters of (device, stream), of at least ``num_counts``, zeroed when allocated,
    with which a ragged launch's split CTAs find the last of each row group (``decode.cu``
    ``merge_if_last``): that CTA merges the splits and sets the count back to zero, so they are
    zeros between launches."""
    import cupy

    return _grown(_MERGE_COUNTS, (device, stream_key(stream)), num_counts, lambda n: cupy.zeros(n, np.int32),
                  "the ragged merge counts", device, stream)


def identity_table(size: int, device: int, stream: int):
    """int32 ``0, 1, ..., size - 1`` (at least) on ``device``: the block table of a contiguous cache
    ``[B, S, Hkv, D]`` read as B * S blocks of one token (row b starts at b * S).  One per device,
    grown (with a device sync: every stream reads it), never built per call."""
    import cupy

    return _grown(_IDENTITIES, device, size, lambda n: cupy.arange(n, dtype=np.int32),
                  "the identity block table", device, stream, shared=True)
