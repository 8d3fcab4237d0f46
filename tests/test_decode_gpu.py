"""flash_attn_with_kvcache on the GPU (cuda_src/decode.cu) against the CPU reference backend.

Every case builds NumPy inputs, runs the reference on NumPy copies and the kernel on CuPy copies
(output poisoned with NaN first), and compares the outputs, the LSE and the whole caches after the
append.  Test ids containing ``sanitize`` form a small subset meant for compute-sanitizer:
``compute-sanitizer --tool memcheck python -m pytest -m gpu -k sanitize tests/test_decode_gpu.py``.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import cupy_paged
from cupy_paged.kernels.decode import Tiles
from _util import BF16, assert_close, assert_same_bits, poisoned, randn, shuffled_block_table, to_numpy
from naive import naive_attention

pytestmark = pytest.mark.gpu
F16 = np.dtype(np.float16)
LSE_RTOL = 2e-3

# Pipeline shapes the GPU tests check beside the registered ones (head dim -> shapes), so that a
# shape benchmarks/bench_decode.py --sweep times (its SWEEP; tests/test_compiler.py checks that every
# swept shape is here and builds) is verified before it is adopted.  A failure rules out that shape only.
CANDIDATES: dict[int, tuple[Tiles, ...]] = {
    128: (Tiles(32, 3, warps=2),),
}


def decode_on_gpu(tiles, **arguments):
    """flash_attn_with_kvcache on device arrays: the public function for ``tiles`` None, else
    ``kernels.decode.run`` with that pipeline shape."""
    if tiles is None:
        return cupy_paged.flash_attn_with_kvcache(**arguments)
    from cupy_paged.api.decode import prepare_decode
    from cupy_paged.kernels import decode

    out, lse = decode.run(prepare_decode(**arguments), tiles)
    return (out, lse) if arguments.get("return_softmax_lse") else out


def make_case(rng, dtype, head_dim, num_heads, num_kv_heads, block_size, cache_seqlens, seqlen_q,
              seqlen_new, extra_columns=1):
    """NumPy inputs of one decode call with a shuffled block table padded with -1."""
    batch = len(cache_seqlens)
    lengths = np.asarray(cache_seqlens, np.int64) + seqlen_new
    # At least one block per sequence, an empty one too (lengths of 0 count as 1).
    table, num_blocks = shuffled_block_table(rng, np.maximum(lengths, 1), block_size,
                                             extra_columns=extra_columns)
    case = dict(
        q=randn(rng, (batch, seqlen_q, num_heads, head_dim), dtype),
        k_cache=randn(rng, (num_blocks, block_size, num_kv_heads, head_dim), dtype),
        v_cache=randn(rng, (num_blocks, block_size, num_kv_heads, head_dim), dtype),
        cache_seqlens=np.asarray(cache_seqlens, np.int32), block_table=table)
    if seqlen_new:
        case["k"] = randn(rng, (batch, seqlen_new, num_kv_heads, head_dim), dtype)
        case["v"] = randn(rng, (batch, seqlen_new, num_kv_heads, head_dim), dtype)
    return case


def run_both(case, tiles=None, lse=True, **options):
    """(reference out, lse, k_cache, v_cache), (gpu out, lse, k_cache, v_cache) as NumPy; the GPU
    call on pipeline shape ``tiles`` (None: the registered one, through the public function), its
    output poisoned; ``lse`` False: calls without the LSE (both LSEs None)."""
    import cupy

    def outputs(result):
        return result if lse else (result, None)

    host = {name: np.array(value) for name, value in case.items()}
    ref_out, ref_lse = outputs(cupy_paged.flash_attn_with_kvcache(**host, return_softmax_lse=lse, **options))
    dev = {name: cupy.asarray(value) for name, value in case.items()}
    dev_options = {name: cupy.asarray(value) if isinstance(value, np.ndarray) else value
                   for name, value in options.items()}
    out = poisoned(case["q"].shape, case["q"].dtype, xp=cupy)
    got_out, got_lse = outputs(decode_on_gpu(tiles, **dev, return_softmax_lse=lse, out=out, **dev_options))
    assert got_out is out
    reference = (ref_out, ref_lse, host["k_cache"], host["v_cache"])
    return reference, tuple(None if x is None else to_numpy(x) for x in (got_out, got_lse, dev["k_cache"],
                                                                         dev["v_cache"]))


def check(case, tiles=None, lse=True, **options):
    dtype = case["q"].dtype
    (ref_out, ref_lse, ref_k, ref_v), (out, got_lse, k_cache, v_cache) = run_both(case, tiles, lse, **options)
    assert_close(out, ref_out, dtype)
    if lse:
        assert_close(got_lse, ref_lse, np.float32, what="lse", rtol=LSE_RTOL)
    # The whole caches: old contents everywhere, new tokens at their slots (bitwise).
    assert_same_bits(k_cache, ref_k, "k_cache after the append")
    assert_same_bits(v_cache, ref_v, "v_cache after the append")
    return out, got_lse


# (id, dtype, head_dim, H, Hkv, block_size, cache_seqlens, seqlen_q, seqlen_new, options)
GRID = [
    ("sanitize-bf16-d128-gqa4-bs16", BF16, 128, 8, 2, 16, [0, 1, 15, 16, 17, 100], 1, 1, {}),
    ("sanitize-f16-d64-mqa-sq4", F16, 64, 8, 1, 32, [31, 32, 33, 5], 4, 4, {"causal": True}),
    ("f16-d32-mha-bs8", F16, 32, 4, 4, 8, [7, 8, 9, 0], 1, 0, {}),
    ("bf16-d32-gqa8-bs256", BF16, 32, 16, 2, 256, [255, 256, 257], 4, 2, {"causal": True}),
    ("f16-d64-gqa4-bs64-window", F16, 64, 8, 2, 64, [63, 64, 65, 300], 4, 1,
     {"causal": True, "window_size": (37, 0)}),
    ("bf16-d64-gqa8-bs128-alibi", BF16, 64, 16, 2, 128, [127, 128, 129, 1], 1, 1, {"alibi": True}),
    ("f16-d96-gqa4-bs32-softcap", F16, 96, 8, 2, 32, [31, 32, 33, 200], 1, 1, {"softcap": 30.0}),
    ("bf16-d96-mha-bs16-sq4", BF16, 96, 4, 4, 16, [15, 16, 17, 0], 4, 0, {"causal": True}),
    ("sanitize-f16-d128-mha-bs64-all", F16, 128, 4, 4, 64, [1, 63, 64, 65], 4, 2,
     {"causal": True, "window_size": (20, -1), "softcap": 15.0, "alibi": True}),
    ("bf16-d128-gqa8-bs8-noncausal-sq4", BF16, 128, 16, 2, 8, [7, 8, 9, 40], 4, 3, {}),
    ("f16-d256-gqa4-bs16", F16, 256, 8, 2, 16, [15, 16, 17, 90], 1, 1, {}),
    ("bf16-d256-mqa-bs256-window-both", BF16, 256, 8, 1, 256, [255, 256, 257, 600], 4, 1,
     {"window_size": (50, 2)}),
    ("bf16-d128-gqa4-bs128-long", BF16, 128, 8, 2, 128, [3000, 4097], 1, 1, {"causal": True}),
    ("f16-d128-gqa4-bs16-100k", F16, 128, 8, 2, 16, [100_003], 1, 1, {}),
    # Exactly 16 rows (one mma row group): GQA 4 x Sq 4 and a 16-head MQA group.
    ("bf16-d128-gqa4-bs32-sq4-16rows", BF16, 128, 8, 2, 32, [0, 31, 64, 1000], 4, 4, {"causal": True}),
    ("f16-d64-mqa16-bs16-softcap", F16, 64, 16, 1, 16, [17, 500, 2], 1, 1, {"softcap": 20.0}),
]


@pytest.mark.parametrize("case_id,dtype,head_dim,num_heads,num_kv_heads,block_size,seqlens,seqlen_q,"
                         "seqlen_new,options", GRID, ids=[g[0] for g in GRID])
def test_decode_matches_reference(case_id, dtype, head_dim, num_heads, num_kv_heads, block_size, seqlens,
                                  seqlen_q, seqlen_new, options):
    rng = np.random.default_rng(zlib.crc32(case_id.encode()))
    case = make_case(rng, dtype, head_dim, num_heads, num_kv_heads, block_size, seqlens, seqlen_q, seqlen_new)
    options = dict(options)
    if options.pop("alibi", False):
        options["alibi_slopes"] = rng.uniform(0.01, 0.5, num_heads).astype(np.float32)
    check(case, **options)


@pytest.mark.parametrize("dtype,head_dim", [(BF16, 128), (F16, 64), (BF16, 256), (F16, 32), (BF16, 96)],
                         ids=["bf16-d128", "f16-d64", "bf16-d256", "f16-d32", "bf16-d96"])
@pytest.mark.parametrize("splits,seqlen_q", [(1, 1), (3, 1), (1, 4)], ids=["nosplit", "splits3", "sq4"])
def test_items_of_mixed_lengths(dtype, head_dim, splits, seqlen_q):
    """Long sequences, short ones, empty ones and tile boundaries next to each other in one
    launch (every head dim's tile shape), with new tokens, splits and four query tokens."""
    rng = np.random.default_rng(zlib.crc32(f"{dtype}{head_dim}{splits}{seqlen_q}".encode()))
    seqlens = [2000, 0, 700, 1, 1500, 383, 384, 385, 100, 1100]
    case = make_case(rng, dtype, head_dim, 8, 2, 16, seqlens, seqlen_q, 1)
    check(case, causal=True, num_splits=splits)


@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128, 256])
def test_every_block_size(block_size):
    rng = np.random.default_rng(block_size)
    seqlens = [block_size - 1, block_size, block_size + 1, 3 * block_size + 5]
    check(make_case(rng, BF16, 128, 32, 8, block_size, seqlens, 1, 1), causal=True)


