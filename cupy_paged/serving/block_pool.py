"""The block allocator: reference counts and the free list.

A block is ``block_size`` consecutive token slots of the paged KV cache.  The pool
only does bookkeeping on block ids; the K/V data lives in
:class:`cupy_paged.serving.kv_cache.PagedAttentionCache`.

Every block is in exactly one of three states:

* **owned**: ``ref_counts[b] > 0``, listed in that many sequences' block tables;
* **free**: ``ref_counts[b] == 0`` and holding nothing worth keeping;
* **cached free**: ``ref_counts[b] == 0`` but registered in the pool's
  :class:`~cupy_paged.serving.prefix_cache.PrefixCache`, so a later request with the
  same prefix can take it back instead of recomputing it.  Cached free blocks are
  reclaimed only when no plain free block is left, least recently freed first (Hugging
  Face transformers hands out the most recently freed block, which throws away the
  hottest prefix).
"""
from __future__ import annotations

import numpy as np

from .prefix_cache import PrefixCache


class CacheFull(RuntimeError):
    """Not enough free blocks for the request; nothing was changed by the failed call."""


class BlockPool:
    """Reference-counted block ids; freed blocks the prefix cache holds stay cached until needed.

    Parameters
    ----------
    num_blocks : int
        Number of blocks, ids ``0 .. num_blocks - 1``.
    prefix_cache : PrefixCache, optional
        Where full computed blocks are registered.  Without one every freed block is plain free.

    Attributes
    ----------
    ref_counts : numpy.ndarray
        ``[num_blocks]`` int32, the number of sequences holding each block.
    prefix_cache : PrefixCache or None

    Examples
    --------
    >>> from cupy_paged import BlockPool
    >>> pool = BlockPool(4)
    >>> blocks = pool.allocate(3)
    >>> blocks.tolist(), pool.num_free
    ([0, 1, 2], 1)
    >>> pool.release(blocks)
    >>> pool.num_free
    4
    """

    def __init__(self, num_blocks: int, prefix_cache: PrefixCache | None = None):
        num_blocks = int(num_blocks)
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1; got {num_blocks}")
        self.num_blocks = num_blocks
        self.prefix_cache = prefix_cache
        self.ref_counts = np.zeros(num_blocks, np.int32)
        # The plain free blocks, a stack of its first `_top` entries popped from the end (so the
        # decode step's numba pass can take blocks too): block 0 is handed out first, which keeps
        # small tests readable.
        self._stack = np.arange(num_blocks - 1, -1, -1, dtype=np.int32)
        self._top = num_blocks

    @property
    def _free(self) -> np.ndarray:
        """The plain free blocks, next handed out last (a view of the stack)."""
        return self._stack[:self._top]

    # ------------------------------------------------------------------ counts

    @property
    def num_free(self) -> int:
        """Blocks an :meth:`allocate` call can hand out now (plain free plus cached free)."""
        return self._top + self.num_cached_free

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a registered prefix."""
        return 0 if self.prefix_cache is None else self.prefix_cache.num_unowned

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache, owned or free."""
        return 0 if self.prefix_cache is None else self.prefix_cache.num_cached

    # ------------------------------------------------------------------ allocate / share / release

    def allocate(self, count: int) -> np.ndarray:
        """Take ``count`` blocks, each with reference count 1.

        Plain free blocks go first; then cached free blocks are evicted, least
        recently freed first, and forgotten by the prefix cache.

        Parameters
        ----------
        count : int
            Number of blocks wanted.

        Returns
        -------
        numpy.ndarray
            ``[count]`` int32 block ids.

        Raises
        ------
        CacheFull
            When fewer than ``count`` blocks are free; the pool is left unchanged.

        Examples
        --------
        >>> from cupy_paged import BlockPool
        >>> BlockPool(8).allocate(2).tolist()
        [0, 1]
        """
        count = int(count)
        if count < 0:
            raise ValueError(f"count must be >= 0; got {count}")
        if count > self.num_free:
            raise CacheFull(f"need {count} free blocks but only {self.num_free} of "
                            f"{self.num_blocks} are free")
        take = min(count, self._top)
        blocks = np.empty(count, np.int32)
        blocks[:take] = self._stack[self._top - take:self._top][::-1]
        self._top -= take
        for i in range(take, count):
            blocks[i] = self.prefix_cache.evict()
        self.ref_counts[blocks] = 1
        return blocks

    def _ids(self, blocks, name: str = "blocks") -> np.ndarray:
        """``blocks`` as int64 block ids, each in ``[0, num_blocks)``: a ValueError naming them
        (as ``name``) otherwise (a negative id would index the pool from its end)."""
        ids = np.asarray(blocks)
        if ids.ndim > 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise TypeError(f"{name} must be a sequence of int block ids; got {ids.dtype} of shape {ids.shape}")
        ids = ids.reshape(-1).astype(np.int64)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            bad = int(ids[(ids < 0) | (ids >= self.num_blocks)][0])
            raise ValueError(f"{name} must be block ids in [0, {self.num_blocks}); got {bad}")
        return ids

    def share(self, blocks) -> None:
        """Add one owner to each of ``blocks`` (a fork, or a prefix-cache hit).

        A cached free block taken back this way leaves the free list.

        Parameters
        ----------
        blocks : array_like of int
            Distinct block ids, each owned or cached free.

        Examples
        --------
        >>> from cupy_paged import BlockPool
        >>> pool = BlockPool(2)
        >>> b = pool.allocate(1)
        >>> pool.share(b)
        >>> int(pool.ref_counts[0])
        2
        """
        blocks = self._ids(blocks)
        if np.unique(blocks).size != blocks.size:
            raise ValueError(f"blocks must be distinct block ids; got {blocks.tolist()[:16]}")
        free = blocks[self.ref_counts[blocks] == 0].tolist()
        for block in free:  # every block checked before any is taken back: a refused call changes nothing
            if self.prefix_cache is None or not self.prefix_cache.unowned(block):
                raise ValueError(f"block {block} is free and not cached: it cannot be shared")
        for block in free:
            self.prefix_cache.take_back(block)
        self.ref_counts[blocks] += 1

    def release(self, blocks) -> None:
        """Drop one owner from each of ``blocks``; blocks left without owners become free.

        Parameters
        ----------
        blocks : array_like of int
            Owned block ids; one listed twice loses two owners.  Pass a sequence's blocks
            **last block first**:
            cached blocks freed together are then evicted tail first, which keeps
            the shared beginnings of prompts around longest.

        Examples
        --------
        >>> from cupy_paged import BlockPool
        >>> pool = BlockPool(3)
        >>> pool.release(pool.allocate(2))
        >>> pool.num_free
        3
        """
        blocks = self._ids(blocks)
        if blocks.size == 0:
            return
        unique, counts = np.unique(blocks, return_counts=True)
        short = self.ref_counts[unique] < counts
        if short.any():
            raise ValueError(f"block {int(unique[short][0])} is not owned {int(counts[short][0])} times: "
                             "it cannot be released that often")
        self.ref_counts[unique] -= counts.astype(np.int32)
        prefix = self.prefix_cache
        for block in dict.fromkeys(blocks[self.ref_counts[blocks] == 0].tolist()):
            if prefix is not None and prefix.holds(block):
                prefix.release(block)
            else:
                self._stack[self._top] = block
                self._top += 1
