"""The CPU reference backend against the plain float64 attention of tests/naive.py."""
import itertools
import zlib

import numpy as np
import pytest

import cupy_paged
from _util import BF16, assert_close, assert_same_bits, randn, scatter_paged
from naive import naive_attention

HEAD_DIMS = (64, 128, 256)
GQA = ((4, 4), (8, 2), (8, 1))  # (num_heads, num_kv_heads): MHA, 4:1, MQA
OPTIONS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window_size": (5, 3)},
    "causal_window": {"causal": True, "window_size": (7, -1)},
    "softcap": {"softcap": 3.0, "causal": True},
    "alibi": {"alibi": True, "causal": True},
    "everything": {"alibi": True, "softcap": 5.0, "window_size": (9, 2)},
}


def _slopes(num_heads):
    return (2.0 ** -np.arange(1, num_heads + 1, dtype=np.float64) * 8 / num_heads).astype(np.float32)


def _naive_options(options, num_heads):
    return dict(causal=options.get("causal", False), window=options.get("window_size", (-1, -1)),
                softcap=options.get("softcap", 0.0),
                slopes=_slopes(num_heads) if options.get("alibi") else None)


def _api_options(options, num_heads):
    api = {k: v for k, v in options.items() if k != "alibi"}
    if options.get("alibi"):
        api["alibi_slopes"] = _slopes(num_heads)
    return api


def _check_varlen(rng, lengths_q, lengths_k, num_heads, num_kv_heads, head_dim, options,
                  dtype=np.float64, block_size=None):
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q = randn(rng, (total_q, num_heads, head_dim), dtype)
    k = randn(rng, (total_k, num_kv_heads, head_dim), dtype)
    v = randn(rng, (total_k, num_kv_heads, head_dim), dtype)
    cu_q, max_q = cupy_paged.cu_seqlens_from_lengths(lengths_q)
    cu_k, max_k = cupy_paged.cu_seqlens_from_lengths(lengths_k)
    kw = _api_options(options, num_heads)
    if block_size is None:
        out, lse = cupy_paged.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k,
                                                     return_softmax_lse=True, **kw)
    else:
        (k_cache, v_cache), table = scatter_paged(rng, [k, v], lengths_k, block_size)
        out, lse = cupy_paged.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max_q, max_k,
                                                     block_table=table, return_softmax_lse=True, **kw)
    assert out.dtype == dtype and lse.dtype == np.float32
    scale = 1.0 / np.sqrt(head_dim)
    for b in range(len(lengths_q)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        ref_out, ref_lse = naive_attention(q[qs], k[ks], v[ks], scale, **_naive_options(options, num_heads))
        tol = 1e-10 if dtype == np.float64 else 2e-2
        assert_close(out[qs], ref_out, dtype, f"out of sequence {b}", rtol=tol)
        assert_close(lse[:, qs], ref_lse, dtype, f"lse of sequence {b}", rtol=max(tol, 1e-6))


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_varlen_matches_naive(option, heads, head_dim):
    rng = np.random.default_rng(zlib.crc32(f"{option}-{heads}-{head_dim}".encode()))  # the same every run
    # Empty, single-token, square, q shorter than k (chunked prefill) and q longer than k.
    _check_varlen(rng, [0, 1, 9, 4, 13, 3], [5, 1, 9, 17, 6, 0], *heads, head_dim, OPTIONS[option])


@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128, 256])
@pytest.mark.parametrize("option", ["causal", "everything"])
def test_varlen_paged_matches_naive(block_size, option):
    rng = np.random.default_rng(block_size)
    lengths_k = [block_size - 1, block_size, block_size + 1, 0, 2 * block_size + 3]
    lengths_q = [3, 1, 5, 2, 4]
    _check_varlen(rng, lengths_q, lengths_k, 8, 2, 64, OPTIONS[option], block_size=block_size)


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32], ids=["fp16", "bf16", "fp32"])
def test_varlen_low_precision_inputs(dtype):
    rng = np.random.default_rng(7)
    _check_varlen(rng, [6, 1, 11], [6, 20, 11], 8, 2, 128, OPTIONS["everything"], dtype=dtype)


