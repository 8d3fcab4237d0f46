"""The device error word: bad index values found by the kernels, reported on request.

What lives in device arrays (block ids, lengths, slots) cannot be checked on the host without
a copy and a sync, so the kernels check it: a bad entry is treated as a hole (no key read, no
slot written, never an access outside the arrays given) and recorded in one int32[4] word per
device -- {code, sequence, detail, count}, the first report winning the code
(``cp::report_error`` in cuda_src/common.cuh).  :func:`check_errors` reads the word (one
device synchronisation), clears it and raises a ``ValueError`` naming the argument and the
sequence.  :func:`set_debug` (or ``CUPY_PAGED_DEBUG=1`` in the environment) makes every
launch check at once.
"""
from __future__ import annotations

import os

import numpy as np

# Code -> (argument, what went wrong, how the detail reads); cuda_src/common.cuh's ErrorCode.
CODES = {
    1: ("block_table", "holds an id outside [0, num_blocks) at column {detail} of sequence {where}, "
                       "a block the sequence needs"),
    2: ("cache_seqlens", "(or cu_seqlens_k with a block table) gives sequence {where} {detail} keys, more "
                         "than its block table row (or the contiguous cache) holds"),
    3: ("cache_seqlens", "is negative ({detail}) for sequence {where}"),
    4: ("cu_seqlens_q", "is not a valid prefix sum at sequence {where} (it must start at 0, never decrease, "
                        "stay within q's tokens and give no length above max_seqlen_q; length {detail})"),
    5: ("cu_seqlens_k", "is not a valid prefix sum at sequence {where} (it must never decrease and stay "
                        "within k's tokens; length {detail})"),
    6: ("slot_mapping", "sends token {where} to slot {detail}, past the cache's num_blocks * block_size slots"),
    7: ("cache_batch_idx", "gives sequence {where} the cache row {detail}, outside the cache's batch"),
    8: ("cache_leftpad", "gives sequence {where} the start {detail}, negative or past its cache_seqlens"),
    9: ("rotary_cos", "has no row for position {detail} of sequence {where} (rotary_cos/rotary_sin "
                      "[seqlen_ro, rotary_dim / 2] must cover every position rotated)"),
}

_WORDS: dict[int, object] = {}   # device id -> cupy int32[4]
_debug = os.environ.get("CUPY_PAGED_DEBUG", "").strip().lower() not in ("", "0", "false", "no", "off")


def set_debug(flag: bool) -> None:
    """Check the device error word after every launch (a sync each), raising at the call that
    met the bad value.  ``CUPY_PAGED_DEBUG=1`` in the environment turns it on at import.

    Parameters
    ----------
    flag : bool
    """
    global _debug
    if not isinstance(flag, (bool, np.bool_)):
        raise TypeError(f"flag must be a bool; got {type(flag).__name__}")
    _debug = bool(flag)


def debug() -> bool:
    """Whether :func:`set_debug` is on."""
    return _debug


def word(device: int) -> int:
    """The address of ``device``'s error word, made (zeroed, synchronously) on first use."""
    found = _WORDS.get(device)
    if found is None:
        import cupy

        with cupy.cuda.Device(device):
            if cupy.cuda.get_current_stream().is_capturing():
                raise RuntimeError("cupy_paged's first call on a device must not be inside a CUDA graph "
                                   "capture: make one eager call first (it also compiles the kernels)")
            found = cupy.zeros(4, np.int32)
            cupy.cuda.Device(device).synchronize()  # zeroed before any other stream's kernel writes it
        _WORDS[device] = found
    return found.data.ptr


def check_errors() -> None:
    """Raise the first bad index value a kernel met since the last check, and clear the record.

    Synchronises every device that ran a cupy_paged kernel (one device-to-host copy each).
    A default call never checks on its own (it would sync); call this where a sync is cheap
    (after a step), or turn :func:`set_debug` on while developing.

    Raises
    ------
    ValueError
        Naming the argument, the sequence (or token) and the value, e.g.
        ``block_table holds an id outside [0, num_blocks) at column 2 of sequence 3, ...``.

    Examples
    --------
    >>> import cupy_paged
    >>> cupy_paged.check_errors()   # nothing recorded: returns None
    """
    if not _WORDS:
        return
    import cupy

    for device, array in _WORDS.items():
        with cupy.cuda.Device(device):
            cupy.cuda.Device(device).synchronize()
            code, where, detail, count = (int(x) for x in array.get())
            if code == 0:
                continue
            array.fill(0)
            cupy.cuda.Device(device).synchronize()
        argument, text = CODES.get(code, ("<unknown>", "error code {code} at {where} ({detail})"))
        more = f" ({count - 1} more reports since the last check)" if count > 1 else ""
        raise ValueError(f"{argument} {text.format(where=where, detail=detail, code=code)}{more}; "
                         "the kernel treated it as a hole (nothing read or written there)")


def after_launch() -> None:
    """Called after every launch: checks at once in debug mode."""
    if _debug:
        check_errors()
