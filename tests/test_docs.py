"""The examples in the public docstrings run as written (on the CPU reference backend)."""
import doctest

import pytest

import cupy_paged.attention
import cupy_paged.layout


@pytest.mark.parametrize("module", [cupy_paged.attention, cupy_paged.layout], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
