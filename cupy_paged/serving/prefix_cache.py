"""The prefix cache: full blocks registered under the chained hash of the tokens they hold.

A block's hash chains its tokens to the hash of the block before it, so equal hashes mean
equal prefixes, not just equal blocks.  The hash is a 128-bit BLAKE2b digest: no one can build two
prompts whose prefixes share a hash and so read each other's K/V (Python's ``hash()`` of a tuple of
ints is deterministic and such collisions can be constructed; vLLM's prefix cache left it for that
reason, CVE-2025-25183).  A registered block is either owned by some
sequence or **unowned**: no sequence holds it, but it keeps its K/V until the
:class:`~cupy_paged.serving.block_pool.BlockPool` runs out of plain free blocks and
evicts it, least recently released first (the shared beginnings of prompts, released
last, stay longest).  A later request with the same prefix takes such a block back
instead of recomputing it.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

# The chain starts from a fixed value so that the first block's hash depends only on its tokens.
_ROOT_HASH = 0x5EED
_DIGEST_BYTES = 16


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
        The 128-bit BLAKE2b digest of the parent's hash and the token ids (as 64-bit ints),
        as a non-negative int: the same in every process, and collision resistant.

    Examples
    --------
    >>> from cupy_paged.serving.prefix_cache import chain_hash
    >>> a = chain_hash(None, (1, 2, 3, 4))
    >>> a == chain_hash(None, (1, 2, 3, 4)), a == chain_hash(7, (1, 2, 3, 4)), a < 2 ** 128
    (True, False, True)
    """
    parent = _ROOT_HASH if parent_hash is None else parent_hash
    data = parent.to_bytes(_DIGEST_BYTES, "little") + struct.pack(f"<{len(tokens)}q", *tokens)
    return int.from_bytes(hashlib.blake2b(data, digest_size=_DIGEST_BYTES).digest(), "little")


def _token_tuple(tokens, start: int, stop: int) -> tuple:
    chunk = tokens[start:stop]
    return tuple(chunk.tolist() if hasattr(chunk, "tolist") else chunk)


