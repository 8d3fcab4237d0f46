"""Shared pytest set-up: GPU tests skip themselves where no CUDA device answers."""
import pytest

from cupy_paged._arrays import gpu_available


def pytest_collection_modifyitems(config, items):
    if gpu_available():  # checked once per process
        return
    skip = pytest.mark.skip(reason="no CUDA GPU (cupy.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
