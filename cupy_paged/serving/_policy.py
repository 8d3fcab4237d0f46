"""The general step of the scheduler: the path any step can take (mixed prefills and decodes,
admission, preemption, the first samples of parallel branches), where the decode-only step
takes the persistent batch's array path (``scheduler.py``).

Each ``schedule()`` call makes one step: running decodes first, then running prefills (oldest
first) and then waiting requests (by priority, then first come first served), long prompts cut
into chunks, all under a token budget (``max_batch_tokens``) and the cache's free blocks.  When
a running request cannot get a block, the least urgent running request, newest first, is
preempted: its blocks are freed and it is recomputed from its tokens later (vLLM's policy; the
prefix cache usually gives most of them back).
"""
from __future__ import annotations

import bisect
import itertools

import numpy as np

from .block_pool import CacheFull
from .requests import RequestStatus

WAITING, RUNNING = RequestStatus.WAITING, RequestStatus.RUNNING


def queue_key(request) -> tuple:
    """Where a request waits: by priority (lower first), then arrival (a parallel branch by its index)."""
    return request.priority, request._arrival, request.sample_index


class GeneralStep:
    """``schedule`` / ``update`` of any step, and the moves of requests between queues, for
    :class:`~cupy_paged.serving.scheduler.Scheduler`."""

    # ------------------------------------------------------------------ moves between queues

    def _enqueue(self, request) -> None:
        request.status = WAITING
        bisect.insort(self.waiting, request, key=queue_key)

    def _start_running(self, request) -> None:
        """``request``'s sequence is in the cache now: it joins the running batch."""
        request.status = RUNNING
        request._cache = self.cache
        self._admissions += 1
        self._running.add(request, int(self.cache.rows([request.request_id])[0]), self._admissions)

    def _stop_running(self, request) -> None:
        """Free ``request``'s blocks (full computed ones stay in the prefix cache); it leaves the batch."""
        request._num_computed = self.cache.num_computed(request.request_id)
        self.cache.free(request.request_id)
        request._cache = None
        self._running.remove(request)

    def _preempt(self, request) -> None:
        """Free ``request``'s blocks and queue it for recomputation."""
        self._stop_running(request)
        request.num_computed = 0
        request.num_preemptions += 1
        self._enqueue(request)
        self.num_preemptions += 1
        self._counters.num_preempted_waiting += 1

    # ------------------------------------------------------------------ schedule

    def _schedule_general(self):
        run, config = self._running, self.config
        n = len(run)
        rows = run.rows[:n].copy()
        is_decode = run.num_tokens[:n] - self.cache.plan_view(rows).num_computed == 1
        decodes = [run.requests[i] for i in np.flatnonzero(is_decode).tolist()]
        prefills = sorted((run.requests[i] for i in np.flatnonzero(~is_decode).tolist()),
                          key=lambda r: run.rank[r._slot, 1])
        decodes, decode_rows = self._schedule_decodes(decodes, rows[is_decode])
        scheduled: dict = dict.fromkeys(decodes, 1)
        preemptions = self.num_preemptions
        budget = self._schedule_running_prefills(prefills, scheduled, config.max_batch_tokens - len(decodes))
        if self.num_preemptions != preemptions:  # a prefill's growth may have preempted decodes
            kept = np.array([r in scheduled for r in decodes], bool)
            decodes, decode_rows = list(itertools.compress(decodes, kept)), decode_rows[kept]
        self._admit_waiting(scheduled, budget)
        if not scheduled:
            return None
        requests, counts = list(scheduled), list(scheduled.values())  # the decodes lead
        num_decodes = len(decodes)
        rows = (decode_rows if num_decodes == len(requests) else np.concatenate(
            [decode_rows, self.cache.rows([r.request_id for r in requests[num_decodes:]])]))
        self._counters.decode_tokens += num_decodes
        self._counters.prefill_tokens += sum(counts) - num_decodes
        return self._batch(requests, counts, rows, num_decodes)

    def _schedule_decodes(self, decodes: list, rows: np.ndarray):
        """All running requests with one token left get a slot, preempting as needed.
        Returns them and their cache rows."""
        while decodes:
            try:
                cow: list = []
                self.cache.grow(None, 1, rows=rows, cow_log=cow)
                self._undo.append(("grow", decodes, rows, 1, np.array([r.num_preemptions for r in decodes]), cow))
                return decodes, rows
            except CacheFull:
                victim = self._running.victim()
                self._preempt(victim)
                if victim in decodes:
                    i = decodes.index(victim)
                    decodes = decodes[:i] + decodes[i + 1:]
                    rows = np.delete(rows, i)
        return decodes, np.empty(0, np.int64)

    def _schedule_running_prefills(self, prefills: list, scheduled: dict, budget: int) -> int:
        """Next chunk of each running, partly prefilled request, oldest first."""
        chunk_limit = self.config.max_prefill_chunk
        for request in prefills:
            if budget == 0:
                break
            if request.status is not RUNNING:
                continue  # preempted for an older request earlier in this loop
            count = min(request.num_tokens - request.num_computed, budget, chunk_limit)
            count, released = self._grow_or_preempt(request, count, scheduled)
            if count:
                scheduled[request] = count
                self._undo.append(("grow", [request], self.cache.rows([request.request_id]), count,
                                   np.array([request.num_preemptions]), self._cow))
            budget += released - count  # a preempted victim's scheduled tokens are back
        return budget

    def _grow_or_preempt(self, request, count: int, scheduled: dict) -> tuple[int, int]:
        """Reserve ``count`` slots for ``request``, shrinking the chunk or preempting others.
        Returns the slots reserved and the tokens of preempted requests taken out of ``scheduled``."""
        cache = self.cache
        released = 0
        while True:
            try:
                cow: list = []
                cache.grow([request.request_id], count, cow_log=cow)
                self._cow = cow
                return count, released
            except CacheFull:
                pass
            # A smaller chunk that fits now beats preempting anyone.
            room = -cache.num_slots(request.request_id) % cache.block_size
            fits = room + cache.num_free_blocks * cache.block_size
            if 0 < fits < count:
                count = fits
                continue
            victim = self._running.victim()
            self._preempt(victim)
            if victim is request:
                return 0, released
            released += scheduled.pop(victim, 0)  # its reserved slots went with its blocks

    def _admit_waiting(self, scheduled: dict, budget: int) -> None:
        """Admit waiting requests in queue order while budget, seats and blocks last."""
        cache, config, counters = self.cache, self.config, self._counters
        while self.waiting and budget > 0 and len(self._running) < config.max_num_seqs:
            request = self.waiting[0]
            limit = min(budget, config.max_prefill_chunk)
            margin = self._margin if len(self._running) else 0
            try:  # one prefix match: allocate cuts the chunk to the limit after the cached prefix
                cached = cache.allocate(request.request_id, request.token_ids, reserve=margin,
                                        max_num_new_tokens=limit)
            except CacheFull:
                break
            count = cache.num_slots(request.request_id) - cached  # the slots allocate reserved
            del self.waiting[0]
            if request.num_preemptions:
                counters.num_preempted_waiting -= 1
            first = not request._admitted
            if first:  # the prefix cache's hit rate counts first admissions of prompts
                request._admitted = True
                request.num_cached_prompt_tokens = min(cached, len(request.prompt_token_ids))
                counters.prompt_tokens += len(request.prompt_token_ids)
                counters.cached_prompt_tokens += request.num_cached_prompt_tokens
                self._cached_by_request[request.request_id] = request.num_cached_prompt_tokens
            self._start_running(request)
            self._undo.append(("admit", request, first))
            scheduled[request] = count
            budget -= count

    def _batch(self, requests: list, counts: list, rows: np.ndarray, num_decodes: int):
        """The step's batch; the first ``num_decodes`` requests decode."""
        computed = [r.num_tokens - 1 for r in requests[:num_decodes]] + [r.num_computed for r in requests[num_decodes:]]
        input_ids = np.fromiter(itertools.chain.from_iterable(
            r.token_ids[c:c + n] for r, c, n in zip(requests, computed, counts)), np.int64, sum(counts))
        sample = None  # every row samples: decodes always do
        if num_decodes < len(requests):
            # Only a prefill whose chunk reaches its last token samples: a one-token chunk in the
            # middle of a prompt (budget or max_prefill_chunk of 1) does not.
            sample = np.array([c + n == r.num_tokens for r, c, n in zip(requests, computed, counts)], bool)
        sampling = requests if sample is None else list(itertools.compress(requests, sample.tolist()))
        sample_requests, sample_rows = sampling, None
        if any(r._unforked for r in sampling):  # a prompt of n parallel samples ends: n samples of its row
            sample_requests = [b for r in sampling for b in (r.branches if r._unforked else (r,))]
            sample_rows = np.repeat(np.arange(len(sampling)), [len(r.branches) if r._unforked else 1
                                                               for r in sampling])
        return self._new_batch(requests, [r.request_id for r in requests], np.asarray(counts, np.int64),
                               input_ids, sample, rows, num_decodes, sample_requests, sample_rows)

    def _undo_step(self) -> None:
        """``rollback``: replay the pending step's record backwards."""
        counters = self._counters
        for entry in reversed(self._undo):
            if entry[0] == "grow":
                _, requests, rows, count, preemptions, cow = entry
                # Still holding this step's reservation: not aborted since, nor preempted later in the step.
                live = np.array([r._cache is not None for r in requests], bool)
                if preemptions is not None:
                    live &= np.array([r.num_preemptions for r in requests]) == preemptions
                self.cache.shrink(None, count, rows=rows if live.all() else rows[live], cow_log=cow)
                continue
            _, request, first = entry
            if request._cache is None:
                continue  # aborted since
            self._stop_running(request)
            request.num_computed = 0
            if request.num_preemptions:
                counters.num_preempted_waiting += 1
            if first:
                request._admitted = False
                request.num_cached_prompt_tokens = 0
                self._cached_by_request.pop(request.request_id, None)
            self._enqueue(request)
        self._admissions -= sum(1 for entry in self._undo if entry[0] == "admit")
        (self._decoding_only, counters.prompt_tokens, counters.cached_prompt_tokens, counters.prefill_tokens,
         counters.decode_tokens) = self._saved
        self._undo = []

    # ------------------------------------------------------------------ update

    def _update_general(self, batch, sampled: list) -> list:
        """``update`` of any step: aborted rows dropped, tokens appended, branches forked, stops."""
        self._detach()  # a step scheduled ahead keeps its rows while requests finish or fork
        if not batch._computed:  # (else schedule_ahead() marked the step's tokens)
            live = [r._cache is not None for r in batch.requests]  # False: aborted or finished since
            if self.cache.enable_prefix_caching:  # the cache hashes blocks this step fills: their tokens
                self._running.flush_filling(self.cache.block_size)
            if all(live):
                self.cache.mark_computed(batch.seq_ids, rows=batch.rows)
            elif any(live):
                self.cache.mark_computed(list(itertools.compress(batch.seq_ids, live)),
                                         rows=batch.rows[np.array(live)])
        finished = []
        for request, token in zip(batch.sample_requests, sampled):
            if request.is_done:
                continue  # aborted after schedule()
            request._unforked = False
            request.token_ids.append(token)
            if request._pending_fork:
                self._place_branch(request)
            elif request._cache is not None:
                self._running.appended(request, token)
            if request.num_tokens >= request.max_tokens or token in request.stop_token_ids:
                finished.append(request)
        for request in finished:
            self._finish(request)
        self._decoding_only = self._all_decoding()
        return finished

    def _place_branch(self, branch) -> None:
        """A parallel branch got its first token: it forks its parent's blocks when a seat is
        free, else it waits (and is recomputed, the prefix cache giving back the prompt)."""
        branch._pending_fork = False
        parent = branch.parent
        if branch.num_tokens >= branch.max_tokens or branch.token_ids[-1] in branch.stop_token_ids:
            return  # finished at its first token: it never needs blocks
        if parent._cache is not None and len(self._running) < self.config.max_num_seqs:
            self.cache.fork(parent.request_id, branch.request_id, token_ids=branch.token_ids)
            self._start_running(branch)
        else:
            branch._admitted = True  # its prompt is its parent's, counted there
            self._enqueue(branch)

    def _finish(self, request) -> None:
        request.finish_reason = "stop" if request.token_ids[-1] in request.stop_token_ids else "length"
        if request._cache is not None:
            self._stop_running(request)
        elif request.status is WAITING and request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        del self._live[request.request_id]
        self._cached_by_request.pop(request.request_id, None)
        self._counters.num_finished += 1

    def _all_decoding(self) -> bool:
        """Whether every running request has exactly one token left to compute, and none is a
        prompt whose parallel branches wait for its first sample (the decode-only path's premise)."""
        run = self._running
        n = len(run)
        return bool((run.num_tokens[:n] - self.cache.plan_view(run.rows[:n]).num_computed == 1).all()) \
            and not any(r._unforked for r in run.requests)
