"""PagedAttentionCache: storage, allocation, fork/copy-on-write, prefix caching, update().

The state machines at the end drive thousands of random allocate / grow / compute /
fork / free / preempt steps, and random requests through the scheduler (abort, parallel
samples, rollback), and check every invariant of the cache after each.
"""
import ctypes

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import cupy_paged.serving._storage
from cupy_paged import write_kv_cache
from cupy_paged.serving.kv_cache import CacheFull, PagedAttentionCache
from cupy_paged.runtime.buffers import PlanBuffers
from cupy_paged.runtime.plan import build_plan
from cupy_paged.runtime.scheduler import Scheduler
from cupy_paged.serving.scheduler import Request, RequestStatus, SamplingParams, SchedulerConfig
from cupy_paged.reference._attend import gather_paged


def small_cache(num_blocks=8, block_size=8, layers=2, **kwargs):
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("device", "cpu")
    return PagedAttentionCache(layers, 1, 32, block_size=block_size, num_blocks=num_blocks, **kwargs)


def bookkeeping(cache: PagedAttentionCache):
    """Everything an operation may change, to compare before and after a failed call."""
    pool = cache.pool
    return [pool.ref_counts.copy(), pool.num_free, pool.num_cached, list(pool._free),
            list(cache.prefix_cache._unowned),
            cache.tables.copy(), cache._num_slots.copy(), cache._num_computed.copy(), dict(cache._row_of),
            cache.kv.copy()]


def assert_same(before, after):
    for x, y in zip(before, after, strict=True):
        assert np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y


def content(tokens, positions, layer):
    """What a token's K (V is its negative) holds in this test: a function of its whole prefix."""
    return np.array([float(hash(tuple(tokens[:p + 1])) % (1 << 20) + layer) for p in positions], np.float32)


def write_computed(cache, seq_id, tokens):
    """Do a step's cache writes for ``seq_id`` through ``update`` and mark them computed."""
    start, stop = cache.num_computed(seq_id), cache.num_slots(seq_id)
    slots = cache.slot_mapping([seq_id])
    for layer in range(cache.num_layers):
        values = np.broadcast_to(content(tokens, range(start, stop), layer)[:, None, None],
                                 (stop - start, cache.num_kv_heads, cache.head_dim))
        cache.update(values, -values, layer, read_index=slots, write_index=slots)
    cache.mark_computed([seq_id], [stop])


def stored(cache, seq_id, layer):
    """K and V of every computed position of ``seq_id`` read back through the block table."""
    table_row, count = cache.block_table([seq_id])[0], cache.num_computed(seq_id)
    return tuple(gather_paged(c, table_row, count) for c in cache.layer(layer))


def assert_content(cache, seq_id, tokens):
    for layer in range(cache.num_layers):
        keys, values = stored(cache, seq_id, layer)
        expected = content(tokens, range(cache.num_computed(seq_id)), layer)
        assert (keys == expected[:, None, None]).all(), f"{seq_id}: keys of layer {layer} were overwritten"
        assert (values == -expected[:, None, None]).all()


# --------------------------------------------------------------------------- storage

def test_layers_are_contiguous_views_of_one_storage():
    cache = small_cache(num_blocks=5, layers=3)
    k_cache, v_cache = cache.layer(2)
    assert k_cache.shape == v_cache.shape == (5, 8, 1, 32) and k_cache.flags.c_contiguous
    k_cache[1, 2] = 7.0
    assert (cache.kv[2, 0, 1, 2] == 7.0).all() and (cache.kv[2, 1] == 0).all()
    with pytest.raises(IndexError, match=r"layer_idx must be in \[0, 3\)"):
        cache.layer(3)


def test_layers_go_through_dlpack_without_a_copy():
    cache = small_cache()
    k_cache, _ = cache.layer(0)
    other = np.from_dlpack(k_cache)
    other[0, 0] = 3.0
    assert (cache.kv[0, 0, 0, 0] == 3.0).all()
    capsules = cache.to_dlpack(1)
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    assert [get_name(c) for c in capsules] == [b"dltensor", b"dltensor"]


