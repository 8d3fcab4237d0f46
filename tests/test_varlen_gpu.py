"""flash_attn_varlen_func on the GPU (cuda_src/varlen.cu, cuda_src/varlen_wgmma.cu) against the
CPU reference backend.  Every test is parametrized over both kernels: ``wgmma`` (the public
function's own choice, the wgmma kernel on compute capability 9.0 for the head dims it serves)
and ``mma_sync`` (named explicitly: the GPU call goes through ``kernels.varlen.run`` with
``tiles=TILES[head_dim]``); the fixture skips the runs that do not apply (a head dim wgmma does
not serve, another kernel's candidate shapes, the wgmma dispatch check under ``mma_sync``).

Every case draws fresh random inputs, runs the public function once on NumPy copies (the
reference) and once on CuPy arrays with a NaN-poisoned ``out``, and checks every element of
``out`` (and of the LSE where asked).  Tests whose names contain ``sanitize`` are a small
subset meant for ``compute-sanitizer --tool memcheck|racecheck``.
"""
from __future__ import annotations

import numpy as np
import pytest

import cupy_paged
from cupy_paged.api.indexing import cu_seqlens_from_lengths
from cupy_paged.api.varlen import prepare_varlen
from cupy_paged.kernels import varlen as varlen_ops
from cupy_paged.kernels.varlen import Tiles
from cupy_paged.kernels.varlen_wgmma import WgmmaTiles, registered_tiles
from _util import DTYPES, assert_close, assert_same_bits, poisoned, randn, scatter_paged, to_numpy

pytestmark = pytest.mark.gpu

NUM_HEADS = 8

# Tile shapes the GPU tests check beside the registered ones (head dim -> shapes): a failure here
# rules out that shape only.  mma.sync: 3 stages and 64-key tiles at D=128, 8 warps at D=64 (the
# shapes NOTES_varlen.md compares); wgmma: the ones benchmarks/bench_varlen.py --sweep times
# (its WGMMA_SWEEP; tests/test_compiler.py checks that every swept shape is here and builds).
MMA_CANDIDATES: dict[int, tuple[Tiles, ...]] = {
    64: (Tiles(128, 64, 8, 3),),
    128: (Tiles(128, 128, 8, 3), Tiles(128, 64, 8, 2)),
}
WGMMA_CANDIDATES: dict[int, tuple[WgmmaTiles, ...]] = {
    64: (WgmmaTiles(128, 2), WgmmaTiles(64, 2, groups=1), WgmmaTiles(128, 2, producer=True, staged_store=True),
         WgmmaTiles(128, 2, producer=True, pv_overlap=True), WgmmaTiles(128, 2, producer=True, tma=True)),
    128: (WgmmaTiles(128, 2), WgmmaTiles(64, 2, groups=1), WgmmaTiles(128, 3, producer=True),
          WgmmaTiles(128, 2, producer=True, persistent=True), WgmmaTiles(128, 2, producer=True),
          WgmmaTiles(128, 3, producer=True, staged_store=True),
          WgmmaTiles(128, 2, producer=True, staged_store=True, pv_overlap=True),
          WgmmaTiles(128, 2, producer=True, staged_store=True, tma=True),
          WgmmaTiles(128, 2, producer=True, staged_store=True, pv_overlap=True, tma=True)),
}


@pytest.fixture(autouse=True, params=["wgmma", "mma_sync"])
def kernel(request):
    """The kernel a test runs on, as ``shape_for`` reads it."""
    import cupy

    if request.param == "wgmma":
        if cupy.cuda.Device().compute_capability != "90":
            pytest.skip("wgmma runs on compute capability 9.0 only")
        params = getattr(request.node, "callspec", None)
        head_dim = params.params.get("head_dim") if params else None
        if head_dim is not None and head_dim not in varlen_ops.WGMMA_TILES:
            pytest.skip(f"no wgmma kernel for head_dim {head_dim}")
        if request.function.__name__ == "test_mma_candidates":
            pytest.skip("mma.sync candidates")
    if request.param == "mma_sync" and request.function.__name__ == "test_wgmma_candidates":
        pytest.skip("wgmma candidates")
    return request.param


def shape_for(kernel, head_dim: int):
    """The tile shape that the GPU call launches: None for ``"wgmma"`` (the public function's own
    choice), ``TILES[head_dim]`` for ``"mma_sync"``, a candidate shape (Tiles or WgmmaTiles) as it is."""
    if kernel == "wgmma":
        return None
    if kernel == "mma_sync":
        return varlen_ops.TILES[head_dim]
    return kernel