def test_forced_splits_equal_no_split():
    rng = np.random.default_rng(7)
    case = make_case(rng, BF16, 128, 8, 2, 32, [5000, 777, 0, 64], 2, 1)
    base_out, base_lse = check(case, num_splits=1, causal=True)
    for splits in (2, 3, 7, 16, 33, 64, 128):  # 128 = MAX_SPLITS: most splits are empty (LSE -inf)
        out, lse = check(case, num_splits=splits, causal=True)
        assert_close(out, base_out, BF16, what=f"out with {splits} splits")
        assert_close(lse, base_lse, np.float32, what=f"lse with {splits} splits", rtol=1e-4)


def test_sanitize_split_heuristic_long_context():
    """Small batch, long context: num_splits=0 must split, and still match the reference."""
    import cupy

    from cupy_paged.api.decode import prepare_decode
    from cupy_paged.kernels import decode

    rng = np.random.default_rng(11)
    case = make_case(rng, BF16, 128, 32, 8, 16, [20_000], 1, 1)
    # The split count the launch of check()'s call uses: the launch plan of these shapes on this GPU.
    problem = prepare_decode(**{name: cupy.asarray(value) for name, value in case.items()}, softmax_scale=None,
                             causal=True, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, num_splits=0,
                             return_softmax_lse=True, out=None)
    splits = decode.plan(problem)
    assert splits > 1, f"num_splits=0 chose {splits} split(s) for 1 sequence of 20001 keys"
    check(case, causal=True)


