"""The CPU reference of `flash_attn_varlen_func`."""
from __future__ import annotations

import numpy as np

from .._core.problems import VarlenProblem
from ._attend import _length, _rows, _slopes_of, accumulator_dtype, attend, paged_slots

def run(p: VarlenProblem, new_k=None, new_v=None) -> None:
    """Fill ``p.out`` (and ``p.lse``) for a checked varlen problem.

    Unchecked lengths, as the kernels take them: a negative length is an empty sequence; query
    rows past ``max_seqlen_q`` are not computed (the kernels' grid ends there) and rows outside q
    are neither read nor written, though the sequence keeps its length for the diagonal; a key
    past k's end (every key when ``cu_seqlens_k[b] < 0``) or behind a bad block id is a hole.

    ``new_k``/``new_v`` ``[total_q, Hkv, D]`` (paged only): each sequence's last ``length_q`` keys
    are its query tokens' own, read from these rows instead of the cache, whatever the block table
    holds there -- how the ragged step launch reads the tokens it appends (a token whose slot is a
    hole is not in the cache, and is still attended).
    """
    acc = accumulator_dtype(p.q.dtype)
    cu_q, cu_k = p.cu_seqlens_q, p.cu_seqlens_k
    total_q = p.q.shape[0]
    for b in range(p.batch):
        q_start, k_start = int(cu_q[b]), int(cu_k[b])
        length_q, length_k = _length(cu_q, b), _length(cu_k, b)
        first, last = max(0, -q_start), min(length_q, p.max_seqlen_q, total_q - q_start)  # rows computed
        if first >= last:
            continue
        if p.block_table is None:
            loadable = 0 if k_start < 0 else max(0, min(length_k, p.k.shape[0] - k_start))
            found = np.arange(loadable)
            k_b, v_b = p.k[k_start + found], p.v[k_start + found]
        else:
            # Keys past the table's last column are holes: only those before it can be found.
            width = p.block_table.shape[1] * p.block_size
            cached = length_k if new_k is None else max(0, length_k - length_q)
            slots = paged_slots(p.block_table[b], np.arange(min(cached, width)), p.block_size, p.k.shape[0])
            found = np.flatnonzero(slots >= 0)
            k_b, v_b = _rows(p.k)[slots[found]], _rows(p.v)[slots[found]]
            if new_k is not None:  # the sequence's own tokens, from k/v (those inside q's rows)
                new = np.arange(max(0, q_start), min(total_q, q_start + length_q))
                found = np.concatenate([found, cached + new - q_start])
                k_b, v_b = np.concatenate([k_b, new_k[new]]), np.concatenate([v_b, new_v[new]])
        rows = slice(q_start + first, q_start + last)
        out, lse = attend(p.q[rows], k_b, v_b, p.softmax_scale, p.window, p.softcap, _slopes_of(p.alibi_slopes, b),
                          acc, key_index=found, offset=length_k - length_q + first)
        p.out[rows] = out.astype(p.out.dtype)
        if p.lse is not None:
            p.lse[:, rows] = lse


