"""``PagedAttentionCache``: the paged K/V storage and the per-sequence block tables.

The storage is one array ``kv[num_layers, 2, num_blocks, block_size, Hkv, D]``
(NumPy on the CPU, CuPy on a GPU); ``layer(i)`` hands out the K and V views
``[num_blocks, block_size, Hkv, D]`` the kernels take.  Keeping all layers in one
array is what lets a copy-on-write move a block in every layer with one indexing
operation.

Block bookkeeping is a :class:`~cupy_paged.serving.block_pool.BlockPool` plus one row per
live sequence in ``tables`` (``[max_seqs, max_blocks_per_seq]`` int32, -1 padded),
so a batch's block table is one indexing of ``tables`` by rows and its slot mapping
one numba pass over them.

Each sequence counts two lengths: ``num_slots``, token positions that have a slot
reserved (``allocate`` / ``grow``), and ``num_computed``, positions whose K/V has
been written (``mark_computed``).  A step writes positions
``num_computed .. num_slots - 1`` (``slot_mapping``) and attends with
``cache_seqlens = num_computed``.
"""
from __future__ import annotations

import os

import numpy as np

from ..runtime import _fill as _plan_kernels
from .._core.arrays import CPU, CUDA, as_array, gpu_available, xp_of
from .._core.types import KERNEL_DTYPES, REFERENCE_DTYPES, check_block_size, check_head_dim, dtype_name
from .block_pool import BlockPool, CacheFull, chain_hash

__all__ = ["PagedAttentionCache", "CacheFull"]


def _token_tuple(tokens, start: int, stop: int) -> tuple:
    chunk = tokens[start:stop]
    return tuple(chunk.tolist() if hasattr(chunk, "tolist") else chunk)


def free_memory_bytes(device: str) -> int:
    """Bytes free now on ``device`` (``"cuda"``: the current GPU; ``"cpu"``: available RAM).

    Examples
    --------
    >>> free_memory_bytes("cpu") > 0
    True
    """
    if device == CUDA:
        import cupy

        free, _total = cupy.cuda.runtime.memGetInfo()
        # Blocks CuPy's pool holds but no array uses are free for us too.
        return int(free) + int(cupy.get_default_memory_pool().free_bytes())
    return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))


