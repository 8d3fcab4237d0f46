"""Bad input raises ValueError/TypeError naming the argument, before any work is done."""
import copy
import warnings

import numpy as np
import pytest

import cupy_paged
from _util import BF16, assert_same_bits, randn

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


def read_only(array):
    array = array.copy()
    array.flags.writeable = False
    return array


def contiguous_decode_args(**change):
    """A valid decode call over a contiguous cache [2, 16, 2, 64] (no block table)."""
    args = dict(q=randn(RNG, (2, 1, 8, 64), F16), k_cache=randn(RNG, (2, 16, 2, 64), F16),
                v_cache=randn(RNG, (2, 16, 2, 64), F16), k=randn(RNG, (2, 1, 2, 64), F16),
                v=randn(RNG, (2, 1, 2, 64), F16), cache_seqlens=np.array([5, 15], np.int32))
    args.update(change)
    return args


def dense_args(**change):
    args = dict(q=randn(RNG, (2, 3, 8, 64), F16), k=randn(RNG, (2, 4, 2, 64), F16), v=randn(RNG, (2, 4, 2, 64), F16))
    args.update(change)
    return args


def merge_args(**change):
    args = dict(out_a=randn(RNG, (5, 8, 64), F16), lse_a=randn(RNG, (8, 5), np.float32),
                out_b=randn(RNG, (5, 8, 64), F16), lse_b=randn(RNG, (8, 5), np.float32))
    args.update(change)
    return args


def slot_args(**change):
    args = dict(block_table=np.array([[2, -1], [0, 1]], np.int32), seq_ids=np.array([0, 1, 1]),
                positions=np.array([3, 0, 17]), block_size=16)
    args.update(change)
    return args


DENSE, MERGE = cupy_paged.flash_attn_func, cupy_paged.merge_attention_states
CU, TABLE, SLOTS = (cupy_paged.cu_seqlens_from_lengths, cupy_paged.block_table_from_lists,
                    cupy_paged.slot_mapping_from_positions)
BIG = 2 ** 32 + 8  # an int64 past int32: a cast would make it 8

