"""FlashAttention-2's decode features on the GPU against the CPU reference: rotary embedding
(GPT-J and GPT-NeoX, q per token or not), cache_batch_idx, cache_leftpad, ALiBi [batch, heads];
and the device error word for their bad values."""
import numpy as np
import pytest

import cupy_paged
from _util import BF16, assert_close, poisoned, randn, shuffled_block_table, to_numpy

pytestmark = pytest.mark.gpu
F16 = np.dtype(np.float16)
LSE_RTOL = 2e-3


def rotary_tables(rng, seqlen_ro: int, rotary_dim: int, dtype):
    angle = rng.uniform(0, 2 * np.pi, (seqlen_ro, rotary_dim // 2))
    return np.cos(angle).astype(dtype), np.sin(angle).astype(dtype)


def decode_case(rng, dtype, head_dim, heads, kv_heads, lengths, seqlen_q, seqlen_new, block_size=None,
                cache_len=None):
    """A decode call's NumPy inputs: a paged cache through a shuffled table (block_size), or a
    contiguous cache [batch, cache_len, Hkv, D]."""
    batch = len(lengths)
    case = dict(q=randn(rng, (batch, seqlen_q, heads, head_dim), dtype),
                cache_seqlens=np.asarray(lengths, np.int32))
    if block_size is not None:
        table, num_blocks = shuffled_block_table(rng, np.maximum(np.asarray(lengths) + seqlen_new, 1), block_size)
        case.update(block_table=table, k_cache=randn(rng, (num_blocks, block_size, kv_heads, head_dim), dtype),
                    v_cache=randn(rng, (num_blocks, block_size, kv_heads, head_dim), dtype))
    else:
        case.update(k_cache=randn(rng, (batch, cache_len, kv_heads, head_dim), dtype),
                    v_cache=randn(rng, (batch, cache_len, kv_heads, head_dim), dtype))
    if seqlen_new:
        case["k"] = randn(rng, (batch, seqlen_new, kv_heads, head_dim), dtype)
        case["v"] = randn(rng, (batch, seqlen_new, kv_heads, head_dim), dtype)
    return case


def compare(case, caches_rtol=None, **options):
    """The call on the reference and on the GPU: outputs, LSE and both caches after it."""
    import cupy

    dtype = case["q"].dtype
    host = {name: np.array(value) for name, value in case.items()}
    host_options = {name: np.array(value) if isinstance(value, np.ndarray) else value for name, value in options.items()}
    ref_out, ref_lse = cupy_paged.flash_attn_with_kvcache(**host, **host_options, return_softmax_lse=True)
    dev = {name: cupy.asarray(value) for name, value in case.items()}
    dev_options = {name: cupy.asarray(value) if isinstance(value, np.ndarray) else value for name, value in options.items()}
    out = poisoned(case["q"].shape, dtype, xp=cupy)
    got_out, got_lse = cupy_paged.flash_attn_with_kvcache(**dev, **dev_options, return_softmax_lse=True, out=out)
    cupy.cuda.get_current_stream().synchronize()
    assert cupy_paged.check_errors() is None
    assert_close(got_out, ref_out, dtype)
    assert_close(got_lse, ref_lse, np.float32, what="lse", rtol=LSE_RTOL)
    # The caches hold the (rotated) new keys; rotation may round one unit apart (FMA or not).
    for name in ("k_cache", "v_cache"):
        got, ref = to_numpy(dev[name]).astype(np.float32), host[name].astype(np.float32)
        np.testing.assert_allclose(got, ref, rtol=caches_rtol or 1e-2, atol=caches_rtol or 1e-2,
                                   err_msg=f"{name} after the call")


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", ["paged16", "paged64", "contiguous"])
@pytest.mark.parametrize("dtype, head_dim, rotary_dim", [(BF16, 128, 128), (F16, 128, 64), (BF16, 64, 32),
                                                         (F16, 256, 128), (BF16, 96, 48)])
@pytest.mark.parametrize("seqlen_q, seqlen_new", [(1, 1), (3, 3), (1, 2)])
def test_rotary(interleaved, causal, layout, dtype, head_dim, rotary_dim, seqlen_q, seqlen_new):
    rng = np.random.default_rng(hash((interleaved, causal, layout, head_dim, seqlen_q, seqlen_new)) % 2**32)
    lengths = [0, 17, 70, 63]
    block = int(layout[5:]) if layout.startswith("paged") else None
    case = decode_case(rng, dtype, head_dim, 8, 2, lengths, seqlen_q, seqlen_new, block_size=block, cache_len=96)
    cos, sin = rotary_tables(rng, 100, rotary_dim, dtype)
    compare(case, rotary_cos=cos, rotary_sin=sin, causal=causal, rotary_interleaved=interleaved)


@pytest.mark.parametrize("dtype, head_dim", [(BF16, 128), (F16, 64)])
def test_rotary_with_splits_and_window(dtype, head_dim):
    """The split-KV launch (each split rotates the new keys it reads) and a window (q per token)."""
    rng = np.random.default_rng(3)
    case = decode_case(rng, dtype, head_dim, 8, 2, [3000, 1], 2, 2, block_size=16)
    cos, sin = rotary_tables(rng, 3010, head_dim, dtype)
    compare(case, rotary_cos=cos, rotary_sin=sin, window_size=(700, 0), num_splits=5, rotary_interleaved=False)


@pytest.mark.parametrize("side", [96, 95], ids=["capacity", "capacity-1"])
def test_rotary_window_as_wide_as_the_cache(side):
    """Not causal, three query tokens, a window (side, side) on a contiguous cache of 96 keys: as wide
    as the cache it bounds nothing and q rotates at cache_seqlens; one narrower, per token."""
    rng = np.random.default_rng(side)
    case = decode_case(rng, BF16, 128, 8, 2, [0, 17, 70, 63], 3, 3, block_size=None, cache_len=96)
    cos, sin = rotary_tables(rng, 100, 128, BF16)
    compare(case, rotary_cos=cos, rotary_sin=sin, window_size=(side, side), rotary_interleaved=False)


@pytest.mark.parametrize("seqlen_new", [0, 1, 3])
@pytest.mark.parametrize("dtype, head_dim", [(BF16, 128), (F16, 64)])
def test_cache_batch_idx_and_leftpad(seqlen_new, dtype, head_dim):
    rng = np.random.default_rng(seqlen_new + head_dim)
    batch, rows, cache_len = 4, 6, 80
    case = decode_case(rng, dtype, head_dim, 8, 2, [40, 7, 60, 20], 1, seqlen_new, cache_len=cache_len)
    for name in ("k_cache", "v_cache"):  # more cache rows than sequences: cache_batch_idx picks them
        case[name] = randn(rng, (rows, cache_len, 2, head_dim), dtype)
    compare(case, cache_batch_idx=np.array([5, 0, 3, 2], np.int32))
    compare(case, cache_batch_idx=np.array([1, 4, 0, 5], np.int32), cache_leftpad=np.array([3, 0, 60, 19], np.int32),
            causal=True)
    case["k_cache"], case["v_cache"] = case["k_cache"][:batch].copy(), case["v_cache"][:batch].copy()
    compare(case, cache_leftpad=np.array([0, 7, 12, 5], np.int32))


def test_leftpad_batch_idx_rotary_together():
    rng = np.random.default_rng(9)
    case = decode_case(rng, BF16, 128, 16, 4, [50, 9, 33], 2, 2, cache_len=64)
    cos, sin = rotary_tables(rng, 70, 64, BF16)
    compare(case, rotary_cos=cos, rotary_sin=sin, causal=True, cache_batch_idx=np.array([2, 0, 1], np.int32),
            cache_leftpad=np.array([10, 0, 30], np.int32), rotary_interleaved=False)


@pytest.mark.parametrize("layout", ["paged16", "contiguous"])
def test_alibi_per_sequence_decode(layout):
    rng = np.random.default_rng(5)
    block = 16 if layout == "paged16" else None
    case = decode_case(rng, F16, 128, 8, 2, [30, 100, 5], 1, 1, block_size=block, cache_len=128)
    slopes = rng.uniform(0.01, 0.5, (3, 8)).astype(np.float32)
    compare(case, alibi_slopes=slopes, causal=True)


@pytest.mark.parametrize("paged", [False, True])
def test_alibi_per_sequence_varlen(paged):
    import cupy

    rng = np.random.default_rng(6)
    lens_q, lens_k = [5, 1, 40], [9, 30, 40]
    cu_q, max_q = cupy_paged.cu_seqlens_from_lengths(lens_q)
    cu_k, max_k = cupy_paged.cu_seqlens_from_lengths(lens_k)
    q = randn(rng, (sum(lens_q), 8, 128), BF16)
    k, v = randn(rng, (sum(lens_k), 2, 128), BF16), randn(rng, (sum(lens_k), 2, 128), BF16)
    table = None
    if paged:
        from _util import scatter_paged

        (k, v), table = scatter_paged(rng, [k, v], lens_k, 16)
    slopes = rng.uniform(0.01, 0.5, (3, 8)).astype(np.float32)
    ref = cupy_paged.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, alibi_slopes=slopes,
                                            block_table=table)
    dev = cupy.asarray
    got = cupy_paged.flash_attn_varlen_func(dev(q), dev(k), dev(v), dev(cu_q), dev(cu_k), max_q, max_k, causal=True,
                                            alibi_slopes=dev(slopes), block_table=None if table is None else dev(table))
    assert_close(got, ref, BF16)


# ---- bad values of these arguments on the device: holes and the error word (memcheck runs these)

def _bad_call(case, **options):
    import cupy

    dev = {name: cupy.asarray(value) for name, value in case.items()}
    opts = {name: cupy.asarray(value) if isinstance(value, np.ndarray) else value for name, value in options.items()}
    out = cupy_paged.flash_attn_with_kvcache(**dev, **opts)
    cupy.cuda.get_current_stream().synchronize()
    assert not bool(cupy.isnan(out).any()), "a bad value made NaN"
    return dev


@pytest.mark.parametrize("name, options, argument", [
    ("batch_idx", dict(cache_batch_idx=np.array([0, 9], np.int32)), "cache_batch_idx"),
    ("batch_idx_negative", dict(cache_batch_idx=np.array([-1, 1], np.int32)), "cache_batch_idx"),
    ("leftpad", dict(cache_leftpad=np.array([0, 50], np.int32)), "cache_leftpad"),
    ("leftpad_negative", dict(cache_leftpad=np.array([-3, 0], np.int32)), "cache_leftpad"),
])
def test_sanitize_bad_contiguous_indices(name, options, argument):
    rng = np.random.default_rng(1)
    case = decode_case(rng, BF16, 128, 8, 2, [20, 30], 1, 1, cache_len=64)
    _bad_call(case, **options)
    with pytest.raises(ValueError, match=f"^{argument}"):
        cupy_paged.check_errors()
    assert cupy_paged.check_errors() is None


def test_sanitize_rotary_positions_past_the_table():
    rng = np.random.default_rng(2)
    case = decode_case(rng, BF16, 128, 8, 2, [20, 60], 1, 1, block_size=16)
    cos, sin = rotary_tables(rng, 40, 128, BF16)  # position 60 has no row
    _bad_call(case, rotary_cos=cos, rotary_sin=sin, causal=True)
    with pytest.raises(ValueError, match="^rotary_cos .*sequence 1"):
        cupy_paged.check_errors()
