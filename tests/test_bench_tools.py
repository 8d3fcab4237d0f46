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