CASES.update({
    # varlen: no silent coercion of scalars, int64 index arrays range-checked before the cast
    "varlen_cu_q_int64_past_int32": (VARLEN, varlen_args(cu_seqlens_q=np.array([0, 3, BIG - 3], np.int64)),
                                     ValueError, "cu_seqlens_q"),
    "varlen_cu_k_int64_past_int32": (VARLEN, varlen_args(cu_seqlens_k=np.array([0, 4, BIG], np.int64)),
                                     ValueError, "cu_seqlens_k"),
    "varlen_cu_bool": (VARLEN, varlen_args(cu_seqlens_q=np.array([False, True, True])), TypeError, "cu_seqlens_q"),
    "varlen_max_seqlen_q_float": (VARLEN, varlen_args(max_seqlen_q=5.9), TypeError, "max_seqlen_q"),
    "varlen_max_seqlen_q_none": (VARLEN, varlen_args(max_seqlen_q=None), TypeError, "max_seqlen_q"),
    "varlen_max_seqlen_q_bool": (VARLEN, varlen_args(max_seqlen_q=True), TypeError, "max_seqlen_q"),
    "varlen_max_seqlen_k_past_int32": (VARLEN, varlen_args(max_seqlen_k=2 ** 31), ValueError, "max_seqlen_k"),
    "varlen_window_float": (VARLEN, varlen_args(window_size=(1.7, 0)), TypeError, "window_size"),
    "varlen_window_three": (VARLEN, varlen_args(window_size=(1, 2, 3)), ValueError, "window_size"),
    "varlen_scale_string": (VARLEN, varlen_args(softmax_scale="0.125"), TypeError, "softmax_scale"),
    "varlen_scale_zero": (VARLEN, varlen_args(softmax_scale=0.0), ValueError, "softmax_scale"),
    "varlen_softcap_string": (VARLEN, varlen_args(softcap="30"), TypeError, "softcap"),
    "varlen_causal_int": (VARLEN, varlen_args(causal=1), TypeError, "causal"),
    "varlen_dropout": (VARLEN, varlen_args(dropout_p=0.1), ValueError, "dropout_p"),
    "varlen_deterministic_string": (VARLEN, varlen_args(deterministic="yes"), TypeError, "deterministic"),
    "varlen_return_lse_int": (VARLEN, varlen_args(return_softmax_lse=1), TypeError, "return_softmax_lse"),
    "varlen_check_values_int": (VARLEN, varlen_args(check_values=0), TypeError, "check_values"),
    "varlen_alibi_int": (VARLEN, varlen_args(alibi_slopes=np.ones(8, np.int32)), TypeError, "alibi_slopes"),
    "varlen_out_read_only": (VARLEN, varlen_args(out=read_only(np.zeros((5, 8, 64), F16))), ValueError, "out"),
    "varlen_lse_out_read_only": (VARLEN, varlen_args(lse_out=read_only(np.zeros((8, 5), np.float32))),
                                 ValueError, "lse_out"),
    "varlen_paged_v_differs": (VARLEN, paged_varlen_args(v=randn(RNG, (5, 8, 2, 64), F16)), ValueError, "v"),
    # decode
    "decode_cache_seqlens_float": (DECODE, decode_args(cache_seqlens=3.7), TypeError, "cache_seqlens"),
    "decode_cache_seqlens_int64_past_int32": (DECODE, decode_args(cache_seqlens=np.array([5, BIG], np.int64)),
                                              ValueError, "cache_seqlens"),
    "decode_cache_seqlens_float_array": (DECODE, decode_args(cache_seqlens=np.array([5.0, 16.0])),
                                         TypeError, "cache_seqlens"),
    "decode_k_cache_read_only": (DECODE, decode_args(k_cache=read_only(randn(RNG, (4, 16, 2, 64), F16))),
                                 ValueError, "k_cache"),
    "decode_v_cache_read_only": (DECODE, decode_args(v_cache=read_only(randn(RNG, (4, 16, 2, 64), F16))),
                                 ValueError, "v_cache"),
    "decode_rotary_interleaved_int": (DECODE, decode_args(rotary_interleaved=0), TypeError, "rotary_interleaved"),
    "decode_num_splits_float": (DECODE, decode_args(num_splits=2.0), TypeError, "num_splits"),
    "decode_window_float": (DECODE, decode_args(window_size=(0, 1.5)), TypeError, "window_size"),
    "decode_scale_string": (DECODE, decode_args(softmax_scale="0.1"), TypeError, "softmax_scale"),
    "decode_causal_none": (DECODE, decode_args(causal=None), TypeError, "causal"),
    "decode_lse_out_read_only": (DECODE, decode_args(lse_out=read_only(np.zeros((2, 8, 1), np.float32))),
                                 ValueError, "lse_out"),
    "decode_rotary_without_new_tokens": (DECODE, decode_args(k=None, v=None, rotary_cos=np.ones((64, 16), F16),
                                                             rotary_sin=np.ones((64, 16), F16)),
                                         ValueError, "rotary_cos"),
    "decode_batch_idx_with_table": (DECODE, decode_args(cache_batch_idx=np.array([0, 1], np.int32)),
                                    ValueError, "cache_batch_idx"),
    # a full contiguous cache plus one new token, no table passed: the message is about the lengths
    "decode_contiguous_full_plus_one": (DECODE, contiguous_decode_args(cache_seqlens=np.array([16, 3], np.int32)),
                                        ValueError, "cache_seqlens"),
    "decode_contiguous_full_plus_one_int": (DECODE, contiguous_decode_args(cache_seqlens=16), ValueError,
                                            "cache_seqlens"),
    "decode_contiguous_batch_idx_float": (DECODE, contiguous_decode_args(cache_batch_idx=np.array([0.0, 1.0])),
                                          TypeError, "cache_batch_idx"),
    "decode_contiguous_leftpad_past_length": (DECODE, contiguous_decode_args(cache_leftpad=np.array([6, 0], np.int32)),
                                              ValueError, "cache_leftpad"),
    # write_kv_cache
    "write_k_cache_read_only": (WRITE, write_args(k_cache=read_only(randn(RNG, (4, 16, 2, 64), F16))),
                                ValueError, "k_cache"),
    "write_slot_int64_past_int32": (WRITE, write_args(slot_mapping=np.array([0, 1, BIG], np.int64)),
                                    ValueError, "slot_mapping"),
    "write_check_values_string": (WRITE, write_args(check_values="no"), TypeError, "check_values"),
    "write_v_shape_differs": (WRITE, write_args(v=randn(RNG, (2, 2, 64), F16)), ValueError, "v"),
    # flash_attn_func
    "dense_q_rank": (DENSE, dense_args(q=randn(RNG, (6, 8, 64), F16)), ValueError, "q"),
    "dense_k_batch": (DENSE, dense_args(k=randn(RNG, (3, 4, 2, 64), F16), v=randn(RNG, (3, 4, 2, 64), F16)),
                      ValueError, "k"),
    "dense_causal_int": (DENSE, dense_args(causal=1), TypeError, "causal"),
    "dense_window_float": (DENSE, dense_args(window_size=(2.5, 0)), TypeError, "window_size"),
    "dense_out_shape": (DENSE, dense_args(out=np.empty((2, 3, 8, 32), F16)), ValueError, "out"),
    "dense_dropout": (DENSE, dense_args(dropout_p=0.5), ValueError, "dropout_p"),
    # v of k's token count in another [batch, seqlen]: refused, not read as if reshaped
    "dense_v_other_batch_seqlen": (DENSE, dense_args(v=randn(RNG, (1, 8, 2, 64), F16)), ValueError, "v"),
    # an out whose batch and seqlen axes do not merge: flattened it would be a copy the caller never sees
    "dense_out_transposed": (DENSE, dense_args(out=np.zeros((3, 2, 8, 64), F16).transpose(1, 0, 2, 3)),
                             ValueError, "out"),
    "dense_head_dim_before_work": (DENSE, dense_args(q=randn(RNG, (2, 3, 8, 48), F16)), ValueError, "q"),
    # more query tokens in cu_seqlens_q than q has (fewer are allowed: padding rows, as in FlashAttention-2)
    "varlen_cu_q_past_q": (VARLEN, varlen_args(cu_seqlens_q=np.array([0, 3, 6], np.int32)), ValueError,
                           "cu_seqlens_q"),
    "varlen_cu_k_past_k": (VARLEN, varlen_args(cu_seqlens_k=np.array([0, 4, 10], np.int32), max_seqlen_k=6),
                           ValueError, "cu_seqlens_k"),
    # merge_attention_states
    "merge_out_a_dtype": (MERGE, merge_args(out_a=np.ones((5, 8, 64), np.int32)), TypeError, "out_a"),
    "merge_out_a_not_an_array": (MERGE, merge_args(out_a=[[1.0]]), TypeError, "out_a"),
    "merge_out_b_shape": (MERGE, merge_args(out_b=randn(RNG, (4, 8, 64), F16)), ValueError, "out_b"),
    "merge_lse_a_shape": (MERGE, merge_args(lse_a=randn(RNG, (5, 8), np.float32)), ValueError, "lse_a"),
    "merge_lse_b_dtype": (MERGE, merge_args(lse_b=randn(RNG, (8, 5), F16)), TypeError, "lse_b"),
    "merge_out_read_only": (MERGE, merge_args(out=read_only(np.zeros((5, 8, 64), F16))), ValueError, "out"),
    # index helpers
    "cu_lengths_float": (CU, dict(lengths=[1.5, 2]), TypeError, "lengths"),
    "cu_lengths_bool": (CU, dict(lengths=np.array([True, False])), TypeError, "lengths"),
    "cu_lengths_negative": (CU, dict(lengths=[3, -1]), ValueError, "lengths"),
    "cu_lengths_rank": (CU, dict(lengths=[[1, 2]]), ValueError, "lengths"),
    "cu_lengths_past_int32": (CU, dict(lengths=[2 ** 31 - 1, 2]), ValueError, "lengths"),
    "table_id_float": (TABLE, dict(block_lists=[[0, 1.5]]), TypeError, "block_lists"),
    "table_id_past_int32": (TABLE, dict(block_lists=[[BIG]]), ValueError, "block_lists"),
    "table_id_negative": (TABLE, dict(block_lists=[[0], [-5]]), ValueError, "block_lists"),
    "table_not_lists": (TABLE, dict(block_lists=[3, 4]), TypeError, "block_lists"),
    "table_max_blocks_float": (TABLE, dict(block_lists=[[0]], max_blocks=2.5), TypeError, "max_blocks"),
    "table_max_blocks_short": (TABLE, dict(block_lists=[[0, 1, 2]], max_blocks=2), ValueError, "max_blocks"),
    "slots_positions_float": (SLOTS, slot_args(positions=np.array([3.0, 0.0, 17.5])), TypeError, "positions"),
    "slots_block_size_float": (SLOTS, slot_args(block_size=16.0), TypeError, "block_size"),
    "slots_block_size_zero": (SLOTS, slot_args(block_size=0), ValueError, "block_size"),
    "slots_seq_id_past_table": (SLOTS, slot_args(seq_ids=np.array([0, 1, 2])), ValueError, "seq_ids"),
    "slots_position_past_table": (SLOTS, slot_args(positions=np.array([3, 0, 32])), ValueError, "positions"),
    "slots_position_negative": (SLOTS, slot_args(positions=np.array([3, 0, -1])), ValueError, "positions"),
    "slots_lengths_differ": (SLOTS, slot_args(positions=np.array([3, 0])), ValueError, "seq_ids"),
    "slots_table_float": (SLOTS, slot_args(block_table=np.array([[2.0, -1.0], [0.0, 1.0]])), TypeError,
                          "block_table"),
})
try:
    import torch
