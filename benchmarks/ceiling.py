"""The read ceiling the benchmarks' floors divide bytes by, for the card a run is on.

The issues' floors are K/V and weight bytes / 4.44 TB/s, the read-only stream measured on the H200
(../shared/GPU.md: 16-byte ``__ldg`` loads over 8 GiB, 132 x 32 blocks of 256 threads).  The device
tool lends H100s too, whose memory reads slower (HBM3, 3.35 TB/s on its data sheet against the
H200's 4.8): a floor at the H200's ceiling would make every H100 figure look 1.3x further from
it than it is.  So on an H200 the floor keeps the issues' 4.44 TB/s, and on any other card the
same read-only stream is measured once per process (4 GiB, median of 10 passes after two) and
used instead.  The FLOP ceiling (700 TFLOP/s) is the same for both: they share the SMs and clocks.

    python benchmarks/ceiling.py     # prints the card, its measured stream and the ceiling used
"""
from __future__ import annotations

import functools

import numpy as np

H200_READ = 4.44e12  # bytes/s, GPU.md
TFLOPS = 700e12

_SOURCE = r"""
extern "C" __global__ void read_stream(const int4* __restrict__ src, long long n, int4* sink) {
    int4 acc = make_int4(0, 0, 0, 0);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const int4 v = __ldg(src + i);
        acc.x ^= v.x; acc.y ^= v.y; acc.z ^= v.z; acc.w ^= v.w;
    }
    if ((acc.x & acc.y & acc.z & acc.w) == -1) *sink = acc;  // never for zeros: keeps the loads
}
"""


def measure_read(gib: float = 4.0, reps: int = 10) -> float:
    """Bytes per second of a read-only stream over ``gib`` GiB of zeros on the current device: 16-byte
    loads, 32 blocks of 256 threads per SM, the device time of one pass (bench_decode.median_ms)."""
    import cupy

    from bench_decode import median_ms

    n = int(gib * 2**30) // 16
    src = cupy.zeros(n * 4, np.int32)
    sink = cupy.zeros(4, np.int32)
    kernel = cupy.RawKernel(_SOURCE, "read_stream")
    grid = (cupy.cuda.Device().attributes["MultiProcessorCount"] * 32,)
    ms = median_ms(lambda: kernel(grid, (256,), (src, np.int64(n), sink)), warmup=2, reps=reps, chain=1)
    return 16 * n / (ms * 1e-3)


def uses_h200_ceiling(device_name: str) -> bool:
    """Whether a card of this name takes the issues' 4.44 TB/s (an H200) rather than a measured one."""
    return "H200" in device_name


@functools.cache
def read_bytes_per_s() -> float:
    """The read ceiling of the current device's floors: 4.44 TB/s on an H200, else measured once.
    Without a GPU (bench_e2e's CPU mode, which records a GPU floor beside its run) the issues' 4.44."""
    import cupy

    from bench_calls import device_name

    if not cupy.cuda.is_available() or uses_h200_ceiling(device_name()):
        return H200_READ
    return measure_read()


def describe() -> dict:
    """What a results file records of the ceiling its floors used."""
    return {"read_bytes_per_s": read_bytes_per_s(), "flops_per_s": TFLOPS,
            "rule": "4.44 TB/s on an H200 (GPU.md); on another card its read-only stream, measured in the run"}


if __name__ == "__main__":
    from bench_calls import device_name

    print(device_name())
    print(f"measured read stream {measure_read() / 1e12:.3f} TB/s; ceiling used {read_bytes_per_s() / 1e12:.3f} TB/s")
