"""The running requests as a persistent batch (vLLM V1's idea): lists and arrays kept from step to
step and updated in place, so a decode-only step costs array operations, not a Python loop over
the requests.

Entry ``i`` of every list and array is the same running request.  A request leaves by the last
entry moving into its place, so the order is admission order until something leaves.

A decode step's sampled tokens go into ``pending`` (one array write for the whole batch); a
request's ``token_ids`` list gets them on first read (``Request.token_ids`` flushes), before
the cache hashes a block they fill, or when ``pending`` is full.
"""
from __future__ import annotations

import numba
import numpy as np

_NO_STOP = -1  # padding of the stop-token table: never a sampled token
PENDING = 128  # sampled tokens a request holds in ``pending`` before they go to its list


@numba.njit(cache=True, nogil=True)
def advance_decodes(sampled, last, num_tokens, max_tokens, stops, pending, num_pending, hash_block, done,
                    to_flush):
    """Entry ``i`` decoded ``sampled[i]``: keep it pending, count it, check its limit and stops.
    ``to_flush`` gets the entries whose pending tokens must go to their lists now: ``pending``
    full, or (``hash_block`` > 0) the step computed the last token of a block the cache hashes.
    Returns (entries done, entries to flush)."""
    num_done = 0
    flush = 0
    width = pending.shape[1]
    for i in range(sampled.shape[0]):
        token = sampled[i]
        last[i] = token
        k = num_pending[i]
        pending[i, k] = token
        num_pending[i] = k + 1
        num_tokens[i] += 1
        stop = num_tokens[i] >= max_tokens[i]
        for j in range(stops.shape[1]):
            if stops[i, j] == token:
                stop = True
        done[i] = stop
        num_done += stop
        if k + 1 == width or (hash_block > 0 and (num_tokens[i] - 1) % hash_block == 0):
            to_flush[flush] = i
            flush += 1
    return num_done, flush


class RunningBatch:
    """The running requests, their cache rows, next input tokens, limits and stop tokens.

    Attributes
    ----------
    requests, ids, tokens : list
        The requests, their ids (the cache's sequence ids) and their ``token_ids`` lists.
    rows : numpy.ndarray
        ``[capacity]`` int64 cache rows (valid up to ``len(self)``).
    last : numpy.ndarray
        ``[capacity]`` int64 last token of each (a decode's input token).
    num_tokens, max_tokens : numpy.ndarray
        ``[capacity]`` int64 tokens so far and the limit.
    stops : numpy.ndarray
        ``[capacity, stop_width]`` int64 stop tokens, -1 padded.
    rank : numpy.ndarray
        ``[capacity, 2]`` int64 (priority, admission number): the preemption victim is the largest.
    """

    def __init__(self, capacity: int = 64):
        self.requests: list = []
        self.ids: list = []
        self.tokens: list = []
        self.stop_width = 1
        self._allocate(max(1, capacity))

    def _allocate(self, capacity: int) -> None:
        n = len(self.requests)
        old = getattr(self, "rows", None)
        fresh = {name: np.zeros(capacity, np.int64) for name in ("rows", "last", "num_tokens", "max_tokens")}
        fresh["num_pending"] = np.zeros(capacity, np.int64)
        fresh["stops"] = np.full((capacity, self.stop_width), _NO_STOP, np.int64)
        fresh["rank"] = np.zeros((capacity, 2), np.int64)
        fresh["pending"] = np.zeros((capacity, PENDING), np.int64)
        for name, array in fresh.items():
            if old is not None:
                current = getattr(self, name)
                if array.ndim == 1:
                    array[:n] = current[:n]
                else:
                    array[:n, :current.shape[1]] = current[:n]
            setattr(self, name, array)

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, request, row: int, admission: int) -> None:
        """Append a running request whose sequence sits in cache row ``row``."""
        i = len(self.requests)
        if i == self.rows.size:
            self._allocate(2 * i)
        stops = sorted(request.stop_token_ids)
        if len(stops) > self.stop_width:
            self.stop_width = len(stops)
            self._allocate(self.rows.size)
        self.requests.append(request)
        self.ids.append(request.request_id)
        tokens = request.token_ids
        self.tokens.append(tokens)
        self.rows[i] = row
        self.last[i] = tokens[-1]
        self.num_tokens[i] = len(tokens)
        self.num_pending[i] = 0
        self.max_tokens[i] = request.max_tokens
        self.stops[i] = _NO_STOP
        self.stops[i, :len(stops)] = stops
        self.rank[i] = (request.priority, admission)
        request._slot, request._run = i, self

    def flush(self, i: int) -> None:
        """Entry ``i``'s pending tokens go to its ``token_ids`` list."""
        k = int(self.num_pending[i])
        if k:
            self.tokens[i].extend(self.pending[i, :k].tolist())
            self.num_pending[i] = 0

    def remove(self, request) -> None:
        """Take ``request`` out; the last entry moves into its place."""
        i, last = request._slot, len(self.requests) - 1
        if self.requests[i] is not request:
            raise ValueError(f"request {request.request_id!r} is not running")
        self.flush(i)
        if i != last:
            moved = self.requests[last]
            for seq in (self.requests, self.ids, self.tokens):
                seq[i] = seq[last]
            for array in (self.rows, self.last, self.num_tokens, self.max_tokens, self.stops, self.rank,
                          self.num_pending, self.pending):
                array[i] = array[last]
            moved._slot = i
        for seq in (self.requests, self.ids, self.tokens):
            seq.pop()
        request._slot, request._run = -1, None

    def victim(self):
        """The least urgent running request, newest first: the preemption victim."""
        n = len(self.requests)
        rank = self.rank[:n]
        return self.requests[int(np.lexsort((rank[:, 1], rank[:, 0]))[-1])]

    def advance(self, sampled: np.ndarray, hash_block: int) -> np.ndarray:
        """Every entry decoded its token of ``sampled``; returns ``[n]`` bool, which are done
        (limit or stop token).  ``hash_block``: the cache's block size when it hashes blocks, else 0."""
        n = len(self.requests)
        done = np.empty(n, bool)
        to_flush = np.empty(n, np.int64)
        num_done, num_flush = advance_decodes(sampled, self.last, self.num_tokens, self.max_tokens, self.stops,
                                              self.pending, self.num_pending, hash_block, done, to_flush)
        for i in to_flush[:num_flush].tolist():
            self.flush(i)
        return done if num_done else None

    def flush_filling(self, block_size: int) -> None:
        """Flush the pending tokens of entries whose next computed token ends a block."""
        n = len(self.requests)
        for i in np.flatnonzero((self.num_pending[:n] > 0) & (self.num_tokens[:n] % block_size == 0)).tolist():
            self.flush(i)

    def appended(self, request, token: int) -> None:
        """``request`` (running) just appended ``token`` to its tokens."""
        i = request._slot
        self.last[i] = token
        self.num_tokens[i] += 1