class PrefixCache:
    """Block hashes to block ids, the unowned registered blocks in release order, prefix matching.

    Parameters
    ----------
    block_size : int
        Tokens per block.
    enabled : bool
        When False nothing matches and nothing is registered by :meth:`register_blocks`.

    Examples
    --------
    >>> from cupy_paged.serving.prefix_cache import PrefixCache, chain_hash
    >>> prefix = PrefixCache(block_size=2)
    >>> tokens = [5, 6, 7, 8, 9]
    >>> prefix.register_blocks(tokens, [10, 11, 12], 0, 2, None) == chain_hash(chain_hash(None, (5, 6)), (7, 8))
    True
    >>> prefix.match(tokens)[0], prefix.num_cached_tokens(tokens[:4])
    ([10, 11], 2)
    """

    def __init__(self, block_size: int, enabled: bool = True):
        self.block_size = int(block_size)
        self.enabled = bool(enabled)
        self._key_of_block: dict[int, tuple] = {}  # block -> (hash, tokens)
        self._block_of_hash: dict[int, int] = {}
        self._unowned: OrderedDict[int, None] = OrderedDict()  # least recently released first

    # ------------------------------------------------------------------ registry

    @property
    def num_cached(self) -> int:
        """Registered blocks, owned or not."""
        return len(self._block_of_hash)

    @property
    def num_unowned(self) -> int:
        """Registered blocks no sequence holds: free, but kept until evicted."""
        return len(self._unowned)

    def holds(self, block: int) -> bool:
        """Whether ``block`` is registered.

        Parameters
        ----------
        block : int

        Returns
        -------
        bool
        """
        return block in self._key_of_block

    def lookup(self, block_hash: int, tokens: tuple) -> int:
        """The registered block holding ``tokens`` after the prefix hashed into ``block_hash``.

        Parameters
        ----------
        block_hash : int
            ``chain_hash(parent_hash, tokens)``.
        tokens : tuple of int
            The block's tokens, compared too (a check on the registry, not on the hash: the
            chained digest already stands for the whole prefix).

        Returns
        -------
        int
            The block id, owned or unowned, or -1 on a miss.

        Examples
        --------
        >>> from cupy_paged.serving.prefix_cache import PrefixCache, chain_hash
        >>> prefix = PrefixCache(block_size=2)
        >>> h = chain_hash(None, (5, 6))
        >>> prefix.register(0, h, (5, 6))
        True
        >>> prefix.lookup(h, (5, 6)), prefix.lookup(h, (5, 7))
        (0, -1)
        """
        block = self._block_of_hash.get(block_hash, -1)
        if block >= 0 and self._key_of_block[block][1] != tokens:
            return -1
        return block

    def register(self, block: int, block_hash: int, tokens: tuple) -> bool:
        """Register ``block``, which holds the computed K/V of ``tokens``.

        The caller owns ``block`` (it sits in a live block table): a block registered while
        free would be handed out again still registered.

        Parameters
        ----------
        block : int
            The block id.
        block_hash : int
            ``chain_hash`` of the prefix up to and including the block.
        tokens : tuple of int
            The block's tokens.

        Returns
        -------
        bool
            True when registered; False when another block already holds this prefix
            (the first copy stays the cached one) or ``block`` is registered already.

        Examples
        --------
        >>> from cupy_paged.serving.prefix_cache import PrefixCache, chain_hash
        >>> prefix = PrefixCache(block_size=1)
        >>> h = chain_hash(None, (1,))
        >>> prefix.register(0, h, (1,)), prefix.register(1, h, (1,))
        (True, False)
        """
        block = int(block)
        if block_hash in self._block_of_hash or block in self._key_of_block:
            return False
        self._block_of_hash[block_hash] = block
        self._key_of_block[block] = (block_hash, tokens)
        return True

    # ------------------------------------------------------------------ unowned blocks (the pool's calls)

    def release(self, block: int) -> None:
        """``block``, registered, lost its last owner: keep it, as the most recently released.

        Parameters
        ----------
        block : int
            A registered block id.
        """
        self._unowned[block] = None

    def unowned(self, block: int) -> bool:
        """Whether ``block`` is registered and has no owner: what :meth:`take_back` takes.

        Parameters
        ----------
        block : int

        Returns
        -------
        bool
        """
        return block in self._unowned

    def take_back(self, block: int) -> bool:
        """An unowned ``block`` gets an owner again.

        Parameters
        ----------
        block : int

        Returns
        -------
        bool
            False (nothing changed) when it is not an unowned registered block.
        """
        if block not in self._unowned:
            return False
        del self._unowned[block]
        return True

    def evict(self) -> int:
        """Forget the least recently released unowned block (a plain free block now).

        Returns
        -------
        int
            Its id.

        Raises
        ------
        KeyError
            When no block is unowned.
        """
        block, _ = self._unowned.popitem(last=False)
        block_hash, _ = self._key_of_block.pop(block)
        del self._block_of_hash[block_hash]
        return block

    # ------------------------------------------------------------------ hashing and matching

    def block_hashes(self, token_ids, first: int, last: int, parent):
        """The full blocks ``first .. last - 1`` of ``token_ids`` with their chained hashes.

        Parameters
        ----------
        token_ids : sequence of int
        first, last : int
            Block indices, ``last`` excluded.
        parent : int or None
            The hash of block ``first - 1`` (None for the first block).

        Yields
        ------
        (int, tuple, int)
            Block index, its tokens, its chained hash.
        """
        bs = self.block_size
        for j in range(first, last):
            tokens = _token_tuple(token_ids, j * bs, (j + 1) * bs)
            parent = chain_hash(parent, tokens)
            yield j, tokens, parent

    def match(self, token_ids) -> tuple[list, int | None]:
        """The registered blocks of the longest cached prefix of ``token_ids``.

        Whole blocks only, and never the last token: its logits must be computed.

        Parameters
        ----------
        token_ids : sequence of int

        Returns
        -------
        (list of int, int or None)
            The block ids and the last matched hash (None when nothing matched).
        """
        blocks, parent = [], None
        if not self.enabled:
            return blocks, parent
        for _, tokens, block_hash in self.block_hashes(token_ids, 0, (len(token_ids) - 1) // self.block_size, None):
            block = self.lookup(block_hash, tokens)
            if block < 0:
                break
            blocks.append(block)
            parent = block_hash
        return blocks, parent

    def num_cached_tokens(self, token_ids) -> int:
        """How many leading tokens of ``token_ids`` the cache holds.

        Parameters
        ----------
        token_ids : sequence of int

        Returns
        -------
        int
            A multiple of ``block_size``.
        """
        return len(self.match(token_ids)[0]) * self.block_size

    def register_blocks(self, token_ids, table_row, first: int, last: int, parent):
        """Register full blocks ``first .. last - 1`` of a sequence (nothing when disabled).

        Parameters
        ----------
        token_ids : sequence of int
            The sequence's tokens.
        table_row : array_like of int
            Its block table row: ``table_row[j]`` holds block ``j``.
        first, last : int
            Block indices, ``last`` excluded.
        parent : int or None
            The hash of block ``first - 1`` (None for the first block).

        Returns
        -------
        int or None
            The hash of block ``last - 1``, where the sequence's chain continues.
        """
        if not self.enabled:
            return parent
        for j, tokens, parent in self.block_hashes(token_ids, first, last, parent):
            self.register(int(table_row[j]), parent, tokens)
        return parent