def varlen_on_gpu(tiles, q, k, v, cu_q, cu_k, max_q, max_k, *, alibi_slopes=None, block_table=None, out=None,
                  check_values=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                  return_softmax_lse=False):
    """flash_attn_varlen_func on device arrays: the public function for ``tiles`` None, else
    ``kernels.varlen.run`` with that shape (whose type names the kernel)."""
    options = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap)
    if tiles is None:
        return cupy_paged.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, alibi_slopes=alibi_slopes,
                                                 block_table=block_table, out=out, check_values=check_values,
                                                 return_softmax_lse=return_softmax_lse, **options)
    p = prepare_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_size, softcap,
                       alibi_slopes, block_table, return_softmax_lse, out, check_values)
    result, lse = varlen_ops.run(p, tiles)
    return (result, lse) if return_softmax_lse else result


def test_wgmma_kernel_is_the_default_on_hopper(kernel, monkeypatch):
    """The wgmma path is really taken (so the tests under ``wgmma`` test it): a call launches the
    wgmma kernel for every head dim it serves, and the mma.sync kernel for the others."""
    if kernel != "wgmma":
        pytest.skip("checks the dispatch to the wgmma kernel")
    for head_dim in (32, 64, 96, 128, 256):
        assert varlen_ops.wgmma_available(head_dim) == (kernel == "wgmma" and head_dim in varlen_ops.WGMMA_TILES)

    launched = []
    launch = varlen_ops._launch

    def spy(device, dtype, head_dim, tiles):
        launched.append((head_dim, tiles))
        return launch(device, dtype, head_dim, tiles)

    monkeypatch.setattr(varlen_ops, "_launch", spy)
    for head_dim in (32, 64, 96, 128, 256):
        launched.clear()
        run_case(kernel, 16, "bfloat16", head_dim, [5, 70], [9, 70], num_kv_heads=2, causal=True)
        (shape,) = {tiles for d, tiles in launched if d == head_dim}
        _, kernel_name = varlen_ops.specialization(np.float16, head_dim, shape)
        if head_dim in varlen_ops.WGMMA_TILES:  # contiguous K/V: the registered shape of that layout
            assert shape == registered_tiles(head_dim, False) and kernel_name == varlen_ops.WGMMA_KERNEL
        else:
            assert shape == varlen_ops.TILES[head_dim] and kernel_name == varlen_ops.KERNEL


LSE_RTOL = 1e-3  # the LSE is float32 from fp32 scores: only exp2/log2 rounding separates them


def run_case(kernel, seed, dtype, head_dim, lens_q, lens_k, *, num_kv_heads=NUM_HEADS, num_heads=NUM_HEADS,
             causal=False, window=(-1, -1), softcap=0.0, alibi=False, lse=False, block_size=None,
             scale=None, check_values=True):
    """One call on both backends (the GPU one on ``shape_for(kernel, head_dim)``); asserts
    closeness and returns the GPU outputs."""
    import cupy

    rng = np.random.default_rng(seed)
    dtype = DTYPES[dtype]
    cu_q, max_q = cu_seqlens_from_lengths(lens_q)
    cu_k, max_k = cu_seqlens_from_lengths(lens_k)
    q = randn(rng, (int(cu_q[-1]), num_heads, head_dim), dtype)
    k = randn(rng, (int(cu_k[-1]), num_kv_heads, head_dim), dtype)
    v = randn(rng, (int(cu_k[-1]), num_kv_heads, head_dim), dtype)
    table = None
    if block_size is not None:
        (k, v), table = scatter_paged(rng, [k, v], lens_k, block_size, extra_columns=2)  # two -1 columns
    slopes = (rng.uniform(0.01, 0.5, num_heads).astype(np.float32) if alibi else None)
    kwargs = dict(softmax_scale=scale, causal=causal, window_size=window, softcap=softcap,
                  return_softmax_lse=lse)

    expected = cupy_paged.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k,
                                                 alibi_slopes=slopes, block_table=table, **kwargs)
    dev = cupy.asarray
    out = poisoned(q.shape, dtype, cupy)
    got = varlen_on_gpu(
        shape_for(kernel, head_dim), dev(q), dev(k), dev(v), dev(cu_q), dev(cu_k), max_q, max_k,
        alibi_slopes=None if slopes is None else dev(slopes),
        block_table=None if table is None else dev(table), out=out, check_values=check_values, **kwargs)
    cupy.cuda.get_current_stream().synchronize()
    if lse:
        (expected, expected_lse), (got, got_lse) = expected, got
        assert_close(got_lse, expected_lse, np.float32, "lse", rtol=LSE_RTOL)
    assert got is out
    assert_close(got, expected, dtype)
    return got


