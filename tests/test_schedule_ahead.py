"""Asynchronous scheduling: ``schedule_ahead()`` plans decode step n + 1 before step n's tokens
are known.  A fake device, run in stream order, shows that every request's tokens, every K/V
slot and the cache's final state are those of the same workload scheduled one step at a time."""
import numpy as np
import pytest

from cupy_paged.runtime.scheduler import Scheduler
from cupy_paged.serving.kv_cache import PagedAttentionCache
from cupy_paged.serving.scheduler import Request, SchedulerConfig

VOCAB = 61


class FakeDevice:
    """Stands in for the model on a stream: a step writes each new token into its K/V slot, then
    samples from everything the row attends to, so a wrong slot, a wrong position or a wrong
    input token changes every later token.  ``launch`` runs a step at once (as the stream would
    before any later work); the host only sees the tokens at ``read``."""

    def __init__(self, cache):
        self.kv = np.full(cache.num_blocks * cache.block_size, -1, np.int64)
        self.block_size = cache.block_size

    def launch(self, plan, previous_tokens=None):
        inputs = np.asarray(plan.input_ids, np.int64).copy()
        if plan.input_ids_pending:  # the previous step's samples, moved on the device
            assert previous_tokens is not None and (inputs == 0).all()
            inputs[:previous_tokens.size] = previous_tokens  # a padded plan: its first rows
        assert (plan.slot_mapping >= 0).all()
        self.kv[plan.slot_mapping] = inputs
        tokens = []
        cu, bs = plan.cu_seqlens_q, self.block_size
        for i in range(plan.batch_size):
            if not plan.sample_mask[i]:
                continue
            length = int(plan.cache_seqlens[i] + plan.query_lens[i])
            positions = np.arange(length)
            context = self.kv[plan.block_table[i, positions // bs] * bs + positions % bs]
            assert (context >= 0).all(), "a row attends to a slot nothing wrote"
            assert context[-1] == inputs[cu[i + 1] - 1]
            tokens.append(int((context * (positions + 7)).sum() % VOCAB))
        return np.array(tokens, np.int64)


def check_prefix_cache(cache, device):
    """Every block the prefix cache registered holds, on the device, the tokens it was hashed with."""
    bs = cache.block_size
    for block, (_, tokens) in cache.prefix_cache._key_of_block.items():
        assert device.kv[block * bs:(block + 1) * bs].tolist() == list(tokens), block


def workload(seed, count=24):
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, VOCAB, 20).tolist()  # a prefix some prompts share
    requests = []
    for i in range(count):
        prompt = (shared if i % 3 == 0 else []) + rng.integers(0, VOCAB, int(rng.integers(1, 30))).tolist()
        eos = int(rng.integers(0, VOCAB)) if i % 2 else None  # stops at an unknown step
        requests.append(Request(i, prompt, int(rng.integers(1, 40)), eos_token_id=eos))
    return requests


def make(num_blocks, max_num_seqs, prefix=True):
    cache = PagedAttentionCache(1, 1, 8, block_size=8, num_blocks=num_blocks, device="cpu",
                                enable_prefix_caching=prefix)
    return cache, Scheduler(cache, SchedulerConfig(max_batch_tokens=32, max_num_seqs=max_num_seqs))


def serve(seed, ahead, num_blocks=120, max_num_seqs=8, prefix=True, aborts=()):
    """Outputs of a workload; ``ahead``: schedule the next step before reading the pending one's
    tokens whenever the scheduler allows.  ``aborts``: (step, request id, when) aborted at that
    step: ``"pending"`` with one step pending, ``"ahead"`` with a step scheduled ahead of it,
    ``"between"`` after the pending step's update, the step ahead still pending (the last two
    only happen when the scheduler went ahead).  Returns the outputs, the steps made ahead and
    the requests aborted with two steps in flight."""
    cache, scheduler = make(num_blocks, max_num_seqs, prefix)
    device = FakeDevice(cache)
    for request in workload(seed):
        scheduler.add_request(request)
    outputs, pending, steps, ahead_steps, in_flight = {}, None, 0, 0, []

    def abort(when):
        for step, request_id, moment in aborts:
            if step == steps and moment == when and scheduler.abort([request_id]) and when != "pending":
                in_flight.append(request_id)

    while scheduler.has_unfinished() or pending is not None:
        if pending is None:
            plan = scheduler.schedule()
            assert plan is not None
            pending = (plan, device.launch(plan))
            steps += 1
        abort("pending")
        plan, tokens = pending
        nxt = scheduler.schedule_ahead() if ahead else None
        if nxt is not None:  # launched before the pending step's tokens reach the host
            following = (nxt, device.launch(nxt, tokens))
            steps += 1
            ahead_steps += 1
            abort("ahead")
        for request in scheduler.update(plan, tokens):
            outputs[request.request_id] = request.output_token_ids
        pending = following if nxt is not None else None
        if pending is not None:
            abort("between")
        check_prefix_cache(cache, device)
    assert cache.num_free_blocks == cache.num_blocks
    return outputs, ahead_steps, in_flight


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("prefix", [True, False])
def test_scheduling_ahead_gives_the_tokens_of_one_step_at_a_time(seed, prefix):
    want, none, _ = serve(seed, ahead=False, prefix=prefix)
    got, ahead_steps, _ = serve(seed, ahead=True, prefix=prefix)
    assert none == 0 and ahead_steps >= 10
    assert got == want


@pytest.mark.parametrize("seed", range(3))
def test_scheduling_ahead_with_a_small_cache_and_aborts(seed):
    """Few blocks (preemption between the ahead runs) and aborts while one or two steps are in
    flight: the other requests' tokens are unchanged and no block leaks."""
    aborts = [(9, 3, "pending"), (14, 4, "ahead"), (22, 10, "between"), (30, 12, "ahead"), (41, 15, "between"),
              (50, 17, "ahead"), (60, 19, "between")]
    cut = {rid for _, rid, _ in aborts}
    want, _, _ = serve(seed, ahead=False, num_blocks=40, max_num_seqs=6, aborts=aborts)
    got, ahead_steps, in_flight = serve(seed, ahead=True, num_blocks=40, max_num_seqs=6, aborts=aborts)
    assert ahead_steps > 0 and in_flight, "some abort must meet two steps in flight"
    assert {k: v for k, v in got.items() if k not in cut} == {k: v for k, v in want.items() if k not in cut}


def decoding_scheduler():
    cache, scheduler = make(40, 4)
    for i in range(3):
        scheduler.add_request(Request(i, [1 + i, 2, 3], 10))
    scheduler.update(scheduler.schedule(), [5, 6, 7])
    return cache, scheduler


def test_schedule_ahead_needs_a_pending_decode_step_and_one_at_a_time():
    cache, scheduler = decoding_scheduler()
    with pytest.raises(RuntimeError, match="pending step"):
        scheduler.schedule_ahead()
    step = scheduler.schedule()
    ahead = scheduler.schedule_ahead()
    assert ahead is not None and ahead.input_ids_pending and ahead.input_ids.tolist() == [0, 0, 0]
    assert ahead.positions.tolist() == [4, 4, 4] and step.positions.tolist() == [3, 3, 3]
    with pytest.raises(RuntimeError, match="scheduled ahead already"):
        scheduler.schedule_ahead()
    with pytest.raises(RuntimeError, match="previous step"):
        scheduler.schedule()
    with pytest.raises(ValueError, match="in the order"):
        scheduler.update(ahead, [1, 1, 1])
    with pytest.raises(ValueError, match="scheduled ahead first"):
        scheduler.rollback(step)
    scheduler.update(step, [8, 8, 8])
    scheduler.update(ahead, [9, 9, 9])
    assert [r.output_token_ids for r in scheduler.running] == [[5, 8, 9], [6, 8, 9], [7, 8, 9]]


def test_rolling_back_the_step_ahead_leaves_the_pending_one():
    cache, scheduler = decoding_scheduler()
    step = scheduler.schedule()
    ids = list(step.seq_ids)
    free, slots = cache.num_free_blocks, [cache.num_slots(i) for i in ids]
    ahead = scheduler.schedule_ahead()
    assert [cache.num_slots(i) for i in ids] == [n + 1 for n in slots]
    scheduler.rollback(ahead)
    assert cache.num_free_blocks == free and [cache.num_slots(i) for i in ids] == slots
    scheduler.update(step, [8, 8, 8])
    again = scheduler.schedule()  # the same step the rolled back one was
    assert again.positions.tolist() == [4, 4, 4] and again.input_ids.tolist() == [8, 8, 8]
    assert not again.input_ids_pending
    scheduler.rollback(scheduler.schedule_ahead())
    with pytest.raises(RuntimeError, match="counted as computed"):  # its K/V is being written
        scheduler.rollback(again)
    scheduler.update(again, [9, 9, 9])
    assert [r.output_token_ids for r in scheduler.running] == [[5, 8, 9], [6, 8, 9], [7, 8, 9]]


def test_rolling_back_a_step_ahead_that_opened_a_block_frees_it():
    cache, scheduler = make(40, 4)
    for i in range(2):
        scheduler.add_request(Request(i, list(range(1 + i, 8 + i)), 10))  # 7 tokens, then 8: block 0 full
    scheduler.update(scheduler.schedule(), [5, 6])
    step = scheduler.schedule()  # position 7, the last slot of block 0
    free = cache.num_free_blocks
    ahead = scheduler.schedule_ahead()  # position 8: a new block each
    assert ahead.positions.tolist() == [8, 8] and cache.num_free_blocks == free - 2
    scheduler.rollback(ahead)
    assert cache.num_free_blocks == free
    scheduler.update(step, [1, 2])


def test_no_step_ahead_when_it_could_not_be_a_decode_step_of_the_same_requests():
    cache, scheduler = decoding_scheduler()
    scheduler.add_request(Request("new", [4, 4], 3))  # a seat is free: the next step admits it
    step = scheduler.schedule()  # the decodes and the new prompt: not decode-only
    assert scheduler.schedule_ahead() is None
    scheduler.update(step, [1, 1, 1, 2])
    step = scheduler.schedule()
    assert step.batch_size == 4 and scheduler.schedule_ahead() is not None

    cache, scheduler = make(40, 4)
    scheduler.add_request(Request("short", [1, 2], 2))
    scheduler.update(scheduler.schedule(), [3])
    step = scheduler.schedule()  # its last token: a step ahead would be wasted
    assert scheduler.schedule_ahead() is None
    assert [r.output_token_ids for r in scheduler.update(step, [4])] == [[3, 4]]


def test_a_decode_planner_builds_every_decode_only_step_the_rest_as_before():
    """``Scheduler(decode_planner=)``: decode-only steps (scheduled ahead or not) come from the
    planner, padded here into buffers of their own; the tokens are those of the scheduler's plans."""
    import sys
    import pathlib

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
    from llama.cuda_graphs import DecodePadding

    want, _, _ = serve(0, ahead=True)
    cache, scheduler = make(121, 8)
    padding = DecodePadding(cache, [4, 8])
    built = []

    def planner(batch):
        plan = padding.plan(batch.seq_ids, batch.input_ids, rows=batch.rows if len(built) % 2 else None)
        built.append((plan, len(batch.seq_ids)))
        return plan

    scheduler.decode_planner = planner
    device = FakeDevice(cache)
    for request in workload(0):
        scheduler.add_request(request)
    outputs, pending = {}, None

    def launch(plan, previous=None):
        rows = len(plan.sample_requests)
        if built and plan is built[-1][0]:  # padded: the batch's rows first
            assert plan.batch_size in (4, 8) and rows == built[-1][1]
        return device.launch(plan, previous)[:rows]

    while scheduler.has_unfinished() or pending is not None:
        if pending is None:
            plan = scheduler.schedule()
            pending = (plan, launch(plan))
        plan, tokens = pending
        nxt = scheduler.schedule_ahead()
        following = None if nxt is None else (nxt, launch(nxt, tokens))
        for request in scheduler.update(plan, tokens):
            outputs[request.request_id] = request.output_token_ids
        pending = following
    padding.release()
    assert len(built) > 20 and outputs == want
    assert cache.num_free_blocks == cache.num_blocks
