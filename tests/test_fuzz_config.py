"""benchmarks/fuzz.py without a GPU: its configuration drawing (reproducible, covering what issue 16
asks for), its comparison rules, its reference side and its report, through ``--dry-run``."""
import importlib.util
import json
import math
import pathlib

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("fuzz", ROOT / "benchmarks" / "fuzz.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fuzz = _load()
DRAWS = 150  # per kernel, for the coverage test (drawing only: no call runs)


@pytest.fixture(scope="module")
def drawn():
    return {kernel: [fuzz.draw(kernel, 0, i) for i in range(DRAWS)] for kernel in fuzz.KERNELS}


def _same_case(a: dict, b: dict) -> bool:
    if a["args"].keys() != b["args"].keys() or fuzz.describe(a) != fuzz.describe(b):
        return False
    return all(np.array_equal(np.asarray(x).view(np.uint8), np.asarray(b["args"][k]).view(np.uint8))
               if isinstance(x, np.ndarray) else x == b["args"][k] for k, x in a["args"].items())


@pytest.mark.parametrize("kernel", fuzz.KERNELS)
def test_a_configuration_is_its_seed(kernel):
    """(seed, kernel, index) alone decides a configuration: --only replays it exactly."""
    for index in (0, 7, 123):
        assert _same_case(fuzz.draw(kernel, 5, index), fuzz.draw(kernel, 5, index))
    assert not _same_case(fuzz.draw(kernel, 5, 1), fuzz.draw(kernel, 6, 1))


def _lengths_of(cu):
    return set(np.diff(cu).tolist())


def test_attention_draws_cover_the_space(drawn):
    for kernel in ("varlen", "varlen_paged", "decode"):
        cases = drawn[kernel]
        args = [c["args"] for c in cases]
        assert {c["dtype"] for c in cases} == {fuzz.F16, fuzz.BF16}, kernel
        assert {a["q"].shape[-1] for a in args} == set(fuzz.HEAD_DIMS), kernel
        key = "k_cache" if kernel == "decode" else "k"
        ratios = {a["q"].shape[-2] // a[key].shape[-2] for a in args}
        assert ratios == {1, 2, 4, 8}, (kernel, ratios)
        for option in ("window_size", "softcap", "alibi_slopes", "softmax_scale"):
            assert any(option in a for a in args) and not all(option in a for a in args), (kernel, option)
        assert {a["causal"] for a in args} == {True, False}
        assert {a["return_softmax_lse"] for a in args} == {True, False}
        assert {c["out_shape"] is None for c in cases} == {True, False}
        assert any(a["q"].shape[0] == 0 for a in args), f"{kernel}: no empty batch (or no query token)"
    varlen = [c["args"] for c in drawn["varlen"] + drawn["varlen_paged"]]
    lengths = set().union(*(_lengths_of(a["cu_seqlens_q"]) | _lengths_of(a["cu_seqlens_k"]) for a in varlen))
    assert {0, 1} <= lengths and max(lengths) > 100
    paged = drawn["varlen_paged"] + [c for c in drawn["decode"] if "block_table" in c["args"]]
    assert {c["args"]["k" if "k_cache" not in c["args"] else "k_cache"].shape[1] for c in paged} == \
        set(fuzz.BLOCK_SIZES)
    assert any(c["holes"] for c in paged) and not all(c["holes"] for c in paged)
    assert all(c["args"].get("check_values") is False for c in paged if c["holes"])
    assert any((c["args"]["block_table"] == -1).any() for c in paged if not c["holes"]), "no -1 padding column"


def test_decode_draws_cover_the_space(drawn):
    args = [c["args"] for c in drawn["decode"]]
    assert any("block_table" not in a for a in args) and any("block_table" in a for a in args)
    for option in ("cache_batch_idx", "cache_leftpad", "rotary_cos", "k"):
        assert any(option in a for a in args), option
    assert {a["rotary_interleaved"] for a in args if "rotary_cos" in a} == {True, False}
    assert any(isinstance(a["cache_seqlens"], int) for a in args)
    seqlens = set().union(*(np.atleast_1d(a["cache_seqlens"]).tolist() for a in args))
    assert {0, 1} <= seqlens
    assert {a["num_splits"] for a in args} >= {0, 1, 2, 8}
    assert {a["q"].shape[1] for a in args} >= {1, 2}
    # grids on both sides of one main-shape wave of the decode kernel (264 CTAs on an H200 at D = 128)
    ctas = [a["q"].shape[0] * a["k_cache"].shape[2] for a in args if a["q"].shape[-1] == 128]
    assert any(c <= 264 for c in ctas) and any(264 < c <= 528 for c in ctas)


def test_write_and_merge_draws_cover_the_space(drawn):
    writes = [c["args"] for c in drawn["write_kv_cache"]]
    tokens = {a["k"].shape[0] for a in writes}
    assert {0, 1} <= tokens
    assert any((a["slot_mapping"] == -1).any() for a in writes)
    for a in writes:  # distinct slots: no two tokens race for one
        used = a["slot_mapping"][a["slot_mapping"] >= 0]
        assert used.size == np.unique(used).size
    assert {a["k_cache"].shape[1] for a in writes} == set(fuzz.BLOCK_SIZES)
    merges = drawn["merge"]
    assert {c["dtype"] for c in merges} == {fuzz.F16, fuzz.BF16, fuzz.F32}
    assert {c["args"]["out_a"].ndim for c in merges} == {3, 4}
    assert any(np.isneginf(c["args"]["lse_a"]).any() for c in merges)
    assert any(c["out_is_a"] for c in merges) and any(c["out_shape"] is not None for c in merges)


def test_compare_follows_the_tests_rules():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((4, 8))
    assert fuzz.compare(ref, ref, fuzz.BF16)[1] is None
    assert fuzz.compare(ref * (1 + 1e-3), ref, fuzz.BF16)[1] is None
    assert "relative error" in fuzz.compare(ref * (1 + 1e-2), ref, fuzz.F16)[1]
    nan = ref.copy()
    nan[0, 0] = np.nan
    assert "NaN" in fuzz.compare(nan, ref, fuzz.BF16)[1]
    with_inf = ref.copy()
    with_inf[1, 1] = -np.inf
    assert "infinities" in fuzz.compare(ref, with_inf, fuzz.BF16)[1]
    assert fuzz.compare(with_inf, with_inf, fuzz.BF16)[1] is None
    spike = ref.copy()
    spike[2, 3] += 0.5
    assert fuzz.compare(spike, ref, fuzz.BF16)[1] is not None
    assert fuzz.compare(ref + 1e-7, ref, fuzz.F16, exact=True)[1] is not None
    assert fuzz.compare(ref[:2], ref, fuzz.F16)[0] == math.inf


def test_a_wrong_result_is_a_mismatch(monkeypatch):
    """The comparison catches a device side that is off, or that raises."""
    case = fuzz.draw("varlen", 0, 3)
    assert fuzz.check_case(case, dry_run=True)[1] == []
    real = fuzz.run_side

    def off(case, xp, reference):
        outputs = real(case, xp, reference)
        if not reference:
            outputs["out"] = outputs["out"] * 1.1 + 0.01
        return outputs

    monkeypatch.setattr(fuzz, "run_side", off)
    assert any(f.startswith("out:") for f in fuzz.check_case(case, dry_run=True)[1])

    def raises(case, xp, reference):
        if not reference:
            raise RuntimeError("launch failed")
        return real(case, xp, reference)

    monkeypatch.setattr(fuzz, "run_side", raises)
    assert fuzz.check_case(case, dry_run=True)[1] == ["raised RuntimeError: launch failed"]


def test_step_draws_cover_the_space(drawn):
    """The step kernel draws every path (the plan's own choice among them), decodes-first and
    shuffled orders, short rows and chunks, softcap and out= both ways."""
    cases = drawn["step"]
    assert {c["args"]["path"] for c in cases} == {None, "ragged", "varlen", "split", "decode"}
    new = [c["args"]["new"] for c in cases]
    assert any(n[0] == 1 and max(n) > 1 for n in new) and any(n[0] > 1 and 1 in n for n in new)
    assert any(max(n) > 16 for n in new) and any(1 < max(n) <= 16 for n in new)
    assert any(0 in c["args"]["cached"] for c in cases)
    assert any("softcap" in c["args"] for c in cases) and any("softcap" not in c["args"] for c in cases)
    assert {c["out_shape"] is None for c in cases} == {True, False}


def test_regressions_found_by_the_fuzzer_run_clean():
    """Configurations that once failed: decode seed 0 #25 (an empty batch with rotary: the
    reference stacked an empty list); step seed 0 #11 (a decode plan's attention on the CPU
    returned a view of out= instead of out)."""
    empty_rotary = fuzz.draw("decode", 0, 25)["args"]
    assert empty_rotary["q"].shape[0] == 0 and "rotary_cos" in empty_rotary  # still the case it was
    for kernel, seed, index in (("decode", 0, 25), ("step", 0, 11)):
        assert fuzz.check_case(fuzz.draw(kernel, seed, index), dry_run=True)[1] == []


def test_dry_run_writes_the_report(tmp_path, capsys):
    out, log = tmp_path / "fuzz.json", tmp_path / "fuzz.log"
    assert fuzz.main(["--dry-run", "--configs", "3", "--seed", "1", "--out", str(out), "--log", str(log)]) == 0
    report = json.loads(out.read_text())
    assert set(report) == {"device", "date", "versions", "cases"}
    names = {(c["name"], c["metric"]) for c in report["cases"]}
    for kernel in fuzz.KERNELS:
        assert {(kernel, "configs"), (kernel, "mismatches")} <= names
        assert any(n == kernel and m.startswith("worst_rel_err_") for n, m in names)
    assert all(c["peers"] == {} for c in report["cases"])
    assert {c["value"] for c in report["cases"] if c["metric"] == "configs"} == {3}
    assert {c["value"] for c in report["cases"] if c["metric"] == "mismatches"} == {0}
    lines = log.read_text().splitlines()
    assert len(lines) == 3 * len(fuzz.KERNELS)
    assert all("--seed 1 --kernels" in line and "--only" in line for line in lines)
    assert f"{3 * len(fuzz.KERNELS)} configurations, 0 mismatches" in capsys.readouterr().out


def test_time_limit_stops_drawing(tmp_path):
    stats = fuzz.fuzz(["merge", "write_kv_cache"], 1000, 0, time_limit=0.0, dry_run=True, quiet=True)
    assert stats["merge"]["configs"] <= 1 and stats["merge"].get("stopped")


def test_kernels_in_processes_report_as_one_process(tmp_path):
    """``--jobs``: each kernel fuzzed in its own process gives the report and the log that one
    process drawing them in turn gives."""
    common = ["--dry-run", "--configs", "2", "--kernels", "merge", "write_kv_cache", "--seed", "5"]
    assert fuzz.main(common + ["--out", str(tmp_path / "one.json"), "--log", str(tmp_path / "one.log")]) == 0
    assert fuzz.main(common + ["--jobs", "2", "--out", str(tmp_path / "two.json"),
                               "--log", str(tmp_path / "two.log")]) == 0
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert one["cases"] == two["cases"] and len(one["cases"]) > 4
    strip = (lambda text: sorted(line.split(" rel=")[0] for line in text.splitlines()))
    assert strip((tmp_path / "one.log").read_text()) == strip((tmp_path / "two.log").read_text())


def test_shards_of_a_kernel_report_as_one_process(tmp_path):
    """``--jobs`` above the kernel count shares each kernel's draws among processes (every n-th
    index each): together they draw the same configurations, once each, and report the same
    counts and worst errors as one process."""
    common = ["--dry-run", "--configs", "5", "--kernels", "merge", "--seed", "3"]
    assert fuzz.main(common + ["--out", str(tmp_path / "one.json"), "--log", str(tmp_path / "one.log")]) == 0
    assert fuzz.main(common + ["--jobs", "3", "--out", str(tmp_path / "three.json"),
                               "--log", str(tmp_path / "three.log")]) == 0
    one, three = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "three"))
    assert one["cases"] == three["cases"]
    assert {c["value"] for c in three["cases"] if c["metric"] == "configs"} == {5}
    indices = sorted(int(line.split(" #")[1].split()[0]) for line in (tmp_path / "three.log").read_text().splitlines())
    assert indices == [0, 1, 2, 3, 4]
    assert not list(tmp_path.glob("three.log.*"))


