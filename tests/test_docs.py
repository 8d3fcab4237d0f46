"""The examples in the docstrings run as written (on the CPU reference backend)."""
import doctest

import pytest

import cupy_paged.attention
import cupy_paged.block_pool
import cupy_paged.cache
import cupy_paged.layout
import cupy_paged.merge
import cupy_paged.plan
import cupy_paged.scheduler

MODULES = [cupy_paged.attention, cupy_paged.block_pool, cupy_paged.cache, cupy_paged.layout, cupy_paged.merge,
           cupy_paged.plan, cupy_paged.scheduler]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
