"""benchmarks/sanitizer_record.py: a sanitizer pair's case from its log, without a GPU."""
import json
import sys

import pytest

sys.path.insert(0, "benchmarks")
import sanitizer_record as record  # noqa: E402

OURS = frozenset({"paged_decode", "add_rms_norm"})

RACE_IN_CUBLAS = """========= COMPUTE-SANITIZER
========= Error: Race reported between Read access at nvjet_sm90_tst_64x72_64x12_4x2_h_bz_TNT+0xab0
=========     and Write access at nvjet_sm90_tst_64x72_64x12_4x2_h_bz_TNT+0x2e30 [384 hazards]
=========
========= Error: Race reported between Read access at nvjet_sm90_tst_64x208_64x6_2x1_v_bz_TNT+0xa10
=========     and Write access at nvjet_sm90_tst_64x208_64x6_2x1_v_bz_TNT+0x2c00 [12 hazards]
=========
1 passed, 10 deselected in 120.50s (0:02:00)
========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)
"""

INIT_FLOOD = """========= Uninitialized __global__ memory read of size 2 bytes
=========     at add_rms_norm+0x250
=========     by thread (0,0,0) in block (8,0,0)
========= Uninitialized __global__ memory read of size 4 bytes
=========     at void cub::CUB_300102_SM_900::detail::merge_sort::DeviceMergeSortMergeKernel<cub::Policy600, int>(bool, int *)+0x1f0
=========     by thread (3,0,0) in block (0,0,0)
3 passed, 36 deselected in 283.51s (0:04:43)
========= ERROR SUMMARY: 754402 errors
========= ERROR SUMMARY: 754400 errors were not printed. Use --print-limit option to adjust the number of printed errors
"""

KILLED = """========= COMPUTE-SANITIZER
========= Error: process didn't terminate successfully
========= Target application returned an error
========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)
"""


def test_reports_are_counted_by_kernel_and_vendor_only_errors_say_so():
    case = record.case("racecheck", "tests/test_hf_integration.py[3/4]", 99, 134, RACE_IN_CUBLAS, ours=OURS)
    assert case["value"] == 2 and case["tests"] == "1 passed, 10 deselected"
    assert case["printed_reports"] == {"nvjet_sm90_tst_64x72_64x12_4x2_h_bz_TNT": 1,
                                       "nvjet_sm90_tst_64x208_64x6_2x1_v_bz_TNT": 1}
    assert case["project_reports"] == 0 and case["project_errors"] == 0


def test_the_summary_not_the_unprinted_remainder_and_reports_in_our_kernels():
    case = record.case("initcheck", "tests/test_llama_engine.py", 99, 288, INIT_FLOOD, ours=OURS)
    assert case["value"] == 754402
    assert case["printed_reports"] == {"add_rms_norm": 1, "DeviceMergeSortMergeKernel": 1}
    assert case["project_reports"] == 1 and "project_errors" not in case


def test_unprinted_errors_give_no_project_verdict():
    text = INIT_FLOOD.replace("=========     at add_rms_norm+0x250", "=========     at cub::Other+0x10")
    case = record.case("initcheck", "t.py", 99, 1, text, ours=OURS)
    assert case["project_reports"] == 0 and "project_errors" not in case  # 754,400 reports unseen


@pytest.mark.parametrize("rc,text", [(9, KILLED), (124, RACE_IN_CUBLAS.replace("1 passed, 10 deselected in 120.50s (0:02:00)\n", "")),
                                     (5, "9 deselected in 3.00s\n========= ERROR SUMMARY: 0 errors\n")],
                         ids=["killed", "cut", "no-test"])
def test_no_verdict_when_the_process_never_finished(rc, text):
    case = record.case("racecheck", "t.py", rc, 60, text, ours=OURS)
    assert case["value"] is None and "reports_before_cut" in case


def test_a_pair_replaces_its_own_case_and_other_splits_of_its_selection(tmp_path):
    results = tmp_path / "sanitizer.json"
    old = [{"name": n, "value": 0} for n in ("racecheck:t.py[0/2]", "racecheck:t.py[1/2]", "racecheck:t.py -k a",
                                            "memcheck:t.py")]
    results.write_text(json.dumps({"cases": old}))
    record.merge(results, {"name": "racecheck:t.py[0/3]", "value": 1})
    names = [c["name"] for c in json.loads(results.read_text())["cases"]]
    assert names == ["memcheck:t.py", "racecheck:t.py -k a", "racecheck:t.py[0/3]"]
    # a -k selection of one parametrized test is not a shard
    record.merge(results, {"name": "racecheck:t.py -k test_a[48]", "value": 0})
    record.merge(results, {"name": "racecheck:t.py -k test_a[80]", "value": 0})
    names = [c["name"] for c in json.loads(results.read_text())["cases"]]
    assert "racecheck:t.py -k test_a[48]" in names and "racecheck:t.py -k test_a[80]" in names


def test_project_kernels_are_every_global_of_the_sources():
    names = record.project_kernels()
    assert {"paged_decode", "combine_splits", "write_kv_cache", "varlen_fwd", "varlen_fwd_wgmma",
            "merge_states_bfloat16", "add_rms_norm", "rotary_split", "swiglu", "embed_rows", "argmax_rows"} <= names
    assert "NAME" not in names