def test_kernels_in_processes_share_one_time_limit(tmp_path):
    """``--time-limit`` bounds the whole run with ``--jobs``: a process started after it is spent
    draws at most one configuration, and a kernel's log is written beside the run's as it goes."""
    out, log = tmp_path / "fuzz.json", tmp_path / "fuzz.log"
    fuzz.main(["--dry-run", "--configs", "50", "--kernels", "merge", "write_kv_cache", "decode", "--jobs", "2",
               "--time-limit", "0", "--out", str(out), "--log", str(log)])
    configs = {c["name"]: c["value"] for c in json.loads(out.read_text())["cases"] if c["metric"] == "configs"}
    assert set(configs) == {"merge", "write_kv_cache", "decode"} and max(configs.values()) <= 1
    assert len(log.read_text().splitlines()) == sum(configs.values())
    assert not list(tmp_path.glob("fuzz.log.*"))


def test_device_list_draws_take_that_path(drawn):
    """The "balanced" and "varlen_short" draws are calls the device-built work list serves: paged,
    short rows (query heads per kv head x max_seqlen_q <= 16) for varlen; an int32 cache_seqlens, no
    LSE, no rotary, num_splits 0 and appends of all or none of the query tokens for decode; and some
    of them hold a sequence long enough to be split."""
    for case in drawn["varlen_short"]:
        a = case["args"]
        group = a["q"].shape[1] // a["k"].shape[2]
        assert "block_table" in a and group * a["max_seqlen_q"] <= 16
        assert a["max_seqlen_q"] == max(np.diff(a["cu_seqlens_q"]).tolist(), default=0)
    assert any(np.diff(c["args"]["cu_seqlens_k"]).max() >= 1000 for c in drawn["varlen_short"])
    for case in drawn["balanced"]:
        a = case["args"]
        assert isinstance(a["cache_seqlens"], np.ndarray) and "block_table" in a and "rotary_cos" not in a
        assert not a["return_softmax_lse"] and a.get("num_splits", 0) == 0
        assert "k" not in a or a["k"].shape[1] == a["q"].shape[1]
    assert any(c["args"]["cache_seqlens"].max() >= 1000 for c in drawn["balanced"])
    assert any(c["holes"] for c in drawn["balanced"]) and any("k" in c["args"] for c in drawn["balanced"])
