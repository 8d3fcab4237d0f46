"""Host cost of one continuous-batching step: is the CPU ever what a decode step waits for?

For 64, 256 and 1024 running requests with about 4k tokens of context each (block
size 16, so ~256 blocks a request), measures the median microseconds of

* ``plan``: ``build_plan`` into ``PlanBuffers`` (the path an engine on a GPU takes)
  for a mostly-decode step: every request decodes, plus one 512-token prefill
  chunk, so the varlen path; one request in 16 has gained a block since the last
  step.  The targets are <= 50 us at 256 and <= 200 us at 1024;
* ``plan_decode``: the same for an all-decode step (the decode kernel's path);
* ``plan_ragged``, ``plan_ragged_decode``: the two steps again with ``num_heads=8`` (8 query heads
  per kv head) into ``PlanBuffers(query_group=8)``: the plan also lists the ragged launch's work;
* ``plan_new_arrays``: ``build_plan`` of the mixed step into freshly allocated
  arrays with every block table row copied (no buffers);
* ``schedule``: a whole ``Scheduler.schedule()`` of an all-decode step (choosing
  requests, reserving slots, gathering input ids, building the plan into buffers);
* ``update``: ``Scheduler.update()`` taking the sampled tokens back;
* ``step``: the median of ``schedule()`` + ``update()`` per step, the host gap between two
  decode steps.  The targets are <= 100 us at 256 and <= 300 us at 1024;
* ``step_ragged``: the same with the scheduler planning for the ragged launch
  (``num_heads=8``, ``PlanBuffers(query_group=8)``), what the example engine does by default.

Writes ``benchmarks/results/host.json`` and prints a markdown table.
Run: ``python benchmarks/bench_host.py [--repeats N]``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import sys
import time

import numba
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import cupy_paged  # noqa: E402
from cupy_paged.runtime.buffers import PlanBuffers  # noqa: E402
from cupy_paged.runtime.plan import build_plan  # noqa: E402
from cupy_paged.runtime.scheduler import Scheduler  # noqa: E402
from cupy_paged.serving.kv_cache import PagedAttentionCache  # noqa: E402
from cupy_paged.serving.scheduler import Request, SchedulerConfig  # noqa: E402

BLOCK_SIZE = 16
CONTEXT = 4096
PREFILL_CHUNK = 512
TARGETS_US = {256: 50.0, 1024: 200.0}
# schedule() + update() of an all-decode step (issue 15): the host gap between two decode steps.
STEP_TARGETS_US = {256: 100.0, 1024: 300.0}


def median_us(fn, repeats: int, before=lambda step: None) -> float:
    """Median wall time of ``fn()`` in microseconds, after warm-up; ``before(step)`` runs untimed."""
    times = []
    for step in range(repeats + 5):
        before(step)
        start = time.perf_counter_ns()
        fn()
        if step >= 5:
            times.append(time.perf_counter_ns() - start)
    return float(np.median(times)) / 1e3


def running_scheduler(num_requests: int, rng: np.random.Generator) -> Scheduler:
    """A scheduler whose ``num_requests`` requests are all decoding with ~4k tokens cached."""
    blocks_per_seq = (CONTEXT + 1024) // BLOCK_SIZE
    cache = PagedAttentionCache(1, 1, 32, block_size=BLOCK_SIZE, num_blocks=(num_requests + 1) * blocks_per_seq,
                                dtype="float16", device="cpu", max_seqs=num_requests + 1,
                                max_blocks_per_seq=blocks_per_seq, enable_prefix_caching=False)
    # A large budget gets the prompts in within a few dozen steps; decode steps use one token a request.
    config = SchedulerConfig(max_batch_tokens=64 * 1024, max_num_seqs=num_requests + 1,
                             admission_margin=0.0)
    scheduler = Scheduler(cache, config, buffers=PlanBuffers(num_requests + 1, 64 * 1024, blocks_per_seq))
    for i in range(num_requests):
        prompt = rng.integers(0, 32000, int(rng.integers(CONTEXT - 512, CONTEXT - 64))).tolist()
        scheduler.add_request(Request(i, prompt, max_new_tokens=1024))  # two timed loops of decodes
    # Run the prompts through until every request has sampled its first token.
    while any(r.num_computed < len(r.prompt_token_ids) for r in scheduler._live.values()):
        plan = scheduler.schedule()
        scheduler.update(plan, rng.integers(0, 32000, len(plan.logits_indices)))
    return scheduler


def decode_steps(scheduler, tokens, repeats: int, path: str) -> tuple[list, list]:
    """Microseconds of ``schedule()`` and of ``update()`` of each of ``repeats`` all-decode steps
    (after 5 untimed ones), every plan on ``path`` with the whole batch."""
    schedule_us, update_us = [], []
    for step in range(max(repeats, 3) + 5):
        start = time.perf_counter_ns()
        plan = scheduler.schedule()
        middle = time.perf_counter_ns()
        scheduler.update(plan, tokens)
        end = time.perf_counter_ns()
        assert plan.path == path and plan.batch_size == len(tokens)
        if step >= 5:
            schedule_us.append((middle - start) / 1e3)
            update_us.append((end - middle) / 1e3)
    return schedule_us, update_us


def measure(num_requests: int, repeats: int, rng: np.random.Generator) -> list[dict]:
    scheduler = running_scheduler(num_requests, rng)
    cache = scheduler.cache
    first = scheduler.schedule()  # an all-decode step: one slot reserved for every request
    ids = list(first.seq_ids)
    rows = cache.rows(ids)
    decode_inputs = rng.integers(0, 32000, len(ids))

    def new_blocks(step):
        # In a real decode step one request in BLOCK_SIZE starts a new block: its table row changed.
        cache.table_versions[rows[step % BLOCK_SIZE::BLOCK_SIZE]] += 1

    buffers = PlanBuffers(num_requests + 1, num_requests + PREFILL_CHUNK, cache.max_blocks_per_seq)
    ragged = PlanBuffers(num_requests + 1, num_requests + PREFILL_CHUNK, cache.max_blocks_per_seq, query_group=8)
    # One more request mid-prefill makes the mostly-decode step take the varlen path.
    prompt = rng.integers(0, 32000, CONTEXT).tolist()
    cache.allocate("prefill", prompt, PREFILL_CHUNK)
    mixed_ids = ids + ["prefill"]
    mixed_rows = cache.rows(mixed_ids)
    mixed_lens = np.ones(len(mixed_ids), np.int64)
    mixed_lens[-1] = PREFILL_CHUNK
    mixed_inputs = rng.integers(0, 32000, len(ids) + PREFILL_CHUNK)
    mixed_sample = np.ones(len(mixed_ids), bool)
    mixed_sample[-1] = False
    results = {
        "plan": median_us(lambda: build_plan(cache, mixed_ids, mixed_lens, mixed_inputs, mixed_sample,
                                             rows=mixed_rows, buffers=buffers), repeats, new_blocks),
        "plan_decode": median_us(lambda: build_plan(cache, ids, 1, decode_inputs, rows=rows, buffers=buffers),
                                 repeats, new_blocks),
        "plan_ragged": median_us(lambda: build_plan(cache, mixed_ids, mixed_lens, mixed_inputs, mixed_sample,
                                                    rows=mixed_rows, buffers=ragged, num_heads=8, path="ragged"),
                                 repeats, new_blocks),
        "plan_ragged_decode": median_us(lambda: build_plan(cache, ids, 1, decode_inputs, rows=rows, buffers=ragged,
                                                           num_heads=8), repeats, new_blocks),
        "plan_new_arrays": median_us(lambda: build_plan(cache, mixed_ids, mixed_lens, mixed_inputs,
                                                        mixed_sample, rows=mixed_rows), repeats),
    }
    cache.free("prefill")
    scheduler.update(first, decode_inputs)

    schedule_us, update_us = decode_steps(scheduler, decode_inputs, repeats, "decode")
    results["schedule"], results["update"] = float(np.median(schedule_us)), float(np.median(update_us))
    results["step"] = float(np.median(np.add(schedule_us, update_us)))
    # The same steps planned for the ragged launch (the example engine's default).
    scheduler.num_heads = 8
    scheduler.buffers = PlanBuffers(num_requests + 1, 64 * 1024, cache.max_blocks_per_seq, query_group=8)
    results["step_ragged"] = float(np.median(np.add(*decode_steps(scheduler, decode_inputs, repeats, "ragged"))))
    return [{"name": f"{name}_{num_requests}", "metric": "median_us", "value": round(value, 2), "peers": {}}
            for name, value in results.items()]


def cpu_name() -> str:
    """The CPU model and core count, e.g. ``CPU: Intel(R) Xeon(R) Processor, 2 cores``."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            model = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"CPU: {model}, {os.cpu_count()} cores"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "host.json"))
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    cases = []
    for num_requests in (64, 256, 1024):
        cases.extend(measure(num_requests, args.repeats, rng))
    report = {
        "device": cpu_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "versions": {"python": platform.python_version(), "numpy": np.__version__,
                     "numba": numba.__version__, "cupy_paged": cupy_paged.__version__},
        "cases": cases,
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print("| case | requests | median us | target us |")
    print("| --- | ---: | ---: | ---: |")
    for case in cases:
        name, count = case["name"].rsplit("_", 1)
        target = {"plan": TARGETS_US, "step": STEP_TARGETS_US}.get(name, {}).get(int(count), "")
        print(f"| {name} | {count} | {case['value']:.1f} | {target} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