def test_sized_by_a_fraction_of_free_memory(monkeypatch):
    monkeypatch.setattr(cupy_paged.serving._storage, "free_memory_bytes", lambda device: 10_000_000)
    cache = PagedAttentionCache(4, 2, 64, block_size=16, memory_fraction=0.5, dtype="float16", device="cpu")
    assert cache.bytes_per_block == 2 * 4 * 16 * 2 * 64 * 2
    assert cache.num_blocks == 5_000_000 // cache.bytes_per_block
    assert cache.kv.nbytes <= 5_000_000


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(num_blocks=4, memory_fraction=0.1), ValueError, "exactly one of num_blocks and memory_fraction"),
    (dict(), ValueError, "exactly one of num_blocks and memory_fraction"),
    (dict(memory_fraction=1.5), ValueError, r"memory_fraction must be in \(0, 1\]"),
    (dict(num_blocks=0), ValueError, "num_blocks must be >= 1"),
    (dict(num_blocks=4, block_size=12), ValueError, "block_size 12 is not supported"),
    (dict(num_blocks=4, dtype="int8"), TypeError, "dtype must be one of"),
    (dict(num_blocks=4, device="tpu"), ValueError, "device must be 'cpu' or 'cuda'"),
])
def test_bad_construction(kwargs, error, match):
    kwargs.setdefault("device", "cpu")
    with pytest.raises(error, match=match):
        PagedAttentionCache(1, 1, 32, **kwargs)


def test_any_positive_head_dim_is_stored():
    """Which head dims the kernels run is not the cache's business: it stores any."""
    cache = PagedAttentionCache(1, 1, 48, block_size=8, num_blocks=4, device="cpu")
    assert cache.layer(0)[0].shape == (4, 8, 1, 48)
    with pytest.raises(ValueError, match="head_dim must be >= 1"):
        PagedAttentionCache(1, 1, 0, num_blocks=4, device="cpu")


# --------------------------------------------------------------------------- allocation

def test_decode_example_block_table():
    """Key lengths [30, 32, 70], block size 32, at most 4 blocks a sequence, blocks handed out
    out of order: the block table and slots of the worked decode example."""
    cache = small_cache(num_blocks=8, block_size=32, max_blocks_per_seq=4, enable_prefix_caching=False)
    cache.allocate("s1", list(range(64)), num_new_tokens=32)  # block 0
    cache.grow(["s1"], 1)  # block 1: 32 + 1 > 32
    cache.allocate("s0", list(range(31)), num_new_tokens=31)  # block 2: 30 + 1 <= 32
    cache.allocate("s2", list(range(71)), num_new_tokens=32)  # block 3
    cache.allocate("gap", [0])  # block 4
    cache.grow(["s2"], 32)  # block 5
    cache.grow(["s2"], 7)  # block 6
    cache.free("gap")
    cache.mark_computed(["s0", "s1", "s2"], [30, 32, 70])
    seqs = ["s0", "s1", "s2"]
    assert cache.num_computed_batch(seqs).tolist() == [30, 32, 70]
    view = cache.plan_view(cache.rows(seqs))
    assert view.num_computed.tolist() == [30, 32, 70] and view.num_slots.tolist() == [31, 33, 71]
    assert cache.block_table(seqs, width=4).tolist() == [[2, -1, -1, -1], [0, 1, -1, -1], [3, 5, 6, -1]]
    buffers = PlanBuffers(4, 4, cache.max_blocks_per_seq)
    plan = build_plan(cache, seqs, 1, buffers=buffers)
    assert plan.path == "decode" and plan.cache_seqlens.tolist() == [30, 32, 70]
    assert plan.block_table.tolist() == [[2, -1, -1, -1], [0, 1, -1, -1], [3, 5, 6, -1]]
    assert plan.slot_mapping.tolist() == [2 * 32 + 30, 1 * 32 + 0, 6 * 32 + 6]


def test_allocate_reserves_whole_blocks_and_chunks():
    cache = small_cache(num_blocks=6)
    assert cache.allocate("a", list(range(20)), num_new_tokens=9) == 0
    assert cache.num_slots("a") == 9 and cache.blocks("a").tolist() == [0, 1]
    assert cache.slot_mapping(["a"]).tolist() == list(range(9))
    cache.mark_computed(["a"], [9])
    cache.grow(["a"], 11)
    assert cache.blocks("a").tolist() == [0, 1, 2] and cache.slot_mapping(["a"]).tolist() == list(range(9, 20))
    with pytest.raises(ValueError, match="already in the cache"):
        cache.allocate("a", [1])
    with pytest.raises(ValueError, match=r"num_new_tokens must be in \[0, 12\] \(20 tokens, 8 cached\)"):
        cache.allocate("b", list(range(20)), num_new_tokens=21)