except ImportError:  # pragma: no cover - torch is in the test extra
    torch = None
if torch is not None:
    CASES["varlen_torch_dtype_unread"] = (VARLEN, varlen_args(q=torch.zeros((5, 8, 64), dtype=torch.complex64)),
                                          TypeError, "q")


def snapshot(args: dict) -> dict:
    """Copies of every array and list argument (torch tensors as NumPy bits)."""
    taken = {}
    for key, value in args.items():
        if isinstance(value, np.ndarray):
            taken[key] = value.copy()
        elif torch is not None and isinstance(value, torch.Tensor):
            taken[key] = value.detach().clone()
        elif isinstance(value, (list, tuple)):
            taken[key] = copy.deepcopy(value)
    return taken


def assert_unchanged(before: dict, args: dict, case: str) -> None:
    for key, old in before.items():
        now = args[key]
        if isinstance(old, np.ndarray):
            assert_same_bits(now, old, f"{case}: {key} after the rejected call")
        elif torch is not None and isinstance(old, torch.Tensor):
            assert torch.equal(now, old), f"{case}: {key} changed"
        else:
            assert now == old, f"{case}: {key} changed"


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_names_the_argument(case):
    function, args, error, name = CASES[case]
    before = snapshot(args)
    with pytest.raises(error) as info:
        function(**args)
    assert str(info.value).startswith(name), f"message does not start with {name!r}: {info.value}"
    assert_unchanged(before, args, case)  # raised before any work: every input and cache untouched


def test_the_table_is_long_enough():
    """Issue 16: at least 60 bad inputs across the public functions, the cache and the scheduler."""
    assert len(CASES) + len(SERVING_CASES) >= 60
    called = {function.__name__ for function, *_ in CASES.values()}
    assert called >= {"flash_attn_varlen_func", "flash_attn_with_kvcache", "flash_attn_func", "write_kv_cache",
                      "merge_attention_states", "cu_seqlens_from_lengths", "block_table_from_lists",
                      "slot_mapping_from_positions"}, called


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


def _host_array_case(function: str, dtype) -> tuple:
    """``(call, host arguments in dtype, the float argument the tests leave on the host)`` of the
    host-array-beside-device-arrays tests."""
    make = {"varlen": paged_varlen_args, "decode": decode_args, "write": write_args}[function]
    host = {k: a.astype(dtype) if isinstance(a, np.ndarray) and a.dtype == F16 else a for k, a in make().items()}
    call = {"varlen": VARLEN, "decode": DECODE, "write": WRITE}[function]
    return call, host, "k" if function in ("varlen", "write") else "k_cache"