def test_sanitize_split_heuristic_about_one_wave():
    """64 sequences x 4 kv heads of 100 to 1,280 keys (about one wave of CTAs on an H200, where
    num_splits=0 chooses no split) and the same forced to three splits of each sequence's own keys:
    both match the reference."""
    for splits in (0, 3):
        rng = np.random.default_rng(12)
        case = make_case(rng, BF16, 128, 16, 4, 16, rng.integers(100, 1280, 64).tolist(), 1, 1)
        check(case, causal=True, num_splits=splits)


@pytest.mark.parametrize("seqlen_cache", [200, 256, 4097], ids=["blocks-of-8", "pow2", "sanitize-odd-length"])
def test_contiguous_cache_without_block_table(seqlen_cache):
    """A contiguous cache of any length (the kernel sees blocks of the largest power of two that
    divides it: 8, 256 and 1 here), with an append at the end of its rows."""
    import cupy

    rng = np.random.default_rng(seqlen_cache)
    batch = 3
    q = randn(rng, (batch, 1, 8, 64), F16)
    k_cache = randn(rng, (batch, seqlen_cache, 2, 64), F16)
    v_cache = randn(rng, (batch, seqlen_cache, 2, 64), F16)
    k = randn(rng, (batch, 1, 2, 64), F16)
    v = randn(rng, (batch, 1, 2, 64), F16)
    seqlens = np.array([0, seqlen_cache - 50, seqlen_cache - 1], np.int32)
    ref_k, ref_v = k_cache.copy(), v_cache.copy()
    ref = cupy_paged.flash_attn_with_kvcache(q, ref_k, ref_v, k, v, cache_seqlens=seqlens, causal=True)
    dk, dv = cupy.asarray(k_cache), cupy.asarray(v_cache)
    got = cupy_paged.flash_attn_with_kvcache(cupy.asarray(q), dk, dv, cupy.asarray(k), cupy.asarray(v),
                                             cache_seqlens=cupy.asarray(seqlens), causal=True)
    assert_close(got, ref, F16)
    assert np.array_equal(to_numpy(dk), ref_k) and np.array_equal(to_numpy(dv), ref_v)


