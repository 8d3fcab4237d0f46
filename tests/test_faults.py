"""Faults in the manager: a step that fails midway leaves the cache and the scheduler as before it.

Injected on the CPU backend: a block allocation that fails inside ``schedule()`` (the cache growing
or admitting a request), a plan build / upload that fails after the batch was chosen, and a model
forward that fails after some layers wrote their K/V.  Each time the state equals the snapshot
before the step, the step can be retried, and the run ends with the tokens of a run without the
fault and no block held.
"""
from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

from cupy_paged.runtime import scheduler as runtime_scheduler
from cupy_paged.serving.scheduler import Request

from test_scheduler import make_scheduler, no_block_held, snapshot

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

from llama import CPU_DEFAULT, Engine, GenerationRequest, LlamaModel, random_weights  # noqa: E402


class Injected(RuntimeError):
    pass


def requests():
    return [Request(i, list(range(7 * i, 7 * i + 5 + 6 * i)), 5) for i in range(5)]


def sample(plan):
    """A deterministic stand-in for the model: the token follows from the request and its length."""
    return [(hash(r.request_id) + len(r.token_ids)) % 97 for r in plan.sample_requests]


def drive(scheduler, fault_at_step=None, fault=None):
    """Run to the end with ``fault`` armed from step ``fault_at_step`` on until it fires once: that
    schedule() raises, the state must equal the snapshot before it, and the run goes on.  Returns
    the outputs by request id."""
    outputs, step, patch = {}, 0, None
    for request in requests():
        scheduler.add_request(request)
    while scheduler.has_unfinished():
        armed = fault is not None and step >= fault_at_step and (patch is None or not patch.fired)
        before = snapshot(scheduler) if armed else None
        if armed and patch is None:
            patch = fault(scheduler).__enter__()
        try:
            plan = scheduler.schedule()
        except Injected:
            assert snapshot(scheduler) == before
            patch.__exit__(None, None, None)
            continue
        for r in scheduler.update(plan, sample(plan)):
            outputs[r.request_id] = r.output_token_ids
        step += 1
    if patch is not None and not patch.fired:
        patch.__exit__(None, None, None)
    assert fault is None or patch.fired, "the fault never fired"
    assert no_block_held(scheduler.cache)
    return outputs


class _Patch:
    """Replace ``owner.name`` with a function that raises on its ``nth`` call (0 first), for one block."""

    def __init__(self, owner, name, nth=0):
        self.owner, self.name, self.nth, self.calls, self.fired = owner, name, nth, 0, False

    def __enter__(self):
        original = self.original = getattr(self.owner, self.name)

        def failing(*args, **kwargs):
            self.calls += 1
            if self.calls - 1 == self.nth and not self.fired:
                self.fired = True
                raise Injected(f"{self.name} failed (injected)")
            return original(*args, **kwargs)
        setattr(self.owner, self.name, failing)
        return self

    def __exit__(self, *exc):
        setattr(self.owner, self.name, self.original)
        return False


def small():
    return make_scheduler(num_blocks=9, block_size=8, max_batch_tokens=12, max_num_seqs=3, max_prefill_chunk=6)


@pytest.mark.parametrize("step", [0, 2, 5, 9])
@pytest.mark.parametrize("nth", [0, 1])
def test_a_block_allocation_failing_inside_schedule(step, nth):
    clean = drive(small())
    got = drive(small(), step, lambda s: _Patch(s.cache.pool, "allocate", nth))
    assert got == clean


@pytest.mark.parametrize("step", [4, 8, 12])
def test_the_decode_steps_block_growth_failing(step):
    """The decode-only step's numba growth (which pops the free stack itself) raising: nothing changed."""
    from cupy_paged.serving import _growth

    clean = drive(small())
    got = drive(small(), step, lambda s: _Patch(_growth, "grow_decodes_from_stack"))
    assert got == clean


@pytest.mark.parametrize("step", [0, 3, 7])
def test_a_plan_build_or_upload_failing(step):
    clean = drive(small())
    got = drive(small(), step, lambda s: _Patch(runtime_scheduler, "build_plan"))
    assert got == clean


def test_a_model_forward_failing_midway_is_rolled_back_and_retried():
    """The engine's step fails after the first layer wrote its K/V; the step rolls back and the
    retried run generates the tokens of a run without the fault."""
    weights = random_weights(CPU_DEFAULT, 2, np.float32)
    prompts = [list(range(3, 3 + n)) for n in (9, 30, 4)]

    def run(fail_step=None):
        model = LlamaModel(CPU_DEFAULT, weights, np, np.float32)
        engine = Engine(model, block_size=8, num_blocks=24, max_batch_tokens=16, max_num_seqs=3)
        for i, prompt in enumerate(prompts):
            engine.add_request(GenerationRequest(i, prompt, 6))
        outputs, step, failures = {}, 0, 0
        original = model._attention_block
        while engine.has_unfinished():
            if step == fail_step and failures == 0:
                def failing(index, *args):
                    if index == 1:  # layer 0 has written its K/V into the cache
                        raise Injected("layer 1 failed (injected)")
                    return original(index, *args)
                model._attention_block = failing
                before = snapshot(engine.scheduler)
                with pytest.raises(Injected):
                    engine.step()
                model._attention_block = original
                assert snapshot(engine.scheduler) == before
                failures += 1
                continue
            for r in engine.step():
                outputs[r.request_id] = r.output_token_ids
            step += 1
        assert engine.cache.num_free_blocks == engine.cache.num_blocks
        return outputs

    clean = run()
    for fail_step in (0, 2, 4):
        assert run(fail_step) == clean, fail_step
