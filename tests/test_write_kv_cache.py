"""The write_kv_cache CUDA kernel against the CPU reference backend.  The case whose id holds
``sanitize`` is the small one for compute-sanitizer (``-k sanitize``)."""
import itertools

import numpy as np
import pytest

import cupy_paged
from _util import BF16, assert_same_bits, randn


def _kernel_cases():
    """Every (dtype, head_dim, block_size), ids ``{block_size}-{head_dim}-{dtype}``; bf16, D=96
    (a 12-vector row), block size 8 is also the compute-sanitizer case: strided inputs, padding slots."""
    cases = []
    for block_size, head_dim, (dtype, name) in itertools.product(
            [8, 16, 256], [32, 64, 96, 128, 256], [(np.float16, "fp16"), (BF16, "bf16")]):
        case_id = f"{block_size}-{head_dim}-{name}"
        if (block_size, head_dim, name) == (8, 96, "bf16"):
            case_id = "sanitize-" + case_id
        cases.append(pytest.param(dtype, head_dim, block_size, id=case_id))
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim,block_size", _kernel_cases())
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
    assert_same_bits(dk, k_cache, "k_cache")
    assert_same_bits(dv, v_cache, "v_cache")


@pytest.mark.gpu
def test_kernel_runs_on_the_current_stream():
    """The write goes into CuPy's current stream: captured there, it is a node of that stream's
    graph and has not run when the capture ends (a launch on any other stream would have run,
    or broken the capture); replaying the graph writes the slot."""
    import cupy

    rng = np.random.default_rng(5)
    k_cache = cupy.zeros((2, 16, 1, 64), cupy.float16)
    v_cache = cupy.zeros_like(k_cache)
    k = cupy.asarray(randn(rng, (1, 1, 64), np.float16))
    slots = cupy.asarray(np.array([20], np.int32))
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()
    with stream:
        stream.begin_capture()
        cupy_paged.write_kv_cache(k_cache, v_cache, k, k, slots)
        graph = stream.end_capture()
    stream.synchronize()
    assert not bool(k_cache.any()), "the write ran outside the captured stream"
    graph.launch(stream)
    stream.synchronize()
    assert bool((k_cache[1, 4] == k[0]).all()) and bool((v_cache[1, 4] == k[0]).all())


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
