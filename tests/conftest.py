"""Shared pytest set-up: GPU tests skip themselves where no CUDA device answers."""
import pytest

from cupy_paged._core.arrays import gpu_available


def pytest_collection_modifyitems(config, items):
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