def test_decode_worked_example():
    """The decode worked example: cache_seqlens [30, 32, 70], block size 32, block table rows [2], [0, 1], [3, 5, 6]."""
    rng = np.random.default_rng(30)
    table = np.array([[2, -1, -1, -1], [0, 1, -1, -1], [3, 5, 6, -1]], np.int32)
    case = dict(q=randn(rng, (3, 1, 8, 128), BF16),
                k_cache=randn(rng, (8, 32, 2, 128), BF16), v_cache=randn(rng, (8, 32, 2, 128), BF16),
                k=randn(rng, (3, 1, 2, 128), BF16), v=randn(rng, (3, 1, 2, 128), BF16),
                cache_seqlens=np.array([30, 32, 70], np.int32), block_table=table)
    before = case["k_cache"].copy()
    _, _, k_cache, _ = run_both(case, causal=True)[1]
    check(case, causal=True)
    # The new tokens landed where the example says: block 2 slot 30, block 1 slot 0, block 6 slot 6.
    for b, (block, slot) in enumerate(((2, 30), (1, 0), (6, 6))):
        assert np.array_equal(k_cache[block, slot], case["k"][b, 0])
    changed = np.argwhere((k_cache.view(np.uint16) != before.view(np.uint16)).any(axis=(2, 3)))
    assert set(map(tuple, changed.tolist())) == {(1, 0), (2, 30), (6, 6)}


def test_sanitize_holes_never_read_or_written():
    """Block ids out of range, past the table or negative lengths: no fault, no NaN (check_values off)."""
    import cupy

    rng = np.random.default_rng(5)
    case = make_case(rng, F16, 64, 8, 2, 16, [40, 40, 40, 10], 1, 2)
    case["block_table"][0, 1] = 10_000
    case["block_table"][1, 0] = -7
    case["block_table"][2, :] = -1
    case["cache_seqlens"][3] = 5_000  # past the table's columns
    dev = {name: cupy.asarray(value) for name, value in case.items()}
    out = poisoned(case["q"].shape, case["q"].dtype, cupy)  # NaN: an element left unwritten fails
    cupy_paged.flash_attn_with_kvcache(**dev, causal=True, check_values=False, num_splits=3, out=out)
    assert not np.isnan(to_numpy(out)).any()


def test_cuda_graph_replay_equals_eager():
    """A captured decode step replayed for 20 steps (inputs, lengths and table updated in place)."""
    import cupy

    rng = np.random.default_rng(20)
    batch, heads, kv_heads, dim, block_size, steps = 4, 8, 2, 128, 16, 20
    start = np.array([30, 0, 95, 200], np.int32)
    full = make_case(rng, BF16, dim, heads, kv_heads, block_size, (start + steps).tolist(), 1, 1,
                     extra_columns=40)  # a long table: the heuristic splits, the combine is captured too
    table_full = full["block_table"]

    def table_at(step):
        table = table_full.copy()
        needed = -(-(start + step + 1) // block_size)
        table[np.arange(table.shape[1])[None, :] >= needed[:, None]] = -1
        return table

    def inputs(step):
        return (randn(rng, (batch, 1, heads, dim), BF16), randn(rng, (batch, 1, kv_heads, dim), BF16),
                randn(rng, (batch, 1, kv_heads, dim), BF16), start + step, table_at(step))

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        eager_k, eager_v = cupy.asarray(full["k_cache"]), cupy.asarray(full["v_cache"])
        graph_k, graph_v = eager_k.copy(), eager_v.copy()
        scratch_k, scratch_v = eager_k.copy(), eager_v.copy()
        q0, k0, v0, lens0, table0 = inputs(0)
        static = [cupy.asarray(x) for x in (q0, k0, v0, lens0, table0)]
        graph_out = cupy.empty((batch, 1, heads, dim), BF16)

        def call(q, k, v, lens, table, k_cache, v_cache, out):
            return cupy_paged.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens,
                                                     block_table=table, causal=True, out=out)

        call(*static, scratch_k, scratch_v, cupy.empty_like(graph_out))  # warm-up sizes the workspace
        stream.begin_capture()
        call(*static, graph_k, graph_v, graph_out)
        graph = stream.end_capture()
        for step in range(steps):
            host = inputs(step)
            for buffer, value in zip(static, host):
                buffer[...] = cupy.asarray(value)
            graph.launch(stream=stream)
            eager_out = poisoned((batch, 1, heads, dim), BF16, xp=cupy)
            call(*(cupy.asarray(x) for x in host), eager_k, eager_v, eager_out)
            stream.synchronize()
            assert_same_bits(graph_out, eager_out, f"graph out at step {step}")
        assert_same_bits(graph_k, eager_k, "graph k_cache")
        assert_same_bits(graph_v, eager_v, "graph v_cache")


