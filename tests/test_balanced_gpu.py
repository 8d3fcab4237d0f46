"""Calls without host lengths balanced on the device: ``flash_attn_with_kvcache`` over a paged cache
(``kernels.decode.BalancedDecodeLaunch``) and ``flash_attn_varlen_func``'s short rows over a paged
cache (``VarlenLaunch.short_rows``), both on the ragged kernel with a work list that
the first CTA of the ragged launch to start builds from the device's lengths.

Against the CPU reference backend with NaN-poisoned outputs: long sequences among short ones (so
the list splits), empty and one-token sequences, every head dim, GQA ratios, block sizes, appends,
windows, softcap and ALiBi; the auto rule's choice; hostile lengths and block ids (holes, the error
word naming the argument); a CUDA graph replayed with other lengths.  Test ids containing
``sanitize`` are the compute-sanitizer subset.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

import cupy_paged
from _util import BF16, assert_close, assert_same_bits, poisoned, randn, scatter_paged, to_numpy
from test_decode_gpu import check, make_case, run_both

pytestmark = pytest.mark.gpu
F16 = np.dtype(np.float16)


@pytest.fixture
def balance(monkeypatch):
    """Set ``kernels.ragged.BALANCE`` for the test (the call memo forgets the launches chosen before)."""
    from cupy_paged.api._call import MEMO
    from cupy_paged.kernels import ragged

    def set_to(value):
        monkeypatch.setattr(ragged, "BALANCE", value)
        MEMO.clear()

    yield set_to
    MEMO.clear()


def check_decode(case, **options):
    """test_decode_gpu's check without the LSE (the balanced path takes no call that asks for one)."""
    return check(case, lse=False, **options)


def launch_of_last_call():
    from cupy_paged.api._call import MEMO

    return list(MEMO.values())[-1]


def device_list(launch) -> np.ndarray:
    """The items of the list the last device-listed launch on the current stream wrote (padding
    dropped); asserts that its hand-over ints (decode.cu wait_for_list) are zeros again (the
    ready word and the ticket; the mode word holds 0 or 1)."""
    import cupy

    from cupy_paged.kernels._workspace import _WORK_LISTS
    from cupy_paged.kernels.ragged import SYNC_INTS, WORK_INTS

    stream = cupy.cuda.get_current_stream().ptr
    current = _WORK_LISTS[(cupy.cuda.runtime.getDevice(), stream)]
    work, sync = launch._work_ptrs[stream]
    assert sync == current.data.ptr and work == sync + 4 * SYNC_INTS, "the launch used the stream's buffer"
    buffer = to_numpy(current)
    # the ready word and the ticket counter are zeros again; the third int keeps the last launch's
    # mode (direct or listed), which every launch writes before its release
    assert not buffer[:2].any(), "the hand-over ints must be zeros between launches"
    assert buffer[2] in (0, 1) and not buffer[3:SYNC_INTS].any()
    items = buffer[SYNC_INTS:SYNC_INTS + WORK_INTS * launch.max_items].reshape(-1, WORK_INTS)
    return items[items[:, 5] > 0]


# Lengths: one long sequence among short ones (split by the list), a long-tailed draw, empty ones.
MIXES = {
    "one-long": [9000] + [37] * 23,
    "lognormal": np.random.default_rng(3).lognormal(6.5, 1.2, 40).clip(0, 12000).astype(int).tolist(),
    "zeros-ones": [0, 1, 0, 5000, 1, 2, 15, 16, 17, 0],
    # more sequences than the builder's CTA has threads: each thread takes several in every pass
    "many": [7000] + np.random.default_rng(5).lognormal(4.0, 1.0, 299).clip(0, 600).astype(int).tolist(),
    # level, and enough sequences to fill about a wave of slots at every case: the list splits
    # nothing and each CTA makes its item itself (decode.cu direct_item)
    "level": np.random.default_rng(7).integers(300, 341, 150).tolist(),
}

