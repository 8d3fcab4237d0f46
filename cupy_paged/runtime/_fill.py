"""The numba loop that writes a step plan's index arrays.

One pass over the batch with no per-token Python.  ``table`` is the cache's
``[max_seqs, max_blocks_per_seq]`` int32 array of block ids (-1 past a sequence's last
block) and ``rows`` the batch's rows of it.
"""
from __future__ import annotations

import numba
import numpy as np

from .._core.paging import slot_of
from .._core.types import check_counts
from ._work import DECODE

# memo_rows value meaning "this output row holds nothing known": it is always rewritten.
UNKNOWN_ROW = -2
# memo_rows value of a padding row (all -1).
PADDING_ROW = -1


@numba.njit(cache=True, nogil=True, inline="always")
def _copy_row(src, dst):
    # An explicit loop: numba compiles it to a tighter copy than slice assignment.
    for j in range(dst.shape[0]):
        dst[j] = src[j]


@numba.njit(cache=True, nogil=True)
def fill_plan(table, versions, rows, num_computed, query_lens, block_size,
              positions, slots, cu_q, cu_k, query_out, cache_seqlens, seqlens_k,
              block_table, memo_rows, memo_versions):
    """Write one step's index arrays; returns ``(max_seqlen_q, max_seqlen_k)``.

    ``num_computed[i]`` is the tokens of ``rows[i]`` already cached; it goes out as
    ``cache_seqlens`` (the decode kernel's argument) and starts the row's new positions.
    Outputs may be longer than the batch (CUDA-graph padding): extra tokens get
    position 0 and slot -1, extra sequences length 0 and an all -1 block table row.
    A block table row is copied only when ``memo_rows`` / ``memo_versions`` say it
    holds another row or an older version of it: in a steady decode batch only
    the rows that gained a block are rewritten.
    """
    batch = rows.shape[0]
    cu_q[0] = 0
    cu_k[0] = 0
    max_q = 0
    max_k = 0
    t = 0
    for i in range(batch):
        row = rows[i]
        table_row = table[row]
        seqlen_k = num_computed[i] + query_lens[i]
        for position in range(num_computed[i], seqlen_k):
            positions[t] = position
            slots[t] = slot_of(table_row, position, block_size)
            t += 1
        cu_q[i + 1] = t
        cu_k[i + 1] = cu_k[i] + seqlen_k
        query_out[i] = query_lens[i]
        cache_seqlens[i] = num_computed[i]
        seqlens_k[i] = seqlen_k
        max_q = max(max_q, query_lens[i])
        max_k = max(max_k, seqlen_k)
        if memo_rows[i] != row or memo_versions[i] != versions[row]:
            _copy_row(table_row[:block_table.shape[1]], block_table[i])
            memo_rows[i] = row
            memo_versions[i] = versions[row]
    for j in range(t, positions.shape[0]):
        positions[j] = 0
        slots[j] = -1
    _pad_rows(batch, t, cu_q, cu_k, query_out, cache_seqlens, seqlens_k, block_table, memo_rows)
    return max_q, max_k


@numba.njit(cache=True, nogil=True, inline="always")
def _pad_rows(batch, tokens, cu_q, cu_k, query_out, cache_seqlens, seqlens_k, block_table, memo_rows):
    # Rows past the batch (CUDA-graph padding): no tokens, no keys, an all -1 block table row.
    for i in range(batch, block_table.shape[0]):
        cu_q[i + 1] = tokens
        cu_k[i + 1] = cu_k[batch]
        query_out[i] = 0
        cache_seqlens[i] = 0
        seqlens_k[i] = 0
        if memo_rows[i] != PADDING_ROW:
            block_table[i, :] = -1
            memo_rows[i] = PADDING_ROW


def query_lengths(query_lens, batch: int) -> np.ndarray:
    """``query_lens`` as ``[batch]`` int64 (one int is every sequence's)."""
    return check_counts(query_lens, batch, "query_lens")


@numba.njit(cache=True, nogil=True)
def _first_unreserved(computed, query, reserved) -> int:
    """The first row with no new token or more than its reserved slots, else -1 (one pass)."""
    for b in range(query.shape[0]):
        if query[b] < 1 or computed[b] + query[b] > reserved[b]:
            return b
    return -1


def check_reserved(seq_ids: list, view, query: np.ndarray) -> None:
    """Every sequence has >= 1 new token, each with a reserved slot."""
    computed, reserved = view.num_computed, view.num_slots
    bad = _first_unreserved(computed, query, reserved)
    if bad >= 0:
        raise ValueError(f"query_lens[{bad}] = {int(query[bad])} must be >= 1 and fit the "
                         f"{int(reserved[bad] - computed[bad])} slots reserved past "
                         f"the {int(computed[bad])} cached tokens of {seq_ids[bad]!r}")


