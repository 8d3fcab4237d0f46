"""The CPU reference backend's FlashAttention-2 features against tests/naive.py, through the public
calls as FlashAttention-2 spells them: rotary embedding, cache_batch_idx, cache_leftpad and ALiBi
[batch, heads] in flash_attn_with_kvcache; ALiBi [batch, heads] in flash_attn_varlen_func and
flash_attn_func; holes in block tables left unchecked (check_values=False); and positional calls.

The ground truth is built here from the inputs alone (tests/naive.py and plain loops over the
cache), never from cupy_paged.reference.  Inputs are float64 (exact ground truth) and float32.
"""
import zlib
from types import SimpleNamespace

import numpy as np
import pytest

import cupy_paged
from _util import assert_close, assert_same_bits, poisoned, randn, scatter_paged
from naive import naive_attention, naive_rotary

DTYPES = {"fp64": np.dtype(np.float64), "fp32": np.dtype(np.float32)}
SEEDS = (0, 1, 2)


def _rng(*key):
    """A generator of its own for every test case and seed (the same every run)."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _tol(dtype):
    """(out rtol, lse rtol) against the float64 naive attention."""
    return (1e-10, 1e-6) if np.dtype(dtype) == np.float64 else (2e-5, 1e-5)


def rotary_tables(seqlen_ro: int, rotary_dim: int, dtype, base: float = 10000.0):
    """cos/sin ``[seqlen_ro, rotary_dim / 2]`` of the usual frequencies, in ``dtype`` with values that
    float32 holds exactly (so a backend that keeps them in float32 computes the same rotation)."""
    inv_freq = base ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    angles = np.arange(seqlen_ro, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32).astype(dtype), np.sin(angles).astype(np.float32).astype(dtype)


def alibi(rng, batch, num_heads, per_sequence: bool):
    """ALiBi slopes, float32 ``[batch, H]`` (different for every sequence) or ``[H]``."""
    shape = (batch, num_heads) if per_sequence else (num_heads,)
    return rng.uniform(0.05, 1.0, shape).astype(np.float32)


def hole_ids(num_blocks):
    """Block ids that are no block of a cache of ``num_blocks``."""
    return [-1, num_blocks, num_blocks + 7, 2**31 - 1, -(2**31)]


# --------------------------------------------------------------------------- decode ground truth

def decode_case(rng, dtype, cache_lens, seqlen_q, seqlen_new, *, num_heads=4, num_kv_heads=2,
                head_dim=64, block_size=None, rotary_dim=0, interleaved=True, causal=False,
                window=(-1, -1), softcap=0.0, slopes=None, scale=None, batch_idx=None,
                leftpad=None, cache_rows=None, cache_length=None, holes=(), seqlen_ro=None):
    """A flash_attn_with_kvcache problem and its ground truth.

    ``block_size`` None: a contiguous cache ``[cache_rows, cache_length, Hkv, D]`` (cache_rows
    default batch) read through ``batch_idx`` (int list or None) with ``leftpad`` (int list or
    None); else a shuffled paged cache.  ``holes``: (sequence, column, i) entries written into the
    block table after it is built, the block id being ``hole_ids(num_blocks)[i]``.  Returns a
    namespace with ``kwargs()`` (fresh caches each time) and ``check(out, lse, k_cache, v_cache)``.
    """
    dtype = np.dtype(dtype)
    batch = len(cache_lens)
    totals = [n + seqlen_new for n in cache_lens]
    q = randn(rng, (batch, seqlen_q, num_heads, head_dim), dtype)
    k_new = randn(rng, (batch, seqlen_new, num_kv_heads, head_dim), dtype) if seqlen_new else None
    v_new = randn(rng, (batch, seqlen_new, num_kv_heads, head_dim), dtype) if seqlen_new else None
    table = None
    if block_size is None:
        cache_rows = batch if cache_rows is None else cache_rows
        cache_length = max(totals) + 3 if cache_length is None else cache_length
        k_cache = randn(rng, (cache_rows, cache_length, num_kv_heads, head_dim), dtype)
        v_cache = randn(rng, (cache_rows, cache_length, num_kv_heads, head_dim), dtype)
        capacity = cache_length
    else:
        shape = (sum(cache_lens), num_kv_heads, head_dim)
        (k_cache, v_cache), table = scatter_paged(rng, [randn(rng, shape, dtype), randn(rng, shape, dtype)],
                                                  cache_lens, block_size, capacity=totals)
        for b, column, i in holes:
            table[b, column] = hole_ids(k_cache.shape[0])[i]
        capacity = table.shape[1] * block_size
    rotary_cos = rotary_sin = None
    if rotary_dim:
        rotary_cos, rotary_sin = rotary_tables(capacity if seqlen_ro is None else seqlen_ro, rotary_dim, dtype)
    slots = k_cache.shape[0] * k_cache.shape[1]

    def row_of(b):
        """Sequence b's contiguous-cache row, None where it is outside the cache."""
        row = b if batch_idx is None else batch_idx[b]
        return row if 0 <= row < k_cache.shape[0] else None

    def slot_of(b, position):
        """Flat slot of sequence b's cache position, or None for a hole."""
        if table is None:
            if row_of(b) is None or position >= k_cache.shape[1]:
                return None
            return row_of(b) * k_cache.shape[1] + position
        column = position // block_size
        if column >= table.shape[1] or not 0 <= table[b, column] < k_cache.shape[0]:
            return None
        return int(table[b, column]) * block_size + position % block_size

    before_k = k_cache.reshape(slots, num_kv_heads, head_dim).astype(np.float64)
    before_v = v_cache.reshape(slots, num_kv_heads, head_dim).astype(np.float64)
    expect_k, expect_v = before_k.copy(), before_v.copy()
    written = np.zeros(slots, bool)
    # FlashAttention-2: q tokens rotate at their own positions when causal or local, and a window side
    # as wide as the cache's capacity bounds nothing, so it is not local.
    per_token = causal or any(0 <= side < capacity for side in window)
    scale_used = 1.0 / np.sqrt(head_dim) if scale is None else scale
    outs, lses = [], []
    for b in range(batch):
        cached = cache_lens[b]
        first = 0 if leftpad is None or not 0 <= leftpad[b] <= cached else leftpad[b]
        new_k = np.zeros((0, num_kv_heads, head_dim)) if k_new is None else k_new[b].astype(np.float64)
        new_v = np.zeros((0, num_kv_heads, head_dim)) if v_new is None else v_new[b].astype(np.float64)
        q_b = q[b].astype(np.float64)
        if rotary_dim:
            new_k = naive_rotary(new_k, rotary_cos, rotary_sin, [cached + t for t in range(seqlen_new)], interleaved)
            q_positions = [cached + (i if per_token else 0) for i in range(seqlen_q)]
            q_b = naive_rotary(q_b, rotary_cos, rotary_sin, q_positions, interleaved)
        # A cached key in a hole is masked; a new token is attended from k/v wherever it lands, and
        # written only to a slot that exists.  A sequence whose cache row is outside sees nothing.
        keys, values, present = [], [], []
        for position in range(first, cached + seqlen_new):
            slot = slot_of(b, position)
            if position < cached:  # a hole's values are never looked at (present is False)
                present.append(slot is not None)
                keys.append(before_k[slot] if slot is not None else np.zeros((num_kv_heads, head_dim)))
                values.append(before_v[slot] if slot is not None else np.zeros((num_kv_heads, head_dim)))
            else:
                t = position - cached
                present.append(table is not None or row_of(b) is not None)
                keys.append(new_k[t])
                values.append(new_v[t])
                if slot is not None:
                    expect_k[slot], expect_v[slot], written[slot] = new_k[t], new_v[t], True
        empty = np.zeros((0, num_kv_heads, head_dim))
        keys, values = (np.array(x) if x else empty for x in (keys, values))
        out, lse = naive_attention(q_b, keys, values, scale_used, causal=causal, window=window, softcap=softcap,
                                   slopes=None if slopes is None else (slopes[b] if slopes.ndim == 2 else slopes),
                                   present=np.array(present, bool))
        outs.append(out)
        lses.append(lse)

    def kwargs():
        kw = dict(q=q, k_cache=k_cache.copy(), v_cache=v_cache.copy(), k=k_new, v=v_new,
                  cache_seqlens=np.array(cache_lens, np.int32), causal=causal, window_size=window,
                  softcap=softcap)
        if table is not None:
            kw["block_table"] = table
        if rotary_dim:
            kw.update(rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=interleaved)
        if slopes is not None:
            kw["alibi_slopes"] = slopes
        if scale is not None:
            kw["softmax_scale"] = scale
        if batch_idx is not None:
            kw["cache_batch_idx"] = np.array(batch_idx, np.int32)
        if leftpad is not None:
            kw["cache_leftpad"] = np.array(leftpad, np.int32)
        return kw

    def check(out, lse, k_after, v_after):
        out_tol, lse_tol = _tol(dtype)
        assert out.dtype == dtype and lse.dtype == np.float32
        for b in range(batch):
            assert_close(out[b], outs[b], dtype, f"out of sequence {b}", rtol=out_tol)
            assert_close(lse[b], lses[b], dtype, f"lse of sequence {b}", rtol=lse_tol)
        for name, after, before, expect in (("k_cache", k_after, k_cache, expect_k),
                                            ("v_cache", v_after, v_cache, expect_v)):
            flat = after.reshape(slots, num_kv_heads, head_dim)
            # Slots the call does not append to keep their bits; appended ones hold the (rotated) new tokens.
            assert_same_bits(flat[~written], before.reshape(flat.shape)[~written], f"{name} outside the appends")
            if written.any():
                assert_close(flat[written], expect[written], dtype, f"{name} appends", rtol=out_tol)

    out_shape = (batch, seqlen_q, num_heads, head_dim)
    return SimpleNamespace(kwargs=kwargs, check=check, out_shape=out_shape, dtype=dtype)