class _DeviceLike:
    """Quacks like a CuPy array at the array boundary (shape, strides, dtype, ``data.ptr``,
    ``data.device_id``) without a GPU; registered as the CuPy kind by the test that uses it."""

    def __init__(self, array):
        self.shape, self.strides, self.dtype, self.itemsize = array.shape, array.strides, array.dtype, array.itemsize

        class _Memory:
            ptr, device_id = 1 << 20, 0
        self.data = _Memory()


@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
@pytest.mark.parametrize("function", ["varlen", "decode", "write"])
def test_a_host_array_beside_device_arrays_is_named_on_the_memoised_path(function, dtype, monkeypatch):
    """A NumPy array among (stand-in) CuPy arrays, bfloat16 included -- whose NumPy buffer cannot
    be exported, so the memoised path's CuPy readers fail on it with ValueError -- reaches the
    checks and is a TypeError naming it, not an error from the readers."""
    from cupy_paged._core import arrays

    monkeypatch.setitem(arrays._KIND_OF_TYPE, _DeviceLike, arrays.CUPY)
    call, host, name = _host_array_case(function, dtype)
    args = {k: _DeviceLike(a) if isinstance(a, np.ndarray) and k != name else a for k, a in host.items()}
    with pytest.raises(TypeError, match=f"{name} is a NumPy array"):
        call(**args)


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
@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
@pytest.mark.parametrize("function", ["varlen", "decode", "write"])
def test_a_host_array_beside_device_arrays_is_named(function, dtype):
    """One NumPy array among CuPy arrays -- bfloat16 included, whose NumPy buffer cannot even be
    exported -- is a TypeError naming it, after a call of the same shapes all on the device (so
    the memoised path, which reads every array as q's kind, is the one asked first)."""
    import cupy

    call, host, name = _host_array_case(function, dtype)
    args = _on_gpu(host)
    call(**args)
    cupy.cuda.get_current_stream().synchronize()
    with pytest.raises(TypeError, match=f"{name} is a NumPy array"):
        call(**dict(args, **{name: host[name]}))


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


# --------------------------------------------------------------------------- the cache and the scheduler
# Each row: (setup, exception, a word the message must hold, xfail reason or None).  ``setup()`` returns
# (the bad call, the objects whose state must not change).  Rows marked xfail need a fix in
# cupy_paged/serving or cupy_paged/runtime (strict: they fail loudly once fixed, to be unmarked).

Cache, Scheduler, Config, Request = (cupy_paged.PagedAttentionCache, cupy_paged.Scheduler, cupy_paged.SchedulerConfig,
                                     cupy_paged.Request)


def new_cache(**change):
    args = dict(num_layers=2, num_kv_heads=2, head_dim=32, block_size=8, num_blocks=8, dtype="float32",
                device="cpu", max_seqs=4, max_blocks_per_seq=4)
    args.update(change)
    return Cache(**args)


def cache_with(*lengths, computed=True):
    """A cache holding sequences "s0", "s1"... of these lengths (computed: K/V marked written)."""
    cache = new_cache()
    cache.kv[...] = RNG.standard_normal(cache.kv.shape)
    for i, n in enumerate(lengths):
        cache.allocate(f"s{i}", list(range(100 * i, 100 * i + n)))
        if computed:
            cache.mark_computed([f"s{i}"], [n])
    return cache


def constructor(**change):
    return lambda: ((lambda: new_cache(**change)), [])


def on_cache(call, *lengths, computed=True):
    def setup():
        cache = cache_with(*lengths, computed=computed)
        return (lambda: call(cache)), [cache]
    return setup


def _update(keys=(2, 2, 32), values=(2, 2, 32), layer=0, read=(0,), write=(0, 1), dtype=np.float32):
    """``cache.update`` (the manual gather/scatter path) with zero K/V of these shapes and indices."""
    return lambda c: c.update(np.zeros(keys, dtype), np.zeros(values, dtype), layer, np.array(read), np.array(write))


def request(*args, **kwargs):
    return lambda: ((lambda: Request(*args, **kwargs)), [])


def config(**kwargs):
    return lambda: ((lambda: Config(**kwargs)), [])


def on_scheduler(call, scheduled: bool = False):
    """A scheduler over a small cache with two requests queued (and one step scheduled)."""
    def setup():
        cache = new_cache(num_blocks=16)
        scheduler = Scheduler(cache, Config(max_batch_tokens=32, max_num_seqs=4))
        for i in range(2):
            scheduler.add_request(Request(f"r{i}", list(range(5 + i)), max_new_tokens=3))
        plan = scheduler.schedule() if scheduled else None
        return (lambda: call(scheduler, plan)), [scheduler]
    return setup


