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
    """Each example runs as a user pasting it into a fresh interpreter would run it: in an empty
    namespace, not the module's globals, so an example that skips an import fails here."""
    module = importlib.import_module(name)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in doctest.DocTestFinder().find(module, name, globs={}):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0
    if name in WITH_EXAMPLES:
        assert result.attempted > 0, f"{name} has no docstring example"


def _serving_classes():
    from cupy_paged.runtime.scheduler import Scheduler
    from cupy_paged.serving import scheduler as serving
    from cupy_paged.serving.block_pool import BlockPool
    from cupy_paged.serving.kv_cache import PagedAttentionCache
    from cupy_paged.serving.prefix_cache import PrefixCache

    return [PagedAttentionCache, serving.Scheduler, Scheduler, BlockPool, PrefixCache]


@pytest.mark.parametrize("cls", _serving_classes(), ids=lambda c: f"{c.__module__}.{c.__name__}")
def test_cache_and_scheduler_methods_have_numpydoc_sections(cls):
    """Every public method of the cache, the schedulers, the block pool and the prefix cache
    documents its arguments (a Parameters section) and, when annotated to return something, what
    it returns (Returns, or Yields)."""
    import inspect

    missing = []
    for name, member in inspect.getmembers(cls):
        if name.startswith("_") or isinstance(member, property) or not inspect.isfunction(member):
            continue
        doc = inspect.getdoc(member) or ""
        signature = inspect.signature(member)
        takes = [p for p in signature.parameters if p not in ("self", "cls")]
        gives = signature.return_annotation not in (inspect.Signature.empty, None, "None")
        if takes and "Parameters\n----------" not in doc:
            missing.append(f"{name}: Parameters")
        if gives and not any(f"{word}\n{'-' * len(word)}" in doc for word in ("Returns", "Yields")) \
                and "(Returns:" not in doc:
            missing.append(f"{name}: Returns")
    assert missing == []
