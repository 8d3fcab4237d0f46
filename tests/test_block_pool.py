"""BlockPool and PrefixCache: reference counts, all-or-nothing allocation, the LRU of cached free blocks."""
import os
import subprocess
import sys

import numpy as np
import pytest

from cupy_paged.serving.block_pool import BlockPool, CacheFull
from cupy_paged.serving.prefix_cache import PrefixCache, chain_hash


def caching_pool(num_blocks: int) -> BlockPool:
    return BlockPool(num_blocks, PrefixCache(block_size=1))


def snapshot(pool: BlockPool):
    return (pool.ref_counts.copy(), pool.num_free, pool.num_cached_free, pool.num_cached,
            list(pool._free), list(pool.prefix_cache._unowned))


def register_full(pool: BlockPool, block: int, tokens: tuple, parent=None) -> int:
    block_hash = chain_hash(parent, tokens)
    assert pool.prefix_cache.register(block, block_hash, tokens)
    return block_hash


def test_allocate_hands_out_distinct_blocks_with_one_owner():
    pool = BlockPool(10)
    a, b = pool.allocate(4), pool.allocate(6)
    assert sorted(a.tolist() + b.tolist()) == list(range(10))
    assert (pool.ref_counts == 1).all() and pool.num_free == 0
    assert pool.allocate(0).size == 0


def test_allocate_is_all_or_nothing():
    pool = caching_pool(5)
    pool.allocate(3)
    before = snapshot(pool)
    with pytest.raises(CacheFull, match="need 3 free blocks but only 2 of 5"):
        pool.allocate(3)
    after = snapshot(pool)
    assert all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(before, after))


def test_share_and_release_count_owners():
    pool = BlockPool(3)
    blocks = pool.allocate(2)
    pool.share(blocks)
    assert pool.ref_counts.tolist() == [2, 2, 0]
    pool.release(blocks)
    assert pool.ref_counts.tolist() == [1, 1, 0] and pool.num_free == 1
    pool.release(blocks[::-1])
    assert pool.num_free == 3


def test_release_of_a_free_block_raises():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="block 1 is not owned"):
        pool.release([1])


def test_share_of_a_plain_free_block_raises():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="block 0 is free and not cached"):
        pool.share([0])


def test_without_a_prefix_cache_every_freed_block_is_plain_free():
    pool = BlockPool(2)
    pool.release(pool.allocate(2))
    assert pool.num_free == 2 and pool.num_cached_free == pool.num_cached == 0
    with pytest.raises(ValueError, match="free and not cached"):
        pool.share([0])


def test_freed_cached_block_is_taken_back_by_share():
    pool = caching_pool(2)
    block = int(pool.allocate(1)[0])
    block_hash = register_full(pool, block, (4, 5))
    pool.release([block])
    assert pool.num_free == 2 and pool.num_cached_free == 1
    assert pool.prefix_cache.lookup(block_hash, (4, 5)) == block
    pool.share([block])
    assert pool.ref_counts[block] == 1 and pool.num_free == 1 and pool.num_cached_free == 0


def test_plain_free_blocks_go_before_cached_ones():
    pool = caching_pool(3)
    blocks = pool.allocate(3).tolist()
    register_full(pool, blocks[0], (1,))
    pool.release(blocks)
    assert sorted(pool.allocate(2).tolist()) == blocks[1:] and pool.num_cached == 1  # no eviction
    assert int(pool.allocate(1)[0]) == blocks[0] and pool.num_cached == 0


def test_eviction_takes_the_least_recently_freed_block():
    """Hugging Face reclaims the most recently freed block; we keep the hottest prefixes longest."""
    pool = caching_pool(3)
    blocks = pool.allocate(3).tolist()
    hashes = [register_full(pool, b, (b,)) for b in blocks]
    for block in blocks:  # freed oldest first: 0, then 1, then 2
        pool.release([block])
    evicted = int(pool.allocate(1)[0])
    assert evicted == blocks[0]
    assert pool.prefix_cache.lookup(hashes[0], (blocks[0],)) == -1
    assert pool.prefix_cache.lookup(hashes[2], (blocks[2],)) == blocks[2]
    assert int(pool.allocate(1)[0]) == blocks[1]


def test_a_cache_hit_refreshes_recency():
    pool = caching_pool(2)
    a, b = pool.allocate(2).tolist()
    hash_a = register_full(pool, a, (1,))
    register_full(pool, b, (2,))
    pool.release([a])
    pool.release([b])
    pool.share([a])  # a prefix hit on a: it is now the most recently used
    pool.release([a])
    assert int(pool.allocate(1)[0]) == b
    assert pool.prefix_cache.lookup(hash_a, (1,)) == a


def test_lookup_compares_tokens_so_a_collision_is_a_miss():
    pool = caching_pool(1)
    block = int(pool.allocate(1)[0])
    pool.prefix_cache.register(block, 12345, (1, 2))
    assert pool.prefix_cache.lookup(12345, (1, 2)) == block
    assert pool.prefix_cache.lookup(12345, (1, 3)) == -1


