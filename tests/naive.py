"""A plain float64 attention, one query row at a time, written apart from the package.

It shares no code with ``cupy_paged.reference``: the reference backend is checked
against it, and the kernels against the reference backend.
"""
import math

import numpy as np


def naive_attention(q, k, v, scale, causal=False, window=(-1, -1), softcap=0.0, slopes=None, present=None):
    """q ``[Lq, H, D]``, k/v ``[Lk, Hkv, D]`` -> out ``[Lq, H, D]`` float64, lse ``[H, Lq]``.

    ``present`` (bool ``[Lk]``, optional): keys marked False are holes, left out without
    moving the others (the diagonal, the window and the ALiBi distances stay where they are).
    """
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
            if present is not None:
                keep &= np.asarray(present, bool)
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


def naive_rotary(x, cos, sin, positions, interleaved):
    """Rotary embedding of ``x [L, H, D]``, token ``l`` at ``positions[l]``, as FlashAttention-2
    defines it; returns a float64 copy.

    ``cos``/``sin`` are ``[seqlen_ro, rotary_dim / 2]``.  Pair ``i`` is dims ``(2i, 2i + 1)``
    when ``interleaved`` (GPT-J), else ``(i, i + rotary_dim / 2)`` (GPT-NeoX), and turns by the
    angle whose cosine and sine are ``cos[position, i]``, ``sin[position, i]``.  Dims from
    rotary_dim on are unchanged, and so is a token whose position is past cos's rows.
    """
    out = np.array(x, dtype=np.float64)
    cos, sin = np.asarray(cos, np.float64), np.asarray(sin, np.float64)
    half = cos.shape[1]
    for l, position in enumerate(positions):
        if not 0 <= position < cos.shape[0]:
            continue
        for i in range(half):
            a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
            x_a, x_b = out[l, :, a].copy(), out[l, :, b].copy()
            c, s = cos[position, i], sin[position, i]
            out[l, :, a] = x_a * c - x_b * s
            out[l, :, b] = x_a * s + x_b * c
    return out
