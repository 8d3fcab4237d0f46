"""``PagedAttentionCache``: the paged K/V storage and the per-sequence block tables.

The storage is one array ``kv[num_layers, 2, num_blocks, block_size, Hkv, D]``
(NumPy on the CPU, CuPy on a GPU); ``layer(i)`` hands out the K and V views
``[num_blocks, block_size, Hkv, D]`` the kernels take.  Keeping all layers in one
array is what lets a copy-on-write move a block in every layer with one indexing
operation.

Block bookkeeping is a :class:`~cupy_paged.serving.block_pool.BlockPool` and its
:class:`~cupy_paged.serving.prefix_cache.PrefixCache`, plus one row per live sequence in
``tables`` (``[max_seqs, max_blocks_per_seq]`` int32, -1 padded), so a batch's block
table is one indexing of ``tables`` by rows and its slot mapping one numba pass over them.

Each sequence counts two lengths: ``num_slots``, token positions that have a slot
reserved (``allocate`` / ``grow``), and ``num_computed``, positions whose K/V has
been written (``mark_computed``).  A step writes positions
``num_computed .. num_slots - 1`` (``slot_mapping``) and attends to the ``num_computed``
cached tokens plus its new ones.

The class is assembled from one module per idea: ``_storage`` (sizing the storage, its
per-layer views, the manual gather/scatter ``update``), ``_batch_views`` (read-only views of
the rows, among them ``plan_view``, the one a step plan reads), ``_growth`` (``grow``,
``fork`` and copy-on-write); allocation, ``mark_computed`` and ``free`` are here.
"""
from __future__ import annotations

import numpy as np

from .._core.arrays import CPU, CUDA, gpu_available, xp_of
from .._core.types import check_block_size, check_bool, check_counts, check_int
from ._batch_views import BatchViews
from ._storage import LayerAccess, check_storage, count_blocks
from ._growth import Growth
from ._tables import set_computed
from .block_pool import BlockPool, CacheFull
from .prefix_cache import PrefixCache
from .requests import token_array

__all__ = ["PagedAttentionCache", "CacheFull"]