def test_failed_allocate_and_grow_change_nothing():
    cache = small_cache(num_blocks=4)
    cache.allocate("a", list(range(20)))
    cache.mark_computed(["a"], [20])
    cache.allocate("b", list(range(100, 108)))
    before = bookkeeping(cache)
    with pytest.raises(CacheFull, match="need 2 free blocks"):
        cache.allocate("c", list(range(200, 216)))
    assert_same(before, bookkeeping(cache))
    with pytest.raises(CacheFull):
        cache.grow(["a", "b"], [5, 1])  # a fits in its last block, b needs one, one too many with a's
    assert_same(before, bookkeeping(cache))
    with pytest.raises(CacheFull, match=r"\+2 kept in reserve"):
        cache.allocate("c", [1], reserve=2)
    assert_same(before, bookkeeping(cache))
    # A prefix hit on cached free blocks takes them out of the free count as well.
    cache.free("a")
    cache.allocate("x", list(range(300, 316)))
    before = bookkeeping(cache)
    with pytest.raises(CacheFull):
        cache.allocate("c", list(range(20)) + [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert_same(before, bookkeeping(cache))


def test_decode_grow_takes_the_general_paths_blocks():
    """``grow(ids, 1)``'s one numba pass (new blocks popped off the free stack) leaves the cache as
    the general growth does: from plain free blocks, from evicted cached ones once those run out,
    with a reserve, and a CacheFull that changes nothing."""
    def build():
        cache = small_cache(num_blocks=12)
        for name, n in (("old", 24), ("a", 8), ("b", 15), ("c", 24)):
            cache.allocate(name, list(range(100 * len(name) + n, 100 * len(name) + 2 * n)))
            cache.mark_computed([name])
        cache.free("old")  # three cached free blocks
        return cache

    fast, general = build(), build()
    live, seen = ["a", "b", "c"], set()
    for step in range(12):
        before, cached = bookkeeping(fast), fast.pool.num_cached
        outcomes = []
        for cache, counts in ((fast, 1), (general, [1] * len(live))):
            try:
                cache.grow(live, counts, reserve=int(step % 3 == 2))
                cache.mark_computed(live)
                outcomes.append("grew")
            except CacheFull:
                outcomes.append("full")
        assert outcomes[0] == outcomes[1]
        assert_same(bookkeeping(fast), bookkeeping(general))
        if outcomes[0] == "full":
            assert_same(before, bookkeeping(fast))
            for cache in (fast, general):
                cache.free(live[-1])
            live.pop()
        else:
            seen.add("evicted" if fast.pool.num_cached < cached else "grew")
        if not live:
            break
        if fast.num_free_blocks >= len(live):  # a few more tokens each, so blocks fill at other steps
            for cache in (fast, general):
                cache.grow(live, 3)
                cache.mark_computed(live)
    assert seen == {"grew", "evicted"} and len(live) < 3  # every kind of step happened


def test_grow_checks_its_arguments():
    cache = small_cache(num_blocks=4, max_blocks_per_seq=2)
    cache.allocate("a", [1, 2])
    with pytest.raises(ValueError, match="distinct"):
        cache.grow(["a", "a"], 1)
    with pytest.raises(ValueError, match="max_seq_len = 16"):
        cache.grow(["a"], 15)
    with pytest.raises(ValueError, match="num_new_tokens must be >= 0"):
        cache.grow(["a"], -1)
    with pytest.raises(ValueError, match="reserve must be >= 0"):
        cache.grow(["a"], 1, reserve=-1)  # the decode path's check too
    with pytest.raises(KeyError, match="'zz' is not in the cache"):
        cache.grow(["zz"], 1)
    with pytest.raises(ValueError, match=r"num_computed .* must be in \[0, 2\]"):
        cache.mark_computed(["a"], [3])


def test_rows_grow_past_max_seqs_and_are_reused():
    cache = small_cache(num_blocks=16, max_seqs=2)
    for i in range(5):
        cache.allocate(i, [i])
    assert len(cache) == 5 and cache.tables.shape[0] >= 5
    assert sorted(cache.block_table(range(5))[:, 0].tolist()) == list(range(5))
    row = cache.rows([2])[0]
    cache.free(2)
    assert (cache.tables[row] == -1).all()
    cache.allocate("new", [9, 9])
    assert cache.rows(["new"])[0] == row and len(set(cache.rows(cache.seq_ids()).tolist())) == 5


def test_free_returns_every_block():
    cache = small_cache(num_blocks=6)
    cache.allocate("a", list(range(30)))
    cache.allocate("b", list(range(9)))
    assert cache.num_free_blocks == 6 - 4 - 2
    cache.free("a")
    cache.free("b")
    assert cache.num_free_blocks == 6 and len(cache) == 0 and (cache.pool.ref_counts == 0).all()


# --------------------------------------------------------------------------- fork and copy-on-write

def test_fork_shares_blocks_and_copies_the_partial_one_on_write():
    cache = small_cache(num_blocks=8)
    tokens = list(range(12))
    cache.allocate("p", tokens)
    write_computed(cache, "p", tokens)
    cache.fork("p", "c")
    assert cache.blocks("c").tolist() == cache.blocks("p").tolist() == [0, 1]
    assert cache.pool.ref_counts[:2].tolist() == [2, 2]
    child = cache._tokens[cache.rows(["c"])[0]]
    child.append(100)
    cache.grow(["c"], 1)  # writes into shared block 1 (4 of 8 used): the child copies it
    assert cache.blocks("c").tolist() == [0, 2] and cache.pool.ref_counts[:3].tolist() == [2, 1, 1]
    assert_content(cache, "c", child)
    write_computed(cache, "c", child)
    assert_content(cache, "p", tokens)
    tokens.append(200)
    cache.grow(["p"], 1)  # the parent now owns block 1 alone: no copy
    assert cache.blocks("p").tolist() == [0, 1]
    write_computed(cache, "p", tokens)
    assert_content(cache, "p", tokens)
    assert_content(cache, "c", child)


def test_copy_on_write_of_many_sequences_is_one_copy(monkeypatch):
    cache = small_cache(num_blocks=16)
    for i in range(3):
        cache.allocate(i, list(range(10 * i, 10 * i + 5)))
        cache.mark_computed([i], [5])
        cache.fork(i, f"child{i}")
    calls = []
    original = cache.copy_blocks
    monkeypatch.setattr(cache, "copy_blocks", lambda src, dst: (calls.append((list(src), list(dst))),
                                                                 original(src, dst)))
    cache.grow([0, 1, 2, "child0"], 1)
    # 0 and child0 both write into block 0, its only owners: 0 keeps it, child0 copies it.
    assert len(calls) == 1 and sorted(calls[0][0]) == [0, 1, 2]
    assert cache.blocks(0)[0] == 0 and cache.blocks("child1")[0] == 1 and cache.blocks("child2")[0] == 2
    assert (cache.pool.ref_counts[:6] == 1).all() and cache.num_free_blocks == 16 - 6


def test_fork_needs_computed_slots():
    cache = small_cache()
    cache.allocate("p", list(range(5)))
    with pytest.raises(ValueError, match="fork it after mark_computed"):
        cache.fork("p", "c")
    cache.mark_computed(["p"], [5])
    cache.fork("p", "c")
    with pytest.raises(ValueError, match="already in the cache"):
        cache.fork("p", "c")


def test_blocks_needed_counts_copy_on_write():
    cache = small_cache()
    cache.allocate("p", list(range(5)))
    cache.mark_computed(["p"], [5])
    cache.fork("p", "c")
    assert cache.blocks_needed(["p"], [1]) == 1  # the copy
    assert cache.blocks_needed(["p"], [4]) == 2  # the copy and one more block
    assert cache.blocks_needed(["p"], [0]) == 0


# --------------------------------------------------------------------------- prefix caching

def test_prefix_hit_returns_the_same_blocks_and_content():
    cache = small_cache(num_blocks=8)
    prompt = list(range(20))
    cache.allocate("a", prompt)
    write_computed(cache, "a", prompt)
    assert cache.pool.num_cached == 2  # two full blocks
    other = prompt[:16] + [99, 98]
    assert cache.num_cached_tokens(other) == 16
    assert cache.allocate("b", other) == 16
    assert cache.blocks("b")[:2].tolist() == cache.blocks("a")[:2].tolist()
    assert cache.num_computed("b") == 16 and cache.slot_mapping(["b"]).size == 2
    assert_content(cache, "b", other)
    # The last token is always recomputed, so a fully cached prompt still yields logits.
    assert cache.num_cached_tokens(prompt[:16]) == 8


def test_prefix_survives_free_and_is_evicted_oldest_first():
    cache = small_cache(num_blocks=4)
    old, new = list(range(9)), list(range(100, 109))
    for seq, tokens in (("old", old), ("new", new)):
        cache.allocate(seq, tokens)
        write_computed(cache, seq, tokens)
    cache.free("old")
    cache.free("new")
    assert cache.num_free_blocks == 4 and cache.pool.num_cached == 2
    cache.allocate("filler", list(range(500, 524)))  # 3 blocks: 2 plain free, then one eviction
    assert cache.num_cached_tokens(old) == 0
    assert cache.num_cached_tokens(new) == 8


def test_a_changed_token_breaks_the_chain():
    cache = small_cache(num_blocks=8)
    prompt = list(range(30))
    cache.allocate("a", prompt)
    cache.mark_computed(["a"], [30])
    changed = list(prompt)
    changed[3] = -1
    assert cache.num_cached_tokens(changed) == 0  # block 0 differs, so blocks 1 and 2 cannot match
    changed = list(prompt)
    changed[12] = -1
    assert cache.num_cached_tokens(changed) == 8


def test_prefix_caching_can_be_disabled():
    cache = small_cache(num_blocks=8, enable_prefix_caching=False)
    cache.allocate("a", list(range(20)))
    cache.mark_computed(["a"], [20])
    assert cache.pool.num_cached == 0 and cache.num_cached_tokens(list(range(20))) == 0


# --------------------------------------------------------------------------- update (manual path)

def test_update_matches_write_kv_cache_and_gathers():
    rng = np.random.default_rng(0)
    cache = small_cache(num_blocks=4, layers=2)
    reference = small_cache(num_blocks=4, layers=2)
    keys = rng.standard_normal((5, 1, 32)).astype(np.float32)
    values = rng.standard_normal((5, 1, 32)).astype(np.float32)
    write = np.array([3, 17, 8, 30, 0], np.int32)
    read = np.array([30, 3, 3, 9], np.int64)
    k, v = cache.update(keys[None], values[None], 1, read, write)
    write_kv_cache(*reference.layer(1), keys, values, write)
    assert np.array_equal(cache.kv, reference.kv)
    assert k.shape == (1, 4, 1, 32)
    assert np.array_equal(k[0], keys[[3, 0, 0]].tolist() + [np.zeros((1, 32), np.float32)])
    assert np.array_equal(v[0, :3], values[[3, 0, 0]])


@pytest.mark.parametrize("read, write, match", [
    (np.array([0]), np.array([0, 1, 2]), "write_index must be a 1-D integer array of num_new = 2"),
    (np.array([0]), np.array([0, 32]), r"write_index holds slots outside \[0, 32\)"),
    (np.array([-1]), np.array([0, 1]), r"read_index holds slots outside"),
    (np.array([0.5]), np.array([0, 1]), "read_index must be a 1-D integer array"),
])
def test_update_rejects_bad_indices(read, write, match):
    cache = small_cache(num_blocks=4, layers=1)
    with pytest.raises(ValueError, match=match):
        cache.update(np.zeros((2, 1, 32), np.float32), np.zeros((2, 1, 32), np.float32), 0, read, write)


def test_update_rejects_bad_shapes():
    cache = small_cache(num_blocks=4, layers=1)
    with pytest.raises(ValueError, match=r"key_states must have shape \[num_new, num_kv_heads = 1, head_dim = 32\]"):
        cache.update(np.zeros((2, 2, 32), np.float32), np.zeros((2, 2, 32), np.float32), 0, [0], [0, 1])
    with pytest.raises(ValueError, match="value_states must have the shape of key_states"):
        cache.update(np.zeros((2, 1, 32), np.float32), np.zeros((3, 1, 32), np.float32), 0, [0], [0, 1])


# --------------------------------------------------------------------------- the state machine

BLOCK = 8
NUM_BLOCKS = 14
# Prompts start with one of these, so prefix hits (and near misses) are common.
STEMS = [list(range(1, 21)), list(range(1, 9)) + [9] * 12, [7] * 20]


class CacheMachine(RuleBasedStateMachine):
    """Random allocate / grow / compute / fork / free / preempt against the invariants."""

    def __init__(self):
        super().__init__()
        self.cache = PagedAttentionCache(2, 1, 32, block_size=BLOCK, num_blocks=NUM_BLOCKS, dtype="float32",
                                         device="cpu", max_seqs=2, max_blocks_per_seq=6)
        self.tokens: dict[int, list] = {}
        self.next_id = 0

    @initialize(stem=st.sampled_from(STEMS))
    def computed_prompt(self, stem):
        """Start with one computed prompt, so prefix hits and forks come early."""
        self.tokens[0] = list(stem)
        self.next_id = 1
        self.cache.allocate(0, self.tokens[0])
        write_computed(self.cache, 0, self.tokens[0])

    def _try(self, action):
        before = bookkeeping(self.cache)
        try:
            action()
            return True
        except CacheFull:
            event("CacheFull")
            assert_same(before, bookkeeping(self.cache))
            return False

    @precondition(lambda self: len(self.tokens) < 6)
    @rule(stem=st.sampled_from(STEMS), keep=st.integers(0, 20), tail=st.lists(st.integers(0, 3), max_size=12),
          chunk=st.floats(0, 1))
    def allocate(self, stem, keep, tail, chunk):
        tokens = stem[:keep] + tail or [0]
        seq = self.next_id
        cached = self.cache.num_cached_tokens(tokens)
        new = round(chunk * (len(tokens) - cached))
        if self._try(lambda: self.cache.allocate(seq, tokens, new)):
            self.next_id += 1
            self.tokens[seq] = tokens
            assert self.cache.num_computed(seq) == cached and cached % BLOCK == 0 and cached < len(tokens)
            event("prefix hit" if cached else "prefix miss")
            assert_content(self.cache, seq, tokens)  # a prefix hit returns the content it promised

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), count=st.integers(0, 12))
    def grow(self, data, count):
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1, max_size=3, unique=True))
        counts = [min(count, self.cache.max_seq_len - self.cache.num_slots(s)) for s in seqs]
        if self.cache.blocks_needed(seqs, counts) > sum(-(-(self.cache.num_slots(s) + n) // BLOCK)
                                                        - self.cache.blocks(s).size for s, n in zip(seqs, counts)):
            event("copy-on-write")
        for seq, n in zip(seqs, counts):
            tokens = self.tokens[seq]
            tokens.extend([n % 4] * max(0, self.cache.num_slots(seq) + n - len(tokens)))
        self._try(lambda: self.cache.grow(seqs, counts))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def compute(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        write_computed(self.cache, seq, self.tokens[seq])

    @precondition(lambda self: self.tokens and len(self.tokens) < 6)
    @rule(data=st.data())
    def fork(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        if self.cache.num_computed(seq) == self.cache.num_slots(seq):
            self.cache.fork(seq, self.next_id)
            self.tokens[self.next_id] = self.cache._tokens[self.cache.rows([self.next_id])[0]]
            self.next_id += 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.cache.free(seq)
        del self.tokens[seq]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def preempt_and_recompute(self, data):
        """Drop a sequence's blocks and start it again from its tokens, as the scheduler does."""
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens.pop(seq)[:max(1, self.cache.num_computed(seq))]
        self.cache.free(seq)
        if self._try(lambda: self.cache.allocate(seq, tokens)):
            self.tokens[seq] = tokens
            assert_content(self.cache, seq, tokens)

    @invariant()
    def blocks_are_accounted_for(self):
        cache, pool = self.cache, self.cache.pool
        owners = np.zeros(NUM_BLOCKS, np.int64)
        holders: dict[int, list] = {}
        for seq in self.tokens:
            blocks = cache.blocks(seq)
            assert len(set(blocks.tolist())) == blocks.size, "a sequence holds a block twice"
            assert blocks.size == -(-cache.num_slots(seq) // BLOCK)
            assert cache.num_computed(seq) <= cache.num_slots(seq)
            owners[blocks] += 1
            for j, block in enumerate(blocks.tolist()):
                holders.setdefault(block, []).append((seq, j))
        assert np.array_equal(pool.ref_counts, owners), "reference counts differ from the owners"
        assert pool.num_free + int((owners > 0).sum()) == NUM_BLOCKS
        # A block held twice is shared on purpose: same place in both sequences, same tokens.
        for block, places in holders.items():
            (seq, j), rest = places[0], places[1:]
            for other, k in rest:
                assert j == k, f"block {block} sits at different places in {seq} and {other}"
                end = min(cache.num_slots(seq), cache.num_slots(other), (j + 1) * BLOCK)
                assert self.tokens[seq][j * BLOCK:end] == self.tokens[other][j * BLOCK:end]

    @invariant()
    def written_content_is_intact(self):
        for seq, tokens in self.tokens.items():
            assert_content(self.cache, seq, tokens)

    def teardown(self):
        for seq in list(self.tokens):
            self.cache.free(seq)
        assert self.cache.num_free_blocks == NUM_BLOCKS and (self.cache.pool.ref_counts == 0).all()
        assert len(self.cache) == 0


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=120, stateful_step_count=50, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------- the scheduler's state machine

class SchedulerMachine(RuleBasedStateMachine):
    """Random requests (several stop ids, n parallel samples, priorities) through the scheduler over a
    small cache, with abort at any point (also between schedule and update) and rolled-back steps;
    every step writes each new token's K/V, and the invariants check blocks and content."""

    def __init__(self):
        super().__init__()
        self.cache = PagedAttentionCache(2, 1, 32, block_size=BLOCK, num_blocks=NUM_BLOCKS, dtype="float32",
                                         device="cpu", max_seqs=2, max_blocks_per_seq=6)
        self.scheduler = Scheduler(self.cache, SchedulerConfig(max_batch_tokens=24, max_num_seqs=4,
                                                               max_prefill_chunk=10, admission_margin=0.0))
        self.requests: list = []
        self.next_id = 0

    def _write_step(self, plan):
        """The forward pass's cache writes: every new token's K/V, a function of its prefix."""
        for b, seq in enumerate(plan.seq_ids):
            tokens = self.scheduler._live[seq].token_ids
            start, stop = int(plan.cu_seqlens_q[b]), int(plan.cu_seqlens_q[b + 1])
            positions = plan.positions[start:stop].tolist()
            slots = plan.slot_mapping[start:stop]
            for layer in range(self.cache.num_layers):
                values = np.broadcast_to(content(tokens, positions, layer)[:, None, None],
                                         (len(positions), 1, self.cache.head_dim))
                self.cache.update(values, -values, layer, read_index=slots, write_index=slots)

    @precondition(lambda self: len(self.scheduler._live) < 8)
    @rule(stem=st.sampled_from(STEMS), keep=st.integers(0, 20), tail=st.lists(st.integers(0, 3), max_size=6),
          new=st.integers(1, 8), n=st.integers(1, 3), priority=st.integers(0, 2),
          stops=st.sets(st.integers(0, 4), max_size=2))
    def add(self, stem, keep, tail, new, n, priority, stops):
        prompt = (stem[:keep] + tail or [0])[:self.cache.max_seq_len - new]
        request = Request(self.next_id, prompt, new, eos_token_id=sorted(stops) or None,
                          sampling=SamplingParams(n=n), priority=priority)
        self.next_id += 1
        self.scheduler.add_request(request)
        self.requests.extend(request.branches)
        event(f"n={n}")

    @precondition(lambda self: self.scheduler.has_unfinished())
    @rule(data=st.data(), abort_in_flight=st.booleans())
    def step(self, data, abort_in_flight):
        plan = self.scheduler.schedule()
        assert plan is not None, "requests are left but nothing could be scheduled"
        self._write_step(plan)
        if abort_in_flight:
            live = sorted(self.scheduler._live, key=repr)
            self.scheduler.abort([data.draw(st.sampled_from(live))])
            event("abort in flight")
        tokens = data.draw(st.lists(st.integers(0, 5), min_size=len(plan.sample_requests),
                                    max_size=len(plan.sample_requests)))
        self.scheduler.update(plan, tokens)

    @precondition(lambda self: self.scheduler.has_unfinished())
    @rule()
    def failed_step_rolled_back(self):
        preemptions = self.scheduler.num_preemptions
        before = scheduler_state(self.scheduler)
        plan = self.scheduler.schedule()
        first = (list(plan.seq_ids), plan.query_lens.tolist(), plan.input_ids.tolist())
        self._write_step(plan)  # the failed forward pass wrote some of its K/V
        self.scheduler.rollback(plan)
        if self.scheduler.num_preemptions == preemptions:
            assert scheduler_state(self.scheduler) == before
            again = self.scheduler.schedule()
            assert (list(again.seq_ids), again.query_lens.tolist(), again.input_ids.tolist()) == first
            self.scheduler.rollback(again)
            event("rolled back")
        else:
            event("rolled back a step that preempted")

    @precondition(lambda self: self.scheduler.has_unfinished())
    @rule(data=st.data())
    def abort(self, data):
        live = sorted(self.scheduler._live, key=repr)
        aborted = self.scheduler.abort([data.draw(st.sampled_from(live))])
        assert aborted and all(r.status is RequestStatus.ABORTED for r in aborted)

    @invariant()
    def blocks_and_content_are_accounted_for(self):
        cache, scheduler = self.cache, self.scheduler
        running = [r for r in self.requests if r.status is RequestStatus.RUNNING]
        assert sorted(map(repr, cache.seq_ids())) == sorted(repr(r.request_id) for r in running)
        owners = np.zeros(NUM_BLOCKS, np.int64)
        for request in running:
            owners[cache.blocks(request.request_id)] += 1
            assert cache.num_computed(request.request_id) == request.num_computed < request.num_tokens
            assert_content(cache, request.request_id, request.token_ids)
        assert np.array_equal(cache.pool.ref_counts, owners)
        stats = scheduler.stats()
        assert stats.num_running == len(running) == len(scheduler.running)
        assert stats.num_waiting == len(scheduler.waiting)
        assert stats.num_preempted == sum(r.num_preemptions > 0 for r in scheduler.waiting)
        assert stats.blocks_used == int((owners > 0).sum())
        done = [r for r in self.requests if r.is_done]
        assert stats.num_finished + stats.num_aborted == len(done)
        for request in done:
            assert request.status is RequestStatus.ABORTED or (
                len(request.output_token_ids) == request.max_new_tokens
                or request.output_token_ids[-1] in request.stop_token_ids)

    def teardown(self):
        self.scheduler.abort(list(self.scheduler._live))
        cache = self.cache
        assert not self.scheduler.has_unfinished() and len(cache) == 0
        assert cache.num_free_blocks == NUM_BLOCKS and (cache.pool.ref_counts == 0).all()


def scheduler_state(scheduler):
    cache = scheduler.cache
    return ([(r.request_id, r.status, r.num_computed, r.num_tokens) for r in scheduler.running],
            [r.request_id for r in scheduler.waiting], cache.num_free_blocks,
            {repr(s): (cache.num_slots(s), cache.num_computed(s), cache.blocks(s).tolist()) for s in cache.seq_ids()},
            {k: v for k, v in vars(scheduler.stats()).items() if k != "cached_prompt_tokens_by_request"})


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------- on a GPU

@pytest.mark.gpu
def test_cuda_cache_update_copy_on_write_and_plan_buffers():
    import cupy

    cache = PagedAttentionCache(2, 1, 64, block_size=16, num_blocks=8, dtype="float16", device="cuda")
    assert isinstance(cache.kv, cupy.ndarray)
    tokens = list(range(20))
    cache.allocate("p", tokens)
    slots = cupy.asarray(cache.slot_mapping(["p"]))
    keys = cupy.arange(20 * 64, dtype=cupy.float16).reshape(20, 1, 64)
    k, v = cache.update(keys, -keys, 1, slots, slots)
    assert bool((k == keys).all()) and bool((v == -keys).all())
    cache.mark_computed(["p"], [20])
    cache.fork("p", "c")
    cache.grow(["c"], 1)  # copy-on-write of the partial block, on the device
    child_block, parent_block = int(cache.blocks("c")[1]), int(cache.blocks("p")[1])
    assert child_block != parent_block
    assert bool((cache.kv[:, :, child_block] == cache.kv[:, :, parent_block]).all())
    buffers = PlanBuffers(4, 8, cache.max_blocks_per_seq, device="cuda")
    plan = build_plan(cache, ["c"], 1, buffers=buffers, batch_size=2, num_tokens=2)
    assert isinstance(plan.block_table, cupy.ndarray)
    assert plan.block_table[0, :2].get().tolist() == cache.blocks("c").tolist()
    assert plan.slot_mapping.get().tolist() == [child_block * 16 + 4, -1]




@pytest.mark.parametrize("src, dst, error, match", [
    ([0], [-1], ValueError, r"^dst must be block ids in \[0, 4\); got -1"),  # -1 would be the last block
    ([-1], [1], ValueError, r"^src must be block ids in \[0, 4\); got -1"),
    ([1.9], [2.7], TypeError, "^src must be a sequence of int block ids"),
    ([True], [2], TypeError, "^src must be a sequence of int block ids"),
    ([0, 1], [2], ValueError, "^src and dst must hold one block id a copy each"),
    ([0, 1], [2, 2], ValueError, "^dst must be distinct block ids, none of them in src"),
    ([0, 1], [1, 2], ValueError, "^dst must be distinct block ids, none of them in src"),
    ([0], [4], ValueError, r"^dst must be block ids in \[0, 4\); got 4"),
])
def test_copy_blocks_refuses_ids_it_cannot_copy(src, dst, error, match):
    """Block ids outside the pool (the tables' -1 among them), floats, bools, unequal lengths,
    repeated or overlapping destinations: an error naming the argument, and no block written."""
    cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=4, dtype="float32", device="cpu")
    cache.kv[...] = np.arange(4, dtype=np.float32)[None, None, :, None, None, None]
    before = cache.kv.copy()
    with pytest.raises(error, match=match):
        cache.copy_blocks(src, dst)
    np.testing.assert_array_equal(cache.kv, before)
    cache.copy_blocks([0, 0], [2, 3])  # one source into two blocks: fine
    assert cache.kv[:, :, 2:].max() == 0


def test_update_refuses_a_batch_of_more_than_one():
    """``update`` takes ``[num_new, Hkv, D]`` or ``[1, num_new, Hkv, D]``; a leading 2 was read as
    its first row only, the second batch row dropped without a word."""
    cache = PagedAttentionCache(1, 1, 4, block_size=8, num_blocks=2, dtype="float32", device="cpu")
    states = np.stack([np.full((2, 1, 4), 1.0, np.float32), np.full((2, 1, 4), 7.0, np.float32)])
    slots = np.array([3, 4])
    with pytest.raises(ValueError, match="^key_states of four axes must have a leading 1"):
        cache.update(states, states, 0, read_index=slots, write_index=slots)
    with pytest.raises(ValueError, match="^value_states of four axes must have a leading 1"):
        cache.update(states[:1], states, 0, read_index=slots, write_index=slots)
    k, _ = cache.update(states[:1], states[:1], 0, read_index=slots, write_index=slots)
    assert k.shape == (1, 2, 1, 4) and float(k.sum()) == 8.0