def run_decode(case, **extra):
    """One keyword call on fresh caches with NaN-poisoned out; checked against the ground truth."""
    kw = case.kwargs()
    buffer = poisoned(case.out_shape, case.dtype)
    out, lse = cupy_paged.flash_attn_with_kvcache(**kw, return_softmax_lse=True, out=buffer, **extra)
    assert np.shares_memory(out, buffer), "out= is written in place and returned"
    case.check(out, lse, kw["k_cache"], kw["v_cache"])
    return out, lse, kw


# --------------------------------------------------------------------------- rotary

ROTARY_SHAPES = [(1, 1), (1, 3), (4, 1), (3, 4)]  # (seqlen_q, seqlen_new)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("seqlen_q,seqlen_new", ROTARY_SHAPES)
@pytest.mark.parametrize("layout", ["paged16", "contiguous"])
@pytest.mark.parametrize("rotary_dim", [32, 64], ids=["rot32of64", "rot64of64"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
def test_decode_rotary(dtype, seqlen_q, seqlen_new, layout, rotary_dim, causal, interleaved):
    """q and the new keys are rotated at their positions; the cache holds the rotated keys."""
    rng = _rng("rotary", dtype, seqlen_q, seqlen_new, layout, rotary_dim, causal, interleaved)
    case = decode_case(rng, DTYPES[dtype], [0, 5, 16, 23], seqlen_q, seqlen_new,
                       block_size=16 if layout == "paged16" else None, rotary_dim=rotary_dim,
                       interleaved=interleaved, causal=causal)
    run_decode(case)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("rotary_dim", [16, 96, 128])
@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
def test_decode_rotary_head_dim_128(seed, rotary_dim, interleaved):
    rng = _rng("rotary128", seed, rotary_dim, interleaved)
    case = decode_case(rng, np.float64, [7, 31, 64], 2, 2, num_heads=8, num_kv_heads=1, head_dim=128,
                       block_size=32, rotary_dim=rotary_dim, interleaved=interleaved, causal=True)
    run_decode(case)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("layout", ["paged8", "contiguous"])
def test_decode_rotary_with_window_rotates_q_per_token(dtype, layout):
    """A window (not causal) also places query token i at cache_seqlens + i."""
    rng = _rng("rotary-window", dtype, layout)
    case = decode_case(rng, DTYPES[dtype], [3, 12, 20], 3, 2, block_size=8 if layout == "paged8" else None,
                       rotary_dim=32, interleaved=False, window=(6, 2))
    run_decode(case)


@pytest.mark.parametrize("layout", ["paged8", "contiguous"])
@pytest.mark.parametrize("wide", [True, False], ids=["capacity", "capacity-1"])
def test_decode_rotary_window_as_wide_as_the_cache_is_not_local(layout, wide):
    """Not causal, both window sides as wide as the cache's capacity: no bound, so every query token
    rotates at ``cache_seqlens`` and the call equals one without a window; one key narrower, the
    call is local and token i rotates at ``cache_seqlens + i`` (FlashAttention-2's rule), so the
    outputs differ though the window masks no key."""
    def case(window):
        rng = _rng("rotary-wide-window", layout)  # the same inputs for every window
        return decode_case(rng, np.float64, [3, 12, 20], 3, 2, block_size=8 if layout == "paged8" else None,
                           rotary_dim=32, interleaved=False, window=window)

    kw = case((-1, -1)).kwargs()
    capacity = (kw["block_table"].shape[1] * 8) if layout == "paged8" else kw["k_cache"].shape[1]
    side = capacity if wide else capacity - 1
    windowed, _, _ = run_decode(case((side, side)))
    unbounded, _, _ = run_decode(case((-1, -1)))
    if wide:
        assert_same_bits(windowed, unbounded, "a window as wide as the cache")
    else:
        assert not np.allclose(windowed, unbounded), "a local call rotates q per token"


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("seed", SEEDS)
def test_decode_rotary_with_everything(dtype, seed):
    """Rotary with ALiBi [B, H], softcap, a window, a softmax scale, leftpad and cache_batch_idx."""
    rng = _rng("rotary-everything", dtype, seed)
    lens = [9, 14, 2, 20]
    case = decode_case(rng, DTYPES[dtype], lens, 2, 3, rotary_dim=32, interleaved=True, causal=True,
                       window=(8, -1), softcap=4.0, scale=0.2, slopes=alibi(rng, 4, 4, True),
                       batch_idx=[int(i) for i in rng.permutation(6)[:4]], cache_rows=6,
                       leftpad=[int(rng.integers(0, n + 1)) for n in lens])
    run_decode(case)


def test_decode_rotary_positions_past_the_table_leave_tokens_unrotated():
    """With cos/sin of as many rows as the cache holds, query tokens placed past the last row
    (cache_seqlens + i >= seqlen_ro, seqlen_q > seqlen_new) are left as they are."""
    rng = _rng("rotary-past")
    case = decode_case(rng, np.float64, [14, 12, 15], 4, 1, cache_length=16, rotary_dim=64,
                       interleaved=False, causal=True)
    run_decode(case, check_values=False)


# --------------------------------------------------------------------------- cache_batch_idx / cache_leftpad

@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("rows", ["permutation", "subset"])
@pytest.mark.parametrize("seqlen_q,seqlen_new", [(1, 0), (1, 1), (3, 2)])
def test_decode_cache_batch_idx(dtype, seed, rows, seqlen_q, seqlen_new):
    """Sequence b reads and appends to row cache_batch_idx[b] of a contiguous cache."""
    rng = _rng("batch_idx", dtype, seed, rows, seqlen_q, seqlen_new)
    batch = 4
    cache_rows = batch if rows == "permutation" else batch + 3
    case = decode_case(rng, DTYPES[dtype], [0, 6, 11, 17], seqlen_q, seqlen_new, causal=True,
                       batch_idx=[int(i) for i in rng.permutation(cache_rows)[:batch]], cache_rows=cache_rows)
    run_decode(case)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("seqlen_q,seqlen_new", [(1, 0), (1, 1), (2, 3)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_decode_cache_leftpad(dtype, seed, seqlen_q, seqlen_new, causal):
    """Keys of b are cache positions [cache_leftpad[b], cache_seqlens[b]) and the new tokens after."""
    rng = _rng("leftpad", dtype, seed, seqlen_q, seqlen_new, causal)
    lens = [0, 4, 10, 10, 19]
    leftpad = [0, int(rng.integers(1, 4)), 10, int(rng.integers(0, 10)), int(rng.integers(1, 19))]
    case = decode_case(rng, DTYPES[dtype], lens, seqlen_q, seqlen_new, causal=causal, leftpad=leftpad,
                       slopes=alibi(rng, 5, 4, True) if seed == 1 else None)
    run_decode(case)


@pytest.mark.parametrize("seed", SEEDS)
def test_decode_leftpad_and_batch_idx_together(seed):
    rng = _rng("leftpad+batch_idx", seed)
    lens = [5, 12, 8]
    case = decode_case(rng, np.float64, lens, 2, 2, causal=True, cache_rows=5,
                       batch_idx=[int(i) for i in rng.permutation(5)[:3]],
                       leftpad=[int(rng.integers(0, n + 1)) for n in lens])
    run_decode(case)


# --------------------------------------------------------------------------- ALiBi [B, H]

@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("layout", ["paged16", "contiguous"])
@pytest.mark.parametrize("per_sequence", [True, False], ids=["BH", "H"])
def test_decode_alibi_per_sequence(dtype, seed, layout, per_sequence):
    rng = _rng("decode-alibi", dtype, seed, layout, per_sequence)
    case = decode_case(rng, DTYPES[dtype], [1, 15, 16, 30], 2, 1, num_heads=8, num_kv_heads=2,
                       block_size=16 if layout == "paged16" else None, causal=True,
                       slopes=alibi(rng, 4, 8, per_sequence))
    run_decode(case)


def _varlen_inputs(rng, dtype, lengths_q, lengths_k, num_heads, num_kv_heads, head_dim):
    q = randn(rng, (sum(lengths_q), num_heads, head_dim), dtype)
    k = randn(rng, (sum(lengths_k), num_kv_heads, head_dim), dtype)
    v = randn(rng, (sum(lengths_k), num_kv_heads, head_dim), dtype)
    return q, k, v


def _naive_varlen(q, k, v, cu_q, cu_k, scale, causal, window, softcap, slopes, present=None):
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        out, lse = naive_attention(q[qs], k[ks], v[ks], scale, causal=causal, window=window, softcap=softcap,
                                   slopes=None if slopes is None else (slopes[b] if slopes.ndim == 2 else slopes),
                                   present=None if present is None else present[b])
        outs.append(out)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses, axis=1)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("block_size", [None, 8, 32], ids=["contiguous", "paged8", "paged32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_alibi_per_sequence(dtype, seed, block_size, causal):
    rng = _rng("varlen-alibi", dtype, seed, block_size, causal)
    dtype = DTYPES[dtype]
    lengths_q, lengths_k = [3, 0, 7, 1, 5], [9, 4, 7, 0, 40]
    q, k, v = _varlen_inputs(rng, dtype, lengths_q, lengths_k, 8, 2, 64)
    cu_q, max_q = cupy_paged.cu_seqlens_from_lengths(lengths_q)
    cu_k, max_k = cupy_paged.cu_seqlens_from_lengths(lengths_k)
    slopes = alibi(rng, 5, 8, True)
    k_in, v_in, table = k, v, None
    if block_size is not None:
        (k_in, v_in), table = scatter_paged(rng, [k, v], lengths_k, block_size)
    buffer = poisoned(q.shape, dtype)
    out, lse, probs = cupy_paged.flash_attn_varlen_func(q, k_in, v_in, cu_q, cu_k, max_q, max_k, causal=causal,
                                                        softcap=2.5, alibi_slopes=slopes, block_table=table,
                                                        return_attn_probs=True, out=buffer)
    assert probs is None and np.shares_memory(out, buffer)
    ref_out, ref_lse = _naive_varlen(q, k, v, cu_q, cu_k, 1 / 8, causal, (-1, -1), 2.5, slopes)
    out_tol, lse_tol = _tol(dtype)
    assert lse.shape == (8, q.shape[0]) and lse.dtype == np.float32
    assert_close(out, ref_out, dtype, rtol=out_tol)
    assert_close(lse, ref_lse, dtype, "lse", rtol=lse_tol)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("per_sequence", [True, False], ids=["BH", "H"])
def test_flash_attn_func_matches_naive(dtype, seed, per_sequence):
    rng = _rng("flash_attn_func", dtype, seed, per_sequence)
    dtype = DTYPES[dtype]
    batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, head_dim = 3, 5, 12, 4, 2, 64
    q = randn(rng, (batch, seqlen_q, num_heads, head_dim), dtype)
    k = randn(rng, (batch, seqlen_k, num_kv_heads, head_dim), dtype)
    v = randn(rng, (batch, seqlen_k, num_kv_heads, head_dim), dtype)
    slopes = alibi(rng, batch, num_heads, per_sequence)
    buffer = poisoned(q.shape, dtype)
    out, lse, probs = cupy_paged.flash_attn_func(q, k, v, causal=True, window_size=(6, -1), alibi_slopes=slopes,
                                                 return_attn_probs=True, out=buffer)
    assert probs is None and np.shares_memory(out, buffer)
    assert lse.shape == (batch, num_heads, seqlen_q) and lse.dtype == np.float32
    out_tol, lse_tol = _tol(dtype)
    for b in range(batch):
        ref_out, ref_lse = naive_attention(q[b], k[b], v[b], 1 / 8, causal=True, window=(6, -1),
                                           slopes=slopes[b] if per_sequence else slopes)
        assert_close(out[b], ref_out, dtype, f"out of sequence {b}", rtol=out_tol)
        assert_close(lse[b], ref_lse, dtype, f"lse of sequence {b}", rtol=lse_tol)


# --------------------------------------------------------------------------- unchecked index values



@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("seqlen_q,seqlen_new", [(1, 0), (1, 1), (3, 2)])
def test_decode_block_table_holes_are_masked(dtype, seed, seqlen_q, seqlen_new):
    """Block ids -1 and >= num_blocks in needed columns (check_values=False): the cached keys there
    are masked in place (the others keep their positions); a new token there is attended (from k)
    but not written."""
    rng = _rng("decode-holes", dtype, seed, seqlen_q, seqlen_new)
    lens = [30, 32, 70, 9]  # the decode worked example's lengths, and a short one
    # Seq 0: its first block; seq 1: the block of the new token (column 2 with 32 cached); seq 2: a
    # middle block; seq 3: the one block it needs.
    holes = [(0, 0, seed % 5), (1, 2, (seed + 1) % 5), (2, 2, (seed + 2) % 5), (3, 0, (seed + 3) % 5)]
    case = decode_case(rng, DTYPES[dtype], lens, seqlen_q, seqlen_new, block_size=16, causal=True,
                       slopes=alibi(rng, 4, 4, True), holes=holes)
    out, lse, _ = run_decode(case, check_values=False)
    if seqlen_new == 0:  # seq 3 lost its only block
        assert not out[3].any() and (lse[3] == -np.inf).all()


@pytest.mark.parametrize("seed", SEEDS)
def test_decode_cache_batch_idx_out_of_range_reads_and_writes_nothing(seed):
    """A row outside the cache: the sequence sees no key (zeros, lse -inf) and appends nothing."""
    rng = _rng("batch_idx-out", seed)
    bad = [-1, 3, 2**31 - 1, -(2**31)][seed % 4]
    case = decode_case(rng, np.float64, [4, 9, 6], 2, 1, causal=True, cache_rows=3, batch_idx=[2, bad, 0])
    out, lse, _ = run_decode(case, check_values=False)
    assert not out[1].any() and (lse[1] == -np.inf).all()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("seqlen_new", [0, 2])
def test_decode_cache_leftpad_out_of_range_is_zero(seed, seqlen_new):
    rng = _rng("leftpad-out", seed, seqlen_new)
    lens = [4, 9, 6, 0]
    leftpad = [-1, 10, 2**31 - 1, 1]  # below 0, past cache_seqlens (twice), past an empty cache
    case = decode_case(rng, np.float64, lens, 1, seqlen_new, leftpad=leftpad)
    run_decode(case, check_values=False)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("rotary_dim", [0, 32])
def test_decode_past_the_end_of_a_contiguous_cache(seed, rotary_dim):
    """cache_seqlens + seqlen_new past S (check_values=False): cached positions past S are holes,
    new tokens past S are attended but not written."""
    rng = _rng("past-the-end", seed, rotary_dim)
    case = decode_case(rng, np.float64, [9, 13, 20, 14], 2, 3, cache_length=14, rotary_dim=rotary_dim,
                       seqlen_ro=32 if rotary_dim else None, causal=True)
    run_decode(case, check_values=False)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_block_table_holes_are_masked(dtype, seed, causal):
    rng = _rng("varlen-holes", dtype, seed, causal)
    dtype = DTYPES[dtype]
    block_size = 8
    lengths_q, lengths_k = [2, 4, 1, 3], [20, 9, 16, 5]
    q, k, v = _varlen_inputs(rng, dtype, lengths_q, lengths_k, 4, 4, 64)
    cu_q, max_q = cupy_paged.cu_seqlens_from_lengths(lengths_q)
    cu_k, max_k = cupy_paged.cu_seqlens_from_lengths(lengths_k)
    (k_cache, v_cache), table = scatter_paged(rng, [k, v], lengths_k, block_size)
    ids = hole_ids(k_cache.shape[0])
    holes = [(0, 1), (1, 0), (2, 1), (3, 0)]
    present = [np.ones(n, bool) for n in lengths_k]
    for i, (b, column) in enumerate(holes):
        table[b, column] = ids[(seed + i) % 5]
        present[b][column * block_size:(column + 1) * block_size] = False
    slopes = alibi(rng, 4, 4, True)
    buffer = poisoned(q.shape, dtype)
    out, lse, _ = cupy_paged.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max_q, max_k, causal=causal,
                                                    alibi_slopes=slopes, block_table=table,
                                                    return_attn_probs=True, out=buffer, check_values=False)
    ref_out, ref_lse = _naive_varlen(q, k, v, cu_q, cu_k, 1 / 8, causal, (-1, -1), 0.0, slopes, present)
    out_tol, lse_tol = _tol(dtype)
    assert_close(out, ref_out, dtype, rtol=out_tol)
    assert_close(lse, ref_lse, dtype, "lse", rtol=lse_tol)
    assert not out[cu_q[3]:].any() and (lse[:, cu_q[3]:] == -np.inf).all()  # seq 3 lost its only block


# --------------------------------------------------------------------------- positional calls

@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("layout", ["paged16", "contiguous"])
def test_flash_attn_with_kvcache_positional_equals_keyword(seed, layout):
    """All 19 FlashAttention-2 arguments by position mean what they mean by keyword."""
    rng = _rng("positional-decode", seed, layout)
    lens = [6, 17, 11]
    paged = layout == "paged16"
    slopes = alibi(rng, 3, 4, True)
    case = decode_case(rng, np.float64, lens, 2, 2, block_size=16 if paged else None, rotary_dim=32,
                       interleaved=False, causal=True, window=(9, 0), softcap=3.0, scale=0.3, slopes=slopes,
                       cache_rows=None if paged else 5,
                       batch_idx=None if paged else [int(i) for i in rng.permutation(5)[:3]],
                       leftpad=None if paged else [int(rng.integers(0, n + 1)) for n in lens])
    kw = case.kwargs()
    by_position = cupy_paged.flash_attn_with_kvcache(
        kw["q"], kw["k_cache"], kw["v_cache"], kw["k"], kw["v"], kw["rotary_cos"], kw["rotary_sin"],
        kw["cache_seqlens"], kw.get("cache_batch_idx"), kw.get("cache_leftpad"), kw.get("block_table"),
        0.3, True, (9, 0), 3.0, False, slopes, 2, True, out=poisoned(case.out_shape, case.dtype))
    assert isinstance(by_position, tuple) and len(by_position) == 2
    case.check(*by_position, kw["k_cache"], kw["v_cache"])
    by_keyword = run_decode(case, num_splits=2)[:2]
    for got, want, what in zip(by_position, by_keyword, ("out", "lse")):
        assert_same_bits(got, want, what)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged16"])
def test_flash_attn_varlen_func_positional_equals_keyword(seed, paged):
    """All 16 FlashAttention-2 arguments by position (dropout_p 0, deterministic and
    return_attn_probs True, block_table last) mean what they mean by keyword."""
    rng = _rng("positional-varlen", seed, paged)
    lengths_q, lengths_k = [4, 1, 6], [10, 33, 6]
    q, k, v = _varlen_inputs(rng, np.float64, lengths_q, lengths_k, 4, 2, 64)
    cu_q, max_q = cupy_paged.cu_seqlens_from_lengths(lengths_q)
    cu_k, max_k = cupy_paged.cu_seqlens_from_lengths(lengths_k)
    slopes = alibi(rng, 3, 4, True)
    k_in, v_in, table = k, v, None
    if paged:
        (k_in, v_in), table = scatter_paged(rng, [k, v], lengths_k, 16)
    by_position = cupy_paged.flash_attn_varlen_func(q, k_in, v_in, cu_q, cu_k, max_q, max_k, 0.0, 0.3, True,
                                                    (7, 0), 2.0, slopes, True, True, table,
                                                    out=poisoned(q.shape, q.dtype))
    by_keyword = cupy_paged.flash_attn_varlen_func(
        q=q, k=k_in, v=v_in, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
        dropout_p=0.0, softmax_scale=0.3, causal=True, window_size=(7, 0), softcap=2.0, alibi_slopes=slopes,
        deterministic=True, return_attn_probs=True, block_table=table, out=poisoned(q.shape, q.dtype))
    assert len(by_position) == 3 and by_position[2] is None
    for got, want, what in zip(by_position[:2], by_keyword[:2], ("out", "lse")):
        assert_same_bits(got, want, what)
    ref_out, ref_lse = _naive_varlen(q, k, v, cu_q, cu_k, 0.3, True, (7, 0), 2.0, slopes)
    assert_close(by_position[0], ref_out, np.float64, rtol=1e-10)
    assert_close(by_position[1], ref_lse, np.float64, "lse", rtol=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
def test_flash_attn_func_positional_equals_keyword(seed):
    """All 11 FlashAttention-2 arguments by position mean what they mean by keyword."""
    rng = _rng("positional-func", seed)
    q = randn(rng, (2, 6, 4, 64), np.float64)
    k = randn(rng, (2, 9, 1, 64), np.float64)
    v = randn(rng, (2, 9, 1, 64), np.float64)
    slopes = alibi(rng, 2, 4, True)
    by_position = cupy_paged.flash_attn_func(q, k, v, 0.0, 0.3, True, (5, 0), 2.0, slopes, True, True,
                                             out=poisoned(q.shape, q.dtype))
    by_keyword = cupy_paged.flash_attn_func(q=q, k=k, v=v, dropout_p=0.0, softmax_scale=0.3, causal=True,
                                            window_size=(5, 0), softcap=2.0, alibi_slopes=slopes,
                                            deterministic=True, return_attn_probs=True,
                                            out=poisoned(q.shape, q.dtype))
    assert len(by_position) == 3 and by_position[2] is None
    for got, want, what in zip(by_position[:2], by_keyword[:2], ("out", "lse")):
        assert_same_bits(got, want, what)
    for b in range(2):
        ref_out, ref_lse = naive_attention(q[b], k[b], v[b], 0.3, causal=True, window=(5, 0), softcap=2.0,
                                           slopes=slopes[b])
        assert_close(by_position[0][b], ref_out, np.float64, f"out of sequence {b}", rtol=1e-10)
        assert_close(by_position[1][b], ref_lse, np.float64, f"lse of sequence {b}", rtol=1e-6)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_varlen_rows_past_the_last_sequence_are_padding(dtype):
    """q and k/v longer than ``cu_seqlens_q[-1]`` / ``cu_seqlens_k[-1]`` (a CUDA-graph batch padded to its
    captured size), as FlashAttention-2 takes them: the sequences' rows equal the unpadded call's, the
    padding rows of ``out`` and the LSE are not written, the padding keys not read (NaN there)."""
    rng = _rng("padded-varlen", dtype)
    dt = DTYPES[dtype]
    cu_q, cu_k = np.array([0, 10, 13, 14], np.int32), np.array([0, 0, 1, 8], np.int32)
    q = randn(rng, (17, 4, 64), dt)
    k, v = randn(rng, (11, 2, 64), dt), randn(rng, (11, 2, 64), dt)
    k[8:] = v[8:] = np.nan  # padding keys: never read
    out, lse = poisoned(q.shape, dt), np.full((4, 17), 7.0, np.float32)
    got = cupy_paged.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 10, 7, causal=True, out=out, lse_out=lse,
                                            return_softmax_lse=True)
    assert got[0] is out and got[1] is lse
    want_out, want_lse = cupy_paged.flash_attn_varlen_func(q[:14], k[:8], v[:8], cu_q, cu_k, 10, 7, causal=True,
                                                           return_softmax_lse=True)
    assert_same_bits(out[:14], want_out, "the sequences' rows")
    assert_same_bits(lse[:, :14], want_lse, "the sequences' LSE")
    assert np.isnan(out[14:]).all() and (lse[:, 14:] == 7.0).all(), "padding rows written"
    ref_out, _ = _naive_varlen(q[:14], k[:8], v[:8], cu_q, cu_k, 1 / 8, True, (-1, -1), 0.0, None)
    assert_close(out[:14], ref_out, dt, rtol=_tol(dt)[0])