class PagedAttentionCache(LayerAccess, BatchViews, Growth):
    """Paged K/V caches for every layer, with block allocation, sharing and prefix caching.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim : int
        Model shape; caches are ``[num_blocks, block_size, num_kv_heads, head_dim]``.  The cache
        stores any head dim; which ones the kernels run is theirs to say.
    block_size : int
        Tokens per block, a power of two from 8 to 256.
    num_blocks : int, optional
        Number of blocks.  Give this or ``memory_fraction``.
    memory_fraction : float, optional
        Size the cache to this fraction of the free memory of ``device``.
    dtype : dtype
        float16 or bfloat16 (float32/float64 too on the CPU).
    device : {"cpu", "cuda"}, optional
        Where the storage lives: NumPy or CuPy arrays.  Default: CUDA when a GPU answers.
    max_seqs : int
        Initial number of sequence rows; doubled when exceeded.
    max_blocks_per_seq : int, optional
        Longest sequence in blocks.  Default ``min(num_blocks, 2048)``.
    enable_prefix_caching : bool
        Register full computed blocks by chained hash and reuse them for equal prefixes.

    Raises
    ------
    ValueError, TypeError
        For a bad size, dtype or block size.

    Examples
    --------
    >>> from cupy_paged import PagedAttentionCache
    >>> cache = PagedAttentionCache(2, 1, 32, block_size=8, num_blocks=4, dtype="float32", device="cpu")
    >>> cache.allocate("a", list(range(10)))
    0
    >>> cache.block_table(["a"]).tolist(), cache.slot_mapping(["a"]).tolist()[-2:]
    ([[0, 1]], [8, 9])
    >>> k_cache, v_cache = cache.layer(1)
    >>> k_cache.shape
    (4, 8, 1, 32)
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, block_size: int = 16,
                 num_blocks: int | None = None, memory_fraction: float | None = None,
                 dtype="float16", device: str | None = None, max_seqs: int = 256,
                 max_blocks_per_seq: int | None = None, enable_prefix_caching: bool = True):
        device = (CUDA if gpu_available() else CPU) if device is None else device
        dtype = np.dtype(dtype)
        check_storage(device, dtype, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       max_seqs=max_seqs, block_size=block_size)
        check_block_size(int(block_size), "block_size")
        self.num_layers, self.num_kv_heads = int(num_layers), int(num_kv_heads)
        self.head_dim, self.block_size = int(head_dim), int(block_size)
        self.dtype, self.device = dtype, device
        self.bytes_per_block = (2 * self.num_layers * self.block_size * self.num_kv_heads
                                * self.head_dim * dtype.itemsize)
        self.num_blocks = num_blocks = count_blocks(num_blocks, memory_fraction, device, self.bytes_per_block)
        self.max_blocks_per_seq = (min(num_blocks, 2048) if max_blocks_per_seq is None
                                   else check_int(max_blocks_per_seq, "max_blocks_per_seq", 1))
        self.enable_prefix_caching = check_bool(enable_prefix_caching, "enable_prefix_caching")

        xp = np
        if device == CUDA:
            import cupy as xp
        self.kv = xp.zeros((self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads,
                            self.head_dim), dtype=dtype)
        self.prefix_cache = PrefixCache(self.block_size, self.enable_prefix_caching)
        self.pool = BlockPool(num_blocks, self.prefix_cache)

        self._row_of: dict = {}
        self._free_rows: list[int] = []
        self._tokens: list = []
        self._last_hash: list = []
        self.tables = np.empty((0, self.max_blocks_per_seq), np.int32)
        self._num_blocks = np.empty(0, np.int64)
        self._num_slots = np.empty(0, np.int64)
        self._num_computed = np.empty(0, np.int64)
        self._num_hashed = np.empty(0, np.int64)
        # Bumped on every change of a row of `tables`, so plan buffers re-copy only changed rows.
        self.table_versions = np.empty(0, np.int64)
        self._seen = np.zeros(0, bool)  # scratch of grow's decode path
        self._add_rows(int(max_seqs))

    # ------------------------------------------------------------------ storage

    @property
    def max_seq_len(self) -> int:
        """Longest sequence a row can hold, in tokens."""
        return self.max_blocks_per_seq * self.block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks free for allocation, counting cached free blocks that can be evicted."""
        return self.pool.num_free

    def copy_blocks(self, src, dst) -> None:
        """Copy blocks ``src[i]`` to ``dst[i]`` in every layer's K and V with one indexing op.

        Parameters
        ----------
        src, dst : array_like of int
            ``[n]`` block ids; ``dst`` distinct and disjoint from ``src``.

        Examples
        --------
        >>> from cupy_paged import PagedAttentionCache
        >>> cache = PagedAttentionCache(2, 1, 32, block_size=8, num_blocks=2, dtype="float32", device="cpu")
        >>> cache.kv[:, :, 0] = 1.0
        >>> cache.copy_blocks([0], [1])
        >>> float(cache.kv[1, 1, 1].min())
        1.0
        """
        src, dst = self.pool._ids(src, "src"), self.pool._ids(dst, "dst")  # -1 would be the last block
        if src.size != dst.size:
            raise ValueError(f"src and dst must hold one block id a copy each; got {src.size} and {dst.size}")
        if np.unique(dst).size != dst.size or np.isin(dst, src).any():
            raise ValueError(f"dst must be distinct block ids, none of them in src; got {dst.tolist()[:16]}")
        if src.size:
            xp = xp_of(self.kv)
            self.kv[:, :, xp.asarray(dst)] = self.kv[:, :, xp.asarray(src)]

    def allocate(self, seq_id, token_ids, num_new_tokens: int | None = None, reserve: int = 0, *,
                 max_num_new_tokens: int | None = None) -> int:
        """Start a sequence: reuse its longest cached prefix, reserve slots for the rest.

        The prefix match hashes each block it covers, once a call; ``max_num_new_tokens``
        cuts the chunk to a budget without a ``num_cached_tokens`` call (a second match) first.

        Parameters
        ----------
        seq_id : hashable
            A new sequence id.
        token_ids : list of int
            The sequence's tokens.  The cache keeps this list (not a copy) to hash blocks
            as they fill: append generated tokens to the same list.
        num_new_tokens : int, optional
            Tokens after the cached prefix to reserve slots for now (a prefill chunk).
            Default: all the rest (at most ``max_num_new_tokens`` when that is given).
        reserve : int
            Blocks that must stay free after this call (an admission safety margin).
        max_num_new_tokens : int, optional
            Instead of ``num_new_tokens``: reserve slots for at most this many tokens after
            the cached prefix, all the rest when fewer are left.  The slots reserved are
            ``min(len(token_ids) - cached, max_num_new_tokens)``, ``cached`` the return value.

        Returns
        -------
        int
            Number of leading tokens already in the cache (a multiple of ``block_size``):
            the sequence's ``num_computed`` starts there.

        Raises
        ------
        CacheFull
            Not enough free blocks; nothing changed.
        ValueError
            ``seq_id`` already present, both ``num_new_tokens`` and ``max_num_new_tokens``
            given, a negative ``max_num_new_tokens``, or the sequence would exceed ``max_seq_len``.

        Examples
        --------
        >>> from cupy_paged import PagedAttentionCache
        >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=2, device="cpu")
        >>> cache.allocate("a", list(range(12)), num_new_tokens=4)
        0
        >>> cache.num_slots("a"), cache.blocks("a").tolist()
        (4, [0])
        >>> cache.allocate("b", [1, 2, 3], max_num_new_tokens=8), cache.num_slots("b")
        (0, 3)
        """
        if seq_id in self._row_of:
            raise ValueError(f"sequence {seq_id!r} is already in the cache")
        token_array(token_ids, "token_ids")  # a float or a string is no token id: refused, not hashed and kept
        hits, last_hash = self.prefix_cache.match(token_ids)
        cached = len(hits) * self.block_size
        new = _chunk_length(len(token_ids), cached, num_new_tokens, max_num_new_tokens)
        self._check_length(seq_id, cached + new)
        fresh = -(-(cached + new) // self.block_size) - len(hits)
        revived = int((self.pool.ref_counts[np.asarray(hits, np.int64)] == 0).sum())
        self._check_room(fresh + revived, reserve)
        # Hits first: allocate() may evict cached free blocks, and must not evict these.
        self.pool.share(hits)
        blocks = np.concatenate([np.asarray(hits, np.int32), self.pool.allocate(fresh)])
        row = self._new_row(seq_id)
        self.tables[row, :blocks.size] = blocks
        self._num_blocks[row] = blocks.size
        self._num_slots[row] = cached + new
        self._num_computed[row] = cached
        self._num_hashed[row] = len(hits)
        self._tokens[row] = token_ids
        self._last_hash[row] = last_hash
        return cached

    def mark_computed(self, seq_ids, num_computed=None, rows: np.ndarray | None = None) -> None:
        """Record that K/V is written up to ``num_computed`` tokens; cache newly full blocks.

        Parameters
        ----------
        seq_ids : sequence
            Live sequence ids.
        num_computed : int or array_like of int, optional
            ``[batch]`` new totals, between the current count and ``num_slots``.  Default: every
            reserved slot (``num_slots``), what a finished step wrote.
        rows : numpy.ndarray, optional
            ``rows(seq_ids)`` when the caller already has them.

        Raises
        ------
        ValueError
            When a total is out of range; nothing changed.

        Examples
        --------
        >>> from cupy_paged import PagedAttentionCache
        >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=4, device="cpu")
        >>> cache.allocate("a", list(range(9)))
        0
        >>> cache.mark_computed(["a"], [9])
        >>> cache.num_computed_batch(["a"]).tolist(), cache.pool.num_cached
        ([9], 1)
        """
        rows = self.rows(seq_ids) if rows is None else rows
        if num_computed is None:
            counts = _NO_COUNTS
        else:
            counts = check_counts(num_computed, rows.shape[0], "num_computed")
        to_hash = np.empty(rows.size, np.int64)
        k, bad = set_computed(rows, counts, self._num_computed, self._num_slots, self._num_hashed,
                              self.block_size, to_hash)
        if bad >= 0:
            row = rows[bad]
            raise ValueError(f"num_computed for sequence {list(seq_ids)[bad]!r} must be in "
                             f"[{self._num_computed[row]}, {self._num_slots[row]}]; got {counts[bad]}")
        if not self.enable_prefix_caching:
            return
        for row in to_hash[:k].tolist():
            last = int(self._num_computed[row]) // self.block_size
            self._last_hash[row] = self.prefix_cache.register_blocks(
                self._tokens[row], self.tables[row], int(self._num_hashed[row]), last, self._last_hash[row])
            self._num_hashed[row] = last

    def free(self, seq_id) -> None:
        """Drop a sequence; blocks nobody else holds become free (cached ones stay cached).

        Parameters
        ----------
        seq_id : hashable
            A live sequence id.

        Raises
        ------
        KeyError
            When ``seq_id`` is not in the cache.

        Examples
        --------
        >>> from cupy_paged import PagedAttentionCache
        >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=4, device="cpu")
        >>> cache.allocate("a", list(range(20)))
        0
        >>> cache.free("a")
        >>> cache.num_free_blocks, "a" in cache
        (4, False)
        """
        row = self.rows([seq_id])[0]
        self.pool.release(self.tables[row, :self._num_blocks[row]][::-1])
        del self._row_of[seq_id]
        self.tables[row] = -1
        self.table_versions[row] += 1
        self._num_blocks[row] = self._num_slots[row] = self._num_computed[row] = self._num_hashed[row] = 0
        self._tokens[row] = self._last_hash[row] = None
        self._free_rows.append(row)

    # ------------------------------------------------------------------ internals

    def _check_room(self, blocks: int, reserve: int) -> None:
        reserve = check_int(reserve, "reserve")
        if blocks + reserve > self.pool.num_free:
            raise CacheFull(f"need {blocks} free blocks (+{int(reserve)} kept in reserve) but "
                            f"{self.pool.num_free} of {self.num_blocks} are free")

    def _check_length(self, seq_id, lengths) -> None:
        longest = int(np.max(lengths, initial=0))
        if longest > self.max_seq_len:
            who = "a sequence" if seq_id is None else f"sequence {seq_id!r}"
            raise ValueError(f"{who} would hold {longest} tokens, more than max_seq_len = "
                             f"{self.max_seq_len} (max_blocks_per_seq * block_size)")

    def _new_row(self, seq_id) -> int:
        """A free row of ``tables`` for the new sequence ``seq_id`` (more rows when none is left)."""
        if not self._free_rows:
            self._add_rows(len(self._num_slots))
        row = self._free_rows.pop()
        self._row_of[seq_id] = row
        self.table_versions[row] += 1
        return row

    def _add_rows(self, count: int) -> None:
        start = len(self._num_slots)
        self.tables = np.concatenate([self.tables, np.full((count, self.max_blocks_per_seq), -1, np.int32)])
        for name in ("_num_blocks", "_num_slots", "_num_computed", "_num_hashed", "table_versions"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(count, np.int64)]))
        self._tokens.extend([None] * count)
        self._last_hash.extend([None] * count)
        self._free_rows.extend(range(start + count - 1, start - 1, -1))


_NO_COUNTS = np.empty(0, np.int64)


def _chunk_length(num_tokens: int, cached: int, num_new_tokens, max_num_new_tokens) -> int:
    """Slots ``allocate`` reserves after the ``cached`` prefix of a ``num_tokens`` sequence."""
    if max_num_new_tokens is not None:
        if num_new_tokens is not None:
            raise ValueError("give num_new_tokens or max_num_new_tokens, not both")
        return min(num_tokens - cached, check_int(max_num_new_tokens, "max_num_new_tokens"))
    new = num_tokens - cached if num_new_tokens is None else check_int(num_new_tokens, "num_new_tokens", None)
    if new < 0 or cached + new > num_tokens:
        raise ValueError(f"num_new_tokens must be in [0, {num_tokens - cached}] "
                         f"({num_tokens} tokens, {cached} cached); got {num_new_tokens}")
    return new