SERVING_CASES = {
    # PagedAttentionCache(...)
    "cache_num_layers_zero": (constructor(num_layers=0), ValueError, "num_layers", None),
    "cache_num_kv_heads_zero": (constructor(num_kv_heads=0), ValueError, "num_kv_heads", None),
    "cache_block_size_not_power_of_two": (constructor(block_size=12), ValueError, "block_size", None),
    "cache_num_blocks_zero": (constructor(num_blocks=0), ValueError, "num_blocks", None),
    "cache_both_sizes": (constructor(memory_fraction=0.5), ValueError, "num_blocks", None),
    "cache_memory_fraction_past_one": (constructor(num_blocks=None, memory_fraction=1.5), ValueError,
                                       "memory_fraction", None),
    "cache_dtype_int": (constructor(dtype="int8"), TypeError, "dtype", None),
    "cache_device_unknown": (constructor(device="tpu"), ValueError, "device", None),
    "cache_max_seqs_zero": (constructor(max_seqs=0), ValueError, "max_seqs", None),
    "cache_max_blocks_per_seq_zero": (constructor(max_blocks_per_seq=0), ValueError, "max_blocks_per_seq", None),
    "cache_head_dim_float": (constructor(head_dim=32.5), TypeError, "head_dim", None),
    "cache_block_size_float": (constructor(block_size=8.0), TypeError, "block_size", None),
    "cache_num_blocks_float": (constructor(num_blocks=7.9), TypeError, "num_blocks", None),
    "cache_prefix_caching_string": (constructor(enable_prefix_caching="no"), TypeError, "enable_prefix_caching",
                                    None),
    # allocate
    "allocate_existing_id": (on_cache(lambda c: c.allocate("s0", [1, 2]), 3), ValueError, "'s0'", None),
    "allocate_too_long": (on_cache(lambda c: c.allocate("x", list(range(33))), 3), ValueError, "max_seq_len", None),
    "allocate_cache_full": (on_cache(lambda c: c.allocate("x", list(range(1000, 1032))), 32, 20), cupy_paged.CacheFull,
                            "free blocks", None),
    "allocate_negative_new_tokens": (on_cache(lambda c: c.allocate("x", [1, 2, 3], num_new_tokens=-1), 3),
                                     ValueError, "num_new_tokens", None),
    "allocate_both_counts": (on_cache(lambda c: c.allocate("x", [1, 2, 3], num_new_tokens=1, max_num_new_tokens=2), 3),
                             ValueError, "max_num_new_tokens", None),
    "allocate_new_tokens_float": (on_cache(lambda c: c.allocate("x", [1, 2, 3], num_new_tokens=2.5), 3),
                                  TypeError, "num_new_tokens", None),
    "allocate_reserve_negative": (on_cache(lambda c: c.allocate("x", [1, 2, 3], reserve=-1), 3),
                                  ValueError, "reserve", None),
    "allocate_token_float": (on_cache(lambda c: c.allocate("x", [1, 2.5, 3]), 3), TypeError, "token_ids", None),
    "allocate_token_string": (on_cache(lambda c: c.allocate("x", [1, "2", 3]), 3), TypeError, "token_ids", None),
    # grow
    "grow_unknown_id": (on_cache(lambda c: c.grow(["zz"], 1), 3), KeyError, "'zz'", None),
    "grow_negative": (on_cache(lambda c: c.grow(["s0"], -1), 3), ValueError, "num_new_tokens", None),
    "grow_duplicate_ids": (on_cache(lambda c: c.grow(["s0", "s0"], 1), 3), ValueError, "seq_ids", None),
    "grow_past_max_seq_len": (on_cache(lambda c: c.grow(["s0"], 30), 3), ValueError, "max_seq_len", None),
    "grow_cache_full": (on_cache(lambda c: c.grow(["s0", "s1"], 9), 16, 16, 16), cupy_paged.CacheFull,
                        "free blocks", None),
    "grow_float": (on_cache(lambda c: c.grow(["s0"], 1.5), 3), TypeError, "num_new_tokens", None),
    # fork
    "fork_unknown_parent": (on_cache(lambda c: c.fork("zz", "c"), 3), KeyError, "'zz'", None),
    "fork_existing_child": (on_cache(lambda c: c.fork("s0", "s1"), 3, 4), ValueError, "'s1'", None),
    "fork_uncomputed_parent": (on_cache(lambda c: c.fork("s0", "c"), 3, computed=False), ValueError, "'s0'", None),
    "fork_short_token_ids": (on_cache(lambda c: c.fork("s0", "c", token_ids=[1]), 3), ValueError, "token_ids", None),
    "fork_token_float": (on_cache(lambda c: c.fork("s0", "c", token_ids=[1.5] * 9), 3), TypeError, "token_ids", None),
    # free, mark_computed
    "free_unknown_id": (on_cache(lambda c: c.free("zz"), 3), KeyError, "'zz'", None),
    "mark_computed_past_slots": (on_cache(lambda c: c.mark_computed(["s0"], [9]), 3, computed=False),
                                 ValueError, "num_computed", None),
    # update (the manual gather/scatter path)
    "update_key_states_shape": (on_cache(_update(keys=(2, 3, 32), values=(2, 3, 32)), 3), ValueError, "key_states",
                                None),
    "update_value_states_shape": (on_cache(_update(values=(1, 2, 32)), 3), ValueError, "value_states", None),
    "update_write_index_past_cache": (on_cache(_update(write=(0, 64)), 3), ValueError, "write_index", None),
    "update_read_index_float": (on_cache(_update(read=(0.0,)), 3), ValueError, "read_index", None),
    "update_layer_past": (on_cache(_update(layer=2), 3), IndexError, "layer_idx", None),
    "update_key_states_dtype": (on_cache(_update(dtype=np.float16), 3), TypeError, "key_states", None),
    # block_table, slot_mapping, layer
    "block_table_width_short": (on_cache(lambda c: c.block_table(["s0", "s1"], width=1), 3, 12), ValueError,
                                "width", None),
    "block_table_unknown_id": (on_cache(lambda c: c.block_table(["zz"]), 3), KeyError, "'zz'", None),
    "block_table_width_float": (on_cache(lambda c: c.block_table(["s0"], width=2.5), 3), TypeError, "width",
                                None),
    "slot_mapping_unknown_id": (on_cache(lambda c: c.slot_mapping(["s0", "zz"]), 3), KeyError, "'zz'", None),
    "layer_float": (on_cache(lambda c: c.layer(0.5), 3), TypeError, "layer_idx", None),
    # SchedulerConfig, Request
    "config_max_num_seqs_zero": (config(max_num_seqs=0), ValueError, "max_num_seqs", None),
    "config_budget_below_seqs": (config(max_batch_tokens=8, max_num_seqs=16), ValueError, "max_batch_tokens", None),
    "config_prefill_chunk_zero": (config(max_prefill_chunk=0), ValueError, "max_prefill_chunk", None),
    "config_margin_past_one": (config(admission_margin=1.5), ValueError, "admission_margin", None),
    "config_budget_float": (config(max_batch_tokens=512.5), TypeError, "max_batch_tokens", None),
    "config_margin_string": (config(admission_margin="0.1"), TypeError, "admission_margin", None),
    "request_empty_prompt": (request("a", [], max_new_tokens=2), ValueError, "prompt_token_ids", None),
    "request_max_new_tokens_zero": (request("a", [1], max_new_tokens=0), ValueError, "max_new_tokens", None),
    "request_token_float": (request("a", [1, 2.5], max_new_tokens=2), TypeError, "prompt_token_ids", None),
    "request_max_new_tokens_float": (request("a", [1], max_new_tokens=2.5), TypeError, "max_new_tokens", None),
    "request_prompt_not_a_list": (request("a", 5, max_new_tokens=2), TypeError, "prompt_token_ids", None),
    "request_eos_string": (request("a", [1], max_new_tokens=2, eos_token_id="2"), TypeError, "eos_token_id",
                           None),
    # Scheduler.add_request, update
    "add_request_duplicate": (on_scheduler(lambda s, _: s.add_request(Request("r0", [1], max_new_tokens=1))),
                              ValueError, "'r0'", None),
    "add_request_too_long": (on_scheduler(lambda s, _: s.add_request(Request("x", list(range(30)), max_new_tokens=5))),
                             ValueError, "'x'", None),
    "add_request_not_a_request": (on_scheduler(lambda s, _: s.add_request(("x", [1]))), TypeError, "request",
                                  None),
    "update_too_few_tokens": (on_scheduler(lambda s, plan: s.update(plan, [7]), scheduled=True), ValueError,
                              "sampled_token_ids", None),
    "update_too_many_tokens": (on_scheduler(lambda s, plan: s.update(plan, [7, 8, 9]), scheduled=True), ValueError,
                               "sampled_token_ids", None),
    "update_other_plan": (on_scheduler(lambda s, plan: s.update(object(), [7, 8]), scheduled=True), ValueError,
                          "plan", None),
    "update_before_schedule": (on_scheduler(lambda s, plan: s.update(plan, [7, 8])), RuntimeError, "schedule", None),
    "update_float_tokens": (on_scheduler(lambda s, plan: s.update(plan, [7.5, 8.0]), scheduled=True), TypeError,
                            "sampled_token_ids", None),
}


