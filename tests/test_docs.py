"""The examples in the docstrings run as written (on the CPU reference backend)."""
import doctest
import importlib
import pkgutil

import pytest

import cupy_paged

# Every module of the package; those of the public surface must hold examples.
MODULES = sorted(name for _, name, is_package in pkgutil.walk_packages(cupy_paged.__path__, "cupy_paged.")
                 if not is_package and not name.endswith("__main__"))
WITH_EXAMPLES = {"cupy_paged.api.varlen", "cupy_paged.api.decode", "cupy_paged.api.dense", "cupy_paged.api.kv_write",
                 "cupy_paged.api.merge", "cupy_paged.api.indexing", "cupy_paged.serving.block_pool",
                 "cupy_paged.serving.kv_cache", "cupy_paged.serving.scheduler", "cupy_paged.runtime.plan"}


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    if name in WITH_EXAMPLES:
        assert result.attempted > 0, f"{name} has no docstring example"
