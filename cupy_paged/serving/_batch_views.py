"""Read-only views of the cache's sequences and block tables: membership, lengths, a batch's
block table and slot mapping, and the narrow view a step plan reads (``plan_view``)."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .._core.paging import gather_slots
from .._core.types import check_int


class PlanView(NamedTuple):
    """What a step plan reads from the cache for one batch (``PagedAttentionCache.plan_view``).

    The arrays ``tables`` and ``table_versions`` are the cache's own, not copies: the view is
    valid until the cache next changes.
    """

    tables: np.ndarray  # [max_seqs, max_blocks_per_seq] int32 block ids, -1 past a row's last block
    table_versions: np.ndarray  # [max_seqs] int64, bumped on every change of a row of `tables`
    block_size: int
    max_blocks_per_seq: int
    device: str  # "cpu" or "cuda": where the storage, and so the plan, lives
    num_computed: np.ndarray  # [batch] int64 tokens of each row whose K/V is in the cache ([max_seqs] by row for rows=None)
    num_slots: np.ndarray  # [batch] int64 positions of each row with a reserved slot (likewise)


class BatchViews:
    """Read-only methods of :class:`~cupy_paged.serving.kv_cache.PagedAttentionCache` over its
    sequence rows (``tables`` and the per-row lengths)."""

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._row_of

    def __len__(self) -> int:
        """Number of live sequences."""
        return len(self._row_of)

    def seq_ids(self) -> list:
        """The live sequences' ids.

        Returns
        -------
        list
            In the order they were added (a copy).
        """
        return list(self._row_of)

    def rows(self, seq_ids) -> np.ndarray:
        """``[batch]`` int64 rows of ``tables`` of the given sequences.

        Parameters
        ----------
        seq_ids : iterable
            Live sequence ids.

        Returns
        -------
        numpy.ndarray
            ``[batch]`` int64; a row stays with its sequence until it is freed.

        Raises
        ------
        KeyError
            For a sequence not in the cache.

        Examples
        --------
        >>> from cupy_paged import PagedAttentionCache
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
        """The block ids of one sequence, in order.

        Parameters
        ----------
        seq_id : hashable
            A live sequence id.

        Returns
        -------
        numpy.ndarray
            ``[num_blocks]`` int32, a copy.
        """
        row = self.rows([seq_id])[0]
        return self.tables[row, :self._num_blocks[row]].copy()

    def num_slots(self, seq_id) -> int:
        """Positions of ``seq_id`` with a reserved slot.

        Parameters
        ----------
        seq_id : hashable
            A live sequence id.

        Returns
        -------
        int
        """
        return int(self._num_slots[self.rows([seq_id])[0]])

    def num_computed(self, seq_id) -> int:
        """Positions of ``seq_id`` whose K/V is written (``mark_computed``).

        Parameters
        ----------
        seq_id : hashable
            A live sequence id.

        Returns
        -------
        int
        """
        return int(self._num_computed[self.rows([seq_id])[0]])

    def num_cached_tokens(self, token_ids) -> int:
        """How many leading tokens of ``token_ids`` the prefix cache already holds.

        Whole blocks only, and never the last token: its logits must be computed.

        Parameters
        ----------
        token_ids : list of int
            A sequence's tokens.

        Returns
        -------
        int
            A multiple of ``block_size``.

        Examples
        --------
        >>> from cupy_paged import PagedAttentionCache
        >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=4, device="cpu")
        >>> cache.allocate("a", list(range(20)))
        0
        >>> cache.mark_computed(["a"], [20])
        >>> cache.num_cached_tokens(list(range(17))), cache.num_cached_tokens(list(range(16)))
        (16, 8)
        """
        return self.prefix_cache.num_cached_tokens(token_ids)

    def block_table(self, seq_ids, width: int | None = None) -> np.ndarray:
        """Block tables of a batch, ``[batch, width]`` int32, -1 padded.

        Parameters
        ----------
        seq_ids : sequence
            Live sequence ids.
        width : int, optional
            Columns; default the most blocks any of them holds.

        Returns
        -------
        numpy.ndarray
            ``[batch, width]`` int32, a copy.

        Examples
        --------
        >>> from cupy_paged import PagedAttentionCache
        >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=4, device="cpu")
        >>> cache.allocate("a", list(range(3))), cache.allocate("b", list(range(17)))
        (0, 0)
        >>> cache.block_table(["a", "b"]).tolist()
        [[0, -1, -1], [1, 2, 3]]
        """
        rows = self.rows(seq_ids)
        longest = int(self._num_blocks[rows].max(initial=0))
        width = longest if width is None else check_int(width, "width")
        if not longest <= width <= self.max_blocks_per_seq:
            raise ValueError(f"width must be in [{longest}, {self.max_blocks_per_seq}]: at least the most "
                             "blocks a sequence holds, at most max_blocks_per_seq")
        return self.tables[rows, :width]  # indexing by an array copies: later changes do not show

    def num_computed_batch(self, seq_ids) -> np.ndarray:
        """``[batch]`` int32 ``num_computed`` of each sequence (e.g. a decode call's ``cache_seqlens``).

        Parameters
        ----------
        seq_ids : sequence
            Live sequence ids.

        Returns
        -------
        numpy.ndarray
            ``[batch]`` int32.
        """
        return self._num_computed[self.rows(seq_ids)].astype(np.int32)

    def slot_mapping(self, seq_ids) -> np.ndarray:
        """Slots of the reserved, not yet computed positions, concatenated in batch order.

        Parameters
        ----------
        seq_ids : sequence
            Live sequence ids.

        Returns
        -------
        numpy.ndarray
            ``[sum(num_slots - num_computed)]`` int32, ``block * block_size + offset``.

        Examples
        --------
        >>> from cupy_paged import PagedAttentionCache
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
        gather_slots(self.tables, rows, starts, counts, self.block_size, out)
        return out

    def plan_view(self, rows: np.ndarray | None) -> PlanView:
        """What a step plan reads from the cache for the sequences in ``rows`` (``rows(seq_ids)``).

        Parameters
        ----------
        rows : numpy.ndarray or None
            ``[batch]`` int64 rows of live sequences; None for the lengths of every row, the
            cache's own arrays (indexed by row, not by batch position).

        Returns
        -------
        PlanView
            The cache's own ``tables`` and ``table_versions`` (valid until it next changes) and
            the rows' lengths.

        Examples
        --------
        >>> from cupy_paged import PagedAttentionCache
        >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=4, device="cpu")
        >>> cache.allocate("a", list(range(10)))
        0
        >>> view = cache.plan_view(cache.rows(["a"]))
        >>> view.num_computed.tolist(), view.num_slots.tolist(), view.tables[0, :2].tolist()
        ([0], [10], [0, 1])
        """
        if rows is None:
            return PlanView(self.tables, self.table_versions, self.block_size, self.max_blocks_per_seq, self.device,
                            self._num_computed, self._num_slots)
        return PlanView(self.tables, self.table_versions, self.block_size, self.max_blocks_per_seq, self.device,
                        self._num_computed[rows], self._num_slots[rows])
