"""Launch glue of ``cuda_src/merge.cu`` (``merge_attention_states`` on CUDA arrays)."""
from __future__ import annotations

import numpy as np

from .._core.arrays import cupy_stream
from .._core.compiler import KernelKey, get_function

SOURCE = "merge.cu"
THREADS = 256
KEY = KernelKey(SOURCE)  # dtype and head dim are run-time: one specialization


def all_keys():
    return [KEY]


def run(out_a, lse_a, out_b, lse_b, out, lse, tokens: int, seqlen: int, stream: int):
    """Merge checked CUDA partials (CuPy arrays) into ``out`` and ``lse`` on the stream ``stream``
    (a ``cudaStream_t``): the contiguous copies of strided inputs too."""
    import cupy

    heads, dim = int(out_a.shape[-2]), int(out_a.shape[-1])
    with cupy_stream(stream):
        a, b = cupy.ascontiguousarray(out_a), cupy.ascontiguousarray(out_b)
        lse_a, lse_b = cupy.ascontiguousarray(lse_a), cupy.ascontiguousarray(lse_b)
        total = tokens * heads * dim
        if total:
            function = get_function(KEY, f"merge_states_{np.dtype(out_a.dtype).name}")
            function((-(-total // THREADS),), (THREADS,),
                     (a, lse_a, b, lse_b, out, lse, np.int64(tokens), np.int32(max(seqlen, 1)),
                      np.int32(heads), np.int32(dim)))
