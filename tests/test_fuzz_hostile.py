"""benchmarks/fuzz.py --hostile without a GPU: every configuration has bad index values of the kinds
issue 16 names, reproducibly; the reference side takes them (dry run, both dtypes agree); the
error-word rule accepts the right report and rejects a missing or wrong one."""
import collections

import numpy as np
import pytest

from test_fuzz_config import fuzz

import fuzz_hostile  # noqa: E402  (benchmarks/ is on the path once fuzz.py is loaded)

HOSTILE = sorted(fuzz.CORRUPT)
DRAWS = 120


@pytest.fixture(scope="module")
def drawn():
    return {kernel: [fuzz.draw(kernel, 0, i, hostile=True) for i in range(DRAWS)] for kernel in HOSTILE}


def _kind(case) -> str:
    """What was made bad, read back from the case (not from the drawing code)."""
    a, kernel = case["args"], case["kernel"]
    if kernel == "step":
        return "table id"
    if kernel == "write_kv_cache":
        return "slot"
    if case["expect"] == ("block_table",):
        return "table id"
    if kernel in ("decode", "balanced"):
        b = int(case["where"].split()[-1])
        seqlens = a["cache_seqlens"]
        if seqlens[b] < 0:
            return "negative length"
        if case["expect"][0] in ("cache_batch_idx", "cache_leftpad"):
            return case["expect"][0]
        return "length past the cache"
    cu_k = np.asarray(a["cu_seqlens_k"], np.int64)
    return "decreasing cu_seqlens_k" if (np.diff(cu_k) < 0).any() else "length past the cache"


def test_every_hostile_configuration_is_bad_and_its_seed(drawn):
    for kernel, cases in drawn.items():
        for case in cases:
            assert case["hostile"] and case["holes"] and case["expect"], kernel
            if kernel != "step":
                assert case["args"]["check_values"] is False and "window_size" not in case["args"]
        again = fuzz.draw(kernel, 0, 7, hostile=True)
        assert fuzz.describe(again) == fuzz.describe(cases[7])
        assert fuzz.describe(fuzz.draw(kernel, 0, 7)) != fuzz.describe(cases[7])  # another stream


def test_hostile_draws_cover_the_kinds(drawn):
    kinds = {kernel: collections.Counter(_kind(c) for c in cases) for kernel, cases in drawn.items()}
    assert set(kinds["varlen_paged"]) == {"table id", "length past the cache", "decreasing cu_seqlens_k"}
    assert set(kinds["varlen"]) == {"length past the cache", "decreasing cu_seqlens_k"}
    assert set(kinds["decode"]) == {"table id", "negative length", "length past the cache", "cache_batch_idx",
                                    "cache_leftpad"}
    # The device-listed calls: a paged cache only (no cache_batch_idx / cache_leftpad to corrupt).
    assert set(kinds["balanced"]) == {"table id", "negative length", "length past the cache"}
    assert set(kinds["varlen_short"]) == {"table id", "length past the cache", "decreasing cu_seqlens_k"}
    ids = [c["args"]["block_table"][c["args"]["block_table"] != -1] for k in ("varlen_paged", "decode")
           for c in drawn[k] if _kind(c) == "table id"]
    values = np.concatenate(ids)
    assert (values < -1).any() and (values == fuzz_hostile.INT32_MAX).any()
    assert {c["args"]["corrupt"][2] < 0 for c in drawn["step"]} == {True, False}


def test_hostile_dry_run_is_clean():
    stats = fuzz.fuzz(HOSTILE, 25, 3, None, dry_run=True, quiet=True, hostile=True)
    assert {k: v["mismatches"] for k, v in stats.items()} == {k: 0 for k in HOSTILE}
    assert fuzz.report(stats, True, hostile=True)["cases"][0]["name"].endswith(" hostile")
    with pytest.raises(ValueError, match="no bad index values for merge"):
        fuzz.draw("merge", 0, 0, hostile=True)


def test_the_error_word_rule(monkeypatch):
    case = dict(hostile=True, holes=True, expect=("block_table",), where="sequence 2")
    said = []

    class Package:  # stands in for cupy_paged: check_errors raises what the kernels "said"
        @staticmethod
        def check_errors():
            if said:
                raise ValueError(said[0])

    monkeypatch.setattr(fuzz, "cupy_paged", Package)
    assert "raised nothing" in fuzz._error_word(case, dry_run=False)
    said.append("block_table holds an id outside [0, num_blocks) at column 3 of sequence 2, a block ...")
    assert fuzz._error_word(case, dry_run=False) is None
    said[0] = "block_table holds an id outside [0, num_blocks) at column 3 of sequence 1, a block ..."
    assert "did not name sequence 2" in fuzz._error_word(case, dry_run=False)
    said[0] = "slot_mapping sends token 4 to slot 99, past the cache"
    assert "another argument" in fuzz._error_word(case, dry_run=False)
    clean = dict(hostile=False, holes=False)
    assert "check_errors:" in fuzz._error_word(clean, dry_run=False)


@pytest.mark.gpu
def test_hostile_configurations_on_the_gpu():
    """A few hundred hostile configurations through the kernels (``benchmarks/sanitize.sh`` runs this
    file under compute-sanitizer: no access outside the arrays given), each against the reference,
    each reported in the error word."""
    stats = fuzz.fuzz(HOSTILE, 40, 11, None, dry_run=False, quiet=True, hostile=True)
    failed = {k: v["failed"][:3] for k, v in stats.items() if v["mismatches"]}
    assert failed == {}


def test_a_run_of_some_kernels_keeps_the_others_results(tmp_path):
    out = tmp_path / "fuzz.json"
    first = fuzz.report(fuzz.fuzz(["merge"], 2, 0, None, dry_run=True, quiet=True), True)
    out.write_text(fuzz.json.dumps(first))
    second = fuzz.merged(fuzz.report(fuzz.fuzz(["write_kv_cache"], 2, 0, None, dry_run=True, quiet=True), True), out)
    assert {c["name"] for c in second["cases"]} == {"merge", "write_kv_cache"}
    other = dict(second, device="another")
    out.write_text(fuzz.json.dumps(other))
    assert {c["name"] for c in fuzz.merged(first, out)["cases"]} == {"merge"}
