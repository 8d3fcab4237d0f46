"""Bad input raises ValueError/TypeError naming the argument, before any work is done."""
import numpy as np
import pytest

import cupy_paged
from _util import assert_same_bits, randn

RNG = np.random.default_rng(0)
F16 = np.float16


def varlen_args(**change):
    """A valid varlen call (query lengths [3, 2], key lengths [4, 5]) with some arguments replaced."""
    args = dict(q=randn(RNG, (5, 8, 64), F16), k=randn(RNG, (9, 2, 64), F16), v=randn(RNG, (9, 2, 64), F16),
                cu_seqlens_q=np.array([0, 3, 5], np.int32), cu_seqlens_k=np.array([0, 4, 9], np.int32),
                max_seqlen_q=3, max_seqlen_k=5)
    args.update(change)
    return args


def paged_varlen_args(**change):
    cache = randn(RNG, (4, 8, 2, 64), F16)
    args = varlen_args(k=cache, v=cache.copy(), block_table=np.array([[0, -1], [2, 3]], np.int32),
                       cu_seqlens_k=np.array([0, 4, 13], np.int32), max_seqlen_k=9)
    args.update(change)
    return args


def decode_args(**change):
    """A valid decode call: batch 2, block size 16, 5 and 16 cached tokens, one new token each."""
    args = dict(q=randn(RNG, (2, 1, 8, 64), F16), k_cache=randn(RNG, (4, 16, 2, 64), F16),
                v_cache=randn(RNG, (4, 16, 2, 64), F16), k=randn(RNG, (2, 1, 2, 64), F16),
                v=randn(RNG, (2, 1, 2, 64), F16), cache_seqlens=np.array([5, 16], np.int32),
                block_table=np.array([[3, -1], [0, 1]], np.int32))
    args.update(change)
    return args


def write_args(**change):
    args = dict(k_cache=randn(RNG, (4, 16, 2, 64), F16), v_cache=randn(RNG, (4, 16, 2, 64), F16),
                k=randn(RNG, (3, 2, 64), F16), v=randn(RNG, (3, 2, 64), F16),
                slot_mapping=np.array([0, 17, -1], np.int32))
    args.update(change)
    return args


VARLEN, DECODE, WRITE = (cupy_paged.flash_attn_varlen_func, cupy_paged.flash_attn_with_kvcache,
                         cupy_paged.write_kv_cache)

