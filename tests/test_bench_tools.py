"""The benchmarks' own logic that needs no GPU: bench_calls' sample order and trace_call's reading
of a profiler trace (a wrong parse or order would report figures for the wrong calls)."""
import pathlib

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def benchmarks(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_calls
    import trace_call

    return bench_calls, trace_call


def test_shuffled_order_puts_every_call_after_every_other(benchmarks):
    """With --shuffle-order each sample runs every call once, in an order of its own, and over the
    samples each call follows each other one about equally often; without it the order is fixed."""
    bench_calls, _ = benchmarks
    names = ["ours torch", "ours cupy", "plan", "cuDNN SDPA", "torch FA2 varlen"]
    orders = [bench_calls.sample_order(names, rep, True) for rep in range(200)]
    assert all(sorted(order) == sorted(names) for order in orders)
    assert orders == [bench_calls.sample_order(names, rep, True) for rep in range(200)]  # seeded: repeatable
    follows = {}
    for order in orders:
        for before, after in zip(order, order[1:]):
            follows[before, after] = follows.get((before, after), 0) + 1
    assert len(follows) == len(names) * (len(names) - 1)  # every ordered pair of calls occurs
    assert min(follows.values()) >= 20  # 40 expected each (200 samples x 4 pairs / 20 pairs)
    assert bench_calls.sample_order(names, 3, False) == names
    assert bench_calls.sample_order([], 3, True) == []


def _span(name, ts, dur, cat, correlation=None, ph="X"):
    event = {"name": name, "ts": ts, "dur": dur, "cat": cat, "ph": ph}
    if correlation is not None:
        event["args"] = {"correlation": correlation}
    return event


def test_trace_split_matches_launches_and_kernels_to_their_call(benchmarks):
    """Each call's range finds the launch APIs inside it and, through their correlation ids, its
    kernels; a range with no launch is not counted, and another call's kernels are not taken."""
    _, trace_call = benchmarks
    events = [
        _span("ours#0", 100.0, 50.0, "user_annotation"),
        _span("cuLaunchKernel", 120.0, 7.0, "cuda_driver", correlation=1),
        _span("paged_decode", 130.0, 16.0, "kernel", correlation=1),
        _span("peer#0", 200.0, 60.0, "user_annotation"),
        _span("cudaLaunchKernel", 210.0, 5.0, "cuda_runtime", correlation=2),
        _span("cudnn_kernel", 222.0, 14.0, "kernel", correlation=2),
        _span("cudaLaunchKernel", 230.0, 5.0, "cuda_runtime", correlation=3),
        _span("cudnn_second", 240.0, 6.0, "kernel", correlation=3),
        _span("ours#1", 300.0, 40.0, "user_annotation"),  # no launch inside: not a sample
        _span("stray", 305.0, 3.0, "kernel", correlation=9),
    ]
    parts = trace_call.split(events, ["ours", "peer"])
    assert parts["ours"] == {"launch api": 20.0, "first kernel": 30.0, "kernels": 16.0, "gaps": 0.0, "host": 50.0,
                             "launches": 1.0, "kernel paged_decode": 16.0, "samples": 1,
                             "apis": [("cuLaunchKernel", 20.0, 7.0)]}
    assert parts["peer"]["launch api"] == 10.0 and parts["peer"]["first kernel"] == 22.0
    assert parts["peer"]["kernels"] == 246.0 - 222.0 and parts["peer"]["launches"] == 2.0
    assert parts["peer"]["gaps"] == 246.0 - 222.0 - 14.0 - 6.0  # between the two kernels
    assert parts["peer"]["kernel cudnn_kernel"] == 14.0 and parts["peer"]["kernel cudnn_second"] == 6.0
    # Every CUDA API call inside the range, in order, as (name, start from the range's start, duration).
    assert parts["peer"]["apis"] == [("cudaLaunchKernel", 10.0, 5.0), ("cudaLaunchKernel", 30.0, 5.0)]
    assert trace_call.split(events, ["missing"]) == {}


def test_trace_list_summary_tells_builder_waiters_work_and_padding(monkeypatch):
    """trace_list.py's reading of a trace (start, ready, end, SM, number, the builder's stamps, then
    each CTA's phases, in ns): the builder's time is ticket 0's start to ready, its phases its stamps
    from that start, real CTAs are the items' kv heads, the rest padding; a real CTA's first tile
    counts from its ready, its epilogue from its loop's end."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import numpy as np
    import trace_list

    heads = trace_list.KV_HEADS
    rows = []
    for number in range(3 * heads):  # 2 real items, 1 padding item
        start = 1000 * (number // heads)            # ns
        ready = max(start, 4000) if number // heads < 2 else 9000  # all wait for the list (ready at 4 us)
        end = ready + (20000 if number // heads < 2 else 500)
        # the builder (ticket 0) stamps its phases 0.5 us apart; the other rows leave them zero
        stamps = [start + 50_000 + 500 * (i + 1) for i in range(len(trace_list.BUILD_PHASES))] if number == 0 else \
            [0] * len(trace_list.BUILD_PHASES)
        # tile 0 lands 3 us after ready, the loop drains 0.6 us before the end (padding CTAs leave first: zeros)
        phases = [ready + 3000, end - 600, end - 100] if number // heads < 2 else [-50_000] * 3
        rows.append([start + 50_000, ready + 50_000, end + 50_000, number % 4, number] + stamps +
                    [at + 50_000 for at in phases])
    summary = trace_list.summarise(np.array(rows, np.uint64), real_items=2)
    assert list(summary["build_phases_us"].values()) == [0.5 * (i + 1) for i in range(len(trace_list.BUILD_PHASES))]
    five = trace_list.summarise(np.array(rows, np.uint64)[:, :5], real_items=2)
    assert five["build_phases_us"] is None and five["tile0_after_ready_us_p10_p50_p90"] is None
    assert summary["tile0_after_ready_us_p10_p50_p90"] == [3.0, 3.0, 3.0]
    assert summary["epilogue_us_p50_p90"] == [0.6, 0.6]
    assert summary["real_ctas"] == 2 * heads and summary["padding_ctas"] == heads
    assert summary["ticket0_ready_us"] == 4.0
    assert summary["first_real_ready_us"] == 4.0
    assert summary["wait_us_p50_p100"][1] == 4.0  # ticket 0 itself: its build
    assert summary["real_duration_us_p10_p50_p90"][1] == 20.0
    assert summary["last_real_end_us"] == 24.0 and summary["span_us"] == 24.0
    assert summary["padding_last_end_us"] == 9.5 and summary["padding_duration_us_p50_p100"] == [7.5, 7.5]


def test_trace_phases_reads_each_ctas_phases(monkeypatch):
    """trace_phases.py's reading of one launch (start, ready, end, SM, number, the builder's seven
    stamps, then tile 0 landed, the loop drained, the rows stored; ns): times from the first CTA's
    start, each CTA's phase lengths, and the window in which tiles stream."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import numpy as np
    import trace_phases

    rows = []
    for i in range(4):  # starts 0, 0.1, 0.2, 0.3 us; tile 0 after 3 us; loops of 5 us; stores of 0.5
        start = 1_000_000 + 100 * i
        tile0, drained = start + 3000, start + 8000
        rows.append([start, start, drained + 500, 0, i] + [0] * 7 + [tile0, drained, drained + 400])
    got = trace_phases.launch_phases(np.array(rows, np.int64))
    assert got["start"] == [0.0, 0.15, 0.3] and got["tile0"] == [3.0, 3.15, 3.3]
    assert got["prologue"] == 3.0 and got["loop_len"] == 5.0 and got["epilogue"] == 0.5
    assert got["span"] == 8.8 and got["stored"][2] == 8.7
    assert abs(got["stream_window"] - (8.3 - 3.15)) < 1e-9


