"""An experiment: what programmatic dependent launch (PDL) would save at each kernel boundary of a
decode step's CUDA graph.

A decode step of the example engine is 77 kernels in one graph (benchmarks/NOTES_e2e.md section
13), most of them a few microseconds long, so the time between one kernel's end and the next
one's start counts many times a step.  With the launch attribute
``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` a kernel may start before the one ahead
of it has finished; it waits for that kernel's results at ``griddepcontrol.wait``, and the
kernel ahead may let it start early with ``griddepcontrol.launch_dependents``.

This times graphs of ``--count`` dependent launches of a row kernel shaped like the engine's
``add_rms_norm`` (64 rows of 2,048 floats, one block a row: read, block sum, write), each reading
the previous launch's output, four ways: plain launches; PDL with the wait first and no early
trigger; PDL with an early trigger then the wait; and the row kernel alternating with a cuBLAS
product ([64, 2048] x [2048, 2048] bf16, the engine's ``out`` shape), plain and with PDL on the row
kernels.  Kernel time a launch = graph replay time / launches (median of CUDA-event samples).
The results of every way are compared with the plain one's (a wrong wait would show there).

    python benchmarks/exp_pdl.py [--count 160] [--reps 20]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

# The engine's fused-kernel helpers (headers, conversions, block_sum), then the experiment's kernel.
_FUSED = (ROOT / "examples" / "llama" / "fused.cu").read_text()  # llama.fused.SOURCE
SOURCE = _FUSED[:_FUSED.index('extern "C"')] + r"""
// MODE 0: no PDL instructions; 1: wait first; 2: trigger the next launch, then wait.
extern "C" __global__ void rows(const float* __restrict__ in, float* __restrict__ out, int hidden) {
#if MODE == 2
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
#if MODE >= 1
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    const long long row = (long long)blockIdx.x * hidden;
    float v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = in[row + threadIdx.x + k * blockDim.x];
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) s += v[k] * v[k];
    const float scale = rsqrtf(block_sum(s) / hidden + 1e-6f);
#pragma unroll
    for (int k = 0; k < 8; ++k) out[row + threadIdx.x + k * blockDim.x] = v[k] * scale + 0.5f;
}
"""


class _Attribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _Config(ctypes.Structure):
    _fields_ = [("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint),
                ("bx", ctypes.c_uint), ("by", ctypes.c_uint), ("bz", ctypes.c_uint),
                ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attribute)), ("num_attrs", ctypes.c_uint)]


PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID (cuda.h)


class RowKernel:
    def __init__(self, mode: int, rows: int, hidden: int):
        import cupy

        from llama.fused import options as fused_options
        from llama.weights import BF16

        options = fused_options(BF16) + (f"-DMODE={mode}",)
        self.function = cupy.RawModule(code=SOURCE, options=options).get_function("rows")
        self.rows, self.hidden, self.pdl = rows, hidden, mode > 0
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self.lib.cuLaunchKernelEx.restype = ctypes.c_int
        self.attribute = _Attribute(PROGRAMMATIC_STREAM_SERIALIZATION)
        ctypes.memmove(ctypes.addressof(self.attribute) + 8, ctypes.byref(ctypes.c_int(1)), 4)

    def __call__(self, src, dst, stream: int) -> None:
        args = [ctypes.c_void_p(src.data.ptr), ctypes.c_void_p(dst.data.ptr), ctypes.c_int(self.hidden)]
        params = (ctypes.c_void_p * 3)(*[ctypes.addressof(a) for a in args])
        config = _Config(self.rows, 1, 1, self.hidden // 8, 1, 1, 0, stream,
                         ctypes.pointer(self.attribute) if self.pdl else None, 1 if self.pdl else 0)
        status = self.lib.cuLaunchKernelEx(ctypes.byref(config), self.function.kernel.ptr, params, None)
        if status != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed: {status}")


def time_graph(body, stream, reps: int) -> float:
    """Median microseconds of one replay of the graph ``body()`` captures on ``stream``
    (``bench_decode.captured`` and ``graph_us``)."""
    from bench_decode import captured, graph_us

    with stream:
        body()  # eager first: nothing loads inside the capture
        stream.synchronize()
    graph = captured(body, 1, stream)
    with stream:
        return graph_us(lambda: graph.launch(stream), reps, 1)


def main(argv=None) -> int:
    import cupy
    from llama.cublas import Gemm
    from llama.weights import BF16

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=160)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", type=pathlib.Path)
    args = p.parse_args(argv)
    rows, hidden, n = 64, 2048, args.count
    stream = cupy.cuda.Stream(non_blocking=True)
    rng = cupy.random.default_rng(0)
    start_x = rng.standard_normal((rows, hidden), dtype=np.float32)
    bufs = [cupy.empty_like(start_x), cupy.empty_like(start_x)]
    gemm = Gemm()
    a = cupy.asarray((np.random.default_rng(1).standard_normal((rows, hidden)) * 0.1).astype(BF16))
    w = cupy.asarray((np.random.default_rng(2).standard_normal((hidden, hidden)) / 45).astype(BF16))
    prod = cupy.empty((rows, hidden), BF16)
    results, finals = {}, {}
    for name, mode, with_gemm in (("plain", 0, False), ("pdl wait", 1, False), ("pdl trigger+wait", 2, False),
                                  ("gemm + plain", 0, True), ("gemm + pdl trigger+wait", 2, True)):
        kernel = RowKernel(mode, rows, hidden)

        def body():
            bufs[0][...] = start_x
            for i in range(n):
                if with_gemm:
                    gemm(a, w, out=prod)
                kernel(bufs[i % 2], bufs[1 - i % 2], stream.ptr)

        us = time_graph(body, stream, args.reps)
        stream.synchronize()
        finals[name] = bufs[n % 2].get()
        results[name] = round(us / n, 3)
        print(f"{name:28} {us:9.1f} us a graph of {n} launches{' (+ as many products)' if with_gemm else ''}: "
              f"{us / n:6.3f} us a row kernel{' + product' if with_gemm else ''}", flush=True)
    for name, value in finals.items():
        same = np.array_equal(value, finals["plain"])
        print(f"{name:28} result equal to plain: {same}")
        results[f"{name} equal"] = bool(same)
    saved = results["plain"] - results["pdl trigger+wait"]
    saved_gemm = results["gemm + plain"] - results["gemm + pdl trigger+wait"]
    print(f"saved a boundary: {saved:.3f} us between row kernels, {saved_gemm:.3f} us after a cuBLAS product")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
