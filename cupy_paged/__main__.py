"""``python -m cupy_paged {demo,info,compile,warm}``.

demo     two worked examples through the public API (varlen indexing of query lengths
         [10, 3, 1] and key lengths [0, 1, 7]; a decode block table for 30, 32 and 70
         cached tokens in blocks of 32), on the GPU when there is one, else on the CPU
         reference backend
info     versions, the GPU (or none), the kernel cache folder, specializations built
compile  compile every specialization through NVRTC without a GPU; print resources
warm     build every specialization into CuPy's kernel cache, in parallel processes
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np


def demo() -> int:
    import cupy_paged
    from cupy_paged._core.arrays import gpu_available

    if gpu_available():
        import cupy as xp
        where = "GPU (CUDA kernels)"
    else:
        xp = np
        where = "CPU reference backend (no GPU found)"
    print(f"cupy_paged {cupy_paged.__version__} on the {where}\n")
    rng = np.random.default_rng(0)
    dtype = np.float16
    heads, kv_heads, head_dim = 8, 2, 64

    # Varlen: query lengths [10, 3, 1], key lengths [0, 1, 7].
    cu_q, max_q = cupy_paged.cu_seqlens_from_lengths([10, 3, 1], xp=xp)
    cu_k, max_k = cupy_paged.cu_seqlens_from_lengths([0, 1, 7], xp=xp)
    q = xp.asarray(rng.standard_normal((1, 14, heads, head_dim)).astype(dtype))
    k = xp.asarray(rng.standard_normal((1, 8, kv_heads, head_dim)).astype(dtype))
    v = xp.asarray(rng.standard_normal((1, 8, kv_heads, head_dim)).astype(dtype))
    out, lse = cupy_paged.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k,
                                                 causal=True, return_softmax_lse=True)
    lse = np.asarray(lse.get() if hasattr(lse, "get") else lse)
    print("varlen path")
    print(f"  cu_seqlens_q = {cu_q.tolist()}  max_seqlen_q = {max_q}")
    print(f"  cu_seqlens_k = {cu_k.tolist()}  max_seqlen_k = {max_k}")
    print(f"  Q {tuple(q.shape)}  K/V {tuple(k.shape)}  -> out {tuple(out.shape)}")
    print(f"  r0's 10 queries see no key: out all zero = {bool((out[0, :10] == 0).all())}, "
          f"lse = {lse[0, 0]}")
    print(f"  r2's query sees 7 keys: lse head 0 = {lse[0, 13]:.4f}\n")

    # Decode: cache lengths [30, 32, 70], block size 32, at most 4 blocks per sequence.
    block_size = 32
    cache_seqlens = xp.asarray(np.array([30, 32, 70], np.int32))
    table = cupy_paged.block_table_from_lists([[2], [0, 1], [3, 5, 6]], max_blocks=4, xp=xp)
    k_cache = xp.asarray(rng.standard_normal((8, block_size, kv_heads, head_dim)).astype(dtype))
    v_cache = xp.asarray(rng.standard_normal((8, block_size, kv_heads, head_dim)).astype(dtype))
    q = xp.asarray(rng.standard_normal((3, 1, heads, head_dim)).astype(dtype))
    k_new = xp.asarray(rng.standard_normal((3, 1, kv_heads, head_dim)).astype(dtype))
    v_new = xp.asarray(rng.standard_normal((3, 1, kv_heads, head_dim)).astype(dtype))
    out = cupy_paged.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                             cache_seqlens=cache_seqlens, block_table=table,
                                             causal=True)
    print("decode path")
    print(f"  cache_seqlens = {cache_seqlens.tolist()}, block_table = {table.tolist()}")
    for b, length in enumerate([30, 32, 70]):
        block = int(table[b, length // block_size])
        stored = bool((k_cache[block, length % block_size] == k_new[b, 0]).all())
        print(f"  seq {b}: new token -> KV_cache[{block}] offset {length % block_size} "
              f"(stored: {stored})")
    print(f"  out {tuple(out.shape)}, finite: {bool(xp.isfinite(out.astype(np.float32)).all())}")
    return 0


def info() -> int:
    import cupy_paged
    from cupy_paged._core import compiler as _compiler
    from cupy_paged.kernels import registry
    from cupy_paged._core.arrays import gpu_available

    import ml_dtypes
    import numba

    print(f"cupy_paged   {cupy_paged.__version__}")
    print(f"python       {sys.version.split()[0]}")
    print(f"numpy        {np.__version__}")
    print(f"numba        {numba.__version__}")
    print(f"ml_dtypes    {ml_dtypes.__version__}")
    try:
        import cupy
        from cupy.cuda import nvrtc

        print(f"cupy         {cupy.__version__}")
        print(f"nvrtc        {'.'.join(map(str, nvrtc.getVersion()))}")
        print(f"kernel cache {_compiler.kernel_cache_dir()}")
    except ImportError:
        print("cupy         not installed (CPU reference backend only)")
    if gpu_available():
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        print(f"gpu          {props['name'].decode()}, sm_{props['major']}{props['minor']}, "
              f"{props['multiProcessorCount']} SMs, driver {cupy.cuda.runtime.driverGetVersion()}")
    else:
        print("gpu          none (cupy.cuda.is_available() is False)")
    print(f"cuda sources {_compiler.source_dir()}")
    keys = registry.all_keys()
    built = _compiler.built_keys()
    print(f"kernels      {len(keys)} specializations; built so far (key, source hash): {len(built)}")
    for line in built:
        print(f"  {line}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupy_paged", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["demo", "info", "compile", "warm"], nargs="?", default="demo")
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo()
    if args.command == "info":
        return info()
    if args.command == "compile":
        from cupy_paged.kernels import registry

        return registry.main(args.rest)
    warm_parser = argparse.ArgumentParser(prog="python -m cupy_paged warm")
    warm_parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    warm_parser.add_argument("--filter", default="")
    warm_args = warm_parser.parse_args(args.rest)
    if warm_args.jobs < 1:
        warm_parser.error(f"--jobs must be >= 1; got {warm_args.jobs}")
    from cupy_paged.kernels import registry

    return registry.warm(warm_args.jobs, warm_args.filter)


if __name__ == "__main__":
    sys.exit(main())
