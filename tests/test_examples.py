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
    assert all(f" {path}" in result.stdout for path in ("decode", "split", "varlen")), result.stdout


def test_continuous_batching_example_finishes_every_request():
    run_example("CPU reference backend", CUDA_VISIBLE_DEVICES="")  # the CPU path, even on a GPU machine


@pytest.mark.gpu
def test_continuous_batching_example_on_the_gpu():
    """The same run on the CUDA kernels (decode, split and paged varlen steps)."""
    run_example("GPU")


def test_readme_first_command_serves_the_engine_on_the_cpu_in_under_a_minute():
    """The README's first Quick start command installs the engine extra and runs the engine; its
    run step, on a machine without a GPU, prints tokens per second within a minute."""
    import re
    import time

    readme = (ROOT / "README.md").read_text()
    first = readme.split("## Quick start", 1)[1].split("```", 2)[1].strip()
    install, run = first.rsplit("&&", 1)
    assert "engine" in install and ".venv/bin/python examples/serve_llama.py" in run, first
    argv = [sys.executable] + run.split()[1:]
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    start = time.perf_counter()
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert time.perf_counter() - start < 60
    assert re.search(r"^tokens per second\s+[\d.]+", result.stdout, re.MULTILINE), result.stdout


def run_torch_interop(**env) -> str:
    """examples/torch_interop.py as written: a torch module over a paged cache, checked inside against
    torch's dense attention; returns what it printed."""
    pytest.importorskip("torch")
    env = dict(os.environ, PYTHONPATH=str(ROOT), **env)
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "torch_interop.py")],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_torch_interop_example_runs_on_the_cpu():
    """torch tensors on the CPU through the reference backend: the example's own check against
    torch's SDPA passes (float32, max |diff| under 1e-4) and its output is a torch tensor."""
    out = run_torch_interop(CUDA_VISIBLE_DEVICES="")
    assert out.startswith("CPU reference, float32") and "out is a Tensor on cpu" in out, out


@pytest.mark.gpu
def test_torch_interop_example_on_the_gpu():
    """The same module on CUDA tensors (bf16): cupy_paged's kernels on torch's stream, torch out."""
    out = run_torch_interop()
    assert out.startswith("CUDA torch.bfloat16") and "out is a Tensor on cuda" in out, out
