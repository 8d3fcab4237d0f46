"""Continuous batching: which requests run each step, and with how many tokens.

Each ``schedule()`` call makes one step: running decodes first, then running
prefills and then waiting requests, long prompts cut into chunks, all under a
token budget (``max_batch_tokens``) and the cache's free blocks.  When a running
request cannot get a block, the newest running request is preempted: its blocks
are freed and it is recomputed from its tokens later (vLLM's policy; the prefix
cache usually gives most of them back).  The step comes out as a :class:`ScheduledBatch`
of plain data; ``update()`` takes it back with the sampled tokens.  The public
``cupy_paged.Scheduler`` builds each batch into a step plan for the kernels.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools

import numpy as np

from .block_pool import CacheFull
from .requests import Request, RequestStatus, SchedulerConfig

__all__ = ["Request", "RequestStatus", "ScheduledBatch", "Scheduler", "SchedulerConfig"]


@dataclasses.dataclass(eq=False)
class ScheduledBatch:
    """One step as :meth:`Scheduler.schedule` chose it, in batch order: the decodes first.

    Every request's new tokens have reserved slots in the cache; a plan builder takes the
    rest from here, and :meth:`Scheduler.update` takes the batch back.

    Attributes
    ----------
    requests : list of Request
    seq_ids : list
        Their ids, the cache's sequence ids.
    num_new_tokens : list of int
        Tokens each request feeds this step (>= 1).
    input_ids : list of int
        ``[sum(num_new_tokens)]`` those tokens, concatenated.
    sample_mask : numpy.ndarray or None
        ``[batch]`` bool, which requests sample a token; None when every one does.
    rows : numpy.ndarray
        ``[batch]`` the sequences' cache rows (``cache.rows(seq_ids)``).
    num_decodes : int
        The first ``num_decodes`` requests decode (one token each).
    """

    requests: list
    seq_ids: list
    num_new_tokens: list
    input_ids: list
    sample_mask: np.ndarray | None
    rows: np.ndarray
    num_decodes: int

    @property
    def num_sampled(self) -> int:
        """Requests that sample a token this step."""
        return len(self.requests) if self.sample_mask is None else int(np.count_nonzero(self.sample_mask))


class Scheduler:
    """Turns a stream of requests into steps over a :class:`~cupy_paged.serving.kv_cache.PagedAttentionCache`.

    Parameters
    ----------
    cache : PagedAttentionCache
        Owns the blocks; the scheduler is its only user while it runs.
    config : SchedulerConfig, optional

    Examples
    --------
    >>> from cupy_paged.serving.kv_cache import PagedAttentionCache
    >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=16, device="cpu")
    >>> scheduler = Scheduler(cache, SchedulerConfig(max_batch_tokens=16, max_num_seqs=4))
    >>> scheduler.add_request(Request("a", list(range(20)), max_new_tokens=2))
    >>> batch = scheduler.schedule()
    >>> batch.seq_ids, batch.num_new_tokens, batch.num_sampled
    (['a'], [16], 0)
    >>> _ = scheduler.update(batch, [])
    >>> batch = scheduler.schedule()
    >>> batch.num_new_tokens, batch.input_ids
    ([4], [16, 17, 18, 19])
    >>> [r.output_token_ids for r in scheduler.update(batch, [7])]
    []
    >>> batch = scheduler.schedule()
    >>> batch.num_decodes, batch.input_ids
    (1, [7])
    >>> [r.output_token_ids for r in scheduler.update(batch, [9])]
    [[7, 9]]
    """

    def __init__(self, cache, config: SchedulerConfig | None = None):
        self.cache = cache
        self.config = SchedulerConfig() if config is None else config
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # admission order: the newest is last
        self._live: dict = {}
        self._step: ScheduledBatch | None = None  # the last schedule()'s batch, until update() takes it
        self.num_preemptions = 0
        # Blocks kept free when admitting; at least one so a decode can always take a block.
        self._margin = max(1, int(self.config.admission_margin * cache.num_blocks))

    # ------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        """Queue a request.

        Raises
        ------
        ValueError
            When its id is live already, or prompt plus ``max_new_tokens`` could never fit
            the cache (a single sequence's length limit, or all blocks).
        """
        if request.request_id in self._live:
            raise ValueError(f"request {request.request_id!r} is already queued or running")
        cache = self.cache
        if request.max_tokens > cache.max_seq_len or -(-request.max_tokens // cache.block_size) > cache.num_blocks:
            raise ValueError(f"request {request.request_id!r} may grow to {request.max_tokens} tokens, "
                             f"more than the cache can hold for one sequence "
                             f"({min(cache.max_seq_len, cache.num_blocks * cache.block_size)})")
        request.status = RequestStatus.WAITING
        self._live[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return bool(self._live)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> ScheduledBatch | None:
        """Choose this step's requests and token counts and reserve their slots.

        Returns
        -------
        ScheduledBatch or None
            ``None`` when nothing can run.  Pass the batch and the sampled tokens to
            :meth:`update` before the next call.

        Examples
        --------
        >>> from cupy_paged.serving.kv_cache import PagedAttentionCache
        >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=8, device="cpu")
        >>> scheduler = Scheduler(cache)
        >>> scheduler.add_request(Request(0, [5, 6, 7], max_new_tokens=1))
        >>> batch = scheduler.schedule()
        >>> batch.input_ids, cache.slot_mapping(batch.seq_ids).tolist()
        ([5, 6, 7], [0, 1, 2])
        """
        if self._step is not None:
            raise RuntimeError("update() must take the previous step's tokens before the next schedule()")
        decodes, prefills = [], []
        for request in self.running:  # one pass: this runs over every running request each step
            (decodes if len(request.token_ids) - request.num_computed == 1 else prefills).append(request)
        decodes, decode_rows = self._schedule_decodes(decodes)
        scheduled: dict[Request, int] = dict.fromkeys(decodes, 1)
        preemptions = self.num_preemptions
        budget = self._schedule_running_prefills(prefills, scheduled, self.config.max_batch_tokens - len(decodes))
        if self.num_preemptions != preemptions:  # a prefill's growth may have preempted decodes
            kept = np.array([r in scheduled for r in decodes], bool)
            decodes, decode_rows = list(itertools.compress(decodes, kept)), decode_rows[kept]
        self._admit_waiting(scheduled, budget)
        if not scheduled:
            return None
        # The decodes lead `scheduled`: the first rows are theirs already.
        requests, counts = list(scheduled), list(scheduled.values())
        ids = [r.request_id for r in requests]
        num_decodes = len(decodes)
        rows = (decode_rows if num_decodes == len(requests)
                else np.concatenate([decode_rows, self.cache.rows(ids[num_decodes:])]))
        # The rows serve update()'s mark_computed too: nothing frees a sequence in between,
        # and a row stays with its sequence until it is freed.
        self._step = self._batch(requests, counts, ids, rows, num_decodes)
        return self._step

    def _schedule_decodes(self, decodes: list) -> tuple[list[Request], np.ndarray]:
        """All running requests with one token left get a slot, preempting the newest as needed.
        Returns them and their cache rows."""
        while decodes:
            ids = [r.request_id for r in decodes]
            rows = self.cache.rows(ids)
            try:
                self.cache.grow(ids, 1, rows=rows)
                return decodes, rows
            except CacheFull:
                victim = self.running[-1]
                self._preempt(victim)
                if victim in decodes:  # the newest is usually a decode itself
                    decodes.remove(victim)
        return decodes, np.empty(0, np.int64)

    def _schedule_running_prefills(self, prefills: list, scheduled: dict, budget: int) -> int:
        """Next chunk of each running, partly prefilled request, oldest first."""
        chunk_limit = self.config.max_prefill_chunk
        for request in prefills:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted for an older request earlier in this loop
            count = min(request.num_tokens - request.num_computed, budget, chunk_limit)
            count, released = self._grow_or_preempt(request, count, scheduled)
            if count:
                scheduled[request] = count
            budget += released - count  # a preempted victim's scheduled tokens are back
        return budget

    def _grow_or_preempt(self, request: Request, count: int, scheduled: dict) -> tuple[int, int]:
        """Reserve ``count`` slots for ``request``, shrinking the chunk or preempting newer requests.
        Returns the slots reserved and the tokens of preempted requests taken out of ``scheduled``."""
        cache = self.cache
        released = 0
        while True:
            try:
                cache.grow([request.request_id], count)
                return count, released
            except CacheFull:
                pass
            # A smaller chunk that fits now beats preempting anyone.
            room = -cache.num_slots(request.request_id) % cache.block_size
            fits = room + cache.num_free_blocks * cache.block_size
            if 0 < fits < count:
                count = fits
                continue
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return 0, released
            released += scheduled.pop(victim, 0)  # its reserved slots went with its blocks

    def _admit_waiting(self, scheduled: dict, budget: int) -> None:
        """Admit waiting requests first come first served while budget, seats and blocks last."""
        cache, config = self.cache, self.config
        while self.waiting and budget > 0 and len(self.running) < config.max_num_seqs:
            request = self.waiting[0]
            limit = min(budget, config.max_prefill_chunk)
            margin = self._margin if self.running else 0
            try:  # one prefix match: allocate cuts the chunk to the limit after the cached prefix
                cached = cache.allocate(request.request_id, request.token_ids, reserve=margin,
                                        max_num_new_tokens=limit)
            except CacheFull:
                break
            count = cache.num_slots(request.request_id) - cached  # the slots allocate reserved
            self.waiting.popleft()
            request.num_computed = cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled[request] = count
            budget -= count

    def _preempt(self, request: Request) -> None:
        """Free ``request``'s blocks and queue it first for recomputation."""
        self.cache.free(request.request_id)
        self.running.remove(request)
        request.num_computed = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _batch(self, requests: list, counts: list, ids: list, rows: np.ndarray, num_decodes: int) -> ScheduledBatch:
        """The step's batch; the first ``num_decodes`` requests decode."""
        if max(counts) == 1:  # one input token each, no slicing
            input_ids = [r.token_ids[r.num_computed] for r in requests]
        else:
            input_ids = list(itertools.chain.from_iterable(
                r.token_ids[r.num_computed:r.num_computed + n] for r, n in zip(requests, counts)))
        sample = None  # every row samples: decodes always do
        if num_decodes < len(requests):
            # Only a prefill whose chunk reaches its last token samples: a one-token chunk in the
            # middle of a prompt (budget or max_prefill_chunk of 1) does not.
            sample = np.ones(len(requests), bool)
            sample[num_decodes:] = [r.num_computed + n == r.num_tokens
                                    for r, n in zip(requests[num_decodes:], counts[num_decodes:])]
        return ScheduledBatch(requests, ids, counts, input_ids, sample, rows, num_decodes)

    def update(self, batch: ScheduledBatch, sampled_token_ids) -> list[Request]:
        """Take the step's sampled tokens; finish requests that hit their limit or EOS.

        Parameters
        ----------
        batch : ScheduledBatch
            The batch the last ``schedule()`` returned.
        sampled_token_ids : array_like of int
            ``[batch.num_sampled]`` one token per sampling request, in batch order.

        Returns
        -------
        list of Request
            Requests finished this step (their blocks are freed).
        """
        if self._step is None:
            raise RuntimeError("update() needs a batch from schedule()")
        if batch is not self._step:
            raise ValueError("batch is not the one the last schedule() returned")
        requests = batch.requests
        sampled = np.asarray(sampled_token_ids).reshape(-1).tolist()
        sampling = (requests if batch.sample_mask is None  # all sample: no mask walk
                    else list(itertools.compress(requests, batch.sample_mask.tolist())))
        if len(sampled) != len(sampling):
            raise ValueError(f"sampled_token_ids must hold {len(sampling)} tokens, one per sampling "
                             f"request; got {len(sampled)}")
        self._step = None
        computed = []
        for request, count in zip(requests, batch.num_new_tokens):
            request.num_computed += count
            computed.append(request.num_computed)
        self.cache.mark_computed(batch.seq_ids, computed, rows=batch.rows)
        finished = []
        for request, token in zip(sampling, sampled):
            request.token_ids.append(token)
            if request.num_tokens >= request.max_tokens or token == request.eos_token_id:
                finished.append(request)
        for request in finished:
            request.status = RequestStatus.FINISHED
            self.cache.free(request.request_id)
            del self._live[request.request_id]
        if finished:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        return finished
