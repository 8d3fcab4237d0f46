"""The benchmark scripts stay importable where no GPU answers: what a module does on import is
definitions only, and the package modules it names still exist (a script that names a module the
package no longer has fails here, in CI, rather than in a device call)."""
import importlib
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("name", sorted(p.stem for p in BENCHMARKS.glob("*.py")))
def test_benchmark_script_imports_without_running(name, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    module = importlib.import_module(name)
    assert module.__doc__, f"benchmarks/{name}.py says nothing of what it measures"
