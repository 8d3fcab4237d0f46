"""The examples run as written (on the GPU where there is one, else on the CPU backend)."""
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_example(where: str, **env):
    """The example end to end; asserts every request finished and the cache emptied."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), **env)
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "continuous_batching.py"),
                             "--requests", "10", "--layers", "2", "--max-new-tokens", "6"],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("10 requests, 60 generated tokens"), result.stdout
    assert f"on the {where}" in result.stdout
    assert "free blocks at the end: 96 of 96" in result.stdout


def test_continuous_batching_example_finishes_every_request():
    run_example("CPU reference backend", CUDA_VISIBLE_DEVICES="")  # the CPU path, even on a GPU machine


@pytest.mark.gpu
def test_continuous_batching_example_on_the_gpu():
    """The same run on the CUDA kernels (both paths: decode and paged varlen)."""
    run_example("GPU")
