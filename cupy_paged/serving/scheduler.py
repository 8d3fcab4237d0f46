"""Continuous batching: which requests run each step, and with how many tokens.

The policy (decodes first, then chunks of prompts under a token budget; preemption of the least
urgent, newest request when blocks run out) is ``_policy.py``'s.  The step comes out as a
:class:`ScheduledBatch` of plain data; ``update()`` takes it back with the sampled tokens, or
``rollback()`` undoes it when the step failed.  A step in which every running request decodes
takes a path without per-request Python: the running requests are a persistent batch
(``_running.py``) whose arrays are updated in place.  The public ``cupy_paged.Scheduler``
builds each batch into a step plan for the kernels.
"""
from __future__ import annotations

import dataclasses
import types

import numpy as np

from ._ahead import StepsInFlight
from ._running import RunningBatch
from ._stats import Counters, SchedulerStats
from .block_pool import CacheFull
from .requests import Request, RequestStatus, SamplingParams, SchedulerConfig, token_array

__all__ = ["Request", "RequestStatus", "SamplingParams", "ScheduledBatch", "Scheduler", "SchedulerConfig",
           "SchedulerStats"]


@dataclasses.dataclass(eq=False)
class ScheduledBatch:
    """One step as :meth:`Scheduler.schedule` chose it, in batch order: the decodes first.

    Every request's new tokens have reserved slots in the cache; a plan builder takes the
    rest from here, and :meth:`Scheduler.update` (or :meth:`Scheduler.rollback`) takes it back.

    Attributes
    ----------
    requests : list of Request
    seq_ids : list
        Their ids, the cache's sequence ids.
    num_new_tokens : numpy.ndarray
        ``[batch]`` int64 tokens each request feeds this step (>= 1).
    input_ids : numpy.ndarray
        ``[sum(num_new_tokens)]`` int64 those tokens, concatenated.
    sample_mask : numpy.ndarray or None
        ``[batch]`` bool, which requests sample (their last token's logits); None when all do.
    rows : numpy.ndarray
        ``[batch]`` the sequences' cache rows (``cache.rows(seq_ids)``).
    num_decodes : int
        The first ``num_decodes`` requests decode (one token each).
    sample_requests : list of Request
        ``[num_samples]`` the request (or parallel branch) each token ``update`` takes is for;
        its ``sampling`` and ``sample_index`` say how to sample it.
    sample_rows : numpy.ndarray or None
        ``[num_samples]`` which sampling row (0 .. num_sampled - 1, in batch order) each sample
        reads: a prompt of ``n`` parallel samples that ends this step is read ``n`` times.
        None when each row is sampled once.
    input_ids_pending : bool
        True for a step :meth:`Scheduler.schedule_ahead` made: ``input_ids`` are zeros, and row
        ``i`` feeds the previous step's sample ``i`` (not yet known on the host).
    """

    requests: list
    seq_ids: list
    num_new_tokens: np.ndarray
    input_ids: np.ndarray
    sample_mask: np.ndarray | None
    rows: np.ndarray
    num_decodes: int
    sample_requests: list
    sample_rows: np.ndarray | None = None
    input_ids_pending: bool = False

    @property
    def num_sampled(self) -> int:
        """Requests whose logits are sampled this step (the sampling rows)."""
        return len(self.requests) if self.sample_mask is None else int(np.count_nonzero(self.sample_mask))

    @property
    def num_samples(self) -> int:
        """Tokens :meth:`Scheduler.update` takes: ``num_sampled`` plus the extra first samples of
        parallel branches."""
        return len(self.sample_requests)


