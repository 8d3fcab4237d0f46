"""Two worked examples, on the CPU and the GPU: the varlen indexing of query lengths [10, 3, 1] and
key lengths [0, 1, 7] (cu_seqlens_q [0, 10, 13, 14], cu_seqlens_k [0, 0, 1, 8]; r0 sees no key), and a
decode block table for 30, 32 and 70 cached tokens in blocks of 32 (rows [2], [0, 1], [3, 5, 6])."""
import numpy as np
import pytest

import cupy_paged
from cupy_paged.reference._attend import gather_paged
from _util import randn, to_numpy
from naive import naive_attention


def _xp(side):
    if side == "cpu":
        return np
    import cupy

    return cupy


SIDES = [pytest.param("cpu"), pytest.param("gpu", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("side", SIDES)
def test_varlen_indexing_example(side):
    xp = _xp(side)
    rng = np.random.default_rng(0)
    cu_q, max_q = cupy_paged.cu_seqlens_from_lengths([10, 3, 1], xp=xp)
    cu_k, max_k = cupy_paged.cu_seqlens_from_lengths([0, 1, 7], xp=xp)
    assert to_numpy(cu_q).tolist() == [0, 10, 13, 14] and max_q == 10
    assert to_numpy(cu_k).tolist() == [0, 0, 1, 8] and max_k == 7
    q = randn(rng, (1, 14, 8, 64), np.float16)
    k = randn(rng, (1, 8, 2, 64), np.float16)
    v = randn(rng, (1, 8, 2, 64), np.float16)
    out, lse = cupy_paged.flash_attn_varlen_func(xp.asarray(q), xp.asarray(k), xp.asarray(v), cu_q, cu_k,
                                                 max_q, max_k, causal=True, return_softmax_lse=True)
    out, lse = to_numpy(out), to_numpy(lse)
    assert out.shape == (1, 14, 8, 64) and lse.shape == (8, 14)
    # Q tokens 0..9 are r0's, which has no K token: zeros and lse -inf, never NaN.
    assert (out[0, :10] == 0).all() and (lse[:, :10] == -np.inf).all()
    # Q tokens 10..12 are r1's and see K token 0; Q token 13 is r2's and sees K tokens 1..7.
    for qs, ks in ((slice(10, 13), slice(0, 1)), (slice(13, 14), slice(1, 8))):
        ref, ref_lse = naive_attention(q[0, qs], k[0, ks], v[0, ks], 1 / 8, causal=True)
        np.testing.assert_allclose(out[0, qs].astype(np.float64), ref, rtol=0, atol=5e-3)
        np.testing.assert_allclose(lse[:, qs], ref_lse, rtol=1e-3)


@pytest.mark.parametrize("side", SIDES)
def test_decode_block_table_example(side):
    xp = _xp(side)
    rng = np.random.default_rng(1)
    block_size, kv_heads, head_dim = 32, 2, 64
    cache_seqlens = np.array([30, 32, 70], np.int32)
    table = cupy_paged.block_table_from_lists([[2], [0, 1], [3, 5, 6]], max_blocks=4)
    assert table.tolist() == [[2, -1, -1, -1], [0, 1, -1, -1], [3, 5, 6, -1]]
    k_cache = randn(rng, (8, block_size, kv_heads, head_dim), np.float16)
    v_cache = randn(rng, (8, block_size, kv_heads, head_dim), np.float16)
    before_k = k_cache.copy()
    q = randn(rng, (3, 1, 8, head_dim), np.float16)
    k_new = randn(rng, (3, 1, kv_heads, head_dim), np.float16)
    v_new = randn(rng, (3, 1, kv_heads, head_dim), np.float16)
    dk, dv = xp.asarray(k_cache), xp.asarray(v_cache)
    out = cupy_paged.flash_attn_with_kvcache(xp.asarray(q), dk, dv, xp.asarray(k_new), xp.asarray(v_new),
                                             cache_seqlens=xp.asarray(cache_seqlens),
                                             block_table=xp.asarray(table), causal=True)
    k_after, v_after = to_numpy(dk), to_numpy(dv)
    # seq 0: 30 cached, the new token fits in KV_cache[2] at offset 30.
    # seq 1: 32 cached, the new token needs the second block: KV_cache[1] offset 0.
    # seq 2: 70 cached in [3], [5], [6]; the new token lands in KV_cache[6] at offset 6.
    landing = [(2, 30), (1, 0), (6, 6)]
    expect = before_k.copy()
    for b, (block, offset) in enumerate(landing):
        np.testing.assert_array_equal(k_after[block, offset], k_new[b, 0])
        np.testing.assert_array_equal(v_after[block, offset], v_new[b, 0])
        expect[block, offset] = k_new[b, 0]
    np.testing.assert_array_equal(k_after, expect)  # nothing else moved
    out = to_numpy(out)
    for b, n in enumerate(cache_seqlens + 1):
        keys, values = gather_paged(k_after, table[b], n), gather_paged(v_after, table[b], n)
        ref, _ = naive_attention(q[b], keys, values, 1 / 8, causal=True)
        np.testing.assert_allclose(out[b].astype(np.float64), ref, rtol=0, atol=5e-3)
