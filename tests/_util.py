"""Helpers shared by the tests: random inputs, shuffled paged caches, poisoned outputs, tolerant
and bitwise comparison."""
from __future__ import annotations

import os

import ml_dtypes
import numpy as np

import cupy_paged

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BF16}
# Relative tolerances of the brief (‖out - ref‖ / ‖ref‖ and per element), by dtype.
RTOL = {np.dtype(np.float16): 5e-3, BF16: 2e-2, np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12}


def sanitizer_tool() -> str | None:
    """The compute-sanitizer tool this test process runs under (``benchmarks/sanitize.sh`` sets
    ``CUPY_PAGED_SANITIZER``), or None: for the tests whose workload or timing a tool changes."""
    return os.environ.get("CUPY_PAGED_SANITIZER") or None


def randn(rng: np.random.Generator, shape, dtype, scale: float = 1.0) -> np.ndarray:
    """Fresh standard-normal values (never zeros) rounded to ``dtype``."""
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)


# Blocks of a shuffled cache that no sequence owns (see shuffled_block_table).
SPARE_BLOCKS = 3


def shuffled_block_table(rng: np.random.Generator, lengths, block_size: int, extra_columns: int = 1):
    """A shuffled block table: the cache has ``sum(ceil(lengths / block_size)) + SPARE_BLOCKS``
    blocks, permuted once; sequence ``b`` takes the next ``ceil(lengths[b] / block_size)`` ids.

    Returns (table int32 ``[batch, longest block count + extra_columns]`` padded with -1, as
    ``cupy_paged.block_table_from_lists`` builds it on the host; num_blocks, the cache's block count).
    """
    counts = [-(-int(n) // block_size) for n in lengths]
    num_blocks = sum(counts) + SPARE_BLOCKS
    ids = rng.permutation(num_blocks)
    starts = np.cumsum([0] + counts)
    lists = [ids[start:start + count].tolist() for start, count in zip(starts, counts)]
    table = cupy_paged.block_table_from_lists(lists, max_blocks=max(counts, default=0) + extra_columns)
    return table, num_blocks


def scatter_paged(rng: np.random.Generator, arrays, lengths, block_size: int, capacity=None,
                  extra_columns: int = 1):
    """Scatter each sequence's tokens of every packed ``[total, Hkv, D]`` array into its own paged
    cache ``[num_blocks, block_size, Hkv, D]`` through one shuffled block table.

    Sequence ``b`` gets blocks for ``capacity[b]`` tokens (default ``lengths[b]``; see
    ``shuffled_block_table`` for the spare blocks and the -1 columns) and its ``lengths[b]`` tokens
    are written at the slots ``cupy_paged.slot_mapping_from_positions`` gives; every other slot holds
    random values, so a kernel that reads the wrong block fails.  Returns (caches, block_table).
    """
    lengths = np.asarray(lengths, np.int64)
    capacity = lengths if capacity is None else np.asarray(capacity, np.int64)
    table, num_blocks = shuffled_block_table(rng, capacity, block_size, extra_columns=extra_columns)
    seq_ids = np.repeat(np.arange(lengths.size), lengths)
    positions = np.arange(seq_ids.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    slots = cupy_paged.slot_mapping_from_positions(table, seq_ids, positions, block_size)
    assert (slots >= 0).all(), "every token needs a block"
    caches = []
    for array in arrays:
        assert array.shape[0] == seq_ids.size, f"{array.shape[0]} tokens for lengths summing to {seq_ids.size}"
        cache = randn(rng, (num_blocks, block_size) + tuple(array.shape[1:]), array.dtype)
        cache[slots // block_size, slots % block_size] = array
        caches.append(cache)
    return caches, table


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


def assert_same_bits(actual, expected, what: str = "array") -> None:
    """The same shape, dtype and raw bytes (NaN payloads and the sign of zero included)."""
    actual, expected = to_numpy(actual), to_numpy(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a = np.ascontiguousarray(actual).view(np.uint8)
    e = np.ascontiguousarray(expected).view(np.uint8)
    if not np.array_equal(a, e):
        item = (actual.dtype.itemsize,)
        differ = (a.reshape(actual.shape + item) != e.reshape(expected.shape + item)).any(axis=-1)
        first = tuple(int(i) for i in np.argwhere(differ)[0]) if differ.ndim else ()
        raise AssertionError(f"{what}: {int(differ.sum())} of {differ.size} elements differ bitwise "
                             f"(the first at index {first})")


def common_prefix(a, b) -> int:
    """Length of the common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