def test_cuda_graph_of_a_contiguous_cache_with_an_int_length():
    """A contiguous cache and an int cache_seqlens need no per-call index arrays (one identity
    table per device, the length by value), so after a warm-up with another length (it loads the
    kernel and sizes the identity table) a call with a new length can be captured: its replay
    equals an eager call bitwise, caches included, and both match the CPU reference."""
    import cupy

    rng = np.random.default_rng(21)
    batch, seqlen_cache, length = 3, 97, 60  # 97: not a power of two
    shapes = {"q": (batch, 1, 8, 64), "k_cache": (batch, seqlen_cache, 2, 64), "v_cache": (batch, seqlen_cache, 2, 64),
              "k": (batch, 1, 2, 64), "v": (batch, 1, 2, 64)}
    host = {name: randn(rng, shape, F16) for name, shape in shapes.items()}
    case = {name: cupy.asarray(value) for name, value in host.items()}
    eager_k, eager_v = case["k_cache"].copy(), case["v_cache"].copy()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cupy_paged.flash_attn_with_kvcache(case["q"], eager_k.copy(), eager_v.copy(), case["k"], case["v"],
                                           cache_seqlens=length - 50, causal=True)  # warm-up, another length
        graph_out = poisoned(shapes["q"], F16, xp=cupy)
        stream.begin_capture()
        cupy_paged.flash_attn_with_kvcache(**case, cache_seqlens=length, causal=True, out=graph_out)
        graph = stream.end_capture()
        graph.launch(stream=stream)
        eager_out = cupy_paged.flash_attn_with_kvcache(case["q"], eager_k, eager_v, case["k"], case["v"],
                                                       cache_seqlens=length, causal=True)
        stream.synchronize()
    assert_same_bits(graph_out, eager_out, "graph out")
    assert_same_bits(case["k_cache"], eager_k, "k_cache")
    assert_same_bits(case["v_cache"], eager_v, "v_cache")
    reference = cupy_paged.flash_attn_with_kvcache(**host, cache_seqlens=length, causal=True)
    assert_close(eager_out, reference, F16)
    assert_same_bits(eager_k, host["k_cache"], "k_cache against the reference append")


def test_params_struct_matches_kernel_source():
    """DecodeParams in decode.cu and the host's struct.pack format list the same fields in order."""
    import re

    from cupy_paged._core.compiler import load_source
    from cupy_paged.kernels import decode

    source = load_source("decode.cu")
    body = source[source.index("struct DecodeParams {"):]
    body = body[:body.index("};")]
    codes = {"long long": "q", "int": "i", "float": "f"}
    layout = ""
    for line in body.splitlines()[1:]:
        line = line.split("//")[0].strip().rstrip(";")
        if not line:
            continue
        kind = next(k for k in codes if line.startswith(k + " "))
        layout += codes[kind] * len(line[len(kind):].split(","))
    expected = re.sub(r"(\d+)(\w)", lambda m: m.group(2) * int(m.group(1)), decode._PARAMS_LAYOUT)
    assert layout == expected


def expected_with_holes(case, window=(-1, -1)):
    """(out, lse, k_cache, v_cache) of a decode with ``seqlen_q = 1`` whose block table may hold
    holes (ids outside the cache, keys past the table row), from the naive float64 attention: a
    key in a hole is masked, a new token is appended only where its slot exists."""
    q, k_cache, v_cache = case["q"], case["k_cache"].copy(), case["v_cache"].copy()
    table, lens = case["block_table"], case["cache_seqlens"]
    num_blocks, block_size = k_cache.shape[:2]
    seqlen_new = case["k"].shape[1] if "k" in case else 0
    outs, lses = [], []
    for b in range(q.shape[0]):
        cached = int(lens[b])
        num_keys = cached + seqlen_new
        j = np.arange(num_keys)
        col = j // block_size
        ids = np.where(col < table.shape[1], table[b, np.minimum(col, table.shape[1] - 1)], -1)
        in_cache = (ids >= 0) & (ids < num_blocks)
        keys = np.zeros((num_keys,) + k_cache.shape[2:], k_cache.dtype)
        values = np.zeros_like(keys)
        old = (j < cached) & in_cache
        keys[old], values[old] = k_cache[ids[old], j[old] % block_size], v_cache[ids[old], j[old] % block_size]
        if seqlen_new:
            keys[cached:], values[cached:] = case["k"][b], case["v"][b]
            new = (j >= cached) & in_cache
            k_cache[ids[new], j[new] % block_size] = keys[new]
            v_cache[ids[new], j[new] % block_size] = values[new]
        keep = old | (j >= cached)
        if window[0] >= 0:
            keep &= j >= num_keys - 1 - window[0]
        out, lse = naive_attention(q[b], keys[keep], values[keep], 1 / np.sqrt(q.shape[-1]))
        outs.append(out)
        lses.append(lse)
    return np.stack(outs), np.stack(lses), k_cache, v_cache