# Lengths that cross the tiles: 0, 1, the tile edges 64/128 +-1, and odd sizes.
EDGE_Q = [1, 127, 128, 129, 0, 65, 300]
EDGE_K = [1, 127, 128, 129, 5, 63, 300]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_grid(kernel, dtype, head_dim, group, causal):
    run_case(kernel, 1, dtype, head_dim, EDGE_Q, EDGE_Q, num_kv_heads=NUM_HEADS // group, causal=causal)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("option", ["window", "window_causal", "left_only", "softcap", "alibi",
                                    "alibi_causal", "lse", "everything"])
def test_options(kernel, dtype, head_dim, option):
    kwargs = {
        "window": dict(window=(37, 11)),
        "window_causal": dict(window=(70, 5), causal=True),
        "left_only": dict(window=(130, -1)),
        "softcap": dict(softcap=5.0, scale=0.5),
        "alibi": dict(alibi=True),
        "alibi_causal": dict(alibi=True, causal=True),
        "lse": dict(lse=True, causal=True),
        "everything": dict(window=(90, 0), softcap=8.0, alibi=True, lse=True),
    }[option]
    run_case(kernel, 2, dtype, head_dim, EDGE_Q, EDGE_K, num_kv_heads=2, **kwargs)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_chunked_prefill(kernel, dtype, head_dim, causal):
    # q shorter than k (a chunk after a cached prefix), q longer than k (leading rows see no
    # key under causal masking: zeros and LSE -inf), and an empty key side.
    run_case(kernel, 3, dtype, head_dim, [64, 200, 1, 150, 7], [700, 333, 513, 40, 0],
             num_kv_heads=2, causal=causal, lse=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128, 256])
def test_paged_block_sizes(kernel, dtype, block_size):
    run_case(kernel, 4, dtype, 128, [129, 1, 64, 300], [700, 257, 64, 300], num_kv_heads=2,
             causal=True, block_size=block_size, lse=True)


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("block_size", [16, 128])
def test_paged_options(kernel, head_dim, block_size):
    run_case(kernel, 5, "bfloat16", head_dim, EDGE_Q, EDGE_K, num_kv_heads=4, block_size=block_size,
             window=(100, 3), softcap=10.0, alibi=True, lse=True)


@pytest.mark.parametrize("block_size", [16, 64])
def test_paged_equals_contiguous(kernel, block_size):
    """The paged path reads the same keys in the same order: bit-identical to the contiguous one."""
    lens_q, lens_k = [100, 3, 257], [900, 3, 300]
    a = run_case(kernel, 6, "bfloat16", 128, lens_q, lens_k, num_kv_heads=2, causal=True)
    b = run_case(kernel, 6, "bfloat16", 128, lens_q, lens_k, num_kv_heads=2, causal=True, block_size=block_size)
    assert_same_bits(b, a, "paged out against contiguous out")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_long_sequence(kernel, dtype):
    run_case(kernel, 7, dtype, 128, [4200, 17], [4200, 4100], num_heads=2, num_kv_heads=1, causal=True, lse=True)


def test_long_sequence_paged_window(kernel):
    run_case(kernel, 8, "bfloat16", 64, [300, 4099], [5000, 4099], num_heads=4, num_kv_heads=1,
             window=(1000, 0), block_size=32)


def test_worked_example(kernel):
    """The README's varlen example: query lengths [10, 3, 1], key lengths [0, 1, 7]; r0 sees no key."""
    out = run_case(kernel, 9, "float16", 64, [10, 3, 1], [0, 1, 7], num_heads=4, num_kv_heads=2,
                   causal=True, lse=True)
    assert (to_numpy(out)[:10] == 0).all()


