"""The ragged step: one launch for any mix of prefill chunks, decodes and short rows.

On the CPU: the work list the plan builds covers every visible (row, key) pair exactly once, with
its own workspace slots per split row group, longest items first; the
plan's path rule; a ragged plan's attention equals the varlen plan's.  On a GPU: the one launch
against the CPU reference over a grid of mixes, block sizes, GQA ratios and head dims, with
window, softcap and ALiBi, the cache writes included.
"""
from __future__ import annotations

import numpy as np
import pytest

from cupy_paged.kernels.ragged import tile_keys
from cupy_paged.runtime.plan import build_plan
from cupy_paged.serving.kv_cache import PagedAttentionCache

from _util import DTYPES, assert_close, randn

ROWS = 16


def make_cache(cached, new, kv_heads=2, head_dim=64, block_size=16, dtype="float32", device="cpu",
               layers=1, spare=3):
    """A cache holding sequences 0.. with ``cached[b]`` computed tokens and ``new[b]`` reserved."""
    totals = [c + n for c, n in zip(cached, new)]
    blocks = [-(-t // block_size) for t in totals]
    cache = PagedAttentionCache(layers, kv_heads, head_dim, block_size=block_size,
                                num_blocks=sum(blocks) + spare, dtype=dtype, device=device,
                                max_seqs=len(totals), max_blocks_per_seq=max(blocks) + 1,
                                enable_prefix_caching=False)
    ids = list(range(len(totals)))
    for seq, total in zip(ids, totals):
        cache.allocate(seq, list(range(total)))
    cache.mark_computed(ids, list(cached))
    return cache, ids


def split_range(keys: int, q_len: int, split: int, splits: int, tile: int):
    """decode.cu split_range, no window."""
    per = -(-(-(-keys // splits)) // tile) * tile
    start = min(split * per, keys)
    return start, min(start + per, keys)


def covered(plan, group: int, tile: int) -> dict:
    """(b, row, key) -> how many items cover it, as the kernel reads the work list."""
    seen: dict = {}
    for b, rg, split, splits, q0, q_len, cached, slot in np.asarray(plan.work)[:plan.num_items].tolist():
        if q_len == 0:  # padding
            continue
        keys = cached + q_len
        start, end = split_range(keys, q_len, split, splits, tile)
        rows = range(rg * ROWS, min(rg * ROWS + ROWS, group * q_len))
        hi_any = max(row % q_len + keys - q_len for row in rows)
        for row in rows:
            hi = row % q_len + keys - q_len
            for key in range(start, min(end, hi_any + 1)):
                if key <= hi:
                    seen[b, row, key] = seen.get((b, row, key), 0) + 1
    return seen


MIXES = [
    ([1536] + [200] * 5, [512] + [1] * 5),         # a chunk after a prefix, decodes
    ([0, 0, 40], [37, 1, 3]),                       # new prompts, a speculative row
    ([3000] + [20] * 7, [1] * 8),                   # one long decode among short ones: split
    ([9000, 1, 0], [4, 1, 1]),                      # a split multi-token row; lengths 0 and 1
]


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_work_list_covers_every_visible_pair_once(mix, group):
    cached, new = mix
    cache, ids = make_cache(cached, new)
    plan = build_plan(cache, ids, new, num_heads=group * cache.num_kv_heads, path="ragged")
    tile = tile_keys(cache.head_dim)
    seen = covered(plan, group, tile)
    want = {(b, row, key) for b, (c, n) in enumerate(zip(cached, new)) for row in range(group * n)
            for key in range(c + row % n + 1)}
    assert set(seen) == want
    assert set(seen.values()) == {1}
    work = np.asarray(plan.work)
    assert plan.work.shape == (plan.num_items, 8)
    for dense in (False, True):  # each kind longest first (in whole tiles), the two merged in proportion
        spans = [-(-(c + q) // n) // tile for _, _, _, n, _, q, c, _ in work.tolist() if (group * q > ROWS) == dense]
        assert spans == sorted(spans, reverse=True)
    kinds = np.array([group * q > ROWS for q in work[:, 5]])
    if 1 < kinds.sum() < kinds.size - 1:  # both kinds, more than one of each: mixed, not one kind first
        dense_at, other_at = np.flatnonzero(kinds), np.flatnonzero(~kinds)
        assert other_at[0] < dense_at[-1] and dense_at[0] < other_at[-1]
    # The splits of a row group share its first workspace slot (and merge_if_last's count there);
    # the groups' slot ranges [slot, slot + splits) tile [0, num_slots) without overlap.
    groups = {}
    for b, rg, _, n, _, _, _, slot in work.tolist():
        if n > 1:
            assert groups.setdefault((b, rg), (slot, n)) == (slot, n)
    slots = sorted(groups.values())
    assert [s for s, _ in slots] == list(np.cumsum([0] + [n for _, n in slots])[:-1])
    assert plan.num_slots == sum(n for _, n in slots)


def test_long_contexts_split_and_short_rows_do_not():
    cache, ids = make_cache([32768] + [512] * 63, [1] * 64, kv_heads=8, head_dim=128)
    plan = build_plan(cache, ids, [1] * 64, num_heads=32)
    assert plan.path == "ragged"
    work = np.asarray(plan.work)
    splits = {b: n for b, _, _, n, *_ in work.tolist()}
    assert splits[0] > 8 and all(splits[b] == 1 for b in range(1, 64))
    assert len({(b, rg) for b, rg, _, n, *_ in work.tolist() if n > 1}) == 1  # one split row group


@pytest.mark.parametrize("per_head", [33, 66])
def test_a_level_batch_of_about_one_wave_splits_nothing(per_head):
    """The rule splits no sequence of a batch whose longest sequence holds at most 1.5 times one
    wave's share of the keys: 64 one-token rows of 577 keys on 66 slots a kv head (the example
    engine's decode step at 16/4 heads) or 33 (32/8), and lengths 400-800.  Under the two-wave range
    alone (577 keys against ranges of 320) each would split in two.  One sequence past 1.5 shares
    still splits, into ranges of the two-wave size."""
    from cupy_paged.runtime._work import MIN_SPLIT_TILES, WAVES, plan_work

    tile = 64
    query = np.ones(64, np.int64)
    rng = np.random.default_rng(per_head)
    for cached in (np.full(64, 576, np.int64), rng.integers(400, 800, 64).astype(np.int64)):
        _, splits, items, slots = plan_work(query, cached, 4, tile, per_head, 1 << 40, 1 << 40)
        assert (splits == 1).all() and items == 64 and slots == 0
    cached = np.full(64, 576, np.int64)
    one_wave = -(-int((cached + 1).sum()) // per_head)
    cached[7] = 2 * one_wave
    _, splits, items, slots = plan_work(query, cached, 4, tile, per_head, 1 << 40, 1 << 40)
    total = int((cached + 1).sum())
    chunk = -(-max(MIN_SPLIT_TILES * tile, -(-total // (WAVES * per_head))) // tile) * tile
    assert splits[7] == -(-(int(cached[7]) + 1) // chunk) > 1
    assert all(splits[b] == (1 if 2 * (int(cached[b]) + 1) <= 3 * chunk else -(-(int(cached[b]) + 1) // chunk))
               for b in range(64))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("group,seqlen_q", [(4, 1), (8, 1), (4, 4), (8, 4), (1, 2)])
def test_device_list_capacities_hold_every_list_of_the_rule(seed, group, seqlen_q):
    """The fixed capacities of a device-built list (kernels.ragged.list_capacities) hold the list the
    rule makes of any lengths, without the range doubling: long-tailed draws, one long sequence among
    short ones, all equal, all empty."""
    from cupy_paged.kernels.ragged import ROWS as LIST_ROWS, list_capacities
    from cupy_paged.runtime._work import plan_work

    rng = np.random.default_rng(seed)
    tile = 64
    for batch in (1, 7, 64, 300):
        draws = [rng.lognormal(7.0, 1.5, batch), np.full(batch, 40.0), np.zeros(batch),
                 np.r_[[200_000.0], np.full(batch - 1, 30.0)]]
        for per_head in (1, 8, 33, 66):
            row_groups = -(-group * seqlen_q // LIST_ROWS)
            items_cap, slots_cap = list_capacities(batch, row_groups, per_head)
            for draw in draws:
                cached = draw.astype(np.int64)
                query = np.full(batch, seqlen_q, np.int64)
                _, splits, items, slots = plan_work(query, cached, group, tile, per_head, 1 << 40, 1 << 40)
                assert items <= items_cap and slots <= slots_cap, (batch, per_head, items, slots,
                                                                   (items_cap, slots_cap))


def test_path_rule_and_arguments():
    cache, ids = make_cache([2000] * 8, [1] * 8)
    assert build_plan(cache, ids, [1] * 8).path == "decode"                 # no num_heads: as before
    assert build_plan(cache, ids, [1] * 8, num_heads=8).path == "ragged"    # decodes: one ragged launch
    prefill, pids = make_cache([0, 0], [4096, 4096], kv_heads=2, head_dim=64)
    assert build_plan(prefill, pids, [4096, 4096], num_heads=8).path == "varlen"  # prefill-heavy
    assert build_plan(prefill, pids, [4096, 4096], num_heads=8, path="ragged").path == "ragged"
    with pytest.raises(ValueError, match="needs num_heads"):
        build_plan(cache, ids, [1] * 8, path="ragged")
    with pytest.raises(ValueError, match="num_heads must be a positive multiple"):
        build_plan(cache, ids, [1] * 8, num_heads=3)
    odd, oids = make_cache([10], [1], head_dim=16)  # no kernel takes D = 16: the reference's paths only
    assert build_plan(odd, oids, [1], num_heads=4).path == "decode"
    with pytest.raises(ValueError, match="head dim the kernels take"):
        build_plan(odd, oids, [1], num_heads=4, path="ragged")
    with pytest.raises(ValueError, match="path must be one of"):
        build_plan(cache, ids, [1] * 8, path="fast")
    # Beside decodes, a chunk of at most LONGEST_RAGGED_ROW tokens joins the ragged launch; a longer
    # one takes the split path.
    from cupy_paged.runtime._work import LONGEST_RAGGED_ROW

    for chunk, path in ((LONGEST_RAGGED_ROW, "ragged"), (LONGEST_RAGGED_ROW + 1, "split")):
        step, sids = make_cache([2047] * 255 + [1536], [1] * 255 + [chunk], kv_heads=8, head_dim=128)
        assert build_plan(step, sids, [1] * 255 + [chunk], num_heads=32).path == path
    mixed, mids = make_cache([300, 40, 0], [1, 1, 20])  # decodes first, then a prompt: split
    plan = build_plan(mixed, mids, [1, 1, 20])
    assert (plan.path, plan.num_split, plan.tail_cu_seqlens_q.tolist()) == ("split", 2, [0, 20])
    assert build_plan(mixed, mids, [1, 1, 20], path="varlen").path == "varlen"
    late, lids = make_cache([0, 300], [20, 1])  # the one-token row last: varlen
    assert (build_plan(late, lids, [20, 1]).path, build_plan(late, lids, [20, 1]).num_split) == ("varlen", 0)
    with pytest.raises(ValueError, match="path='split' takes steps that start with one-token rows"):
        build_plan(late, lids, [20, 1], path="split")
    from cupy_paged.runtime.buffers import PlanBuffers

    with pytest.raises(ValueError, match="work list for query_group = None"):
        build_plan(cache, ids, [1] * 8, num_heads=8, buffers=PlanBuffers(8, 8, cache.max_blocks_per_seq))
    with pytest.raises(ValueError, match="one new token per sequence"):
        build_plan(prefill, pids, [4096, 4096], path="decode")


@pytest.mark.parametrize("mix", MIXES)
def test_buffered_work_list_is_padded_to_its_capacity(mix):
    """Into PlanBuffers made with query_group: the list at full capacity, padding items of query
    length 0 past the step's own, the same coverage, the grids the buffers' capacity."""
    from cupy_paged.runtime.buffers import PlanBuffers

    cached, new = mix
    cache, ids = make_cache(cached, new)
    buffers = PlanBuffers(8, 1024, cache.max_blocks_per_seq, query_group=4)
    plan = build_plan(cache, ids, new, num_heads=8, path="ragged", buffers=buffers, batch_size=8,
                      num_tokens=1024)
    items, slots = buffers.work_capacity
    assert (plan.num_items, plan.num_slots) == (items, slots)
    assert plan.work.shape == (items, 8)
    own = build_plan(cache, ids, new, num_heads=8, path="ragged")
    work = np.asarray(plan.work)
    real = int((work[:, 5] > 0).sum())
    assert (work[real:] == 0).all()  # the step's items first, then padding
    if own.num_slots <= slots:  # within capacity: the same list
        np.testing.assert_array_equal(work[:real], own.work)
    else:  # split less, to fit
        assert int((work[:real, 3] > 1).sum()) <= slots
    seen = covered(plan, 4, tile_keys(cache.head_dim))
    assert set(seen.values()) == {1} and len(seen) == sum(4 * n * c + 4 * n * (n + 1) // 2
                                                         for c, n in zip(cached, new))


@pytest.mark.parametrize("new", [[1, 1, 1], [1, 1, 9], [9, 1, 1]], ids=["decode", "split", "varlen"])
def test_cpu_plan_attention_returns_out_itself(new):
    """With out= every path returns that array itself (the GPU launches do), not a view of it."""
    cache, ids = make_cache([30, 0, 17], new, dtype="float32")
    plan = build_plan(cache, ids, new)
    rng = np.random.default_rng(2)
    q, k, v = (randn(rng, (sum(new), h, 64), np.float32) for h in (4, 2, 2))
    out = np.full_like(q, np.nan)
    assert plan.attention(q, k, v, *cache.layer(0), out=out) is out and not np.isnan(out).any()


def test_cpu_ragged_plan_attention_equals_varlen():
    rng = np.random.default_rng(3)
    cached, new = [30, 0, 17], [5, 9, 1]
    results = []
    for path in ("ragged", "varlen"):
        cache, ids = make_cache(cached, new, dtype="float64")
        for array in cache.layer(0):
            array[...] = np.random.default_rng(1).standard_normal(array.shape)
        plan = build_plan(cache, ids, new, num_heads=4, path=path)
        q, k, v = (randn(rng, (sum(new), h, 64), np.float64) for h in (4, 2, 2))
        rng = np.random.default_rng(3)
        results.append((plan.attention(q, k, v, *cache.layer(0)), cache.layer(0)[0].copy()))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])


@pytest.mark.parametrize("path,attended", [("decode", True), ("ragged", True), ("split", True), ("varlen", False)])
def test_cpu_paths_read_a_new_token_in_a_hole_as_their_kernels_do(path, attended):
    """A bad block id where a one-token row's new token lands (a hostile table, check_values off):
    the token is never written; the decode and ragged launches (and the split path's decode rows)
    attend it from k/v, the varlen launch reads keys from the cache only and sees none.  The CPU
    backend follows each path as its kernels do, so the GPU is compared with the same reading."""
    cached, new = [0, 17], [1, 1] if path == "decode" else [1, 6]
    cache, ids = make_cache(cached, new, dtype="float64")
    for array in cache.layer(0):
        array[...] = np.random.default_rng(1).standard_normal(array.shape)
    cache.tables[cache.rows([ids[0]])[0], 0] = -1  # sequence 0's only block
    cache.table_versions[cache.rows([ids[0]])[0]] += 1
    plan = build_plan(cache, ids, new, num_heads=4 if path == "ragged" else None, path=path)
    assert plan.path == path and (path != "split" or plan.num_split == 1)
    rng = np.random.default_rng(5)
    q, k, v = (randn(rng, (sum(new), h, 64), np.float64) for h in (4, 2, 2))
    before = [array.copy() for array in cache.layer(0)]
    out = plan.attention(q, k, v, *cache.layer(0))
    # One key at most: the row's output is that token's value (each query head its kv head's), or 0.
    want = np.repeat(v[0], 2, axis=0) if attended else np.zeros_like(q[0])
    np.testing.assert_allclose(out[0], want, rtol=1e-12, atol=0)
    for after, old in zip(cache.layer(0), before):  # nothing of sequence 0 was written anywhere
        changed = np.flatnonzero((after != old).any(axis=(1, 2, 3)))
        assert set(changed.tolist()) <= set(cache.tables[cache.rows([ids[1]])[0]].tolist()), changed


@pytest.mark.parametrize("options", [{"softcap": 20.0}, {"alibi_slopes": "per-sequence", "window_size": (6, 0)}],
                         ids=["softcap", "alibi-batch-window"])
def test_cpu_split_plan_attention_equals_varlen(options):
    """A clean table: the split path's two parts give the varlen path's output and appends, with
    the options passed on (ALiBi ``[batch, heads]`` split between the parts by sequence)."""
    cached, new = [30, 0, 17, 4], [1, 1, 9, 3]
    if options.get("alibi_slopes") == "per-sequence":
        options = dict(options, alibi_slopes=np.random.default_rng(4).uniform(0.1, 1.0, (len(new), 4)))
    results = []
    for path in ("split", "varlen"):
        cache, ids = make_cache(cached, new, dtype="float64")
        for array in cache.layer(0):
            array[...] = np.random.default_rng(1).standard_normal(array.shape)
        plan = build_plan(cache, ids, new, path=path)
        assert plan.path == path and (path != "split" or plan.num_split == 2)
        rng = np.random.default_rng(3)
        q, k, v = (randn(rng, (sum(new), h, 64), np.float64) for h in (4, 2, 2))
        results.append((plan.attention(q, k, v, *cache.layer(0), **options), [a.copy() for a in cache.layer(0)]))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-12, atol=1e-14)
    for split_cache, varlen_cache in zip(results[0][1], results[1][1]):
        np.testing.assert_array_equal(split_cache, varlen_cache)


@pytest.mark.parametrize("path", ["decode", "split", "varlen", "ragged"])
def test_cpu_plan_attention_rejects_an_unknown_option_before_any_work(path):
    new = [1, 1] if path == "decode" else [1, 6]
    cache, ids = make_cache([5, 17], new, dtype="float64")
    plan = build_plan(cache, ids, new, num_heads=4 if path == "ragged" else None, path=path)
    q, k, v = (np.ones((sum(new), h, 64)) for h in (4, 2, 2))
    before = [a.copy() for a in cache.layer(0)]
    with pytest.raises(TypeError, match="deterministic"):
        plan.attention(q, k, v, *cache.layer(0), deterministic=True)
    for after, old in zip(cache.layer(0), before):
        np.testing.assert_array_equal(after, old)


# --------------------------------------------------------------------------- on a GPU

GPU_MIXES = MIXES + [
    ([0], [300]),                                    # prefill only
    ([100] * 6, [4] * 6),                            # short rows only (speculative verification)
    ([5000, 300, 0, 1], [1, 1, 1, 1]),               # decode only, ragged
]


def _paired(cached, new, kv_heads, head_dim, block_size, dtype, layers=1):
    """A CUDA cache and a float32 host cache with the same blocks and the same random contents."""
    import cupy

    gpu, ids = make_cache(cached, new, kv_heads, head_dim, block_size, dtype, "cuda", layers)
    host, _ = make_cache(cached, new, kv_heads, head_dim, block_size, "float32", "cpu", layers)
    rng = np.random.default_rng(11)
    for layer in range(layers):
        for g, h in zip(gpu.layer(layer), host.layer(layer)):
            values = randn(rng, h.shape, DTYPES[dtype])
            g[...] = cupy.asarray(values)
            h[...] = values.astype(np.float32)
    return gpu, host, ids


def _run_both(cached, new, group, kv_heads, head_dim, block_size, dtype, path="ragged", poison=True, **kwargs):
    import cupy

    gpu, host, ids = _paired(cached, new, kv_heads, head_dim, block_size, dtype)
    heads = group * kv_heads
    plan = build_plan(gpu, ids, new, num_heads=heads if path == "ragged" else None, path=path)
    assert plan.path == path
    host_plan = build_plan(host, ids, new)
    rng = np.random.default_rng(5)
    q, k, v = (randn(rng, (sum(new), h, head_dim), DTYPES[dtype]) for h in (heads, kv_heads, kv_heads))
    host_kwargs = {name: (value.get() if hasattr(value, "get") else value) for name, value in kwargs.items()}
    want = host_plan.attention(*(a.astype(np.float32) for a in (q, k, v)), *host.layer(0), **host_kwargs)
    out = cupy.full((sum(new), heads, head_dim), np.nan, DTYPES[dtype]) if poison else None
    got = plan.attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), *gpu.layer(0), out=out, **kwargs)
    assert got is out or out is None
    assert_close(got.get(), want, DTYPES[dtype])
    for g, h in zip(gpu.layer(0), host.layer(0)):  # the same appends
        np.testing.assert_array_equal(g.get().astype(np.float32), h)
    return plan


@pytest.mark.gpu
@pytest.mark.parametrize("mix", GPU_MIXES)
@pytest.mark.parametrize("group,kv_heads", [(1, 2), (4, 2), (8, 1), (6, 2)])
def test_gpu_ragged_mixes(mix, group, kv_heads):
    _run_both(*mix, group, kv_heads, 128, 16, "bfloat16")


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("block_size", [8, 16, 64, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_ragged_head_dims_block_sizes(head_dim, block_size, dtype):
    _run_both([700, 0, 33, 4000], [130, 5, 1, 1], 4, 2, head_dim, block_size, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("kwargs", [dict(window_size=(100, 0)), dict(softcap=20.0), dict(alibi=True)])
def test_gpu_ragged_window_softcap_alibi(kwargs):
    import cupy

    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = cupy.asarray(np.linspace(0.05, 0.4, 8, dtype=np.float32))
    _run_both([700, 0, 33, 4000], [130, 5, 1, 1], 4, 2, 128, 16, "bfloat16", **kwargs)


SPLIT_MIXES = [
    ([200] * 5 + [1536], [1] * 5 + [512]),           # decodes, then a chunk after a prefix
    ([5000, 30, 0, 0], [1, 1, 37, 3]),               # a long decode (split-KV), new prompts
    ([0, 700, 64], [1, 130, 1]),                     # a one-token prompt; a one-token row in the tail
]


@pytest.mark.gpu
@pytest.mark.parametrize("mix", SPLIT_MIXES)
@pytest.mark.parametrize("group,kv_heads", [(1, 2), (4, 2), (8, 1), (6, 2)])
@pytest.mark.parametrize("poison", [True, False])
def test_gpu_split_step_mixes(mix, group, kv_heads, poison):
    """The split path (decode kernel, then write + varlen) against the CPU reference, the appends
    of both launches compared, into a NaN-poisoned out= or a new output."""
    _run_both(*mix, group, kv_heads, 128, 16, "bfloat16", path="split", poison=poison)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block_size", [8, 16, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_split_head_dims_block_sizes(head_dim, block_size, dtype):
    _run_both([33, 4000, 700, 0], [1, 1, 130, 5], 4, 2, head_dim, block_size, dtype, path="split")


@pytest.mark.gpu
def test_gpu_ragged_step_as_a_cuda_graph_replayed_with_other_mixes():
    """A ragged step captured once over PlanBuffers and replayed with three other mixes of the same
    maxima (8 sequences, 600 tokens): each replay equals an eager call of the step's own plan."""
    import cupy

    from cupy_paged.runtime.buffers import PlanBuffers

    mixes = [([100, 0, 2000, 50], [200, 1, 1, 4]), ([3000, 10, 0], [1, 1, 300]),
             ([500] * 8, [1] * 8), ([0, 7000, 20], [590, 1, 9])]
    kv_heads, heads, dim, batch, tokens = 2, 8, 128, 8, 600
    cache = PagedAttentionCache(1, kv_heads, dim, block_size=16, num_blocks=2048, dtype="bfloat16", device="cuda",
                                max_seqs=64, max_blocks_per_seq=512, enable_prefix_caching=False)
    ids = []
    for m, (cached, new) in enumerate(mixes):
        ids.append([(m, i) for i in range(len(new))])
        for seq, c, n in zip(ids[-1], cached, new):
            cache.allocate(seq, list(range(c + n)))
        cache.mark_computed(ids[-1], cached)
    rng = np.random.default_rng(23)
    for array in cache.layer(0):
        array[...] = cupy.asarray(randn(rng, array.shape, DTYPES["bfloat16"]))
    buffers = PlanBuffers(batch, tokens, cache.max_blocks_per_seq, device="cuda", query_group=heads // kv_heads)
    q, k, v = (cupy.asarray(randn(rng, (tokens, h, dim), DTYPES["bfloat16"])) for h in (heads, kv_heads, kv_heads))
    out = cupy.full((tokens, heads, dim), np.nan, DTYPES["bfloat16"])
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        plan = build_plan(cache, ids[0], mixes[0][1], num_heads=heads, path="ragged", buffers=buffers,
                          batch_size=batch, num_tokens=tokens)
        plan.attention(q, k, v, *cache.layer(0), out=out)  # eager warm-up: the workspace grows here
        stream.synchronize()
        stream.begin_capture()
        try:
            plan.attention(q, k, v, *cache.layer(0), out=out)
        finally:
            graph = stream.end_capture()
        for m, (cached, new) in enumerate(mixes[1:] + mixes[:1], start=1):
            m %= len(mixes)
            used = sum(new)
            for array in (q, k, v):
                array[...] = cupy.asarray(randn(rng, array.shape, DTYPES["bfloat16"]))
            out.fill(np.nan)
            build_plan(cache, ids[m], new, num_heads=heads, path="ragged", buffers=buffers, batch_size=batch,
                       num_tokens=tokens)
            graph.launch(stream=stream)
            stream.synchronize()
            eager = build_plan(cache, ids[m], new, num_heads=heads, path="ragged")
            want = eager.attention(q[:used], k[:used], v[:used], *cache.layer(0))
            stream.synchronize()
            assert_close(out[:used].get(), want.get().astype(np.float32), DTYPES["bfloat16"], f"mix {m}")


def test_scheduler_with_num_heads_plans_ragged_steps_and_checks_its_buffers():
    from cupy_paged import Scheduler
    from cupy_paged.runtime.buffers import PlanBuffers
    from cupy_paged.serving.scheduler import Request, SchedulerConfig

    cache = PagedAttentionCache(1, 2, 64, block_size=16, num_blocks=32, device="cpu")
    config = SchedulerConfig(max_batch_tokens=64, max_num_seqs=4)
    with pytest.raises(ValueError, match="query_group=4"):
        Scheduler(cache, config, buffers=PlanBuffers(4, 64, cache.max_blocks_per_seq), num_heads=8)
    scheduler = Scheduler(cache, config, buffers=PlanBuffers(4, 64, cache.max_blocks_per_seq, query_group=4),
                          num_heads=8)
    scheduler.add_request(Request("a", list(range(20)), 3))
    paths = []
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        paths.append(plan.path)
        assert plan.num_items == scheduler.buffers.work_capacity[0]
        scheduler.update(plan, [1] * len(plan.sample_requests))
    assert paths == ["ragged"] * 3