# (id, dtype, head_dim, H, Hkv, block_size, seqlen_q, seqlen_new, options)
GRID = [
    ("sanitize-bf16-d128-gqa4-bs16", BF16, 128, 16, 4, 16, 1, 1, {"causal": True}),
    ("f16-d64-gqa8-bs32-noappend", F16, 64, 16, 2, 32, 1, 0, {}),
    ("bf16-d32-mha-bs8-sq2", BF16, 32, 4, 4, 8, 2, 2, {"causal": True}),
    ("f16-d96-gqa4-bs64-softcap", F16, 96, 8, 2, 64, 1, 1, {"softcap": 25.0}),
    ("bf16-d256-gqa2-bs256-window", BF16, 256, 4, 2, 256, 3, 3, {"causal": True, "window_size": (700, 0)}),
    ("sanitize-f16-d128-gqa4-bs16-sq4-alibi", F16, 128, 8, 2, 16, 4, 4, {"causal": True, "alibi": True}),
    ("bf16-d128-gqa8-bs128-sq4-2groups", BF16, 128, 16, 2, 128, 4, 0, {"causal": True}),
]


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("case_id,dtype,head_dim,num_heads,num_kv_heads,block_size,seqlen_q,seqlen_new,options",
                         GRID, ids=[g[0] for g in GRID])
def test_balanced_decode_matches_reference(balance, mix, case_id, dtype, head_dim, num_heads, num_kv_heads,
                                           block_size, seqlen_q, seqlen_new, options):
    from cupy_paged.kernels.decode import BalancedDecodeLaunch

    balance(True)
    rng = np.random.default_rng(zlib.crc32(f"{case_id}{mix}".encode()))
    seqlens = [max(n, seqlen_q - seqlen_new) for n in MIXES[mix]]  # every query token has its key
    case = make_case(rng, dtype, head_dim, num_heads, num_kv_heads, block_size, seqlens, seqlen_q, seqlen_new)
    options = dict(options)
    if options.pop("alibi", False):
        options["alibi_slopes"] = rng.uniform(0.01, 0.5, num_heads).astype(np.float32)
    check_decode(case, **options)
    launch = launch_of_last_call()
    assert isinstance(launch, BalancedDecodeLaunch)
    if mix == "level":
        assert (device_list(launch.balanced)[:, 3] == 1).all(), "a level batch splits nothing"