def _bench_e2e(monkeypatch):
    """benchmarks/bench_e2e.py as a module (it puts examples/ on the path, for ``llama``)."""
    import importlib.util
    import sys

    monkeypatch.syspath_prepend(str(BENCHMARKS.parent / "examples"))
    spec = importlib.util.spec_from_file_location("_bench_e2e", BENCHMARKS / "bench_e2e.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def _step_kinds(engine) -> list:
    """Wrap ``engine.step``: returns a list that gets, per call, the kind of the step it launched
    (None when it launched none), read from the engine's step counts."""
    launched, inner = [], engine.step

    def step():
        before = dict(engine.stats.steps)
        finished = inner()
        grown = [k for k, v in engine.stats.steps.items() if v > before.get(k, 0)]
        assert len(grown) <= 1
        launched.append(grown[0] if grown else None)
        return finished

    engine.step = step
    return launched


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_e2e_step_log_sets_apart_decode_steps_that_waited_for_a_prefill(async_scheduling, monkeypatch):
    """bench_e2e's StepLog on the CPU engine.  With asynchronous scheduling a ``step()`` call
    launches a step and then waits for the one the call before launched, so a decode step whose
    call waited for a prefill or mixed step is a transition, kept out of the steady figures;
    ``Engine.in_flight_kind`` names the step a call will wait for.  Without it every call waits
    for its own step and every decode step is steady."""
    import numpy as np

    bench_e2e = _bench_e2e(monkeypatch)
    from llama import Engine, GenerationRequest, LlamaConfig, LlamaModel, random_weights

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=50000.0,
                         rms_norm_eps=1e-6, max_position_embeddings=256)
    model = LlamaModel(config, random_weights(config, 3), np, np.float32)
    rng = np.random.default_rng(5)
    # More requests than run at once, of several lengths: requests finish at different steps and
    # the waiting ones are admitted between decode steps (prefill and mixed steps mid-run).
    prompts = [rng.integers(3, 96, int(rng.integers(5, 40))).tolist() for _ in range(10)]
    requests = [GenerationRequest(i, p, 4 + 3 * (i % 4)) for i, p in enumerate(prompts)]
    engine = Engine(model, block_size=8, num_blocks=80, max_batch_tokens=48, max_num_seqs=4,
                    async_scheduling=async_scheduling)
    assert engine.in_flight_kind is None

    # At a known point: the first call launches a prefill, which is still in flight after the call
    # with asynchronous scheduling, and read within the call without it.
    engine.add_request(requests[0])
    engine.step()
    assert engine.in_flight_kind == ("prefill" if async_scheduling else None)
    while engine.has_unfinished():
        engine.step()
    assert engine.in_flight_kind is None
    engine.reset_stats()

    log = bench_e2e.StepLog(engine)
    launched = _step_kinds(engine)  # outside the log: sees the same calls
    outputs = engine.run(requests[1:])
    tokens = [outputs[r.request_id] for r in requests[1:]]
    assert engine.stats.steps["mixed"] + engine.stats.steps["prefill"] >= 3

    # The kind each call waited for: the step the call before launched (async), else its own.
    waited = [None] + launched[:-1] if async_scheduling else [None] * len(launched)
    decode_calls = [i for i, kind in enumerate(launched) if kind == "decode"]
    assert len(log.seconds) == len(log.steady) == len(decode_calls) == engine.stats.steps["decode"]
    assert log.steady == [waited[i] in (None, "decode") for i in decode_calls]
    transitions = log.steady.count(False)
    if async_scheduling:
        assert transitions >= 2, "decode steps must follow prefill or mixed steps, else this test could not fail"
    else:
        assert transitions == 0

    summary = log.summary([r.prompt for r in requests[1:]], tokens, weight_bytes=10**10, kv_bytes=10**5)
    old = {"count", "mean_ms", "median_ms", "mean_batch", "max_batch", "mean_context", "floor_ms_at_mean",
           "over_floor"}
    new = {"steady_count", "steady_mean_ms", "steady_median_ms", "steady_over_floor", "transition_ms"}
    assert old | new <= set(summary)
    assert summary["count"] == len(decode_calls)
    assert summary["steady_count"] == summary["count"] - transitions
    steady = [s for s, kept in zip(log.seconds, log.steady) if kept]
    assert summary["steady_mean_ms"] == round(1e3 * sum(steady) / len(steady), 4)
    assert summary["mean_ms"] == round(1e3 * sum(log.seconds) / len(log.seconds), 4)
    assert summary["transition_ms"] == [round(1e3 * s, 3) for s, kept in zip(log.seconds, log.steady)
                                        if not kept][:bench_e2e.StepLog.TRANSITIONS_KEPT]
    floor_ms = summary["floor_ms_at_mean"]  # a few ms: the ratios keep their digits
    assert summary["steady_over_floor"] == pytest.approx(summary["steady_mean_ms"] / floor_ms, rel=1e-3, abs=0.006)
    assert "steady_over_floor" not in log.summary([r.prompt for r in requests[1:]], tokens, None, None)


def test_tree_digest_names_the_sources_measured(benchmarks, tmp_path):
    """The results files' ``tree``: the same sources give the same digest, a changed kernel another."""
    bench_calls, _ = benchmarks
    for name, text in (("cupy_paged/a.py", "x = 1\n"), ("cupy_paged/sub/b.py", "y = 2\n"), ("cuda_src/k.cu", "k\n")):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    first = bench_calls.tree_digest(tmp_path)
    assert len(first) == 12 and int(first, 16) >= 0 and bench_calls.tree_digest(tmp_path) == first
    (tmp_path / "cuda_src/k.cu").write_text("k2\n")
    assert bench_calls.tree_digest(tmp_path) != first
    assert len(bench_calls.tree_digest()) == 12  # the repository's own tree
