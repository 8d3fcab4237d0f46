"""Shared pytest set-up: GPU tests skip themselves where no CUDA device answers; CUPY_PAGED_SHARD=i/n
keeps every n-th collected test from the i-th (0-based), so that a slow run (a file under a sanitizer)
can be split over processes that together run each test once."""
import os

import pytest

# JAX, where a test imports it on the GPU, takes GPU memory as it needs it rather than 75% of the
# card at once beside CuPy's and torch's pools.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from cupy_paged._core.arrays import gpu_available


def _shard(config, items):
    spec = os.environ.get("CUPY_PAGED_SHARD", "")
    if not spec:
        return
    try:
        index, count = (int(part) for part in spec.split("/"))
    except ValueError:
        raise pytest.UsageError(f"CUPY_PAGED_SHARD must be i/n, as 0/3; got {spec!r}") from None
    if not 0 <= index < count:
        raise pytest.UsageError(f"CUPY_PAGED_SHARD {spec!r}: i must be in [0, n)")
    config.hook.pytest_deselected(items=[item for k, item in enumerate(items) if k % count != index])
    items[:] = [item for k, item in enumerate(items) if k % count == index]


def pytest_collection_modifyitems(config, items):
    _shard(config, items)
    if gpu_available():  # checked once per process
        return
    skip = pytest.mark.skip(reason="no CUDA GPU (cupy.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _clear_device_errors(request):
    """Each GPU test starts with an empty device error word: a test that feeds bad values on
    purpose (and reads them) must not see, nor leave, another test's reports."""
    if "gpu" in request.keywords and gpu_available():
        import cupy_paged

        try:
            cupy_paged.check_errors()
        except ValueError:
            pass
    yield