CASES = {
    # varlen
    "varlen_q_rank": (VARLEN, varlen_args(q=randn(RNG, (5, 512), F16)), ValueError, "q"),
    "varlen_q_not_an_array": (VARLEN, varlen_args(q=[[1.0]]), TypeError, "q"),
    "varlen_q_dtype": (VARLEN, varlen_args(q=np.ones((5, 8, 64), np.int32)), TypeError, "q"),
    "varlen_k_dtype_differs": (VARLEN, varlen_args(k=randn(RNG, (9, 2, 64), np.float32),
                                                   v=randn(RNG, (9, 2, 64), np.float32)), TypeError, "k"),
    "varlen_v_shape_differs": (VARLEN, varlen_args(v=randn(RNG, (8, 2, 64), F16)), ValueError, "v"),
    "varlen_heads_not_divisible": (VARLEN, varlen_args(k=randn(RNG, (9, 3, 64), F16),
                                                       v=randn(RNG, (9, 3, 64), F16)), ValueError, "q"),
    "varlen_head_dim_unsupported": (VARLEN, varlen_args(q=randn(RNG, (5, 8, 48), F16), k=randn(RNG, (9, 2, 48), F16),
                                                        v=randn(RNG, (9, 2, 48), F16)), ValueError, "q"),
    "varlen_head_dim_differs": (VARLEN, varlen_args(k=randn(RNG, (9, 2, 128), F16),
                                                    v=randn(RNG, (9, 2, 128), F16)), ValueError, "k"),
    "varlen_cu_q_total_mismatch": (VARLEN, varlen_args(cu_seqlens_q=np.array([0, 3, 4], np.int32)),
                                   ValueError, "cu_seqlens_q"),
    "varlen_cu_k_total_mismatch": (VARLEN, varlen_args(cu_seqlens_k=np.array([0, 4, 8], np.int32)),
                                   ValueError, "cu_seqlens_k"),
    "varlen_cu_k_decreasing": (VARLEN, varlen_args(cu_seqlens_k=np.array([0, 10, 9], np.int32), max_seqlen_k=10),
                               ValueError, "cu_seqlens_k"),
    "varlen_cu_q_not_from_zero": (VARLEN, varlen_args(cu_seqlens_q=np.array([1, 3, 5], np.int32)),
                                  ValueError, "cu_seqlens_q"),
    "varlen_cu_dtype": (VARLEN, varlen_args(cu_seqlens_q=np.array([0, 3, 5], np.float32)), TypeError, "cu_seqlens_q"),
    "varlen_cu_lengths_differ": (VARLEN, varlen_args(cu_seqlens_k=np.array([0, 9], np.int32)),
                                 ValueError, "cu_seqlens_k"),
    "varlen_max_seqlen_q_short": (VARLEN, varlen_args(max_seqlen_q=2), ValueError, "max_seqlen_q"),
    "varlen_max_seqlen_k_short": (VARLEN, varlen_args(max_seqlen_k=4), ValueError, "max_seqlen_k"),
    "varlen_window": (VARLEN, varlen_args(window_size=(-2, 0)), ValueError, "window_size"),
    "varlen_window_not_pair": (VARLEN, varlen_args(window_size=3), ValueError, "window_size"),
    "varlen_softcap": (VARLEN, varlen_args(softcap=-1.0), ValueError, "softcap"),
    "varlen_scale": (VARLEN, varlen_args(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    "varlen_alibi_shape": (VARLEN, varlen_args(alibi_slopes=np.ones(4, np.float32)), ValueError, "alibi_slopes"),
    "varlen_out_shape": (VARLEN, varlen_args(out=np.empty((5, 8, 32), F16)), ValueError, "out"),
    "varlen_out_dtype": (VARLEN, varlen_args(out=np.empty((5, 8, 64), np.float32)), TypeError, "out"),
    "varlen_paged_block_table_short": (VARLEN, paged_varlen_args(cu_seqlens_k=np.array([0, 4, 21], np.int32),
                                                                 max_seqlen_k=17), ValueError, "block_table"),
    "varlen_paged_block_id_range": (VARLEN, paged_varlen_args(block_table=np.array([[0, -1], [2, 4]], np.int32)),
                                    ValueError, "block_table"),
    "varlen_paged_block_id_unallocated": (VARLEN, paged_varlen_args(block_table=np.array([[0, -1], [2, -1]], np.int32)),
                                          ValueError, "block_table"),
    "varlen_paged_cache_strided": (VARLEN, paged_varlen_args(k=randn(RNG, (4, 8, 4, 64), F16)[:, :, ::2],
                                                             v=randn(RNG, (4, 8, 4, 64), F16)[:, :, ::2]),
                                   ValueError, "k"),
    "varlen_paged_block_size": (VARLEN, paged_varlen_args(k=randn(RNG, (4, 12, 2, 64), F16),
                                                          v=randn(RNG, (4, 12, 2, 64), F16)), ValueError, "k"),
    "varlen_paged_block_table_rows": (VARLEN, paged_varlen_args(block_table=np.array([[0, 1]], np.int32)),
                                      ValueError, "block_table"),
    # decode
    "decode_q_rank": (DECODE, decode_args(q=randn(RNG, (2, 8, 64), F16)), ValueError, "q"),
    "decode_q_dtype": (DECODE, decode_args(q=np.ones((2, 1, 8, 64), np.int8)), TypeError, "q"),
    "decode_cache_dtype": (DECODE, decode_args(k_cache=randn(RNG, (4, 16, 2, 64), np.float32)), TypeError, "k_cache"),
    "decode_cache_rank": (DECODE, decode_args(v_cache=randn(RNG, (64, 2, 64), F16)), ValueError, "v_cache"),
    "decode_heads_not_divisible": (DECODE, decode_args(q=randn(RNG, (2, 1, 5, 64), F16)), ValueError, "q"),
    "decode_head_dim_unsupported": (DECODE, decode_args(q=randn(RNG, (2, 1, 8, 80), F16),
                                                        k_cache=randn(RNG, (4, 16, 2, 80), F16),
                                                        v_cache=randn(RNG, (4, 16, 2, 80), F16), k=None, v=None),
                                    ValueError, "q"),
    "decode_block_size": (DECODE, decode_args(k_cache=randn(RNG, (4, 24, 2, 64), F16),
                                              v_cache=randn(RNG, (4, 24, 2, 64), F16)), ValueError, "k_cache"),
    "decode_block_table_short": (DECODE, decode_args(block_table=np.array([[3], [0]], np.int32)),
                                 ValueError, "block_table"),
    "decode_block_id_range": (DECODE, decode_args(block_table=np.array([[4, -1], [0, 1]], np.int32)),
                              ValueError, "block_table"),
    "decode_block_id_unallocated": (DECODE, decode_args(block_table=np.array([[3, -1], [0, -1]], np.int32)),
                                    ValueError, "block_table"),
    "decode_block_table_rows": (DECODE, decode_args(block_table=np.array([[3, -1]], np.int32)),
                                ValueError, "block_table"),
    "decode_block_table_dtype": (DECODE, decode_args(block_table=np.array([[3, -1], [0, 1]], np.float64)),
                                 TypeError, "block_table"),
    "decode_cache_seqlens_shape": (DECODE, decode_args(cache_seqlens=np.array([5, 16, 1], np.int32)),
                                   ValueError, "cache_seqlens"),
    "decode_cache_seqlens_negative": (DECODE, decode_args(cache_seqlens=np.array([-1, 16], np.int32)),
                                      ValueError, "cache_seqlens"),
    "decode_k_without_v": (DECODE, decode_args(v=None), ValueError, "k and v"),
    "decode_k_shape": (DECODE, decode_args(k=randn(RNG, (2, 1, 4, 64), F16)), ValueError, "k"),
    "decode_num_splits": (DECODE, decode_args(num_splits=-1), ValueError, "num_splits"),
    "decode_out_shape": (DECODE, decode_args(out=np.empty((2, 8, 64), F16)), ValueError, "out"),
    # write_kv_cache
    "write_slot_mapping_length": (WRITE, write_args(slot_mapping=np.array([0, 1], np.int32)), ValueError, "slot_mapping"),
    "write_slot_past_cache": (WRITE, write_args(slot_mapping=np.array([0, 64, 1], np.int32)), ValueError, "slot_mapping"),
    "write_slot_dtype": (WRITE, write_args(slot_mapping=np.array([0, 1, 2], np.float32)), TypeError, "slot_mapping"),
    "write_k_shape": (WRITE, write_args(k=randn(RNG, (3, 4, 64), F16)), ValueError, "k"),
    "write_k_dtype": (WRITE, write_args(k=randn(RNG, (3, 2, 64), np.float32)), TypeError, "k"),
    "write_cache_rank": (WRITE, write_args(k_cache=randn(RNG, (64, 2, 64), F16)), ValueError, "k_cache"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_names_the_argument(case):
    function, args, error, name = CASES[case]
    caches = [a.copy() for key, a in args.items() if key.endswith("cache") and isinstance(a, np.ndarray)]
    with pytest.raises(error) as info:
        function(**args)
    assert str(info.value).startswith(name), f"message does not start with {name!r}: {info.value}"
    after = [a for key, a in args.items() if key.endswith("cache") and isinstance(a, np.ndarray)]
    for before, now in zip(caches, after):  # raised before any work: caches untouched
        assert_same_bits(now, before, f"{case}: a cache after the rejected call")


def test_valid_calls_pass():
    """The base calls that the cases above break are themselves valid."""
    VARLEN(**varlen_args())
    VARLEN(**paged_varlen_args())
    DECODE(**decode_args())
    WRITE(**write_args())


@pytest.mark.gpu
def test_mixed_host_and_device_arrays_raise():
    import cupy

    args = varlen_args()
    args["k"] = cupy.asarray(args["k"])
    with pytest.raises(TypeError, match="^k is on a CUDA device but q is a NumPy array"):
        VARLEN(**args)


def test_windows_wider_than_any_sequence_are_unbounded():
    """A window past 2^31 (no int32 fits it) is accepted and means no bound."""
    wide = (2 ** 40, 2 ** 40)
    for function, args in ((VARLEN, varlen_args()), (DECODE, decode_args())):
        np.testing.assert_array_equal(function(**args, window_size=wide), function(**args))


def test_lse_out_is_filled_in_place():
    args = decode_args()
    lse = np.full((2, 8, 1), np.nan, np.float32)
    out, returned = DECODE(**args, lse_out=lse)
    assert returned is lse and np.isfinite(lse).all()
    with pytest.raises(ValueError, match="^lse_out must have shape"):
        DECODE(**decode_args(), lse_out=np.empty((2, 8), np.float32))
    with pytest.raises(TypeError, match="^lse_out must have dtype float32"):
        VARLEN(**varlen_args(), lse_out=np.empty((8, 5), np.float16))


def _on_gpu(args):
    import cupy

    return {k: cupy.asarray(a) if isinstance(a, np.ndarray) else a for k, a in args.items()}


@pytest.mark.gpu
def test_windows_wider_than_any_sequence_on_the_gpu():
    wide = (2 ** 40, 2 ** 40)
    for function, args in ((VARLEN, varlen_args()), (DECODE, decode_args())):
        args = _on_gpu(args)
        np.testing.assert_array_equal(function(**args, window_size=wide).get(), function(**args).get())


def _misaligned(array):
    """A C-contiguous CuPy copy of ``array`` starting 2 bytes past a 16-byte boundary."""
    import cupy

    flat = cupy.zeros(array.size + 8, array.dtype)
    view = flat[1:1 + array.size].reshape(array.shape)
    view[...] = cupy.asarray(array)
    return view


@pytest.mark.gpu
@pytest.mark.parametrize("function", ["varlen", "decode", "write"])
def test_misaligned_cache_is_rejected_not_copied(function):
    """The kernels move a paged cache 16 bytes at a time and write it in place: a cache that does
    not start on a 16-byte boundary is an error naming it (never a silent per-call copy)."""
    args = _on_gpu({"varlen": paged_varlen_args, "decode": decode_args, "write": write_args}[function]())
    name = "k" if function == "varlen" else "k_cache"
    args[name] = _misaligned(args[name].get())
    call = {"varlen": VARLEN, "decode": DECODE, "write": WRITE}[function]
    with pytest.raises(ValueError, match=f"^{name} must start on a 16-byte boundary"):
        call(**args)


@pytest.mark.gpu
def test_decode_with_built_index_arrays_allocates_nothing():
    """A contiguous cache (no block_table) and an int cache_seqlens: the kernel takes them as they
    are (no table, one length by value), so a call with ``out=`` allocates nothing, whatever the
    length; an int length is a host value, still checked (a length past the cache is refused)."""
    import cupy

    args = _on_gpu(dict(q=randn(RNG, (2, 1, 8, 64), F16), k_cache=randn(RNG, (2, 32, 2, 64), F16),
                        v_cache=randn(RNG, (2, 32, 2, 64), F16)))
    out = cupy.empty_like(args["q"])
    for seqlens in (20, None, 7, 31):
        DECODE(**args, cache_seqlens=seqlens, out=out)  # first call: compiles, plans the launch
        cupy.cuda.get_current_stream().synchronize()
        pool = cupy.get_default_memory_pool()
        used = pool.used_bytes()
        DECODE(**args, cache_seqlens=seqlens, out=out)
        DECODE(**args, cache_seqlens=seqlens - 1 if seqlens else seqlens, out=out)  # another length
        assert pool.used_bytes() == used, f"cache_seqlens={seqlens}: the call allocated"
    reference = DECODE(**{k: a.get() for k, a in args.items()}, cache_seqlens=20)
    np.testing.assert_allclose(DECODE(**args, cache_seqlens=20).get().astype(np.float32),
                               reference.astype(np.float32), rtol=5e-3, atol=5e-3)
    with pytest.raises(ValueError, match="^cache_seqlens = 33 plus 0 new tokens is more than the 32 keys"):
        DECODE(**args, cache_seqlens=33)