class PagedAttentionCache:
    """Paged K/V caches for every layer, with block allocation, sharing and prefix caching.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim : int
        Model shape; caches are ``[num_blocks, block_size, num_kv_heads, head_dim]``.
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
        For a bad size, dtype, head dim or block size.

    Examples
    --------
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
        if device not in (CPU, CUDA):
            raise ValueError(f"device must be 'cpu' or 'cuda'; got {device!r}")
        if device == CUDA and not gpu_available():
            raise ValueError("device='cuda' needs CuPy and a CUDA GPU; none answers")
        dtype = np.dtype(dtype)
        allowed = KERNEL_DTYPES if device == CUDA else REFERENCE_DTYPES
        if dtype not in allowed:
            raise TypeError(f"dtype must be one of {', '.join(dtype_name(d) for d in allowed)} "
                            f"on {device}; got {dtype_name(dtype)}")
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                            ("max_seqs", max_seqs)):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1; got {value}")
        check_head_dim(int(head_dim), "head_dim")
        check_block_size(int(block_size), "block_size")
        self.num_layers, self.num_kv_heads = int(num_layers), int(num_kv_heads)
        self.head_dim, self.block_size = int(head_dim), int(block_size)
        self.dtype, self.device = dtype, device
        self.bytes_per_block = (2 * self.num_layers * self.block_size * self.num_kv_heads
                                * self.head_dim * dtype.itemsize)
        if (num_blocks is None) == (memory_fraction is None):
            raise ValueError("give exactly one of num_blocks and memory_fraction")
        if memory_fraction is not None:
            if not 0.0 < float(memory_fraction) <= 1.0:
                raise ValueError(f"memory_fraction must be in (0, 1]; got {memory_fraction}")
            num_blocks = int(free_memory_bytes(device) * float(memory_fraction)) // self.bytes_per_block
        num_blocks = int(num_blocks)
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1 (memory_fraction too small?); got {num_blocks}")
        self.num_blocks = num_blocks
        self.max_blocks_per_seq = min(num_blocks, 2048) if max_blocks_per_seq is None else int(max_blocks_per_seq)
        if self.max_blocks_per_seq < 1:
            raise ValueError(f"max_blocks_per_seq must be >= 1; got {max_blocks_per_seq}")
        self.enable_prefix_caching = bool(enable_prefix_caching)

        xp = np
        if device == CUDA:
            import cupy as xp
        self.kv = xp.zeros((self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads,
                            self.head_dim), dtype=dtype)
        self.pool = BlockPool(num_blocks)

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

    def layer(self, layer_idx: int):
        """The K and V caches of one layer.

        Parameters
        ----------
        layer_idx : int
            In ``[0, num_layers)``.

        Returns
        -------
        tuple
            ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``,
            C-contiguous views of the storage (writes land in the cache).

        Examples
        --------
        >>> cache = PagedAttentionCache(1, 2, 64, block_size=8, num_blocks=3, device="cpu")
        >>> [a.shape for a in cache.layer(0)]
        [(3, 8, 2, 64), (3, 8, 2, 64)]
        """
        layer_idx = int(layer_idx)
        if not 0 <= layer_idx < self.num_layers:
            raise IndexError(f"layer_idx must be in [0, {self.num_layers}); got {layer_idx}")
        return self.kv[layer_idx, 0], self.kv[layer_idx, 1]

    def to_dlpack(self, layer_idx: int):
        """DLPack capsules of one layer's K and V caches, for zero-copy use elsewhere.

        Returns
        -------
        tuple
            ``(k_capsule, v_capsule)``; e.g. ``torch.from_dlpack(k_capsule)`` shares the memory.

        Examples
        --------
        >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=2, device="cpu")
        >>> k_capsule, v_capsule = cache.to_dlpack(0)
        >>> type(k_capsule).__name__
        'PyCapsule'
        """
        k_cache, v_cache = self.layer(layer_idx)
        return k_cache.__dlpack__(), v_cache.__dlpack__()

    def copy_blocks(self, src, dst) -> None:
        """Copy blocks ``src[i]`` to ``dst[i]`` in every layer's K and V with one indexing op.

        Parameters
        ----------
        src, dst : array_like of int
            ``[n]`` block ids; ``dst`` distinct and disjoint from ``src``.

        Examples
        --------
        >>> cache = PagedAttentionCache(2, 1, 32, block_size=8, num_blocks=2, dtype="float32", device="cpu")
        >>> cache.kv[:, :, 0] = 1.0
        >>> cache.copy_blocks([0], [1])
        >>> float(cache.kv[1, 1, 1].min())
        1.0
        """
        xp = xp_of(self.kv)
        src = xp.asarray(np.asarray(src, np.int64))
        dst = xp.asarray(np.asarray(dst, np.int64))
        if src.size:
            self.kv[:, :, dst] = self.kv[:, :, src]

    def update(self, key_states, value_states, layer_idx: int, read_index, write_index):
        """The source document's manual cache path: scatter new K/V, gather a contiguous K/V.

        Writes ``key_states[i]`` to slot ``write_index[i]`` of layer ``layer_idx``, then
        returns the K/V at slots ``read_index`` as contiguous arrays for
        ``flash_attn_varlen_func``.  Both are single array-indexing operations (one
        GPU gather/scatter each on CuPy), never a host loop.

        Parameters
        ----------
        key_states, value_states : array
            ``[num_new, num_kv_heads, head_dim]``, or ``[1, num_new, num_kv_heads, head_dim]``.
        layer_idx : int
            Which layer's cache.
        read_index : array of int
            ``[total_k]`` slots (``block * block_size + offset``) to read, e.g. ``StepPlan.read_index``.
        write_index : array of int
            ``[num_new]`` slots to write, e.g. ``StepPlan.slot_mapping``.

        Returns
        -------
        tuple
            ``(keys, values)``, ``[total_k, num_kv_heads, head_dim]`` (with a leading axis of 1
            when the inputs had one).

        Raises
        ------
        ValueError
            On a shape mismatch or a slot outside ``[0, num_blocks * block_size)``.

        Examples
        --------
        >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=2, dtype="float32", device="cpu")
        >>> new = np.ones((2, 1, 32), np.float32)
        >>> k, v = cache.update(new, 2 * new, 0, read_index=np.array([9, 3]), write_index=np.array([3, 4]))
        >>> k.shape, float(k[1].sum()), float(k[0].sum())
        ((2, 1, 32), 32.0, 0.0)
        """
        key_states = as_array(key_states, "key_states")
        value_states = as_array(value_states, "value_states")
        batched = key_states.ndim == 4
        if batched:
            key_states, value_states = key_states[0], value_states[0]
        row = (self.num_kv_heads, self.head_dim)
        for name, states in (("key_states", key_states), ("value_states", value_states)):
            if states.ndim != 3 or tuple(states.shape[1:]) != row:
                raise ValueError(f"{name} must have shape [num_new, num_kv_heads = {row[0]}, "
                                 f"head_dim = {row[1]}] (or with a leading 1); got {tuple(states.shape)}")
        if key_states.shape != value_states.shape:
            raise ValueError(f"value_states must have the shape of key_states {tuple(key_states.shape)}; "
                             f"got {tuple(value_states.shape)}")
        xp = xp_of(self.kv)
        capacity = self.num_blocks * self.block_size
        indices = []
        for name, index, length in (("write_index", write_index, key_states.shape[0]),
                                    ("read_index", read_index, None)):
            index = xp.asarray(as_array(index, name))
            if index.ndim != 1 or index.dtype.kind not in "iu" or (length is not None and index.shape[0] != length):
                raise ValueError(f"{name} must be a 1-D integer array of "
                                 f"{'num_new = %d ' % length if length is not None else ''}slots; "
                                 f"got shape {tuple(index.shape)} dtype {index.dtype}")
            if index.size and (int(index.min()) < 0 or int(index.max()) >= capacity):
                raise ValueError(f"{name} holds slots outside [0, {capacity}) (num_blocks * block_size)")
            indices.append(index)
        write_index, read_index = indices
        k_cache, v_cache = (c.reshape(capacity, *row) for c in self.layer(layer_idx))
        k_cache[write_index] = key_states
        v_cache[write_index] = value_states
        keys, values = k_cache[read_index], v_cache[read_index]
        return (keys[None], values[None]) if batched else (keys, values)

    # ------------------------------------------------------------------ sequences

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._row_of

    def __len__(self) -> int:
        """Number of live sequences."""
        return len(self._row_of)

    def seq_ids(self) -> list:
        """The live sequences' ids."""
        return list(self._row_of)

    def rows(self, seq_ids) -> np.ndarray:
        """``[batch]`` int64 rows of ``tables`` of the given sequences.

        Examples
        --------
        >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=2, device="cpu")
        >>> cache.allocate(7, [1, 2, 3])
        0
        >>> cache.rows([7]).tolist()
        [0]
        """
        try:
            return np.array(list(map(self._row_of.__getitem__, seq_ids)), np.int64)
        except KeyError as error:
            raise KeyError(f"sequence {error.args[0]!r} is not in the cache") from None

    def blocks(self, seq_id) -> np.ndarray:
        """The block ids of one sequence, in order."""
        row = self.rows([seq_id])[0]
        return self.tables[row, :self._num_blocks[row]].copy()

    def num_slots(self, seq_id) -> int:
        """Positions of ``seq_id`` with a reserved slot."""
        return int(self._num_slots[self.rows([seq_id])[0]])

    def num_computed(self, seq_id) -> int:
        """Positions of ``seq_id`` whose K/V is written (``mark_computed``)."""
        return int(self._num_computed[self.rows([seq_id])[0]])

    def num_cached_tokens(self, token_ids) -> int:
        """How many leading tokens of ``token_ids`` the prefix cache already holds.

        Whole blocks only, and never the last token: its logits must be computed.

        Examples
        --------
        >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=4, device="cpu")
        >>> cache.allocate("a", list(range(20)))
        0
        >>> cache.mark_computed(["a"], [20])
        >>> cache.num_cached_tokens(list(range(17))), cache.num_cached_tokens(list(range(16)))
        (16, 8)
        """
        return len(self._match_prefix(token_ids)[0]) * self.block_size

    def _match_prefix(self, token_ids):
        """Cached blocks of the longest prefix, and the last matched hash."""
        blocks, parent = [], None
        if not self.enable_prefix_caching:
            return blocks, parent
        for _, tokens, block_hash in self._block_hashes(token_ids, 0, (len(token_ids) - 1) // self.block_size, None):
            block = self.pool.lookup(block_hash, tokens)
            if block < 0:
                break
            blocks.append(block)
            parent = block_hash
        return blocks, parent

    def _block_hashes(self, token_ids, first: int, last: int, parent):
        """(index, tokens, chained hash) of full blocks ``first .. last - 1`` of ``token_ids``,
        the chain starting from ``parent`` (the hash of block ``first - 1``, or None)."""
        bs = self.block_size
        for j in range(first, last):
            tokens = _token_tuple(token_ids, j * bs, (j + 1) * bs)
            parent = chain_hash(parent, tokens)
            yield j, tokens, parent

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
            Number of leading tokens already in the cache (a multiple of ``block_size``);
            ``cache_seqlens`` starts there.

        Raises
        ------
        CacheFull
            Not enough free blocks; nothing changed.
        ValueError
            ``seq_id`` already present, both ``num_new_tokens`` and ``max_num_new_tokens``
            given, a negative ``max_num_new_tokens``, or the sequence would exceed ``max_seq_len``.

        Examples
        --------
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
        if max_num_new_tokens is not None:
            if num_new_tokens is not None:
                raise ValueError("give num_new_tokens or max_num_new_tokens, not both")
            if int(max_num_new_tokens) < 0:
                raise ValueError(f"max_num_new_tokens must be >= 0; got {max_num_new_tokens}")
        hits, last_hash = self._match_prefix(token_ids)
        cached = len(hits) * self.block_size
        if num_new_tokens is not None:
            new = int(num_new_tokens)
        elif max_num_new_tokens is not None:
            new = min(len(token_ids) - cached, int(max_num_new_tokens))
        else:
            new = len(token_ids) - cached
        if new < 0 or cached + new > len(token_ids):
            raise ValueError(f"num_new_tokens must be in [0, {len(token_ids) - cached}] "
                             f"({len(token_ids)} tokens, {cached} cached); got {num_new_tokens}")
        self._check_length(seq_id, cached + new)
        fresh = -(-(cached + new) // self.block_size) - len(hits)
        revived = int((self.pool.ref_counts[np.asarray(hits, np.int64)] == 0).sum())
        self._check_room(fresh + revived, reserve)
        # Hits first: allocate() may evict cached free blocks, and must not evict these.
        self.pool.share(hits)
        blocks = np.concatenate([np.asarray(hits, np.int32), self.pool.allocate(fresh)])
        if not self._free_rows:
            self._add_rows(len(self._num_slots))
        row = self._free_rows.pop()
        self._row_of[seq_id] = row
        self.tables[row, :blocks.size] = blocks
        self._num_blocks[row] = blocks.size
        self.table_versions[row] += 1
        self._num_slots[row] = cached + new
        self._num_computed[row] = cached
        self._num_hashed[row] = len(hits)
        self._tokens[row] = token_ids
        self._last_hash[row] = last_hash
        return cached

    def blocks_needed(self, seq_ids, num_new_tokens) -> int:
        """Free blocks ``grow(seq_ids, num_new_tokens)`` would take (copy-on-write included).

        Examples
        --------
        >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=4, device="cpu")
        >>> cache.allocate("a", list(range(8)))
        0
        >>> cache.blocks_needed(["a"], [1])
        1
        """
        return int(self._growth(self.rows(seq_ids), num_new_tokens)[0].sum())

    def _growth(self, rows, num_new_tokens):
        """(new blocks per row, rows needing copy-on-write of their last block, new counts)."""
        new = np.broadcast_to(np.asarray(num_new_tokens, np.int64), rows.shape)
        if (new < 0).any():
            raise ValueError(f"num_new_tokens must be >= 0; got {new[new < 0][0]}")
        slots = self._num_slots[rows]
        have = self._num_blocks[rows]
        need = -(-(slots + new) // self.block_size) - have
        last = self.tables[rows, np.maximum(have - 1, 0)]
        cow = (new > 0) & (slots % self.block_size != 0) & (self.pool.ref_counts[last] > 1)
        if cow.any():
            # When every owner of a shared block writes into it in this call, the first keeps it.
            shared, first, writers = np.unique(last[cow], return_index=True, return_counts=True)
            keeps = writers == self.pool.ref_counts[shared]
            cow[np.flatnonzero(cow)[first[keeps]]] = False
        return need + cow, cow, new

    def grow(self, seq_ids, num_new_tokens, reserve: int = 0, rows: np.ndarray | None = None) -> None:
        """Reserve slots for ``num_new_tokens`` more tokens of each sequence.

        A sequence about to write into a last block it shares (after ``fork``) first gets
        a private copy of it; all such copies of the call are one ``copy_blocks``.

        Parameters
        ----------
        seq_ids : sequence
            Distinct live sequence ids.
        num_new_tokens : int or array_like of int
            ``[batch]`` (or one for all) tokens to add.
        reserve : int
            Blocks that must stay free afterwards.
        rows : numpy.ndarray, optional
            ``rows(seq_ids)`` when the caller already has them.

        Raises
        ------
        CacheFull
            Not enough free blocks for all of them; nothing changed.

        Examples
        --------
        >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=4, device="cpu")
        >>> cache.allocate("a", list(range(8)))
        0
        >>> cache.grow(["a"], 1)
        >>> cache.blocks("a").tolist()
        [0, 1]
        """
        rows = self.rows(seq_ids) if rows is None else rows
        seen = np.zeros(len(self._num_slots), bool)
        seen[rows] = True  # cheaper than np.unique for a thousand rows
        if np.count_nonzero(seen) != rows.size:
            raise ValueError("seq_ids must be distinct")
        need, cow, new = self._growth(rows, num_new_tokens)
        self._check_length(None, self._num_slots[rows] + new)
        self._check_room(int(need.sum()), reserve)
        fresh = self.pool.allocate(int(need.sum()))
        num_cow = int(cow.sum())
        if num_cow:
            cow_rows = rows[cow]
            columns = self._num_blocks[cow_rows] - 1
            shared = self.tables[cow_rows, columns]
            self.copy_blocks(shared, fresh[:num_cow])
            self.tables[cow_rows, columns] = fresh[:num_cow]
            self.pool.release(shared)
        _plan_kernels.append_blocks(self.tables, rows, self._num_blocks, need - cow, fresh[num_cow:])
        self._num_slots[rows] += new
        self.table_versions[rows[need > 0]] += 1

    def fork(self, parent_id, child_id, token_ids=None) -> None:
        """Start ``child_id`` sharing all of ``parent_id``'s blocks (no copy, no allocation).

        A shared, partly filled last block is copied on the first write into it by either.

        Parameters
        ----------
        parent_id, child_id : hashable
            A live sequence whose reserved slots are all computed, and a new id.
        token_ids : list of int, optional
            The child's token list (kept by reference).  Default: a copy of the parent's.

        Examples
        --------
        >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=4, device="cpu")
        >>> cache.allocate("p", list(range(12)))
        0
        >>> cache.mark_computed(["p"], [12])
        >>> cache.fork("p", "c")
        >>> cache.blocks("c").tolist(), int(cache.pool.ref_counts[1])
        ([0, 1], 2)
        """
        if child_id in self._row_of:
            raise ValueError(f"sequence {child_id!r} is already in the cache")
        parent = self.rows([parent_id])[0]
        if self._num_computed[parent] != self._num_slots[parent]:
            raise ValueError(f"sequence {parent_id!r} has reserved slots not yet computed: "
                             "fork it after mark_computed")
        tokens = list(self._tokens[parent]) if token_ids is None else token_ids
        if len(tokens) < self._num_slots[parent]:
            raise ValueError(f"token_ids must hold at least the parent's {self._num_slots[parent]} tokens")
        blocks = self.tables[parent, :self._num_blocks[parent]]
        self.pool.share(blocks)
        if not self._free_rows:
            self._add_rows(len(self._num_slots))
        child = self._free_rows.pop()
        self._row_of[child_id] = child
        for array in (self.tables, self._num_blocks, self._num_slots, self._num_computed, self._num_hashed):
            array[child] = array[parent]
        self.table_versions[child] += 1
        self._tokens[child] = tokens
        self._last_hash[child] = self._last_hash[parent]

    def mark_computed(self, seq_ids, num_computed, rows: np.ndarray | None = None) -> None:
        """Record that K/V is written up to ``num_computed`` tokens; cache newly full blocks.

        Parameters
        ----------
        seq_ids : sequence
            Live sequence ids.
        num_computed : int or array_like of int
            ``[batch]`` new totals, between the current count and ``num_slots``.
        rows : numpy.ndarray, optional
            ``rows(seq_ids)`` when the caller already has them.

        Examples
        --------
        >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=4, device="cpu")
        >>> cache.allocate("a", list(range(9)))
        0
        >>> cache.mark_computed(["a"], [9])
        >>> cache.cache_seqlens(["a"]).tolist(), cache.pool.num_cached
        ([9], 1)
        """
        rows = self.rows(seq_ids) if rows is None else rows
        counts = np.broadcast_to(np.asarray(num_computed, np.int64), rows.shape)
        bad = (counts < self._num_computed[rows]) | (counts > self._num_slots[rows])
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"num_computed for sequence {list(seq_ids)[i]!r} must be in "
                             f"[{self._num_computed[rows[i]]}, {self._num_slots[rows[i]]}]; "
                             f"got {counts[i]}")
        self._num_computed[rows] = counts
        if not self.enable_prefix_caching:
            return
        full = counts // self.block_size
        for row in rows[full > self._num_hashed[rows]].tolist():
            self._hash_full_blocks(row)

    def _hash_full_blocks(self, row: int) -> None:
        parent, last = self._last_hash[row], int(self._num_computed[row]) // self.block_size
        for j, block_tokens, parent in self._block_hashes(self._tokens[row], int(self._num_hashed[row]), last, parent):
            self.pool.register(int(self.tables[row, j]), parent, block_tokens)
        self._last_hash[row] = parent
        self._num_hashed[row] = last

    def free(self, seq_id) -> None:
        """Drop a sequence; blocks nobody else holds become free (cached ones stay cached).

        Examples
        --------
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

    # ------------------------------------------------------------------ batch views

    def block_table(self, seq_ids, width: int | None = None) -> np.ndarray:
        """Block tables of a batch, ``[batch, width]`` int32, -1 padded.

        Parameters
        ----------
        seq_ids : sequence
            Live sequence ids.
        width : int, optional
            Columns; default the most blocks any of them holds.

        Examples
        --------
        >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=4, device="cpu")
        >>> cache.allocate("a", list(range(3))), cache.allocate("b", list(range(17)))
        (0, 0)
        >>> cache.block_table(["a", "b"]).tolist()
        [[0, -1, -1], [1, 2, 3]]
        """
        rows = self.rows(seq_ids)
        longest = int(self._num_blocks[rows].max(initial=0))
        width = longest if width is None else int(width)
        if not longest <= width <= self.max_blocks_per_seq:
            raise ValueError(f"width must be in [{longest}, {self.max_blocks_per_seq}]: at least the most "
                             "blocks a sequence holds, at most max_blocks_per_seq")
        return self.tables[rows, :width]  # indexing by an array copies: later changes do not show

    def cache_seqlens(self, seq_ids) -> np.ndarray:
        """``[batch]`` int32 tokens already in the cache (``num_computed``) of each sequence."""
        return self._num_computed[self.rows(seq_ids)].astype(np.int32)

    def slot_mapping(self, seq_ids) -> np.ndarray:
        """Slots of the reserved, not yet computed positions, concatenated in batch order.

        Returns
        -------
        numpy.ndarray
            ``[sum(num_slots - num_computed)]`` int32, ``block * block_size + offset``.

        Examples
        --------
        >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=4, device="cpu")
        >>> cache.allocate("a", list(range(2))), cache.allocate("b", list(range(3)))
        (0, 0)
        >>> cache.slot_mapping(["b", "a"]).tolist()
        [8, 9, 10, 0, 1]
        """
        rows = self.rows(seq_ids)
        starts = self._num_computed[rows]
        counts = self._num_slots[rows] - starts
        out = np.empty(int(counts.sum()), np.int32)
        _plan_kernels.gather_slots(self.tables, rows, starts, counts, self.block_size, out)
        return out

    def context_lens(self, rows: np.ndarray) -> np.ndarray:
        """``num_computed`` of the given rows (for plan building, which works on rows)."""
        return self._num_computed[rows]

    def reserved_lens(self, rows: np.ndarray) -> np.ndarray:
        """``num_slots`` of the given rows."""
        return self._num_slots[rows]

    # ------------------------------------------------------------------ internals

    def _check_room(self, blocks: int, reserve: int) -> None:
        if blocks + int(reserve) > self.pool.num_free:
            raise CacheFull(f"need {blocks} free blocks (+{int(reserve)} kept in reserve) but "
                            f"{self.pool.num_free} of {self.num_blocks} are free")

    def _check_length(self, seq_id, lengths) -> None:
        longest = int(np.max(lengths, initial=0))
        if longest > self.max_seq_len:
            who = "a sequence" if seq_id is None else f"sequence {seq_id!r}"
            raise ValueError(f"{who} would hold {longest} tokens, more than max_seq_len = "
                             f"{self.max_seq_len} (max_blocks_per_seq * block_size)")

    def _add_rows(self, count: int) -> None:
        start = len(self._num_slots)
        self.tables = np.concatenate([self.tables, np.full((count, self.max_blocks_per_seq), -1, np.int32)])
        for name in ("_num_blocks", "_num_slots", "_num_computed", "_num_hashed", "table_versions"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(count, np.int64)]))
        self._tokens.extend([None] * count)
        self._last_hash.extend([None] * count)
        self._free_rows.extend(range(start + count - 1, start - 1, -1))