def test_second_copy_of_a_prefix_is_not_registered():
    pool = caching_pool(2)
    a, b = pool.allocate(2).tolist()
    block_hash = chain_hash(None, (9,))
    assert pool.prefix_cache.register(a, block_hash, (9,))
    assert not pool.prefix_cache.register(b, block_hash, (9,))
    assert not pool.prefix_cache.register(a, chain_hash(None, (8,)), (8,))  # already holds a prefix
    pool.release([b])
    assert pool.num_cached_free == 0  # b goes back as a plain free block


def test_chain_hash_depends_on_the_whole_prefix():
    first = chain_hash(None, (1, 2))
    assert chain_hash(first, (3, 4)) != chain_hash(chain_hash(None, (1, 5)), (3, 4))
    assert chain_hash(first, (3, 4)) == chain_hash(chain_hash(None, (1, 2)), (3, 4))


def test_chain_hash_has_no_collisions_that_python_hash_has():
    """Pairs of prefixes that Python's tuple hash maps to one value (hash(2**61 - 1) == hash(0),
    hash(-1) == hash(-2), so the tuples holding them collide): built on purpose, they must still get
    different chained hashes, else one prompt would be served another's K/V from the prefix cache."""
    for a, b in (((0,), (2 ** 61 - 1,)), ((-1, 5), (-2, 5)), ((7, 0, 3), (7, 2 ** 61 - 1, 3))):
        assert hash((None, a)) == hash((None, b))  # the collision, as Python hashes
        assert chain_hash(None, a) != chain_hash(None, b)
        assert chain_hash(chain_hash(None, (1,)), a) != chain_hash(chain_hash(None, (1,)), b)


def test_chain_hash_is_the_same_in_every_process():
    code = "from cupy_paged.serving.prefix_cache import chain_hash; print(chain_hash(chain_hash(None, (1, 2)), (3, 4)))"
    values = set()
    for seed in ("0", "1"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        values.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                  check=True).stdout.strip())
    assert values == {str(chain_hash(chain_hash(None, (1, 2)), (3, 4)))}


@pytest.mark.parametrize("bad", [0, -3])
def test_bad_pool_size(bad):
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        BlockPool(bad)


def test_prefix_cache_matches_whole_blocks_and_never_the_last_token():
    prefix = PrefixCache(block_size=2)
    tokens = [1, 2, 3, 4, 5]
    last = prefix.register_blocks(tokens, [7, 8], 0, 2, None)
    assert last == chain_hash(chain_hash(None, (1, 2)), (3, 4))
    assert prefix.match(tokens) == ([7, 8], last)
    assert prefix.num_cached_tokens([1, 2, 3, 4]) == 2  # the last token's block is recomputed
    assert prefix.num_cached_tokens([1, 9, 3, 4, 5]) == 0  # a changed first block breaks the chain
    disabled = PrefixCache(block_size=2, enabled=False)
    assert disabled.register_blocks(tokens, [7, 8], 0, 2, None) is None and disabled.num_cached == 0


def _state(pool: BlockPool):
    return pool.ref_counts.tolist(), pool.num_free, pool.num_cached_free, sorted(pool._free.tolist())


@pytest.mark.parametrize("call", ["release", "share"])
@pytest.mark.parametrize("bad", [[-1], [4], [0, 9]])
def test_block_ids_outside_the_pool_are_refused_and_change_nothing(call, bad):
    """A negative id (which NumPy would read from the pool's end) or one past it: a ValueError
    naming ``blocks``, the pool as it was, and every block still allocatable after a full release."""
    pool = BlockPool(4)
    owned = pool.allocate(4)
    before = _state(pool)
    with pytest.raises(ValueError, match="^blocks must be block ids in \\[0, 4\\)"):
        getattr(pool, call)(bad)
    assert _state(pool) == before
    pool.release(owned[::-1])
    assert sorted(pool.allocate(4).tolist()) == [0, 1, 2, 3]


def test_a_refused_share_takes_no_cached_block_out_of_the_cache():
    """share([cached free, plain free]) is refused as a whole: the cached block stays cached and
    free (not lost with no owner and off the free list), and duplicates are refused too."""
    cache = PrefixCache(block_size=2)
    pool = BlockPool(4, cache)
    a, b = pool.allocate(2).tolist()
    cache.register(a, chain_hash(None, (1, 2)), (1, 2))
    pool.release([b, a])
    before = _state(pool)
    with pytest.raises(ValueError, match=f"^block {b} is free and not cached"):
        pool.share([a, b])
    assert _state(pool) == before and cache.unowned(a)
    assert len(pool.allocate(4)) == 4
    pool = BlockPool(2)
    pool.allocate(1)
    with pytest.raises(ValueError, match="^blocks must be distinct"):
        pool.share([0, 0])
    assert pool.ref_counts.tolist() == [1, 0]
