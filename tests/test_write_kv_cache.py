"""The write_kv_cache CUDA kernel against the CPU reference backend."""
import numpy as np
import pytest

import cupy_paged
from _util import BF16, randn


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("block_size", [8, 16, 256])
def test_kernel_matches_reference(dtype, head_dim, block_size):
    import cupy

    rng = np.random.default_rng(head_dim * block_size)
    num_blocks, kv_heads, tokens = 6, 4, 37
    k_cache = randn(rng, (num_blocks, block_size, kv_heads, head_dim), dtype)
    v_cache = randn(rng, (num_blocks, block_size, kv_heads, head_dim), dtype)
    # Strided k/v (a slice of a fused qkv buffer) and padding slots (-1) mixed in.
    fused = randn(rng, (tokens, 3 * kv_heads, head_dim), dtype)
    k, v = fused[:, kv_heads:2 * kv_heads], fused[:, 2 * kv_heads:]
    slots = rng.permutation(num_blocks * block_size)[:tokens].astype(np.int32)
    slots[::5] = -1
    dk, dv = cupy.asarray(k_cache), cupy.asarray(v_cache)
    dfused = cupy.asarray(fused)
    cupy_paged.write_kv_cache(dk, dv, dfused[:, kv_heads:2 * kv_heads], dfused[:, 2 * kv_heads:], cupy.asarray(slots))
    cupy_paged.write_kv_cache(k_cache, v_cache, k, v, slots)
    np.testing.assert_array_equal(cupy.asnumpy(dk).view(np.uint16), k_cache.view(np.uint16))
    np.testing.assert_array_equal(cupy.asnumpy(dv).view(np.uint16), v_cache.view(np.uint16))


@pytest.mark.gpu
def test_kernel_runs_on_the_current_stream():
    import cupy

    rng = np.random.default_rng(5)
    k_cache = cupy.zeros((2, 16, 1, 64), cupy.float16)
    v_cache = cupy.zeros_like(k_cache)
    k = cupy.asarray(randn(rng, (1, 1, 64), np.float16))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cupy_paged.write_kv_cache(k_cache, v_cache, k, k, cupy.asarray(np.array([20], np.int32)))
    stream.synchronize()
    assert bool((k_cache[1, 4] == k[0]).all())


@pytest.mark.gpu
def test_sanitize_write_kv_cache():
    """A small case for compute-sanitizer: strided inputs, padding slots, a 12-vector row (D=96)."""
    test_kernel_matches_reference(BF16, 96, 8)


@pytest.mark.gpu
def test_head_dim_axis_with_a_stride_is_read_as_values():
    """k/v whose last axis is not dense (every other element of a wider buffer) are written as
    the values they hold, as on the CPU backend."""
    import cupy

    rng = np.random.default_rng(6)
    k_cache, v_cache = (randn(rng, (4, 16, 2, 64), np.float16) for _ in range(2))
    wide = randn(rng, (5, 2, 128), np.float16)
    slots = np.array([3, 17, -1, 40, 63], np.int32)
    dk, dv = cupy.asarray(k_cache), cupy.asarray(v_cache)
    cupy_paged.write_kv_cache(dk, dv, cupy.asarray(wide)[..., ::2], cupy.asarray(wide)[..., 1::2], cupy.asarray(slots))
    cupy_paged.write_kv_cache(k_cache, v_cache, wide[..., ::2], wide[..., 1::2], slots)
    np.testing.assert_array_equal(cupy.asnumpy(dk), k_cache)
    np.testing.assert_array_equal(cupy.asnumpy(dv), v_cache)
