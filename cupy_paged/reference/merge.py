"""The CPU reference of `merge_attention_states`."""
from __future__ import annotations

import numpy as np

def _rows(lse, ndim: int):
    """LSE as [..., H] rows aligned with out's leading axes (a view)."""
    return lse.T if ndim == 3 else lse.transpose(0, 2, 1)


def run(out_a, lse_a, out_b, lse_b, out):
    la = _rows(lse_a, out_a.ndim).astype(np.float64)
    lb = _rows(lse_b, out_a.ndim).astype(np.float64)
    top = np.maximum(la, lb)
    safe = np.where(np.isneginf(top), 0.0, top)
    with np.errstate(invalid="ignore"):  # a NaN or +inf LSE: a NaN weight (inf - inf), as in merge.cu
        wa, wb = np.exp(la - safe), np.exp(lb - safe)
    total = wa + wb
    seen = total > 0
    merged = np.zeros(out_a.shape, np.float64)
    for weight, part in ((wa, out_a), (wb, out_b)):
        contributes = weight > 0  # a side with weight 0 may hold anything (NaN): never read it
        share = np.where(seen, weight / np.where(seen, total, 1.0), 0.0)[..., None]
        merged += np.where(contributes[..., None], share * part.astype(np.float64), 0.0)
    merged_lse = np.where(seen, safe + np.log(np.where(seen, total, 1.0)), -np.inf).astype(np.float32)
    invalid = np.isnan(total)  # the row NaN, never one that reads as empty (zeros, LSE -inf)
    merged[invalid], merged_lse[invalid] = np.nan, np.nan
    lse = np.ascontiguousarray(_rows(merged_lse, out_a.ndim))  # the transpose is its own inverse
    out[...] = merged.astype(out_a.dtype)
    return out, lse