@numba.njit(cache=True, nogil=True)
def fill_decodes(table, versions, rows, computed, reserved, block_size, input_ids, has_input,
                 positions, slots, cu_q, cu_k, query_out, cache_seqlens, seqlens_k, block_table,
                 memo_rows, memo_versions, input_out, logits, tail):
    """:func:`fill_plan` for a step of one new token per sequence, with what ``build_plan`` does
    around it folded in: the reserved-slot check (``computed`` and ``reserved`` are the cache's
    whole per-row arrays, read at ``rows``), the input ids, every row sampling, the tail prefix
    sums (no split).  Returns ``max_seqlen_k``, or ``-1 - i`` when row ``i`` has no reserved slot
    (nothing written then)."""
    batch = rows.shape[0]
    for i in range(batch):
        if computed[rows[i]] >= reserved[rows[i]]:
            return -1 - i
    cu_q[0] = 0
    cu_k[0] = 0
    max_k = 0
    for i in range(batch):
        row = rows[i]
        table_row = table[row]
        position = computed[row]
        positions[i] = position
        slots[i] = slot_of(table_row, position, block_size)
        cu_q[i + 1] = i + 1
        cu_k[i + 1] = cu_k[i] + position + 1
        query_out[i] = 1
        cache_seqlens[i] = position
        seqlens_k[i] = position + 1
        max_k = max(max_k, position + 1)
        if memo_rows[i] != row or memo_versions[i] != versions[row]:
            _copy_row(table_row[:block_table.shape[1]], block_table[i])
            memo_rows[i] = row
            memo_versions[i] = versions[row]
        input_out[i] = input_ids[i] if has_input else 0
        logits[i] = i
    for j in range(batch, positions.shape[0]):
        positions[j] = 0
        slots[j] = -1
        input_out[j] = 0
    _pad_rows(batch, batch, cu_q, cu_k, query_out, cache_seqlens, seqlens_k, block_table, memo_rows)
    for i in range(batch, logits.shape[0]):
        logits[i] = 0
    for i in range(cu_q.shape[0]):
        tail[i] = cu_q[i]
    return max_k


_NO_INPUT = np.zeros(0, np.int64)
_SAMPLE_MASKS: dict = {}  # (batch, batch_size) -> read-only mask of the first batch rows


def decode_plan_fields(cache, seq_ids: list, rows: np.ndarray, input_ids, buffers, batch_size, num_tokens):
    """``build_plan``'s ``StepPlan`` fields for one new token per sequence into ``buffers``, in one
    numba pass (:func:`fill_decodes`), or None when the padding asked for is not a decode step's
    (as many tokens as rows), which the general path then plans."""
    batch = rows.size
    batch_size = batch if batch_size is None else int(batch_size)
    num_tokens = batch_size if num_tokens is None else int(num_tokens)
    if num_tokens != batch_size:
        return None
    out, memo_rows, memo_versions = buffers.host_views(batch, batch, batch_size, num_tokens, cache.max_blocks_per_seq)
    if input_ids is not None:
        input_ids = np.asarray(input_ids)
        if input_ids.shape != (batch,):
            raise ValueError(f"input_ids must have shape [num_tokens = {batch}]; got {input_ids.shape}")
    view = cache.plan_view(None)
    max_k = fill_decodes(view.tables, view.table_versions, rows, view.num_computed, view.num_slots, view.block_size,
                         _NO_INPUT if input_ids is None else input_ids, input_ids is not None,
                         out["positions"], out["slot_mapping"], out["cu_seqlens_q"], out["cu_seqlens_k"],
                         out["query_lens"], out["cache_seqlens"], out["seqlens_k"], out["block_table"],
                         memo_rows, memo_versions, out["input_ids"], out["logits_indices"], out["tail_cu_seqlens_q"])
    if max_k < 0:
        check_reserved(seq_ids, cache.plan_view(rows), np.ones(batch, np.int64))  # raises, naming the row
    out = buffers.upload(batch_size, num_tokens)
    if input_ids is None:
        out["input_ids"] = None
    mask = _SAMPLE_MASKS.get((batch, batch_size))
    if mask is None:
        if len(_SAMPLE_MASKS) > 256:
            _SAMPLE_MASKS.clear()
        mask = _SAMPLE_MASKS[batch, batch_size] = np.arange(batch_size) < batch
        mask.flags.writeable = False
    if batch_size > batch:
        seq_ids = seq_ids + [None] * (batch_size - batch)
    out["logits_indices"] = out["logits_indices"][:batch]
    return dict(out, seq_ids=seq_ids, max_seqlen_q=1, max_seqlen_k=int(max_k), sample_mask=mask, path=DECODE,
                block_size=view.block_size)
