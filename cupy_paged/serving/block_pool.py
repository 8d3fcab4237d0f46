"""The block allocator: reference counts, free lists and the prefix cache.

A block is ``block_size`` consecutive token slots of the paged KV cache.  The pool
only does bookkeeping on block ids; the K/V data lives in
:class:`cupy_paged.serving.kv_cache.PagedAttentionCache`.

Every block is in exactly one of three states:

* **owned**: ``ref_counts[b] > 0``, listed in that many sequences' block tables;
* **free**: ``ref_counts[b] == 0`` and holding nothing worth keeping;
* **cached free**: ``ref_counts[b] == 0`` but registered under the chained hash of
  the tokens it holds, so a later request with the same prefix can take it back
  instead of recomputing it.  Cached free blocks are reclaimed only when no plain
  free block is left, least recently freed first (Hugging Face transformers hands
  out the most recently freed block, which throws away the hottest prefix).
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

# The chain starts from a fixed value so that the first block's hash depends only on its tokens.
_ROOT_HASH = 0x5EED


class CacheFull(RuntimeError):
    """Not enough free blocks for the request; nothing was changed by the failed call."""


def chain_hash(parent_hash: int, tokens: tuple) -> int:
    """The hash of a full block: its tokens chained to the hash of the block before it.

    Parameters
    ----------
    parent_hash : int
        ``chain_hash`` of the previous block of the sequence, or ``None`` for the first.
    tokens : tuple of int
        The ``block_size`` token ids the block holds.

    Returns
    -------
    int
        A 64-bit hash.  Python hashes tuples of ints the same way in every process
        (``PYTHONHASHSEED`` only salts strings and bytes), so hashes are reproducible.

    Examples
    --------
    >>> a = chain_hash(None, (1, 2, 3, 4))
    >>> a == chain_hash(None, (1, 2, 3, 4)), a == chain_hash(7, (1, 2, 3, 4))
    (True, False)
    """
    return hash((_ROOT_HASH if parent_hash is None else parent_hash, tokens))


class BlockPool:
    """Reference-counted block ids with an LRU prefix cache.

    Parameters
    ----------
    num_blocks : int
        Number of blocks, ids ``0 .. num_blocks - 1``.

    Attributes
    ----------
    ref_counts : numpy.ndarray
        ``[num_blocks]`` int32, the number of sequences holding each block.

    Examples
    --------
    >>> pool = BlockPool(4)
    >>> blocks = pool.allocate(3)
    >>> blocks.tolist(), pool.num_free
    ([0, 1, 2], 1)
    >>> pool.release(blocks)
    >>> pool.num_free
    4
    """

    def __init__(self, num_blocks: int):
        num_blocks = int(num_blocks)
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1; got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = np.zeros(num_blocks, np.int32)
        # A stack popped from the end: block 0 is handed out first, which keeps small tests readable.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self._key_of_block: list[tuple | None] = [None] * num_blocks  # (hash, tokens) once registered
        self._block_of_hash: dict[int, int] = {}

    # ------------------------------------------------------------------ counts

    @property
    def num_free(self) -> int:
        """Blocks an :meth:`allocate` call can hand out now (plain free plus cached free)."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a registered prefix."""
        return len(self._cached_free)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache, owned or free."""
        return len(self._block_of_hash)

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
        >>> BlockPool(8).allocate(2).tolist()
        [0, 1]
        """
        count = int(count)
        if count < 0:
            raise ValueError(f"count must be >= 0; got {count}")
        if count > self.num_free:
            raise CacheFull(f"need {count} free blocks but only {self.num_free} of "
                            f"{self.num_blocks} are free")
        take = min(count, len(self._free))
        blocks = self._free[len(self._free) - take:][::-1]
        del self._free[len(self._free) - take:]
        for _ in range(count - take):
            block, _ = self._cached_free.popitem(last=False)
            self._forget(block)
            blocks.append(block)
        blocks = np.asarray(blocks, dtype=np.int32)
        self.ref_counts[blocks] = 1
        return blocks

    def share(self, blocks) -> None:
        """Add one owner to each of ``blocks`` (a fork, or a prefix-cache hit).

        A cached free block taken back this way leaves the free list.

        Parameters
        ----------
        blocks : array_like of int
            Distinct block ids, each owned or cached free.

        Examples
        --------
        >>> pool = BlockPool(2)
        >>> b = pool.allocate(1)
        >>> pool.share(b)
        >>> int(pool.ref_counts[0])
        2
        """
        blocks = np.asarray(blocks, dtype=np.int64)
        for block in blocks[self.ref_counts[blocks] == 0].tolist():
            if block not in self._cached_free:
                raise ValueError(f"block {block} is free and not cached: it cannot be shared")
            del self._cached_free[block]
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
        >>> pool = BlockPool(3)
        >>> pool.release(pool.allocate(2))
        >>> pool.num_free
        3
        """
        blocks = np.asarray(blocks, dtype=np.int64)
        if blocks.size == 0:
            return
        unique, counts = np.unique(blocks, return_counts=True)
        short = self.ref_counts[unique] < counts
        if short.any():
            raise ValueError(f"block {int(unique[short][0])} is not owned {int(counts[short][0])} times: "
                             "it cannot be released that often")
        self.ref_counts[unique] -= counts.astype(np.int32)
        for block in dict.fromkeys(blocks[self.ref_counts[blocks] == 0].tolist()):
            if self._key_of_block[block] is None:
                self._free.append(block)
            else:
                self._cached_free[block] = None

    # ------------------------------------------------------------------ prefix cache

    def lookup(self, block_hash: int, tokens: tuple) -> int:
        """The cached block holding ``tokens`` after the prefix hashed into ``block_hash``.

        Parameters
        ----------
        block_hash : int
            ``chain_hash(parent_hash, tokens)``.
        tokens : tuple of int
            The block's tokens, compared too, so a hash collision is a miss, not wrong data.

        Returns
        -------
        int
            The block id, owned or cached free, or -1 on a miss.

        Examples
        --------
        >>> pool = BlockPool(2)
        >>> b = int(pool.allocate(1)[0])
        >>> h = chain_hash(None, (5, 6))
        >>> pool.register(b, h, (5, 6))
        True
        >>> pool.lookup(h, (5, 6)), pool.lookup(h, (5, 7))
        (0, -1)
        """
        block = self._block_of_hash.get(block_hash, -1)
        if block >= 0 and self._key_of_block[block][1] != tokens:
            return -1
        return block

    def register(self, block: int, block_hash: int, tokens: tuple) -> bool:
        """Offer the owned, full, computed ``block`` to the prefix cache.

        Parameters
        ----------
        block : int
            An owned block whose K/V for ``tokens`` has been written.
        block_hash : int
            Its ``chain_hash``.
        tokens : tuple of int
            The tokens it holds.

        Returns
        -------
        bool
            True when registered; False when another block already holds this prefix
            (the first copy stays the cached one) or ``block`` is already registered.

        Examples
        --------
        >>> pool = BlockPool(2)
        >>> a, b = pool.allocate(2).tolist()
        >>> h = chain_hash(None, (1,))
        >>> pool.register(a, h, (1,)), pool.register(b, h, (1,))
        (True, False)
        """
        block = int(block)
        if self.ref_counts[block] <= 0:
            raise ValueError(f"block {block} is not owned: only computed blocks can be registered")
        if block_hash in self._block_of_hash or self._key_of_block[block] is not None:
            return False
        self._block_of_hash[block_hash] = block
        self._key_of_block[block] = (block_hash, tokens)
        return True

    def _forget(self, block: int) -> None:
        block_hash, _ = self._key_of_block[block]
        del self._block_of_hash[block_hash]
        self._key_of_block[block] = None