def cache_state(cache) -> dict:
    """Everything a cache call may change: storage, tables, lengths, pool and prefix bookkeeping."""
    return dict(kv=cache.kv.copy(), tables=cache.tables.copy(), num_blocks=cache._num_blocks.copy(),
                num_slots=cache._num_slots.copy(), num_computed=cache._num_computed.copy(),
                num_hashed=cache._num_hashed.copy(), versions=cache.table_versions.copy(),
                rows=dict(cache._row_of), free_rows=list(cache._free_rows),
                tokens=[None if t is None else list(t) for t in cache._tokens],
                ref_counts=cache.pool.ref_counts.copy(), free=list(cache.pool._free),
                num_free=cache.num_free_blocks, num_cached=cache.pool.num_cached)


def scheduler_state(scheduler) -> dict:
    requests = sorted(scheduler._live.values(), key=lambda r: str(r.request_id))
    return dict(cache=cache_state(scheduler.cache), waiting=[r.request_id for r in scheduler.waiting],
                running=[r.request_id for r in scheduler.running], live=sorted(map(str, scheduler._live)),
                pending=(scheduler._step, scheduler._ahead), preemptions=scheduler.num_preemptions,
                requests=[(r.request_id, list(r.token_ids), r.num_computed, r.status) for r in requests])


def state_of(obj) -> dict:
    return scheduler_state(obj) if isinstance(obj, Scheduler) else cache_state(obj)


def assert_same_state(before: dict, after: dict, case: str) -> None:
    assert before.keys() == after.keys()
    for key in before:
        old, new = before[key], after[key]
        if isinstance(old, dict):
            assert_same_state(old, new, f"{case}.{key}")
        elif isinstance(old, np.ndarray):
            assert_same_bits(new, old, f"{case}: {key}")
        else:
            assert new == old, f"{case}: {key} changed: {old!r} -> {new!r}"