def check_with_holes(case, tiles, splits, window, label, **options):
    """One decode call (seqlen_q 1, causal, LSE, NaN-poisoned out) on pipeline shape ``tiles``
    against ``expected_with_holes``: the output, the LSE, and the whole caches bitwise."""
    import cupy

    ref_out, ref_lse, ref_k, ref_v = expected_with_holes(case, window)
    dev = {name: cupy.asarray(value) for name, value in case.items()}
    out, lse = decode_on_gpu(tiles, **dev, causal=True, num_splits=splits, window_size=window,
                             return_softmax_lse=True, out=poisoned(case["q"].shape, case["q"].dtype, cupy),
                             **options)
    what = f"{label}{tiles.label() if tiles else 'registered'} splits={splits} window={window}"
    assert_close(out, ref_out, BF16, what=what)
    assert_close(lse, ref_lse, np.float32, what=f"{what} lse", rtol=LSE_RTOL)
    assert_same_bits(dev["k_cache"], ref_k, f"{what} k_cache")
    assert_same_bits(dev["v_cache"], ref_v, f"{what} v_cache")
    return what


def test_sanitize_holes_staged_ids():
    """Block ids are staged in shared memory two tiles ahead of their data (decode.cu): long
    sequences (many tiles per CTA, every id slot reused), holes in the middle of a table, an id
    past the cache, a sequence longer than its table row, a window that starts inside a block,
    new tokens, splits; every CANDIDATES shape too.  Against the naive float64 attention with the
    holes masked, and the whole caches bitwise."""
    rng = np.random.default_rng(41)
    case = make_case(rng, BF16, 128, 8, 2, 16, [1500, 999, 300, 17], 1, 1)
    case["block_table"][0, 20:23] = -1      # a hole of 48 keys inside sequence 0
    case["block_table"][1, 10] = 1_000_000  # an id past the cache
    case["cache_seqlens"][2] = case["block_table"].shape[1] * 16 + 40  # keys past its table row
    for tiles in (None,) + CANDIDATES.get(128, ()):  # None: the registered shape, through the public function
        for splits, window in ((1, (-1, -1)), (3, (-1, -1)), (1, (700, 0))):
            check_with_holes(case, tiles, splits, window, "", check_values=False)