class Scheduler(StepsInFlight):
    """Turns a stream of requests into steps over a :class:`~cupy_paged.serving.kv_cache.PagedAttentionCache`.

    Parameters
    ----------
    cache : PagedAttentionCache
        Owns the blocks; the scheduler is its only user while it runs.
    config : SchedulerConfig, optional

    Attributes
    ----------
    waiting : list of Request
        Queued requests in admission order (priority, then arrival); read only.
    num_preemptions : int

    Examples
    --------
    >>> from cupy_paged import PagedAttentionCache, Request, SchedulerConfig
    >>> from cupy_paged.serving.scheduler import Scheduler
    >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=16, device="cpu")
    >>> scheduler = Scheduler(cache, SchedulerConfig(max_batch_tokens=16, max_num_seqs=4))
    >>> scheduler.add_request(Request("a", list(range(20)), max_new_tokens=2))
    >>> batch = scheduler.schedule()
    >>> batch.seq_ids, batch.num_new_tokens.tolist(), batch.num_sampled
    (['a'], [16], 0)
    >>> _ = scheduler.update(batch, [])
    >>> batch = scheduler.schedule()
    >>> batch.num_new_tokens.tolist(), batch.input_ids.tolist()
    ([4], [16, 17, 18, 19])
    >>> [r.output_token_ids for r in scheduler.update(batch, [7])]
    []
    >>> batch = scheduler.schedule()
    >>> batch.num_decodes, batch.input_ids.tolist()
    (1, [7])
    >>> [r.output_token_ids for r in scheduler.update(batch, [9])]
    [[7, 9]]
    """

    def __init__(self, cache, config: SchedulerConfig | None = None):
        self.cache, self.config = cache, SchedulerConfig() if config is None else config
        self.waiting: list = []
        self._running = RunningBatch(min(self.config.max_num_seqs, 1024))
        self._live: dict = {}  # id -> request, every branch of every unfinished request
        self._step: ScheduledBatch | None = None  # the last schedule()'s batch, until update() takes it
        self._ahead: ScheduledBatch | None = None  # schedule_ahead()'s batch, while _step is pending
        self._undo: list = []  # what the step being scheduled did (then the batch's), for rollback()
        self._saved: tuple | None = None
        self._decoding_only = True  # every running request has exactly one token to compute
        self._arrivals = self._admissions = 0
        self._counters = Counters()
        self._cached_by_request: dict = {}
        self._ones, self._zeros = np.ones(0, np.int64), np.zeros(0, np.int64)
        self.num_preemptions = 0
        # Blocks kept free when admitting; at least one so a decode can always take a block.
        self._margin = max(1, int(self.config.admission_margin * cache.num_blocks))

    @property
    def running(self) -> list:
        """The running requests (read only; the persistent batch's order)."""
        return self._running.requests

    # ------------------------------------------------------------------ requests

    def max_model_len(self) -> int:
        """Longest sequence (prompt plus new tokens) a request may reach here.

        Returns
        -------
        int
            The least of ``config.max_model_len``, the cache's block table width
            (``max_seq_len``) and all its blocks, in tokens.
        """
        cache = self.cache
        limit = min(cache.max_seq_len, cache.num_blocks * cache.block_size)
        return limit if self.config.max_model_len is None else min(limit, self.config.max_model_len)

    def add_request(self, request: Request) -> None:
        """Queue a request (and, for ``sampling.n > 1``, its parallel branches).

        Parameters
        ----------
        request : Request
            A new request; its id (and its branches' ``(id, k)``) must not be live.

        Raises
        ------
        ValueError
            When its id is live already, or prompt plus ``max_new_tokens`` could never fit
            (:meth:`max_model_len`: the cache's block table width, all its blocks, or
            ``config.max_model_len``).
        """
        if not isinstance(request, Request):
            raise TypeError(f"request must be a cupy_paged.Request; got {type(request).__name__}")
        if request.request_id in self._live:
            raise ValueError(f"request {request.request_id!r} is already queued or running")
        limit = self.max_model_len()
        if request.max_tokens > limit:
            raise ValueError(f"request {request.request_id!r} may grow to {request.max_tokens} tokens, "
                             f"more than the cache can hold for one sequence ({limit}: max_model_len)")
        branches = None
        if request.sampling.n > 1 and len(request.branches) == 1:
            # Checked before the request changes: a refused one can be queued again once the clash is gone.
            branches = [request] + [request._branch(k) for k in range(1, request.sampling.n)]
            if any(b.request_id in self._live for b in branches):
                raise ValueError(f"a branch id of request {request.request_id!r} is already live")
        self._arrivals += 1
        request._arrival = self._arrivals
        if branches is not None:
            for branch in branches:
                branch._arrival = request._arrival
            request.branches = branches
            request._unforked = True
        for branch in request.branches:
            self._live[branch.request_id] = branch
        request._cache = None
        self._enqueue(request)

    def abort(self, request_ids) -> list[Request]:
        """Stop requests wherever they are; their blocks are freed (full computed blocks stay in
        the prefix cache).  Aborting a request aborts its parallel branches; ``(id, k)`` aborts
        one branch.

        Safe between any two calls.  Between ``schedule()`` and ``update()`` the pending step
        keeps its rows (the forward pass may be running over them): ``update`` drops the
        aborted rows and their sampled tokens, and ``rollback`` leaves them aborted.

        Parameters
        ----------
        request_ids : request id or iterable of request ids
            One id (a string, a number, or a branch's ``(id, k)`` tuple) or a list, set or other
            iterable of them; finished, aborted and unknown ones are skipped.

        Returns
        -------
        list of Request
            The requests (branches) aborted, status ``ABORTED``.
        """
        if isinstance(request_ids, (str, bytes, tuple)) or not hasattr(request_ids, "__iter__"):
            request_ids = [request_ids]  # one id: a string is not its characters, a tuple is a branch
        aborted = []
        self._detach()
        for request_id in request_ids:
            request = self._live.get(request_id)
            if request is None:
                continue
            for branch in ([request] + request.branches[1:]):
                if not branch.is_done:
                    self._abort_one(branch)
                    aborted.append(branch)
        return aborted

    def _abort_one(self, request: Request) -> None:
        if request._cache is not None:
            self._stop_running(request)
        elif request.status is RequestStatus.WAITING and request in self.waiting:
            self.waiting.remove(request)
            if request.num_preemptions:
                self._counters.num_preempted_waiting -= 1
        request.status, request.finish_reason = RequestStatus.ABORTED, "abort"
        request._pending_fork = False
        del self._live[request.request_id]
        self._cached_by_request.pop(request.request_id, None)
        self._counters.num_aborted += 1

    def has_unfinished(self) -> bool:
        """True while any request (or branch) waits or runs (Returns: bool)."""
        return bool(self._live)

    def stats(self) -> SchedulerStats:
        """Counts of requests, cache blocks and scheduled tokens; O(1), cheap every step.

        Returns
        -------
        SchedulerStats
        """
        c, cache = self._counters, self.cache
        return SchedulerStats(
            num_running=len(self._running), num_waiting=len(self.waiting), num_preempted=c.num_preempted_waiting,
            num_preemptions=self.num_preemptions, num_finished=c.num_finished, num_aborted=c.num_aborted,
            blocks_used=cache.num_blocks - cache.num_free_blocks, blocks_total=cache.num_blocks,
            prompt_tokens=c.prompt_tokens, cached_prompt_tokens=c.cached_prompt_tokens,
            prefill_tokens=c.prefill_tokens, decode_tokens=c.decode_tokens,
            cached_prompt_tokens_by_request=types.MappingProxyType(self._cached_by_request))

    # ------------------------------------------------------------------ one step

    def schedule(self) -> ScheduledBatch | None:
        """Choose this step's requests and token counts and reserve their slots.

        Returns
        -------
        ScheduledBatch or None
            ``None`` when nothing can run.  Pass the batch and the sampled tokens to
            :meth:`update` (or the batch to :meth:`rollback`) before the next call.

        Raises
        ------
        RuntimeError
            When the previous step was neither updated nor rolled back.  (Any exception midway
            leaves the scheduler and the cache as they were.)

        Examples
        --------
        >>> from cupy_paged import PagedAttentionCache, Request
        >>> from cupy_paged.serving.scheduler import Scheduler
        >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=8, device="cpu")
        >>> scheduler = Scheduler(cache)
        >>> scheduler.add_request(Request(0, [5, 6, 7], max_new_tokens=1))
        >>> batch = scheduler.schedule()
        >>> batch.input_ids.tolist(), cache.slot_mapping(batch.seq_ids).tolist()
        ([5, 6, 7], [0, 1, 2])
        """
        if self._step is not None:
            raise RuntimeError("update() must take the previous step's tokens before the next schedule()")
        self._step = self._recorded(self._choose_step)
        return self._step

    def _choose_step(self) -> ScheduledBatch | None:
        run, batch = self._running, None
        if run and self._decoding_only and (not self.waiting or len(run) >= self.config.max_num_seqs):
            batch = self._schedule_decodes_only(run, len(run))
        return self._schedule_general() if batch is None else batch

    def _schedule_decodes_only(self, run: RunningBatch, n: int, ahead: bool = False) -> ScheduledBatch | None:
        """Every running request decodes: one numba pass reserves the slots; no per-request Python.
        The batch's lists and input ids are the running batch's own (``abort`` copies them first);
        ``ahead``: zeros for input ids, the pending step's samples feeding them."""
        rows = run.rows[:n].copy()
        cow: list = []  # forked sequences writing into a shared block: the cache's general growth
        try:
            self.cache.grow(None, 1, rows=rows, cow_log=cow)
        except CacheFull:
            return None  # the general step preempts
        self._undo.append(("grow", run.requests, rows, 1, None, cow))  # nothing preempts after it
        self._counters.decode_tokens += n
        if self._ones.size < n:
            self._ones, self._zeros = np.ones(2 * n, np.int64), np.zeros(2 * n, np.int64)
            self._ones.flags.writeable = self._zeros.flags.writeable = False
        inputs = self._zeros[:n] if ahead else run.last[:n]
        batch = self._new_batch(run.requests, run.ids, self._ones[:n], inputs, None, rows, n, run.requests)
        batch._persistent = True  # the running batch in its order: update's array path applies
        batch.input_ids_pending = ahead
        return batch

    @staticmethod
    def _new_batch(*fields) -> ScheduledBatch:
        batch = ScheduledBatch(*fields)
        batch._persistent = False
        batch._computed = False  # its tokens marked computed already (by schedule_ahead)
        batch._undo_log, batch._saved_state = [], None
        batch._step_plan = None  # the public Scheduler's plan of it
        return batch

    def update(self, batch: ScheduledBatch, sampled_token_ids) -> list[Request]:
        """Take the step's sampled tokens; finish requests that hit their limit or a stop token.

        Parameters
        ----------
        batch : ScheduledBatch
            The batch the last ``schedule()`` returned.
        sampled_token_ids : array_like of int
            ``[batch.num_samples]`` one token per sample, in ``batch.sample_requests`` order.

        Returns
        -------
        list of Request
            Requests (branches) finished this step (their blocks are freed).

        Raises
        ------
        RuntimeError
            Without a pending step.
        ValueError
            For another batch, or the wrong number of tokens.
        """
        if self._step is None:
            raise RuntimeError("update() needs a batch from schedule()")
        if batch is not self._step:
            if batch is self._ahead:
                raise ValueError("update() takes the steps in the order they were scheduled: the pending "
                                 "step before the one scheduled ahead")
            raise ValueError("batch is not the one the last schedule() returned")
        sampled = token_array(sampled_token_ids, "sampled_token_ids")
        if sampled.size != len(batch.sample_requests):
            raise ValueError(f"sampled_token_ids must hold {len(batch.sample_requests)} tokens, one per sampling "
                             f"request; got {sampled.size}")
        self._step, self._ahead = self._ahead, None
        if batch._persistent and batch.requests is self._running.requests:  # no abort since schedule()
            return self._update_decodes_only(batch, self._running, sampled)
        return self._update_general(batch, sampled.tolist())

    def _update_decodes_only(self, batch: ScheduledBatch, run: RunningBatch, sampled: np.ndarray) -> list:
        """The decode-only step's update, on the persistent batch's arrays."""
        cache = self.cache
        done = run.advance(sampled, cache.block_size if cache.enable_prefix_caching else 0)
        if not batch._computed:
            cache.mark_computed(run.ids, rows=run.rows[:len(run)])
        if done is None:
            return []
        finished = [run.requests[i] for i in np.flatnonzero(done).tolist()]
        self._detach()  # a step scheduled ahead keeps its rows (and drops theirs at its update)
        for request in finished:
            self._finish(request)
        return finished
