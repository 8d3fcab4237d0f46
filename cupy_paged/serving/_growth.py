"""Growing sequences: reserving more slots, and the copy-on-write of a shared last block that
``fork`` sets up (a forked sequence shares every block of its parent until one of them writes)."""
from __future__ import annotations

import numpy as np

from .._core.types import check_counts, check_int
from ._tables import append_blocks, count_decode_growth, grow_decodes, grow_decodes_from_stack
from .requests import token_array

_NO_BLOCKS = np.empty(0, np.int32)


class Growth:
    """``grow``, ``blocks_needed`` and ``fork`` of :class:`~cupy_paged.serving.kv_cache.PagedAttentionCache`."""

    def blocks_needed(self, seq_ids, num_new_tokens) -> int:
        """Free blocks ``grow(seq_ids, num_new_tokens)`` would take (copy-on-write included).

        Parameters
        ----------
        seq_ids : sequence
            Live sequence ids.
        num_new_tokens : int or array_like of int
            ``[batch]`` (or one for all) tokens each would add.

        Returns
        -------
        int

        Examples
        --------
        >>> from cupy_paged import PagedAttentionCache
        >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=4, device="cpu")
        >>> cache.allocate("a", list(range(8)))
        0
        >>> cache.blocks_needed(["a"], [1])
        1
        """
        return int(self._growth(self.rows(seq_ids), num_new_tokens)[0].sum())

    def _growth(self, rows, num_new_tokens):
        """(new blocks per row, rows needing copy-on-write of their last block, new counts)."""
        new = check_counts(num_new_tokens, rows.shape[0], "num_new_tokens")
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

    def grow(self, seq_ids, num_new_tokens, reserve: int = 0, rows: np.ndarray | None = None,
             cow_log: list | None = None) -> None:
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
        cow_log : list, optional
            Gets the call's copies-on-write, for a :meth:`shrink` that undoes them.

        Raises
        ------
        CacheFull
            Not enough free blocks for all of them; nothing changed.

        Examples
        --------
        >>> from cupy_paged import PagedAttentionCache
        >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=4, device="cpu")
        >>> cache.allocate("a", list(range(8)))
        0
        >>> cache.grow(["a"], 1)
        >>> cache.blocks("a").tolist()
        [0, 1]
        """
        rows = self.rows(seq_ids) if rows is None else rows
        if type(num_new_tokens) is int and num_new_tokens == 1 and self._grow_decodes(rows, reserve):
            return
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
            if cow_log is not None:
                cow_log.append((cow_rows, columns, shared.copy(), fresh[:num_cow].copy()))
        append_blocks(self.tables, rows, self._num_blocks, need - cow, fresh[num_cow:])
        self._num_slots[rows] += new
        self.table_versions[rows[need > 0]] += 1

    def _grow_decodes(self, rows: np.ndarray, reserve: int) -> bool:
        """``grow(rows, 1)`` in one numba pass, the decode step's case; False (nothing changed) when
        the general path must take it: a row listed twice, too long, or a copy-on-write."""
        if self._seen.size < self._num_slots.size:
            self._seen = np.zeros(self._num_slots.size, bool)
        pool = self.pool
        if type(reserve) is not int or reserve < 0:
            reserve = check_int(reserve, "reserve", 0)
        taken = grow_decodes_from_stack(self.tables, rows, self._num_blocks, self._num_slots, pool.ref_counts,
                                        self.table_versions, self.block_size, self.max_blocks_per_seq, self._seen,
                                        pool._stack, pool._top, pool.num_free - reserve)
        if taken >= 0:
            pool._top -= taken
            return True
        if taken > -4:
            return False
        need = count_decode_growth(self.tables, rows, self._num_blocks, self._num_slots, pool.ref_counts,
                                   self.block_size, self.max_blocks_per_seq, self._seen)
        self._check_room(need, reserve)
        fresh = self.pool.allocate(need) if need else _NO_BLOCKS
        grow_decodes(self.tables, rows, self._num_blocks, self._num_slots, self.table_versions, fresh,
                     self.block_size)
        return True

    def shrink(self, seq_ids, num_tokens, rows: np.ndarray | None = None, cow_log=()) -> None:
        """Give back the last ``num_tokens`` reserved, not yet computed slots of each sequence: the
        inverse of :meth:`grow` (blocks no longer needed are freed, so a later ``grow`` of the same
        counts takes the same blocks again).

        Parameters
        ----------
        seq_ids : sequence
            Distinct live sequence ids.
        num_tokens : int or array_like of int
            ``[batch]`` (or one for all) slots to give back, at most each one's uncomputed slots.
        rows : numpy.ndarray, optional
            ``rows(seq_ids)`` when the caller already has them.
        cow_log : list, optional
            The ``cow_log`` of the ``grow`` undone: its copies go back to the blocks they copied
            (where those are still owned or cached; else the copy stays).

        Raises
        ------
        ValueError
            When a sequence would give back computed slots.

        Examples
        --------
        >>> from cupy_paged import PagedAttentionCache
        >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=4, device="cpu")
        >>> cache.allocate("a", list(range(8)))
        0
        >>> cache.grow(["a"], 1)
        >>> cache.shrink(["a"], 1)
        >>> cache.num_slots("a"), cache.blocks("a").tolist(), cache.num_free_blocks
        (8, [0], 3)
        """
        rows = self.rows(seq_ids) if rows is None else rows
        back = check_counts(num_tokens, rows.shape[0], "num_tokens")
        slots = self._num_slots[rows] - back
        if (back < 0).any() or (slots < self._num_computed[rows]).any():
            raise ValueError("shrink gives back only reserved slots not yet computed")
        keep = -(-slots // self.block_size)
        freed = []
        # Last row first, each row's last block first: the pool's free stack then hands them out
        # again in the order grow took them.
        for row, kept in zip(rows.tolist()[::-1], keep.tolist()[::-1]):
            have = int(self._num_blocks[row])
            if kept < have:
                freed.append(self.tables[row, kept:have][::-1].copy())
                self.tables[row, kept:have] = -1
                self._num_blocks[row] = kept
                self.table_versions[row] += 1
        self._num_slots[rows] = slots
        if freed:
            self.pool.release(np.concatenate(freed))
        for cow_rows, columns, shared, copies in reversed(cow_log):
            self._undo_copies(cow_rows, columns, shared, copies)

    def _undo_copies(self, cow_rows, columns, shared, copies) -> None:
        """Rows ``cow_rows`` take back the blocks ``shared`` their ``copies`` were made of."""
        back = []
        for row, column, block, copy in zip(cow_rows.tolist(), columns.tolist(), shared.tolist(), copies.tolist()):
            if self._num_blocks[row] > column and self.tables[row, column] == copy and (
                    self.pool.ref_counts[block] > 0 or self.prefix_cache.holds(block)):
                self.pool.share([block])
                self.tables[row, column] = block
                self.table_versions[row] += 1
                back.append(copy)
        if back:
            self.pool.release(back[::-1])

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
        >>> from cupy_paged import PagedAttentionCache
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
        if token_ids is not None:
            token_array(token_ids, "token_ids")  # ints only, as allocate takes them
        tokens = list(self._tokens[parent]) if token_ids is None else token_ids
        if len(tokens) < self._num_slots[parent]:
            raise ValueError(f"token_ids must hold at least the parent's {self._num_slots[parent]} tokens")
        blocks = self.tables[parent, :self._num_blocks[parent]]
        self.pool.share(blocks)
        child = self._new_row(child_id)
        for array in (self.tables, self._num_blocks, self._num_slots, self._num_computed, self._num_hashed):
            array[child] = array[parent]
        self._tokens[child] = tokens
        self._last_hash[child] = self._last_hash[parent]
