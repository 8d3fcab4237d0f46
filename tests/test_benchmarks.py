"""The benchmark scripts stay importable where no GPU answers: what a module does on import is
definitions only, and the package modules it names still exist (a script that names a module the
package no longer has fails here, in CI, rather than in a device call)."""
import importlib
import pathlib

import numpy as np
import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("name", sorted(p.stem for p in BENCHMARKS.glob("*.py")))
def test_benchmark_script_imports_without_running(name, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    module = importlib.import_module(name)
    assert module.__doc__, f"benchmarks/{name}.py says nothing of what it measures"


def test_interleaved_timing_takes_the_calls_in_turn(monkeypatch):
    """bench_varlen.interleaved_ms: rounds alternate the calls' order (a drift over the run falls on
    every call alike) and each call's figure is the median of its round medians."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench_varlen = importlib.import_module("bench_varlen")
    order, drift = [], iter(range(100))

    def fake_time_ms(fn, reps, warmup=3):
        order.append((fn, reps))
        return 10.0 * fn() + next(drift)  # the clock drifts up by 1 a timing

    monkeypatch.setattr(bench_varlen, "time_ms", fake_time_ms)
    result = bench_varlen.interleaved_ms({"a": lambda: 1, "b": lambda: 2}, reps=12, rounds=3)
    assert [fn() for fn, _ in order] == [1, 2, 2, 1, 1, 2] and {reps for _, reps in order} == {4}
    assert result == {"a": 10.0 + 3, "b": 20.0 + 2}  # a: 0, 3, 4 -> 3; b: 1, 2, 5 -> 2


def _ptx_for_sm90(source: str) -> bytes:
    """The PTX of a benchmark's kernel source compiled for sm_90 by NVRTC (which needs no GPU)."""
    from cupy.cuda import nvrtc

    program = nvrtc.createProgram(source, "benchmark.cu", [], [])
    try:
        nvrtc.compileProgram(program, ["-arch=sm_90"])
        return nvrtc.getPTX(program)
    finally:
        nvrtc.destroyProgram(program)


def test_the_read_ceiling_kernel_compiles_and_only_the_h200_keeps_4_44(monkeypatch):
    """benchmarks/ceiling.py: its read-stream kernel compiles for sm_90 (NVRTC needs no GPU), and the
    floors keep the issues' 4.44 TB/s on an H200 only (an H100's is measured in the run)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    ceiling = importlib.import_module("ceiling")
    import cupy

    assert b"read_stream" in _ptx_for_sm90(ceiling._SOURCE)
    assert ceiling.uses_h200_ceiling("NVIDIA H200") and ceiling.uses_h200_ceiling("NVIDIA H200 NVL")
    assert not ceiling.uses_h200_ceiling("NVIDIA H100 80GB HBM3")
    assert ceiling.H200_READ == 4.44e12
    if not cupy.cuda.is_available():  # no card to measure: the issues' figure (bench_e2e's CPU mode)
        assert ceiling.read_bytes_per_s() == 4.44e12


def test_the_eager_floor_kernel_compiles(monkeypatch):
    """benchmarks/eager_floor.py: its empty kernel compiles for sm_90 (NVRTC needs no GPU)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import eager_floor

    assert b"empty" in _ptx_for_sm90(eager_floor._EMPTY)


def test_the_wave_model_times_one_item_and_a_shared_stream(monkeypatch):
    """benchmarks/model_waves.py: one item alone is prologue + bytes at the CTA's rate + epilogue; two
    items on one slot run in turn; items beyond the CTAs' own rates share the bandwidth."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import model_waves as m

    one = m.simulate(np.array([100]), slots=8, bandwidth=1e9, rate=10.0, prologue=2.0, epilogue=1.0)
    assert one == pytest.approx(2.0 + 100 * m.KB_PER_KEY / 10.0 + 1.0)  # every kv head in its own slot
    serial = m.simulate(np.array([100]), slots=1, bandwidth=1e9, rate=10.0, prologue=2.0, epilogue=1.0)
    assert serial == pytest.approx(m.KV_HEADS * one)
    shared = m.simulate(np.array([100]), slots=8, bandwidth=8 * 10.0 / 2, rate=10.0, prologue=0.0, epilogue=0.0)
    assert shared == pytest.approx(2 * 100 * m.KB_PER_KEY / 10.0)
    keys = m.rule_items(m.BATCHES["1x32k+63x512"], 33)
    assert keys.sum() == sum(m.BATCHES["1x32k+63x512"]) and keys[0] >= keys[-1]
