"""Choosing each request's next token from its logits row: greedy, temperature, top-k, top-p.

Each request owns a NumPy generator seeded from its ``seed``: every sampled token takes one
uniform draw from it, on the host, whatever device holds the logits.  A request's tokens
therefore depend on its seed and its logits alone, not on which other requests share its steps,
nor on whether it was preempted and recomputed in between.

A stochastic row is sampled by inverse CDF over its tokens in descending logit order: the
temperature divides the logits, the softmax is taken in float32 (float64 for float64 logits),
top-k keeps the first ``k`` tokens, the kept mass is renormalised, and top-p keeps the smallest
prefix whose mass reaches ``p`` (a token stays while the mass before it is below ``p``).
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens.

    Parameters
    ----------
    temperature : float
        0 for greedy (argmax); otherwise logits are divided by it.
    top_p : float
        In (0, 1]; 1 keeps every token.
    top_k : int
        Keep only the ``k`` most likely tokens; 0 keeps all.
    seed : int, optional
        The request's generator seed; default one derived from the engine's seed and the request id.

    Examples
    --------
    >>> SamplingParams().greedy, SamplingParams(temperature=0.7, top_p=0.9).greedy
    (True, False)
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0; got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0; got {self.top_k}")

    @property
    def greedy(self) -> bool:
        """True when the token is the argmax (temperature 0)."""
        return self.temperature == 0.0


def _xp_of(array):
    return np if isinstance(array, np.ndarray) else __import__("cupy")


def row_argmax(logits):
    """``[rows]`` int64 argmax of each row of NumPy or CuPy ``logits`` (the first on ties): one
    block per row on the GPU (CuPy's reduction took 42 us for [64, 32000] float32 on the H200),
    NumPy's on the CPU."""
    xp = _xp_of(logits)
    if xp is not np and logits.dtype == np.float32 and logits.flags.c_contiguous:
        from .fused import argmax_rows

        return argmax_rows(logits)
    return xp.argmax(logits, axis=-1)


def filtered_probs(logits, temperature, top_k, top_p):
    """The distributions stochastic rows sample from, over tokens sorted by descending logit.

    Parameters
    ----------
    logits : array
        ``[rows, vocab]`` float32 or float64 (NumPy or CuPy).
    temperature, top_p : array_like of float
        ``[rows]``, temperatures > 0, top-p in (0, 1].
    top_k : array_like of int
        ``[rows]``, 0 for no limit.

    Returns
    -------
    (order, probs)
        ``order [rows, vocab]`` token ids by descending logit; ``probs [rows, vocab]`` the
        probability of ``order[r, j]`` after temperature, top-k and top-p (each row sums to 1).

    Examples
    --------
    >>> order, probs = filtered_probs(np.log([[0.1, 0.6, 0.3]]), [1.0], [0], [0.8])
    >>> order.tolist(), probs.round(3).tolist()
    ([[1, 2, 0]], [[0.667, 0.333, 0.0]])
    """
    xp = _xp_of(logits)
    acc = np.float64 if logits.dtype == np.float64 else np.float32
    rows, vocab = logits.shape
    temperature = xp.asarray(np.asarray(temperature, acc))[:, None]
    scaled = logits.astype(acc) / temperature
    order = xp.argsort(-scaled, axis=-1)
    ranked = xp.take_along_axis(scaled, order, axis=-1)
    probs = xp.exp(ranked - ranked[:, :1])  # the first is each row's largest
    limits = np.asarray(top_k, np.int64)
    limits = xp.asarray(np.where(limits > 0, np.minimum(limits, vocab), vocab))[:, None]
    probs = xp.where(xp.arange(vocab)[None, :] < limits, probs, 0)
    probs = probs / probs.sum(axis=-1, keepdims=True)
    top_p = np.asarray(top_p, acc)
    if (top_p < 1.0).any():
        before = xp.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked ahead
        keep = (before < xp.asarray(top_p)[:, None]) | xp.asarray(top_p >= 1.0)[:, None]
        probs = xp.where(keep, probs, 0)
        probs = probs / probs.sum(axis=-1, keepdims=True)
    return order, probs


def sample(logits, params: list, generators: list) -> list[int]:
    """One token per logits row.

    Parameters
    ----------
    logits : array
        ``[rows, vocab]`` float32 or float64, NumPy or CuPy.
    params : list of SamplingParams
        ``[rows]``.
    generators : list of numpy.random.Generator
        ``[rows]``, each request's own; a stochastic row draws one uniform from its generator.

    Returns
    -------
    list of int
        ``[rows]`` token ids (one host transfer on the GPU).

    Examples
    --------
    >>> logits = np.array([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    >>> sample(logits, [SamplingParams(), SamplingParams(temperature=1.0, top_k=1)],
    ...        [None, np.random.default_rng(0)])
    [1, 0]
    """
    tokens = sample_tokens(logits, params, generators)
    return [int(t) for t in (tokens if isinstance(tokens, np.ndarray) else tokens.get()).tolist()]


def sample_tokens(logits, params: list, generators: list, greedy_tokens=None):
    """:func:`sample` without the host transfer: ``[rows]`` int64 tokens on the logits' device.

    The uniforms of stochastic rows are drawn on the host from each request's generator (they
    do not depend on the logits), so nothing here waits for the device.  ``greedy_tokens``: each
    row's argmax when the caller has it already (a captured decode step computes it).
    """
    xp = _xp_of(logits)
    if logits.shape[0] == 0:
        return xp.zeros(0, np.int64)
    tokens = row_argmax(logits) if greedy_tokens is None else greedy_tokens
    stochastic = [i for i, p in enumerate(params) if not p.greedy]
    if stochastic:
        tokens = tokens.copy() if greedy_tokens is not None else tokens
        chosen = [params[i] for i in stochastic]
        rows = xp.asarray(np.asarray(stochastic, np.int64))
        order, probs = filtered_probs(logits[rows], [p.temperature for p in chosen],
                                      [p.top_k for p in chosen], [p.top_p for p in chosen])
        cdf = xp.cumsum(probs, axis=-1)
        draws = np.array([generators[i].random() for i in stochastic], cdf.dtype)
        # The first token whose CDF passes the draw (scaled by the row's total against rounding).
        targets = xp.asarray(draws)[:, None] * cdf[:, -1:]
        # At most the row's last token of nonzero probability: a draw that rounds to 1 (float32: 1 in
        # 2**25) would otherwise pass every CDF entry, the filtered-out tail's included.
        last = cdf.shape[1] - 1 - xp.argmax(probs[:, ::-1] > 0, axis=-1)
        picks = xp.minimum((cdf <= targets).sum(axis=-1), last)
        tokens[rows] = xp.take_along_axis(order, picks[:, None], axis=-1)[:, 0]
    return tokens
