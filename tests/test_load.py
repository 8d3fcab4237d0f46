"""benchmarks/load.py: many requests through the scheduler and the kernels under preemption, aborts,
parallel samples and stops, each checked against its run alone; no block left at the end.  On the
CPU backend here (float32 and float16 K/V), 10,000 requests on the GPU."""
import importlib.util
import pathlib
import sys

import numpy as np
import pytest

PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "load.py"
spec = importlib.util.spec_from_file_location("load_bench", PATH)
load = sys.modules["load_bench"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(load)


def assert_clean(report, requests):
    assert report["failures"] == []
    c = report["counts"]
    assert c["mismatches"] == 0 and c["lost"] == 0 and c["returned_twice"] == 0
    assert c["completed"] + c["aborted"] == report["branches"] > requests
    assert c["aborted"] > 0 and report["preemptions"] > 0 and report["cached_prompt_tokens"] > 0
    assert c["near_ties"] <= 0.01 * c["compared_tokens"]
    leaks = report["leaks"]
    assert leaks["live"] == 0 and leaks["referenced_blocks"] == 0 and leaks["free_blocks"] == leaks["num_blocks"]


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_load_on_the_cpu_backend(kv_dtype):
    report = load.run("cpu", 240, seed=3, abort_rate=0.1, num_blocks=64, kv_dtype=kv_dtype)
    assert_clean(report, 240)


def test_the_check_sees_a_corrupted_cache():
    """Noise written over the first layer's keys mid-run: the requests that read them fail."""
    report = load.run("cpu", 120, seed=4, abort_rate=0.0, num_blocks=64, corrupt_at=6)
    assert report["counts"]["mismatches"] > 10
    assert any("logits differ" in line for line in report["failures"])


def test_the_check_sees_a_wrong_length():
    alone = {0: ([5, 6, 7], np.eye(8)[[5, 6, 7]] * 10.0)}

    class Branch:
        request_id, output_token_ids = 0, [5, 6]

    served = dict(finished=[Branch()], aborted=[], logits={0: list(np.eye(8)[[5, 6]] * 10.0)})
    report = load.check(served, alone, 1e-4)
    assert report["failures"] == ["completed request 0: finished after 2 tokens, alone after 3"]
    served["aborted"], served["finished"] = served["finished"], []
    assert load.check(served, alone, 1e-4)["failures"] == []  # an aborted request may stop early


@pytest.mark.gpu
def test_ten_thousand_requests_on_the_gpu():
    report = load.run("cuda", 10_000, seed=0)
    assert_clean(report, 10_000)
