"""Helpers shared by the tests: random inputs, poisoned outputs, tolerant comparison."""
from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BF16}
# Relative tolerances of the brief (‖out - ref‖ / ‖ref‖ and per element), by dtype.
RTOL = {np.dtype(np.float16): 5e-3, BF16: 2e-2, np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12}


def randn(rng: np.random.Generator, shape, dtype, scale: float = 1.0) -> np.ndarray:
    """Fresh standard-normal values (never zeros) rounded to ``dtype``."""
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)


def poisoned(shape, dtype, xp=np):
    """An output buffer full of NaN: an element a kernel forgets to write fails the check."""
    return xp.full(shape, np.nan, dtype=np.float32).astype(dtype)


def to_numpy(array) -> np.ndarray:
    if isinstance(array, np.ndarray):
        return array
    import cupy

    return cupy.asnumpy(array)


def assert_close(actual, expected, dtype, what: str = "out", rtol: float | None = None) -> None:
    """No NaN anywhere; norm-wise error under the dtype's tolerance; every element near."""
    actual = to_numpy(actual).astype(np.float64)
    expected = to_numpy(expected).astype(np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    finite = np.isfinite(expected)
    assert not np.isnan(actual).any(), f"{what}: {int(np.isnan(actual).sum())} NaN elements"
    assert (np.isfinite(actual) == finite).all(), f"{what}: infinities differ from the reference"
    assert (actual[~finite] == expected[~finite]).all(), f"{what}: non-finite values differ"
    tol = RTOL[np.dtype(dtype)] if rtol is None else rtol
    a, e = actual[finite], expected[finite]
    scale = max(float(np.abs(e).max(initial=0.0)), 1e-6)
    norm = float(np.linalg.norm(e)) or 1.0
    rel = float(np.linalg.norm(a - e)) / norm
    assert rel <= tol, f"{what}: relative error {rel:.2e} > {tol:.0e}"
    worst = float(np.abs(a - e).max(initial=0.0))
    assert worst <= 8 * tol * scale, f"{what}: worst element error {worst:.3e} > {8 * tol * scale:.3e}"