def test_sanitize_ids_past_the_lengths_are_never_used():
    """The table columns past what a sequence needs hold ids outside the cache (every kind the
    error word would report): they must be neither used nor reported, whichever shape, split or
    window reads the first tiles' ids.  Short sequences (0 to 2 tiles), a row narrower than two
    tiles, new tokens; default arguments."""
    rng = np.random.default_rng(43)
    # (lengths, extra columns): a wide row, and a row of two columns (32 keys, under two tiles)
    for lengths, extra in (([0, 1, 15, 17, 40, 130, 63], 12), ([0, 5, 20], 0)):
        case = make_case(rng, BF16, 128, 8, 2, 16, lengths, 1, 1, extra_columns=extra)
        table = case["block_table"]
        hostile = np.array([2 ** 31 - 1, -7, case["k_cache"].shape[0], -1, 1 << 30], np.int32)
        for b, cached in enumerate(lengths):
            needed = (cached + 1 + 15) // 16  # the columns of the cached keys and the new token
            table[b, needed:] = np.resize(hostile, table.shape[1] - needed)
        for tiles in (None,) + CANDIDATES.get(128, ()):
            for splits, window in ((1, (-1, -1)), (2, (-1, -1)), (1, (50, 0))):
                what = check_with_holes(case, tiles, splits, window, f"{lengths} ")
                assert cupy_paged.check_errors() is None, f"{what}: columns past the lengths reported"


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("tiles", [None] + list(CANDIDATES.get(128, ())), ids=lambda t: "registered" if t is None else t.label())
def test_an_out_pointer_off_16_bytes_is_stored_element_by_element(tiles, dtype):
    """The host refuses an ``out`` that does not start on 16 bytes, but a launch resolved once takes
    later calls' pointers unchecked (a step plan's layers): the kernel then stores element by element
    instead of in 16-byte vectors.  Every element of the shifted output right, the two bytes before
    and the bytes after it untouched; the aligned call beside it equal bit for bit."""
    import cupy

    from cupy_paged.api.decode import prepare_decode
    from cupy_paged.kernels import decode

    rng = np.random.default_rng(47)
    case = make_case(rng, dtype, 128, 8, 2, 16, [0, 1, 17, 100, 33], 1, 0)
    host = {name: np.array(value) for name, value in case.items()}
    ref_out, ref_lse = cupy_paged.flash_attn_with_kvcache(**host, return_softmax_lse=True)
    dev = {name: cupy.asarray(value) for name, value in case.items()}
    aligned = poisoned(case["q"].shape, dtype, xp=cupy)
    # One split: the kernel itself stores out (a split launch's combine_splits writes it instead).
    p = prepare_decode(**dev, out=aligned, return_softmax_lse=True, num_splits=1, check_values=False)
    launch = decode.DecodeLaunch(p, tiles)
    assert launch.splits == 1
    ptrs, cached_all, out, lse = decode.problem_args(p)
    stream = cupy.cuda.get_current_stream().ptr
    launch.run(p.q.kind, p.q.obj, ptrs, cached_all, out, None, stream)
    size = aligned.size
    shifted = poisoned((size + 16,), dtype, xp=cupy)
    sentinel = np.array(7.0, dtype)
    shifted[0] = shifted[size + 1:] = cupy.asarray(sentinel)
    view = shifted[1:size + 1].reshape(case["q"].shape)
    assert view.data.ptr % 16 == 2
    got, got_lse = launch.run(p.q.kind, p.q.obj, ptrs, cached_all, (view, view.data.ptr), None, stream)
    assert got is view
    assert_close(view, ref_out, dtype)
    assert_close(got_lse, ref_lse, np.float32, what="lse", rtol=LSE_RTOL)
    edges = to_numpy(shifted)
    assert_same_bits(edges[:1], np.full(1, sentinel, dtype), "the element before the shifted output")
    assert_same_bits(edges[size + 1:], np.full(15, sentinel, dtype), "the elements after the shifted output")
    assert_same_bits(to_numpy(view), to_numpy(aligned), "the shifted output against the aligned one")


@pytest.mark.parametrize("batch", [48, 80])
def test_grids_of_several_waves_take_the_small_shape(batch):
    """48 and 80 sequences x 8 kv heads (384 and 640 CTAs: two and three waves of the registered
    shape on an H200, one and two of the small one) of 0 to 200 keys, a hole in the table:
    ``num_splits=0`` launches the small shape, and it matches the reference (new tokens appended,
    caches compared bitwise)."""
    import cupy

    from cupy_paged.kernels import _decode_shapes as decode

    from cupy_paged.api.decode import prepare_decode
    from cupy_paged.kernels.decode import DecodeLaunch

    device, ctas = cupy.cuda.Device().id, batch * 8
    main, small = decode.slots(device, BF16, 128, decode.TILES[128]), decode.slots(device, BF16, 128,
                                                                                   decode.SMALL_TILES[128])
    if not (ctas > main and decode.fewer_waves(ctas, main, small)):
        pytest.skip(f"on this GPU {ctas} CTAs take no fewer waves with the small shape")
    rng = np.random.default_rng(batch)
    lengths = [0, 1, 15, 16, 17, 200] + rng.integers(0, 200, batch - 6).tolist()
    case = make_case(rng, BF16, 128, 32, 8, 16, lengths, 1, 1)
    case["block_table"][3, 0] = -1  # a hole where sequence 3 has keys
    ref_out, ref_lse, ref_k, ref_v = expected_with_holes(case)
    dev = {name: cupy.asarray(value) for name, value in case.items()}
    launch = DecodeLaunch(prepare_decode(**dev, causal=True, check_values=False))
    assert launch.shape.tiles == decode.SMALL_TILES[128] and launch.splits == 1  # what the call below runs
    out, lse = cupy_paged.flash_attn_with_kvcache(**dev, causal=True, return_softmax_lse=True, check_values=False,
                                                  out=poisoned(case["q"].shape, case["q"].dtype, cupy))
    assert_close(out, ref_out, BF16)
    assert_close(lse, ref_lse, np.float32, what="lse", rtol=LSE_RTOL)
    assert_same_bits(dev["k_cache"], ref_k, "k_cache")
    assert_same_bits(dev["v_cache"], ref_v, "v_cache")


