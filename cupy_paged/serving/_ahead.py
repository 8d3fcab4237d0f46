"""Two steps in flight: a step scheduled while the one before it still runs (asynchronous
scheduling), and the record each step keeps for ``rollback``.

``schedule_ahead()`` takes the pending step's tokens as computed and plans the next decode step
of the same requests; ``update()`` then takes the two steps in order and ``rollback()`` undoes
the newest.  While two steps are in flight the persistent batch may change under them (a
request finishing at the first), so each keeps its own copy of the lists it was built from.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ._policy import GeneralStep

if TYPE_CHECKING:
    from .scheduler import ScheduledBatch


class StepsInFlight(GeneralStep):
    """The scheduler's record of its pending steps (``Scheduler`` builds on it)."""

    def _recorded(self, choose) -> ScheduledBatch | None:
        """``choose()``'s batch, carrying the record ``rollback`` replays; a failure midway (an
        allocation, an interrupt) leaves nothing of the step."""
        self._undo = []
        c = self._counters
        self._saved = (self._decoding_only, c.prompt_tokens, c.cached_prompt_tokens, c.prefill_tokens,
                       c.decode_tokens)
        try:
            batch = choose()
        except BaseException:
            self._undo_step()
            raise
        if batch is not None:
            batch._undo_log, batch._saved_state = self._undo, self._saved
        return batch

    def schedule_ahead(self) -> ScheduledBatch | None:
        """Schedule the next decode step while the pending one still runs (asynchronous scheduling).

        The host's work for step ``n + 1`` then overlaps the device's step ``n``: the pending
        step's tokens count as computed (its forward pass must have been launched), every
        running request gets one more slot, and the batch's ``input_ids`` are zeros with
        ``input_ids_pending`` set: row ``i`` feeds the pending step's sample ``i``, which the
        caller moves into the step's inputs on the device.  ``update()`` then takes the two
        steps in order.  A request that finishes at the pending step still has a row in the step
        ahead; that row's token is dropped and its blocks are freed when the pending step is
        updated (the device writes into them before any later step can reuse them).

        Returns
        -------
        ScheduledBatch or None
            None when the next step cannot be a decode step of the same requests: the pending
            step is not one (or a request was aborted since), a waiting request could be
            admitted, a request reaches its token limit at the pending step, or a block is
            short.  Then ``update()`` the pending step and ``schedule()`` as usual.

        Raises
        ------
        RuntimeError
            Without a pending step, or with a step already scheduled ahead.

        Examples
        --------
        >>> from cupy_paged import PagedAttentionCache, Request
        >>> from cupy_paged.serving.scheduler import Scheduler
        >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=8, device="cpu")
        >>> scheduler = Scheduler(cache)
        >>> scheduler.add_request(Request(0, [5, 6, 7], max_new_tokens=4))
        >>> _ = scheduler.update(scheduler.schedule(), [8])
        >>> step = scheduler.schedule()  # decodes 8
        >>> ahead = scheduler.schedule_ahead()  # feeds the token step samples
        >>> ahead.input_ids_pending, cache.slot_mapping(ahead.seq_ids).tolist()
        (True, [4])
        >>> scheduler.update(step, [9]), [r.output_token_ids for r in scheduler.update(ahead, [10])]
        ([], [])
        >>> scheduler.running[0].output_token_ids
        [8, 9, 10]
        """
        step, run = self._step, self._running
        if step is None:
            raise RuntimeError("schedule_ahead() needs a pending step: call schedule() first")
        if self._ahead is not None:
            raise RuntimeError("a step is scheduled ahead already; update() the pending step first")
        n = len(run)
        if not (step._persistent and step.requests is run.requests and self._decoding_only
                and (not self.waiting or n >= self.config.max_num_seqs)):
            return None
        if (run.num_tokens[:n] + 1 >= run.max_tokens[:n]).any():
            return None  # known to finish at the pending step: a row ahead would be wasted
        cache = self.cache
        if not step._computed:
            if cache.enable_prefix_caching:  # the blocks the pending step fills are hashed now
                run.flush_filling(cache.block_size)
            cache.mark_computed(run.ids, rows=run.rows[:n])
            step._computed = True
        self._ahead = self._recorded(lambda: self._schedule_decodes_only(run, n, ahead=True))
        return self._ahead

    def _detach(self) -> None:
        """The pending decode-only batches stop sharing the running batch's lists (before they change)."""
        for batch in (self._step, self._ahead):
            if batch is not None and batch._persistent and batch.requests is self._running.requests:
                batch.requests = batch.sample_requests = list(batch.requests)
                batch.seq_ids, batch.input_ids = list(batch.seq_ids), batch.input_ids.copy()
                log = batch._undo_log
                log[0] = log[0][:1] + (batch.requests,) + log[0][2:]

    def rollback(self, batch: ScheduledBatch) -> None:
        """Undo the pending step (its forward pass failed): the slots it reserved are given back and
        the requests it admitted wait again where they were, so the next ``schedule()`` makes the
        same step.  What the failed step may have written over is not trusted again: requests
        it preempted stay preempted and cached free blocks it evicted from the prefix cache stay
        evicted (the forward pass may have written into either); requests aborted since stay
        aborted.

        Parameters
        ----------
        batch : ScheduledBatch
            The batch the last ``schedule()`` returned.

        Raises
        ------
        RuntimeError, ValueError
            As :meth:`update`.
        """
        if self._step is None:
            raise RuntimeError("rollback() needs a batch from schedule()")
        newest = self._step if self._ahead is None else self._ahead
        if batch is not newest:
            if batch is self._step:
                raise ValueError("roll back the step scheduled ahead first; the pending step's forward pass ran")
            raise ValueError("batch is not the one the last schedule() returned")
        if batch._computed:
            raise RuntimeError("the step's tokens were counted as computed when the next step was scheduled "
                               "ahead: update() it instead")
        self._undo, self._saved = batch._undo_log, batch._saved_state
        self._undo_step()
        if self._ahead is not None:
            self._ahead = None
        else:
            self._step = None