def test_strided_inputs(kernel):
    """q, k, v as views into packed [total, 3, H, D] projections (non-dense token strides)."""
    import cupy

    rng = np.random.default_rng(10)
    lens = [33, 190]
    cu, longest = cu_seqlens_from_lengths(lens)
    qkv = randn(rng, (int(cu[-1]), 3, 4, 64), DTYPES["bfloat16"])
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    expected = cupy_paged.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True)
    dq = cupy.asarray(qkv)
    got = varlen_on_gpu(shape_for(kernel, 64), dq[:, 0], dq[:, 1], dq[:, 2], cupy.asarray(cu), cupy.asarray(cu),
                        longest, longest, causal=True)
    assert_close(got, expected, DTYPES["bfloat16"])


def _holes_case(kernel, head_dim, block_size, seed=11, blocks=(4, 3)):
    """Block ids -1 and past num_blocks (passed with check_values=False) are holes: their keys
    contribute nothing.  The reference is the same attention over the remaining keys only
    (non-causal, no ALiBi, so key positions do not matter).  ``blocks``: the two sequences' whole
    blocks (the second has 3 keys more), holes in their columns 1 and 2."""
    import cupy

    rng = np.random.default_rng(seed)
    bf16 = DTYPES["bfloat16"]
    lens_q, lens_k = [5, 40], [blocks[0] * block_size, blocks[1] * block_size + 3]
    cu_q, max_q = cu_seqlens_from_lengths(lens_q)
    cu_k, max_k = cu_seqlens_from_lengths(lens_k)
    q = randn(rng, (int(cu_q[-1]), 4, head_dim), bf16)
    k = randn(rng, (int(cu_k[-1]), 2, head_dim), bf16)
    v = randn(rng, (int(cu_k[-1]), 2, head_dim), bf16)
    (k_cache, v_cache), table = scatter_paged(rng, [k, v], lens_k, block_size, extra_columns=2)
    num_blocks = k_cache.shape[0]
    table[0, 1], table[1, 2] = -1, num_blocks + 5  # holes
    keep = np.ones(int(cu_k[-1]), bool)
    keep[block_size:2 * block_size] = False
    keep[lens_k[0] + 2 * block_size:lens_k[0] + 3 * block_size] = False
    kept = [int(keep[:lens_k[0]].sum()), int(keep[lens_k[0]:].sum())]
    cu_kept, max_kept = cu_seqlens_from_lengths(kept)
    expected = cupy_paged.flash_attn_varlen_func(q, k[keep], v[keep], cu_q, cu_kept, max_q, max_kept)
    out = poisoned(q.shape, bf16, cupy)
    varlen_on_gpu(shape_for(kernel, head_dim), cupy.asarray(q), cupy.asarray(k_cache), cupy.asarray(v_cache),
                  cupy.asarray(cu_q), cupy.asarray(cu_k), max_q, max_k, block_table=cupy.asarray(table), out=out,
                  check_values=False)
    assert_close(out, expected, bf16)


@pytest.mark.parametrize("block_size", [8, 64])
def test_block_table_holes(kernel, block_size):
    _holes_case(kernel, 128, block_size)


def _candidate_params(candidates):
    return [pytest.param(head_dim, tiles, id=f"d{head_dim}-{tiles.label()}")
            for head_dim, shapes in sorted(candidates.items()) for tiles in shapes]


@pytest.mark.parametrize("head_dim,tiles", _candidate_params(MMA_CANDIDATES))
def test_mma_candidates(head_dim, tiles):
    """Each mma.sync candidate (the fixture runs it under ``mma_sync`` only)."""
    _candidate_cases(tiles, 15, head_dim)


@pytest.mark.parametrize("head_dim,tiles", _candidate_params(WGMMA_CANDIDATES))
def test_wgmma_candidates(head_dim, tiles):
    """Each wgmma candidate (the fixture runs it under ``wgmma`` only)."""
    _candidate_cases(tiles, 18, head_dim)


