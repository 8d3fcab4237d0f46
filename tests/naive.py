"""A plain float64 attention, one query row at a time, written apart from the package.

It shares no code with ``cupy_paged.reference``: the reference backend is checked
against it, and the kernels against the reference backend.
"""
import math

import numpy as np


def naive_attention(q, k, v, scale, causal=False, window=(-1, -1), softcap=0.0, slopes=None):
    """q ``[Lq, H, D]``, k/v ``[Lk, Hkv, D]`` -> out ``[Lq, H, D]`` float64, lse ``[H, Lq]``."""
    num_q, num_heads, head_dim = q.shape
    num_k, num_kv_heads = k.shape[:2]
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    out = np.zeros((num_q, num_heads, head_dim))
    lse = np.full((num_heads, num_q), -math.inf)
    left, right = window
    if causal:
        right = 0
    j = np.arange(num_k)
    for h in range(num_heads):
        kv = h // (num_heads // num_kv_heads)
        for i in range(num_q):
            diagonal = i + num_k - num_q          # the key aligned with query i
            keep = np.ones(num_k, bool)
            if left >= 0:
                keep &= j >= diagonal - left
            if right >= 0:
                keep &= j <= diagonal + right
            if not keep.any():
                continue                           # no key: zeros, lse -inf
            s = scale * (k[keep, kv] @ q[i, h])
            if softcap > 0:
                s = softcap * np.tanh(s / softcap)
            if slopes is not None:
                s = s - float(slopes[h]) * np.abs(diagonal - j[keep])
            w = np.exp(s - s.max())
            out[i, h] = w @ v[keep, kv] / w.sum()
            lse[h, i] = s.max() + math.log(w.sum())
    return out, lse