def test_launch_plans_follow_shapes():
    """Calls alternating between shapes (kept launch plans) each match the reference."""
    rng = np.random.default_rng(42)
    small = make_case(rng, BF16, 128, 32, 8, 16, [100, 3], 1, 1)
    split = make_case(rng, BF16, 128, 32, 8, 16, [9000], 1, 1)  # the heuristic splits this one
    mqa = make_case(rng, F16, 128, 8, 1, 64, [70, 700, 1], 4, 0)
    for case in (small, split, mqa, small, split):
        check(dict(case), causal=True)


# ---- the CANDIDATES shapes: a shape that is adopted is already verified.
def _candidate_params():
    """The CANDIDATES and the registered small shapes (``SMALL_TILES``)."""
    from cupy_paged.kernels.decode import SMALL_TILES

    shapes = {(head_dim, tiles) for head_dim, listed in CANDIDATES.items() for tiles in listed}
    shapes |= set(SMALL_TILES.items())
    return [pytest.param(head_dim, tiles, id=f"d{head_dim}-{tiles.label()}")
            for head_dim, tiles in sorted(shapes, key=lambda item: (item[0], item[1].label()))]


def _skip_without_smem(smem):
    import cupy

    optin = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["sharedMemPerBlockOptin"]
    if smem > optin:
        pytest.skip(f"the shape needs {smem} bytes of shared memory per CTA; this GPU allows {optin}")


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("head_dim,tiles", _candidate_params())
def test_sweep_candidates_match_reference(head_dim, tiles, dtype):
    """Each candidate shape through the public function against the CPU reference: block sizes 16
    and 256, new tokens appended (caches compared bitwise), long sequences (every stage of the
    pipeline refilled many times), the plain and the masked (softcap) tile paths, forced splits."""
    _skip_without_smem(tiles.smem_bytes(head_dim))
    rng = np.random.default_rng(zlib.crc32(f"{head_dim}{tiles}{dtype}".encode()))
    for block_size in (16, 256):
        seqlens = [0, block_size - 1, block_size, 3 * block_size + 5, 2000]
        case = make_case(rng, dtype, head_dim, 32, 8, block_size, seqlens, 1, 2)
        check(case, tiles, causal=True)
        check(case, tiles, causal=True, num_splits=3)
        gqa4_sq4 = make_case(rng, dtype, head_dim, 8, 2, block_size, [1500, 7, 300], 4, 1)
        check(gqa4_sq4, tiles, causal=True, softcap=20.0)
        check(gqa4_sq4, tiles, causal=True, num_splits=5)


@pytest.mark.parametrize("head_dim,tiles", _candidate_params())
def test_sweep_candidates_holes(head_dim, tiles):
    """Holes in the middle of long sequences (the per-tile loaded vote decides which tiles skip the
    mask): a candidate with the registered keys per stage and warps per CTA equals the registered
    kernel bitwise (same arithmetic in the same order; only the pipeline depth or the load layout
    differs); any candidate has no NaN
    and stays close to the registered kernel."""
    import cupy

    from cupy_paged.kernels import decode

    _skip_without_smem(tiles.smem_bytes(head_dim))
    rng = np.random.default_rng(43)
    case = make_case(rng, BF16, head_dim, 8, 2, 16, [1500, 999, 300, 17], 1, 1)
    case["block_table"][0, 20:23] = -1      # a hole of 48 keys inside sequence 0
    case["block_table"][1, 10] = 1_000_000  # an id past the cache
    case["block_table"][2, 5] = -3
    results = []
    for shape in (decode.TILES[head_dim], tiles):
        for splits in (1, 3):
            dev = {name: cupy.asarray(value) for name, value in case.items()}
            out = poisoned(case["q"].shape, BF16, xp=cupy)
            out, lse = decode_on_gpu(shape, **dev, causal=True, num_splits=splits, out=out,
                                     return_softmax_lse=True, check_values=False)
            results.append([to_numpy(x) for x in (out, lse, dev["k_cache"], dev["v_cache"])])
    # the same keys per stage shared by the same warps: the same arithmetic in the same order
    shape = decode.TILES[head_dim]
    same_keys = (tiles.keys, tiles.warps) == (shape.keys, shape.warps)
    for registered, candidate in zip(results[:2], results[2:]):
        assert not np.isnan(candidate[0]).any()
        if same_keys:
            for name, a, b in zip(("out", "lse", "k_cache", "v_cache"), registered, candidate):
                assert_same_bits(b, a, f"{tiles.label()} {name}")
        else:
            assert_close(candidate[0], registered[0], BF16)
            assert_close(candidate[1], registered[1], np.float32, what="lse", rtol=LSE_RTOL)
            for name, a, b in zip(("k_cache", "v_cache"), registered[2:], candidate[2:]):
                assert_same_bits(b, a, f"{tiles.label()} {name}")