def _serving_params():
    for name in sorted(SERVING_CASES):
        reason = SERVING_CASES[name][3]
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        yield pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("case", list(_serving_params()))
def test_serving_bad_input_names_the_argument(case):
    setup, error, word, _ = SERVING_CASES[case]
    call, objects = setup()
    before = [state_of(obj) for obj in objects]
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    assert word in message, f"message does not name {word!r}: {message}"
    for obj, old in zip(objects, before):  # the cache and the scheduler are as before the call
        assert_same_state(old, state_of(obj), case)


# --------------------------------------------------------------------------- served, not rejected

def test_valid_base_calls_of_the_new_rows_pass():
    DECODE(**contiguous_decode_args())
    DENSE(**dense_args())
    MERGE(**merge_args())
    SLOTS(**slot_args())
    CU(lengths=[1, 2])
    TABLE(block_lists=[[0, 1], [-1, 2]], max_blocks=3)


@pytest.mark.parametrize("bad_id", [-1, 4, 1000, -7])
def test_unchecked_bad_block_ids_are_holes_in_varlen(bad_id):
    """check_values=False: a block id outside [0, num_blocks), -1 included, reads nothing (the keys
    there are masked), as the kernels treat it -- never the last block, never an IndexError."""
    args = paged_varlen_args(cu_seqlens_k=np.array([0, 12, 21], np.int32), max_seqlen_k=12,
                             block_table=np.array([[0, bad_id], [2, 3]], np.int32), check_values=False)
    out = VARLEN(**args)
    # Sequence 0 sees the 8 keys of block 0 only (no causal mask, no window: where they sit is moot).
    cache_k, cache_v = args["k"], args["v"]
    keys = np.concatenate([cache_k[0], cache_k[2], cache_k[3, :1]])
    values = np.concatenate([cache_v[0], cache_v[2], cache_v[3, :1]])
    expected = VARLEN(args["q"], keys, values, np.array([0, 3, 5], np.int32), np.array([0, 8, 17], np.int32), 3, 9)
    assert_same_bits(out, expected, "the hole-masked output")


def test_unchecked_hole_in_decode_is_not_written():
    """A new token whose block is -1 (check_values=False) is attended from k/v but not written."""
    args = decode_args(cache_seqlens=np.array([16, 16], np.int32), block_table=np.array([[3, -1], [0, 1]], np.int32),
                       check_values=False)
    before = args["k_cache"].copy()
    DECODE(**args)
    assert_same_bits(args["k_cache"][[0, 2, 3]], before[[0, 2, 3]], "blocks of sequence 0 and unowned blocks")
    assert_same_bits(args["k_cache"][1, 0], args["k"][1, 0], "sequence 1's new token")


@pytest.mark.parametrize("lse", [False, True])
def test_empty_batches_are_served(lse):
    """No sequence, or no query token (zero-size NumPy arrays, whatever their strides): empty
    outputs of the right shape, on every public function."""
    empty_q = np.zeros((0, 8, 64), F16)
    for cu_q, cu_k, k in ((np.array([0], np.int32), np.array([0], np.int32), np.zeros((0, 2, 64), F16)),
                          (np.array([0, 0, 0], np.int32), np.array([0, 4, 9], np.int32), randn(RNG, (9, 2, 64), F16))):
        result = VARLEN(empty_q, k, k, cu_q, cu_k, 0, 5, return_softmax_lse=lse)
        out = result[0] if lse else result
        assert out.shape == (0, 8, 64) and out.dtype == F16
        if lse:
            assert result[1].shape == (8, 0) and result[1].dtype == np.float32
    result = DECODE(**decode_args(q=np.zeros((0, 1, 8, 64), F16), k=np.zeros((0, 1, 2, 64), F16),
                                  v=np.zeros((0, 1, 2, 64), F16), cache_seqlens=np.zeros(0, np.int32),
                                  block_table=np.zeros((0, 2), np.int32), return_softmax_lse=lse))
    out = result[0] if lse else result
    assert out.shape == (0, 1, 8, 64)
    if lse:
        assert result[1].shape == (0, 8, 1)
    assert DENSE(np.zeros((0, 3, 8, 64), F16), np.zeros((0, 4, 2, 64), F16), np.zeros((0, 4, 2, 64), F16)).shape == \
        (0, 3, 8, 64)
    assert DENSE(np.zeros((2, 0, 8, 64), F16), randn(RNG, (2, 4, 2, 64), F16), randn(RNG, (2, 4, 2, 64), F16)).shape \
        == (2, 0, 8, 64)
    args = write_args(k=np.zeros((0, 2, 64), F16), v=np.zeros((0, 2, 64), F16), slot_mapping=np.zeros(0, np.int32))
    before = args["k_cache"].copy()
    WRITE(**args)
    assert_same_bits(args["k_cache"], before, "a cache after writing no token")
    merged, merged_lse = MERGE(np.zeros((0, 8, 64), F16), np.zeros((8, 0), np.float32), np.zeros((0, 8, 64), F16),
                               np.zeros((8, 0), np.float32))
    assert merged.shape == (0, 8, 64) and merged_lse.shape == (8, 0)
    assert CU([])[0].tolist() == [0] and TABLE([]).shape == (0, 0)