def _check_decode(rng, cache_lens, seqlen_q, seqlen_new, num_heads, num_kv_heads, head_dim,
                  block_size, options, dtype=np.float64):
    batch = len(cache_lens)
    totals = [n + seqlen_new for n in cache_lens]
    keys = [randn(rng, (n, num_kv_heads, head_dim), dtype) for n in totals]
    values = [randn(rng, (n, num_kv_heads, head_dim), dtype) for n in totals]
    q = randn(rng, (batch, seqlen_q, num_heads, head_dim), dtype)
    # The cache holds the first cache_lens[b] tokens; the rest arrive as new k/v.
    packed_k = np.concatenate([kk[:n] for kk, n in zip(keys, cache_lens)])
    packed_v = np.concatenate([vv[:n] for vv, n in zip(values, cache_lens)])
    (k_cache, v_cache), full = scatter_paged(rng, [packed_k, packed_v], cache_lens, block_size, capacity=totals)
    k_new = v_new = None
    if seqlen_new:
        k_new = np.stack([kk[n:] for kk, n in zip(keys, cache_lens)])
        v_new = np.stack([vv[n:] for vv, n in zip(values, cache_lens)])
    kw = _api_options(options, num_heads)
    out, lse = cupy_paged.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                                  cache_seqlens=np.array(cache_lens, np.int32),
                                                  block_table=full, return_softmax_lse=True, **kw)
    scale = 1.0 / np.sqrt(head_dim)
    for b in range(batch):
        ref_out, ref_lse = naive_attention(q[b], keys[b], values[b], scale, **_naive_options(options, num_heads))
        assert_close(out[b], ref_out, dtype, f"out of sequence {b}", rtol=1e-10)
        assert_close(lse[b], ref_lse, dtype, f"lse of sequence {b}", rtol=1e-6)
        for j in range(totals[b]):  # the appended tokens sit where the block table says
            block, offset = full[b, j // block_size], j % block_size
            np.testing.assert_array_equal(k_cache[block, offset], keys[b][j])
            np.testing.assert_array_equal(v_cache[block, offset], values[b][j])


@pytest.mark.parametrize("seqlen_q,seqlen_new", [(1, 0), (1, 1), (4, 4), (4, 0), (2, 3)])
@pytest.mark.parametrize("option", ["plain", "causal", "everything"])
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_decode_matches_naive(seqlen_q, seqlen_new, option, heads):
    rng = np.random.default_rng(seqlen_q * 100 + seqlen_new)
    _check_decode(rng, [0, 1, 15, 16, 17, 40], seqlen_q, seqlen_new, *heads, 64, 16, OPTIONS[option])


@pytest.mark.parametrize("block_size,head_dim", list(itertools.product([8, 32, 64, 128, 256], [64, 128, 256])))
def test_decode_block_sizes_and_head_dims(block_size, head_dim):
    rng = np.random.default_rng(block_size + head_dim)
    _check_decode(rng, [block_size - 1, block_size, 2 * block_size + 1], 1, 1, 8, 2, head_dim,
                  block_size, OPTIONS["causal"])


def test_decode_contiguous_cache_without_block_table():
    """A [B, S, Hkv, D] cache with no block table, as FlashAttention-2 allows."""
    rng = np.random.default_rng(3)
    k_cache = randn(rng, (2, 20, 2, 64), np.float64)
    v_cache = randn(rng, (2, 20, 2, 64), np.float64)
    q = randn(rng, (2, 1, 4, 64), np.float64)
    k_new = randn(rng, (2, 1, 2, 64), np.float64)
    v_new = randn(rng, (2, 1, 2, 64), np.float64)
    lens = np.array([5, 19], np.int32)
    out = cupy_paged.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, causal=True)
    for b in range(2):
        n = lens[b] + 1
        np.testing.assert_array_equal(k_cache[b, lens[b]], k_new[b, 0])
        ref, _ = naive_attention(q[b], k_cache[b, :n], v_cache[b, :n], 1 / 8, causal=True)
        assert_close(out[b], ref, np.float64, rtol=1e-10)


def test_write_kv_cache_skips_negative_slots():
    rng = np.random.default_rng(11)
    for dtype in (np.float16, BF16, np.float32):
        k_cache = randn(rng, (4, 8, 2, 64), dtype)
        v_cache = randn(rng, (4, 8, 2, 64), dtype)
        before_k, before_v = k_cache.copy(), v_cache.copy()
        k = randn(rng, (5, 2, 64), dtype)
        v = randn(rng, (5, 2, 64), dtype)
        slots = np.array([3, -1, 31, 8, -7], np.int32)
        cupy_paged.write_kv_cache(k_cache, v_cache, k, v, slots)
        expect_k, expect_v = before_k.reshape(32, 2, 64), before_v.reshape(32, 2, 64)
        for t, slot in enumerate(slots):
            if slot >= 0:
                expect_k[slot], expect_v[slot] = k[t], v[t]
        assert_same_bits(k_cache.reshape(32, 2, 64), expect_k, f"{np.dtype(dtype)} k_cache")
        assert_same_bits(v_cache.reshape(32, 2, 64), expect_v, f"{np.dtype(dtype)} v_cache")