def test_auto_rule():
    """Without LSE, one or two full waves of sequences whose table can hold long ones take the
    balanced launch; a table of 128 keys, a small batch (the decode kernel splits it itself), more
    than two waves, an LSE or a forced split count keep the decode kernel."""
    import cupy

    from cupy_paged.api.decode import prepare_decode
    from cupy_paged.kernels import ragged
    from cupy_paged.kernels.decode import SMALL_TILES, balances, slots

    def problem(batch, capacity, **options):  # shapes only: the rule reads no values
        arrays = dict(q=cupy.empty((batch, 1, 32, 128), BF16), k_cache=cupy.empty((8, 16, 8, 128), BF16),
                      v_cache=cupy.empty((8, 16, 8, 128), BF16), k=cupy.empty((batch, 1, 8, 128), BF16),
                      v=cupy.empty((batch, 1, 8, 128), BF16), cache_seqlens=cupy.zeros(batch, np.int32),
                      block_table=cupy.zeros((batch, capacity // 16), np.int32))
        return prepare_decode(**arrays, **options)

    assert balances(problem(64, 4096))
    # ragged.BALANCE_MAX_WAVES waves of the decode kernel's small CTAs (one per sequence and kv head
    # here) take it; one sequence more does not (the wave read off this GPU)
    wave = slots(cupy.cuda.runtime.getDevice(), BF16, 128, SMALL_TILES[128])
    most = ragged.BALANCE_MAX_WAVES * wave // 8
    assert balances(problem(most, 2048))
    assert not balances(problem(most + 1, 2048))
    assert not balances(problem(64, 128))
    assert not balances(problem(4, 32768))
    assert not balances(problem(64, 4096, return_softmax_lse=True))
    assert not balances(problem(64, 4096, num_splits=1))


def test_tables_past_the_key_limit_keep_the_decode_kernel(monkeypatch):
    """The device list counts keys in 32 bits: a table whose rows hold ``ragged.MAX_LIST_KEYS`` keys or
    more never takes it, even when balancing is forced (the limit lowered here to a 4,096-key row)."""
    import cupy

    from cupy_paged.api.decode import prepare_decode
    from cupy_paged.kernels import ragged
    from cupy_paged.kernels.decode import balances

    arrays = dict(q=cupy.empty((64, 1, 32, 128), BF16), k_cache=cupy.empty((8, 16, 8, 128), BF16),
                  v_cache=cupy.empty((8, 16, 8, 128), BF16), cache_seqlens=cupy.zeros(64, np.int32),
                  block_table=cupy.zeros((64, 256), np.int32))
    for forced in (None, True):
        monkeypatch.setattr(ragged, "BALANCE", forced)
        monkeypatch.setattr(ragged, "MAX_LIST_KEYS", 4097)
        assert balances(prepare_decode(**arrays))
        monkeypatch.setattr(ragged, "MAX_LIST_KEYS", 4096)
        assert not balances(prepare_decode(**arrays))


def test_one_long_sequence_is_split_over_ctas(balance):
    """The list the device builds for one 20k-key sequence among 63 short ones splits the long one
    into ranges of about the batch's keys per CTA slot pair, and covers every sequence once."""
    import cupy

    balance(True)
    rng = np.random.default_rng(9)
    seqlens = [20_000] + [300] * 63
    case = make_case(rng, BF16, 128, 32, 8, 16, seqlens, 1, 1)
    check_decode(case, causal=True)
    launch = launch_of_last_call().balanced
    items = device_list(launch)
    stream = cupy.cuda.get_current_stream().ptr
    long_items = items[items[:, 0] == 0]
    assert len(long_items) > 4 and set(long_items[:, 2].tolist()) == set(range(len(long_items)))
    assert (long_items[:, 3] == len(long_items)).all()
    # The split CTA that merged each kv head's rows (merge_if_last) set its count back to zero.
    from cupy_paged.kernels._workspace import _MERGE_COUNTS

    current = _MERGE_COUNTS[(cupy.cuda.runtime.getDevice(), stream)]
    assert launch.ragged._split_ptrs[(stream, launch.max_slots)][2] == current.data.ptr
    assert not to_numpy(current).any()
    assert sorted(items[items[:, 0] != 0][:, 0].tolist()) == list(range(1, 64))
    assert items[0, 0] == 0, "the long sequence's items come first"


def test_a_sequence_split_the_most_times_merges_right(balance):
    """One 150k-key sequence among 31 of 100 keys at 8 / 2 heads: the rule splits it MAX_SPLITS
    times (128, four rounds of the merge's lanes), and the CTA that finishes last merges them all."""
    from cupy_paged.kernels.ragged import MAX_SPLITS

    balance(True)
    rng = np.random.default_rng(21)
    case = make_case(rng, BF16, 64, 8, 2, 16, [150_000] + [100] * 31, 1, 1)
    check_decode(case, causal=True)
    items = device_list(launch_of_last_call().balanced)
    long_items = items[items[:, 0] == 0]
    assert len(long_items) == MAX_SPLITS and (long_items[:, 3] == MAX_SPLITS).all()


@pytest.mark.parametrize("seed,batch,level", [(0, 48, False), (1, 48, False), (2, 300, False), (3, 64, True)])
def test_device_list_splits_as_the_host_rule(balance, seed, batch, level):
    """Each sequence's split count in the list the device writes equals the host rule's
    (runtime/_work.py plan_work) for the same lengths, slots and capacities: one rule, two builders.
    ``level``: 64 sequences of 576 to 640 keys at 16/4 heads (about one wave of slots, level enough
    that the rule splits none; the two-wave range alone would split each in two)."""
    import cupy

    from cupy_paged.kernels.ragged import slots_per_head, tile_keys
    from cupy_paged.runtime._work import plan_work

    balance(True)
    rng = np.random.default_rng(seed)
    seqlens = rng.lognormal(6.5, 1.3, batch).clip(0, 20_000).astype(int).tolist()
    if level:
        seqlens = rng.integers(576, 640, batch).tolist()
    case = make_case(rng, F16, 128, 16, 4, 16, seqlens, 1, 1)
    check_decode(case, causal=True)
    launch = launch_of_last_call().balanced
    per_head = slots_per_head(cupy.cuda.runtime.getDevice(), F16, 128, 4)
    query = np.ones(len(seqlens), np.int64)
    _, splits, *_ = plan_work(query, np.asarray(seqlens, np.int64), 4, tile_keys(128), per_head, launch.max_items,
                              launch.max_slots)
    items = device_list(launch)
    device = {int(b): int(n) for b, n in zip(items[:, 0], items[:, 3])}
    assert device == {b: int(n) for b, n in enumerate(splits)}
    assert not level or set(device.values()) == {1}


# Varlen short rows: query lengths 0 to 4 with 4 query heads per kv head (at most 16 rows); the last
# case has more sequences than the list builder's CTA has threads (several a thread in every pass).
@pytest.mark.parametrize("dtype,head_dim,num_heads,num_kv_heads,block_size,max_q,options,batch", [
    (BF16, 128, 16, 4, 16, 1, {"causal": True}, 30),
    (F16, 64, 8, 2, 32, 4, {"causal": True, "return_softmax_lse": True}, 30),
    (BF16, 256, 8, 8, 64, 2, {"softcap": 30.0, "window_size": (300, 0), "causal": True}, 30),
    (F16, 32, 16, 1, 8, 1, {"alibi": True, "return_softmax_lse": True}, 30),
    (BF16, 128, 32, 8, 16, 4, {"causal": True, "return_softmax_lse": True}, 300),
], ids=["sanitize-bf16-d128-decode", "f16-d64-sq4-lse", "bf16-d256-mha-window", "f16-d32-mqa16-alibi",
        "bf16-d128-sq4-300seqs"])
@pytest.mark.parametrize("balanced", [True, False], ids=["ragged", "varlen-kernel"])
def test_varlen_short_rows_match_reference(balance, monkeypatch, balanced, dtype, head_dim, num_heads, num_kv_heads,
                                           block_size, max_q, options, batch):
    import cupy

    from cupy_paged.kernels import ragged

    balance(None if balanced else False)
    runs = []
    real_run = ragged.DeviceListLaunch.run
    monkeypatch.setattr(ragged.DeviceListLaunch, "run", lambda self, *a: runs.append(1) or real_run(self, *a))
    rng = np.random.default_rng(zlib.crc32(f"{dtype}{head_dim}{max_q}{batch}".encode()))
    lens_q = rng.integers(1, max_q + 1, batch)
    lens_q[3] = 0
    lens_k = (rng.lognormal(6.0 if batch <= 30 else 4.5, 1.3, batch).clip(0, 9000).astype(np.int64) + lens_q)
    lens_k[0] = 9000
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = randn(rng, (int(cu_q[-1]), num_heads, head_dim), dtype)
    k = randn(rng, (int(cu_k[-1]), num_kv_heads, head_dim), dtype)
    v = randn(rng, (int(cu_k[-1]), num_kv_heads, head_dim), dtype)
    (k_cache, v_cache), table = scatter_paged(rng, [k, v], lens_k, block_size)
    options = dict(options)
    if options.pop("alibi", False):
        options["alibi_slopes"] = rng.uniform(0.01, 0.5, num_heads).astype(np.float32)
    args = (cu_q, cu_k, int(lens_q.max()), int(lens_k.max()))
    ref = cupy_paged.flash_attn_varlen_func(q, k_cache, v_cache, *args, block_table=table, **options)
    dev = [cupy.asarray(x) for x in (q, k_cache, v_cache, cu_q, cu_k)]
    dev_options = {n: cupy.asarray(x) if isinstance(x, np.ndarray) else x for n, x in options.items()}
    out = poisoned(q.shape, dtype, xp=cupy)
    got = cupy_paged.flash_attn_varlen_func(*dev[:3], dev[3], dev[4], *args[2:], block_table=cupy.asarray(table),
                                            out=out, **dev_options)
    if options.get("return_softmax_lse"):
        (ref, ref_lse), (got, lse) = ref, got
        assert_close(lse, ref_lse, np.float32, what="lse", rtol=2e-3)
    assert got is out
    assert_close(got, ref, dtype)
    assert bool(runs) == balanced, "the short-row path ran" if runs else "the short-row path did not run"


@pytest.mark.parametrize("margin", [0, 1], ids=["at-limit", "under-limit"])
def test_varlen_short_rows_past_the_key_limit_take_the_varlen_kernel(balance, monkeypatch, margin):
    """Short rows over a table whose rows hold ``ragged.MAX_LIST_KEYS`` keys (the limit lowered to the
    keys of this table's rows) take the varlen kernel, still right; with the limit one key higher they
    take the device list."""
    import cupy

    from cupy_paged.kernels import ragged

    balance(None)
    runs = []
    real_run = ragged.DeviceListLaunch.run
    monkeypatch.setattr(ragged.DeviceListLaunch, "run", lambda self, *a: runs.append(1) or real_run(self, *a))
    rng = np.random.default_rng(11)
    lens_q = np.ones(20, np.int64)
    lens_k = rng.integers(1, 9000, 20)
    lens_k[0] = 9000
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = randn(rng, (20, 16, 128), BF16)
    k = randn(rng, (int(cu_k[-1]), 4, 128), BF16)
    v = randn(rng, (int(cu_k[-1]), 4, 128), BF16)
    (k_cache, v_cache), table = scatter_paged(rng, [k, v], lens_k, 16)
    monkeypatch.setattr(ragged, "MAX_LIST_KEYS", table.shape[1] * 16 + margin)
    args = (cu_q, cu_k, 1, int(lens_k.max()))
    ref = cupy_paged.flash_attn_varlen_func(q, k_cache, v_cache, *args, block_table=table, causal=True)
    dev = [cupy.asarray(x) for x in (q, k_cache, v_cache, cu_q, cu_k)]
    got = cupy_paged.flash_attn_varlen_func(*dev[:3], dev[3], dev[4], *args[2:], block_table=cupy.asarray(table),
                                            causal=True)
    assert_close(got, ref, BF16)
    assert bool(runs) == bool(margin)


def test_each_threads_per_thread_default_stream_gets_its_own_buffers(balance):
    """Two host threads calling on ``cudaStreamPerThread`` (handle 2: a different stream in each
    thread) at once: each is right against the reference, and each thread's launch lists its work
    in a buffer of its own (one handle, two streams: a shared work list would be written by both)."""
    import threading

    import cupy

    from cupy_paged.kernels._workspace import _WORK_LISTS

    balance(True)
    rng = np.random.default_rng(43)
    cases = [make_case(rng, BF16, 128, 16, 4, 16, [3000] + [40] * 15, 1, 1) for _ in range(3)]
    check_decode(cases.pop(), causal=True)  # kernels loaded, the error word made, on the null stream
    results, both_alive = {}, threading.Barrier(2)

    def serve(i):
        with cupy.cuda.Stream.ptds:
            case = {name: cupy.asarray(value) if isinstance(value, np.ndarray) else value
                    for name, value in cases[i].items()}
            out = cupy_paged.flash_attn_with_kvcache(**case, causal=True)
            results[i] = (to_numpy(out), threading.get_ident())
            both_alive.wait(timeout=60)  # both threads alive: their idents differ

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    device = cupy.cuda.runtime.getDevice()
    buffers = {_WORK_LISTS[(device, (2, results[i][1]))].data.ptr for i in range(2)}
    assert len(buffers) == 2, "the two threads' per-thread streams shared one work-list buffer"
    for i in range(2):
        expected = cupy_paged.flash_attn_with_kvcache(**cases[i], causal=True)
        assert_close(results[i][0], expected, BF16)


def test_new_tokens_of_length_zero_append_nothing(balance):
    """k / v of shape [B, 0, Hkv, D] beside one query token: nothing appended, the cached keys attended."""
    balance(True)
    rng = np.random.default_rng(41)
    case = make_case(rng, BF16, 128, 16, 4, 16, [5000] + [60] * 20, 1, 0)
    case["k"] = np.zeros((21, 0, 4, 128), BF16)
    case["v"] = np.zeros((21, 0, 4, 128), BF16)
    check_decode(case, causal=True)


def test_capture_on_an_unprepared_stream_takes_the_decode_kernel(balance):
    """A balanced call captured on a stream no eager call has used (its work-list buffer and split
    workspace not sized: nothing may be allocated in a capture) launches the decode kernel instead;
    the replay equals an eager balanced call."""
    import cupy

    from cupy_paged.kernels.decode import BalancedDecodeLaunch

    balance(None)  # the default rule: 64 sequences x 4 kv heads, a full wave, take it
    rng = np.random.default_rng(43)
    case = make_case(rng, BF16, 128, 16, 4, 16, rng.integers(0, 3000, 64).tolist(), 1, 1)
    dev = {n: cupy.asarray(v) for n, v in case.items()}
    eager_k, eager_v = dev["k_cache"].copy(), dev["v_cache"].copy()
    eager = cupy_paged.flash_attn_with_kvcache(dev["q"], eager_k, eager_v, dev["k"], dev["v"],
                                              cache_seqlens=dev["cache_seqlens"], block_table=dev["block_table"],
                                              causal=True)
    assert isinstance(launch_of_last_call(), BalancedDecodeLaunch)
    stream = cupy.cuda.Stream(non_blocking=True)
    out = cupy.empty_like(eager)
    with stream:
        stream.begin_capture()
        cupy_paged.flash_attn_with_kvcache(dev["q"], dev["k_cache"], dev["v_cache"], dev["k"], dev["v"],
                                           cache_seqlens=dev["cache_seqlens"], block_table=dev["block_table"],
                                           causal=True, out=out)
        graph = stream.end_capture()
        graph.launch(stream=stream)
        stream.synchronize()
    assert_close(out, to_numpy(eager), BF16)
    assert_same_bits(dev["k_cache"], eager_k, "k_cache after the replayed append")


def test_sanitize_hostile_lengths_and_ids(balance):
    """Device lengths past the table, a negative length and block ids outside the cache in a
    balanced decode call, then a decreasing cu_seqlens_q in a short-row varlen call: no fault, the
    good sequences right, and check_errors naming the argument."""
    import cupy

    balance(True)
    cupy_paged.check_errors()
    rng = np.random.default_rng(77)
    seqlens = [3000, 40, 40, 40, 200, 10]
    case = make_case(rng, F16, 64, 8, 2, 16, seqlens, 1, 1)
    (ref, _, _, _), _ = run_both(case, lse=False, causal=True)
    bad = dict(case, cache_seqlens=case["cache_seqlens"].copy(), block_table=case["block_table"].copy())
    bad["cache_seqlens"][1] = 100_000   # past its table row
    bad["cache_seqlens"][2] = -5
    bad["block_table"][3, 0] = 1 << 20  # outside the cache
    dev = {name: cupy.asarray(value) for name, value in bad.items()}
    out = poisoned(case["q"].shape, F16, xp=cupy)
    cupy_paged.flash_attn_with_kvcache(**dev, causal=True, out=out)
    good = [0, 4, 5]
    assert_close(to_numpy(out)[good], ref[good], F16)
    with pytest.raises(ValueError, match="cache_seqlens|block_table"):
        cupy_paged.check_errors()

    lens = np.array([1, 1, 1, 1])
    cu_q = cupy.asarray(np.array([0, 1, 3, 2, 4], np.int32))  # decreases at sequence 2
    cu_k = cupy.asarray(np.array([0, 50, 100, 150, 200], np.int32))
    q = cupy.asarray(randn(rng, (4, 8, 64), F16))
    (k_cache, v_cache), table = scatter_paged(rng, [randn(rng, (200, 2, 64), F16)] * 2, [50] * 4, 16)
    cupy_paged.flash_attn_varlen_func(q, cupy.asarray(k_cache), cupy.asarray(v_cache), cu_q, cu_k, int(lens.max()),
                                      50, block_table=cupy.asarray(table), causal=True)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        cupy_paged.check_errors()


def test_cuda_graph_of_a_balanced_call_replays_other_lengths(balance):
    """A balanced decode call captured once (one launch: list, attention, merge) and replayed with
    three other sets of lengths equals eager calls with those lengths, bitwise, caches included."""
    import cupy

    balance(True)
    rng = np.random.default_rng(31)
    batch, capacity = 24, 12_000
    full = make_case(rng, BF16, 128, 16, 4, 16, [capacity] * batch, 1, 1)
    length_sets = [rng.integers(0, capacity, batch) for _ in range(4)]
    for lengths in length_sets[1:]:
        lengths[rng.integers(batch)] = capacity - 1  # one long sequence: split

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        static = {n: cupy.asarray(full[n]) for n in ("q", "k", "v", "block_table")}
        static["cache_seqlens"] = cupy.asarray(length_sets[0].astype(np.int32))
        graph_k, graph_v = cupy.asarray(full["k_cache"]), cupy.asarray(full["v_cache"])
        eager_k, eager_v = graph_k.copy(), graph_v.copy()
        out = cupy.empty(full["q"].shape, BF16)

        def call(k_cache, v_cache, result, **arrays):
            return cupy_paged.flash_attn_with_kvcache(arrays["q"], k_cache, v_cache, arrays["k"], arrays["v"],
                                                     cache_seqlens=arrays["cache_seqlens"],
                                                     block_table=arrays["block_table"], causal=True, out=result)

        call(graph_k.copy(), graph_v.copy(), cupy.empty_like(out), **static)  # warm-up: sizes the buffers
        stream.begin_capture()
        call(graph_k, graph_v, out, **static)
        graph = stream.end_capture()
        for lengths in length_sets[1:]:
            static["cache_seqlens"][...] = cupy.asarray(lengths.astype(np.int32))
            graph.launch(stream=stream)
            eager_out = poisoned(full["q"].shape, BF16, xp=cupy)
            call(eager_k, eager_v, eager_out, **dict(static, cache_seqlens=cupy.asarray(lengths.astype(np.int32))))
            stream.synchronize()
            assert_same_bits(out, eager_out, "graph out")
        assert_same_bits(graph_k, eager_k, "graph k_cache")
