"""The public ``Scheduler``: the serving scheduler's steps, each built into a :class:`StepPlan`."""
from __future__ import annotations

from ..serving import scheduler as serving
from ._work import work_group
from .plan import StepPlan, build_plan

__all__ = ["Scheduler"]


class Scheduler(serving.Scheduler):
    """Turns a stream of requests into step plans over a :class:`~cupy_paged.serving.kv_cache.PagedAttentionCache`.

    The requests, token counts, preemption, abort, rollback and statistics are the serving
    scheduler's (:class:`cupy_paged.serving.scheduler.Scheduler`); each scheduled batch comes out
    as the :class:`StepPlan` the kernels run, with ``sample_requests`` / ``sample_rows`` saying
    which request each sampled token is for.

    Parameters
    ----------
    cache : PagedAttentionCache
        Owns the blocks; the scheduler is its only user while it runs.
    config : SchedulerConfig, optional
    buffers : PlanBuffers, optional
        Build every plan into these fixed (device) buffers: the addresses a captured
        CUDA graph needs.  Each plan is then valid until the next ``schedule()``.
    num_heads : int, optional
        The model's query heads: plans list the work of one ragged launch per layer and take
        the ``"ragged"`` path for every step that is not prefill-heavy (``build_plan``'s
        ``num_heads``; ``buffers`` then need ``query_group = num_heads // num_kv_heads``).
    decode_planner : callable, optional
        ``decode_planner(batch)`` builds the plan of each decode-only step instead of the
        scheduler (for instance padded to a captured CUDA graph's size, into that graph's
        buffers), or returns None to leave it to the scheduler.  The plan's first
        ``len(batch.seq_ids)`` rows must be the batch's, in order, with its input ids.

    Raises
    ------
    ValueError
        When ``buffers``' block table width is not the cache's, or ``num_heads`` does not match
        their ``query_group``.

    Examples
    --------
    >>> from cupy_paged import PagedAttentionCache, Request, Scheduler, SchedulerConfig
    >>> cache = PagedAttentionCache(1, 1, 32, block_size=8, num_blocks=16, device="cpu")
    >>> scheduler = Scheduler(cache, SchedulerConfig(max_batch_tokens=16, max_num_seqs=4))
    >>> scheduler.add_request(Request("a", list(range(20)), max_new_tokens=2))
    >>> plan = scheduler.schedule()
    >>> plan.query_lens.tolist(), plan.logits_indices.tolist()
    ([16], [])
    >>> _ = scheduler.update(plan, [])
    >>> plan = scheduler.schedule()
    >>> plan.query_lens.tolist(), plan.positions.tolist()
    ([4], [16, 17, 18, 19])
    >>> [r.output_token_ids for r in scheduler.update(plan, [7])]
    []
    >>> plan = scheduler.schedule()
    >>> plan.path, plan.input_ids.tolist()
    ('decode', [7])
    >>> [r.output_token_ids for r in scheduler.update(plan, [9])]
    [[7, 9]]
    """

    def __init__(self, cache, config: serving.SchedulerConfig | None = None, buffers=None,
                 num_heads: int | None = None, decode_planner=None):
        super().__init__(cache, config)
        self.num_heads, self.decode_planner = num_heads, decode_planner
        if num_heads is not None:  # checked now, not at the first schedule()
            work_group(cache, num_heads, buffers)
        if buffers is not None and buffers.max_blocks_per_seq != cache.max_blocks_per_seq:
            raise ValueError(f"the buffers' block tables have {buffers.max_blocks_per_seq} columns but the "
                             f"cache's max_blocks_per_seq is {cache.max_blocks_per_seq}")
        self.buffers = buffers

    def schedule(self) -> StepPlan | None:
        """The serving scheduler's next batch (:meth:`serving.scheduler.Scheduler.schedule`) as the
        plan every layer of the step reuses.

        Returns
        -------
        StepPlan or None
            ``None`` when nothing can run.  Pass the plan and the sampled tokens to
            :meth:`update` (or the plan to :meth:`rollback`) before the next call.
        """
        batch = super().schedule()
        return None if batch is None else self._plan(batch)

    def schedule_ahead(self) -> StepPlan | None:
        """The next decode step as a plan, built while the pending step still runs
        (:meth:`serving.scheduler.Scheduler.schedule_ahead`).

        Its ``input_ids_pending`` is set: ``input_ids`` hold zeros, and row ``i`` feeds the pending
        step's sampled token ``i``, which the caller writes into ``plan.input_ids`` on the device
        (in stream order, after the pending step's sampling) before the forward pass.  With
        ``buffers`` this plan is built into the same buffers as the pending one: launch all of the
        pending step's work before calling it (on one stream, the upload then follows that work).

        Returns
        -------
        StepPlan or None
            None when the next step cannot be scheduled ahead: ``update()`` the pending step,
            then ``schedule()``.
        """
        batch = super().schedule_ahead()
        return None if batch is None else self._plan(batch)

    def _plan(self, batch: serving.ScheduledBatch) -> StepPlan:
        """The batch's plan, kept on the batch (``update`` and ``rollback`` find the batch by it)."""
        try:
            plan = None
            decodes = batch.num_decodes == len(batch.seq_ids)
            if self.decode_planner is not None and decodes:
                plan = self.decode_planner(batch)
            if plan is None:  # one token each given as 1: build_plan's decode pass
                plan = build_plan(self.cache, batch.seq_ids, 1 if decodes else batch.num_new_tokens, batch.input_ids,
                                  batch.sample_mask, rows=batch.rows, buffers=self.buffers, num_heads=self.num_heads)
        except Exception:
            super().rollback(batch)
            raise
        plan.sample_requests, plan.sample_rows = batch.sample_requests, batch.sample_rows
        plan.num_decodes, plan.input_ids_pending = batch.num_decodes, batch.input_ids_pending
        batch._step_plan = plan
        return plan

    def _detach(self) -> None:
        super()._detach()
        for batch in (self._step, self._ahead):
            if batch is not None and batch._step_plan is not None:  # the batch's own requests now
                batch._step_plan.sample_requests = batch.sample_requests

    def _batch_of(self, plan: StepPlan, verb: str) -> serving.ScheduledBatch:
        if self._step is None:
            raise RuntimeError(f"{verb}() needs a plan from schedule()")
        for batch in (self._step, self._ahead):
            if batch is not None and batch._step_plan is plan:
                return batch
        raise ValueError("plan is not the one the last schedule() returned")

    def update(self, plan: StepPlan, sampled_token_ids) -> list:
        """Take the step's sampled tokens; finish requests that hit their limit or a stop token.

        Parameters
        ----------
        plan : StepPlan
            The plan the last ``schedule()`` returned.
        sampled_token_ids : array_like of int
            ``[len(plan.sample_requests)]`` one token per sample (``len(plan.logits_indices)``
            unless a prompt of parallel samples ends this step).  With a step scheduled ahead,
            the pending (earlier) plan first.

        Returns
        -------
        list of Request
            Requests finished this step (their blocks are freed).
        """
        return super().update(self._batch_of(plan, "update"), sampled_token_ids)

    def rollback(self, plan: StepPlan) -> None:
        """Undo the pending step, as :meth:`serving.scheduler.Scheduler.rollback` does.

        Parameters
        ----------
        plan : StepPlan
            The plan the last ``schedule()`` returned.
        """
        super().rollback(self._batch_of(plan, "rollback"))