@pytest.mark.gpu
def test_empty_batches_are_served_on_the_gpu_without_a_launch(monkeypatch):
    import cupy

    from cupy_paged import kernels

    def no_launch(*args, **kwargs):
        raise AssertionError("an empty call built a kernel launch")

    for name in ("varlen.VarlenLaunch", "decode.DecodeLaunch", "kv_write.WriteLaunch"):
        module, cls = name.split(".")
        monkeypatch.setattr(getattr(kernels, module), cls, no_launch)
    q = cupy.zeros((0, 8, 64), F16)
    k = cupy.asarray(randn(RNG, (9, 2, 64), F16))
    out, lse = VARLEN(q, k, k, cupy.zeros(3, cupy.int32), cupy.asarray(np.array([0, 4, 9], np.int32)), 0, 5,
                      return_softmax_lse=True)
    assert isinstance(out, cupy.ndarray) and out.shape == (0, 8, 64) and lse.shape == (8, 0)
    args = _on_gpu(decode_args(q=np.zeros((0, 1, 8, 64), F16), k=None, v=None, cache_seqlens=np.zeros(0, np.int32),
                               block_table=np.zeros((0, 2), np.int32)))
    assert DECODE(**args).shape == (0, 1, 8, 64)
    WRITE(**_on_gpu(write_args(k=np.zeros((0, 2, 64), F16), v=np.zeros((0, 2, 64), F16),
                               slot_mapping=np.zeros(0, np.int32))))
    assert DENSE(*(cupy.zeros((2, 0, 8, 64), F16),) * 3).shape == (2, 0, 8, 64)


def test_torch_cpu_bfloat16_and_requires_grad_are_read(monkeypatch):
    """torch CPU bfloat16 tensors are read as NumPy bfloat16 (through their bits); tensors that
    require grad are read through .detach() (FA2 inference callers pass them), with one warning a
    process that no gradient flows back (none under torch.no_grad())."""
    from cupy_paged._core import grad

    torch = pytest.importorskip("torch")
    args = varlen_args()
    q, k, v = (torch.from_numpy(args[n].astype(np.float32)) for n in ("q", "k", "v"))
    cu = {n: torch.from_numpy(args[n]) for n in ("cu_seqlens_q", "cu_seqlens_k")}
    expected = VARLEN(*(args[n].astype(np.float32).astype(BF16) for n in ("q", "k", "v")),
                      args["cu_seqlens_q"], args["cu_seqlens_k"], 3, 5)
    out = VARLEN(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu["cu_seqlens_q"], cu["cu_seqlens_k"], 3, 5)
    assert out.dtype == torch.bfloat16
    np.testing.assert_array_equal(out.view(torch.int16).numpy(), expected.view(np.int16))
    grad_q = q.clone().requires_grad_(True)
    monkeypatch.setattr(grad, "_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            VARLEN(grad_q, k, v, cu["cu_seqlens_q"], cu["cu_seqlens_k"], 3, 5)
    with pytest.warns(UserWarning, match="no gradient flows back") as caught:
        out = VARLEN(grad_q, k, v, cu["cu_seqlens_q"], cu["cu_seqlens_k"], 3, 5)
        VARLEN(grad_q, k, v, cu["cu_seqlens_q"], cu["cu_seqlens_k"], 3, 5)
    assert len(caught) == 1 and caught[0].filename == __file__ and not out.requires_grad
    # Through a path that reads its arrays without the memo (flash_attn_func): the caller's line too.
    monkeypatch.setattr(grad, "_warned", False)
    with pytest.warns(UserWarning, match="no gradient flows back") as caught:
        DENSE(grad_q[None, :3], k[None, :3], v[None, :3])
    assert [w.filename for w in caught] == [__file__]
    np.testing.assert_array_equal(out.numpy(), VARLEN(q.numpy(), k.numpy(), v.numpy(), args["cu_seqlens_q"],
                                                      args["cu_seqlens_k"], 3, 5))


@pytest.mark.parametrize("arch", ["bogus", "sm_9", "90", "sm_90b", "compute_90"])
def test_compile_rejects_a_bad_arch_before_nvrtc(arch, capsys):
    from cupy_paged.kernels import registry

    with pytest.raises(SystemExit) as info:
        registry.main(["--arch", arch])
    assert info.value.code == 2
    assert f"--arch must name a CUDA architecture as sm_NN or sm_NNa (sm_80, sm_90a); got {arch!r}" in \
        capsys.readouterr().err


def test_warm_without_a_gpu_says_so_in_one_line(monkeypatch, capsys):
    """``python -m cupy_paged warm`` where no CUDA device answers: one line naming ``compile`` (which
    needs none), exit status 1, and no process pool started."""
    from cupy_paged._core import arrays
    from cupy_paged.kernels import registry

    import multiprocessing

    monkeypatch.setattr(arrays, "gpu_available", lambda: False)
    monkeypatch.setattr(multiprocessing, "get_context", lambda *a: pytest.fail("a process pool was started"))
    assert registry.warm(2) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA device" in err and "python -m cupy_paged compile" in err


def test_an_unsupported_block_size_is_named():
    """A block size that is not a power of two from 8 to 256: the cache's argument, or the cache
    array's axis 1, named before any work."""
    from cupy_paged.serving.kv_cache import PagedAttentionCache

    message = r"^block_size 12 is not supported; block sizes are powers of two from 8 to 256$"
    with pytest.raises(ValueError, match=message):
        PagedAttentionCache(1, 1, 32, block_size=12, num_blocks=4, dtype="float32", device="cpu")
    cache = np.zeros((4, 12, 1, 32), np.float16)
    with pytest.raises(ValueError, match=r"^k_cache's block size \(axis 1\) 12 is not supported"):
        DECODE(np.zeros((1, 1, 2, 32), np.float16), cache, cache, cache_seqlens=np.array([3], np.int32),
               block_table=np.zeros((1, 1), np.int32))