def _candidate_cases(tiles, seed, head_dim):
    """What a candidate shape must pass: the edge grid causal with LSE, chunked prefill, and
    paged K/V with every option."""
    run_case(tiles, seed, "bfloat16", head_dim, EDGE_Q, EDGE_K, num_kv_heads=2, causal=True, lse=True)
    run_case(tiles, seed + 1, "bfloat16", head_dim, [64, 200, 1, 150, 7], [700, 333, 513, 40, 0], num_kv_heads=2,
             causal=True, lse=True)
    run_case(tiles, seed + 2, "bfloat16", head_dim, EDGE_Q, EDGE_K, num_kv_heads=4, block_size=16,
             window=(100, 3), softcap=10.0, alibi=True, lse=True)
    # many key tiles through a block table (every pipeline slot reused several times), and holes
    run_case(tiles, seed + 3, "float16", head_dim, [300, 1000, 3], [2000, 1000, 1500], num_kv_heads=2,
             block_size=16, causal=True, lse=True)
    _holes_case(tiles, head_dim, 16, seed + 4)
    if getattr(tiles, "persistent", False):
        _persistent_cases(tiles, head_dim, seed + 5)
    if getattr(tiles, "tma", False):
        _tma_cases(tiles, head_dim, seed + 6)


def _tma_cases(tiles, head_dim, seed):
    """What only the TMA loader does: full 128-key tiles copied as 16-row boxes through block
    tables of every block size it takes (16 to 256: a box inside one block), and as one 128-row box
    a column block from contiguous K/V (sequences starting at rows that are not multiples of 128), with
    holes inside full tiles (their boxes land as zeros); blocks of 8 keys and K/V whose strides no
    tensor map takes run the cp.async loader (the launch made without maps)."""
    import cupy

    assert _launch_of(tiles, head_dim, [300, 700])._maps is not None  # the maps are made: the TMA runs
    for i, block_size in enumerate((16, 32, 64, 256)):
        run_case(tiles, seed + i, "bfloat16", head_dim, [300, 1000, 3, 129], [1300, 1000, 1500, 129],
                 num_kv_heads=2, block_size=block_size, causal=True, lse=True)
    run_case(tiles, seed + 4, "float16", head_dim, [1, 700, 256], [2048, 700, 1000], num_kv_heads=4,
             window=(300, 0), softcap=8.0, alibi=True, lse=True)
    for block_size in (16, 64):  # holes inside full tiles (keys 16..31 / 64..127 of 128-key tiles)
        _holes_case(tiles, head_dim, block_size, seed + 5, blocks=(2048 // block_size, 1024 // block_size))
    run_case(tiles, seed + 6, "bfloat16", head_dim, [129, 500], [900, 1500], num_kv_heads=2, block_size=8,
             causal=True, lse=True)
    # K and V of heads that are not inside a row (a [kv heads, total_k, D] array transposed): no map
    rng = np.random.default_rng(seed + 7)
    lens = [400, 700]
    cu, max_len = cu_seqlens_from_lengths(lens)
    total = int(cu[-1])
    bf16 = DTYPES["bfloat16"]
    q = randn(rng, (total, 4, head_dim), bf16)
    k_heads = randn(rng, (2, total, head_dim), bf16)
    v_heads = randn(rng, (2, total, head_dim), bf16)
    k, v = k_heads.transpose(1, 0, 2), v_heads.transpose(1, 0, 2)
    expected = cupy_paged.flash_attn_varlen_func(q, np.ascontiguousarray(k), np.ascontiguousarray(v), cu, cu,
                                                 max_len, max_len, causal=True)
    dk, dv = cupy.asarray(k_heads).transpose(1, 0, 2), cupy.asarray(v_heads).transpose(1, 0, 2)
    p = prepare_varlen(cupy.asarray(q), dk, dv, cupy.asarray(cu), cupy.asarray(cu), max_len, max_len, None, True,
                       (-1, -1), 0.0, None, None, False, None, False)
    launch = varlen_ops.VarlenLaunch(p, tiles)
    assert launch._maps is None and not launch.tiles.tma
    out = poisoned(q.shape, bf16, cupy)
    varlen_on_gpu(tiles, cupy.asarray(q), dk, dv, cupy.asarray(cu), cupy.asarray(cu), max_len, max_len, out=out,
                  causal=True)
    assert_close(out, expected, bf16)


def _persistent_cases(tiles, head_dim, seed):
    """What only a persistent launch does: CTAs that take several tasks each (query tiles of
    mixed lengths, empty sequences, a paged cache), tasks whose rows see no key (written by the
    producer), and a batch past PERSISTENT_MAX_SEQS (the same shape on a grid of one CTA a tile)."""
    from cupy_paged.kernels.varlen_wgmma import PERSISTENT_MAX_SEQS

    # 8 + 6 + 1 + 12 + 3 query tiles of 16 heads: 480 tasks, several per CTA on any GPU
    run_case(tiles, seed, "bfloat16", head_dim, [1000, 0, 700, 1, 1500, 300], [1000, 5, 900, 1, 1500, 333],
             num_heads=16, num_kv_heads=4, causal=True, lse=True)
    # under causal alignment the first rows of a 300-row query on 100 keys see none
    run_case(tiles, seed + 1, "float16", head_dim, [300, 512, 40] * 4, [100, 600, 2000] * 4, num_heads=16,
             num_kv_heads=2, causal=True, lse=True, block_size=16)
    run_case(tiles, seed + 2, "bfloat16", head_dim, [129, 256, 0, 700] * 3, [1500, 256, 9, 700] * 3,
             num_heads=8, num_kv_heads=8, window=(200, 0), softcap=5.0, alibi=True, lse=True, block_size=32)
    lengths = np.random.default_rng(seed).integers(0, 4, PERSISTENT_MAX_SEQS + 40).tolist()
    run_case(tiles, seed + 3, "bfloat16", head_dim, lengths, lengths, num_heads=4, num_kv_heads=2, causal=True)
    assert not _launch_of(tiles, head_dim, lengths).persistent  # that batch ran on the per-tile grid
    assert _launch_of(tiles, head_dim, lengths[:PERSISTENT_MAX_SEQS]).persistent


def _launch_of(tiles, head_dim, lengths):
    """The VarlenLaunch of a causal call on ``tiles`` over these lengths (4 heads, 2 kv heads)."""
    import cupy

    cu, max_len = cu_seqlens_from_lengths(lengths)
    total = int(cu[-1])
    q = cupy.asarray(np.zeros((total, 4, head_dim), DTYPES["bfloat16"]))
    kv = cupy.asarray(np.zeros((total, 2, head_dim), DTYPES["bfloat16"]))
    p = prepare_varlen(q, kv, kv, cupy.asarray(cu), cupy.asarray(cu), max_len, max_len, None, True, (-1, -1), 0.0,
                       None, None, False, None, False)
    return varlen_ops.VarlenLaunch(p, tiles)


def test_registered_launch_takes_its_layouts_shape(kernel):
    """The registered (``tiles=None``) launch takes the shape of its K/V layout with its tensor maps:
    at D = 128 the TMA shape for contiguous K/V and for paged blocks of 16 keys, the cp.async shape
    (no maps) for paged blocks of 8 keys."""
    import cupy

    if kernel != "wgmma":
        pytest.skip("the wgmma kernel's registration")
    contiguous = _launch_of(None, 128, [300, 700])
    assert contiguous.tiles == registered_tiles(128, False) and contiguous._maps is not None
    rng = np.random.default_rng(5)
    for block_size, tiles, maps in ((16, registered_tiles(128, True), True), (8, varlen_ops.WGMMA_TILES[128], False)):
        lens = [300, 700]
        cu, max_len = cu_seqlens_from_lengths(lens)
        k = randn(rng, (int(cu[-1]), 2, 128), DTYPES["bfloat16"])
        (k_cache, v_cache), table = scatter_paged(rng, [k, k], lens, block_size)
        q = cupy.asarray(randn(rng, (int(cu[-1]), 4, 128), DTYPES["bfloat16"]))
        p = prepare_varlen(q, cupy.asarray(k_cache), cupy.asarray(v_cache), cupy.asarray(cu), cupy.asarray(cu),
                           max_len, max_len, None, True, (-1, -1), 0.0, None, cupy.asarray(table), False, None, False)
        launch = varlen_ops.VarlenLaunch(p)
        assert launch.tiles == tiles and (launch._maps is not None) == maps, block_size


# ---- the compute-sanitizer subset: small, every path (contiguous, paged, holes, options)

@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_sanitize_contiguous(kernel, head_dim):
    run_case(kernel, 12, "bfloat16", head_dim, [1, 129, 0, 70], [1, 129, 3, 200], num_kv_heads=2,
             causal=True, lse=True)


@pytest.mark.parametrize("head_dim", [96, 128])
def test_sanitize_paged_options(kernel, head_dim):
    run_case(kernel, 13, "float16", head_dim, [1, 129, 0, 70], [1, 129, 3, 200], num_kv_heads=2,
             block_size=16, window=(50, 2), softcap=6.0, alibi=True, lse=True)


def test_sanitize_holes(kernel):
    _holes_case(kernel, 64, 16, seed=14)
