"""benchmarks/bench_e2e.py in its CPU mode: a tiny float32 HF Llama checkpoint served by our
engine (NumPy reference backend) and by HF's continuous batching (sdpa, eager and, on a tested
transformers, flash_attention_2 on cupy_paged's CPU reference); every request's greedy tokens
agree between ours and HF sdpa, and the JSON has the results files' schema.  Also the GPU
mode's plan, budget, agreement and targets on made-up runs."""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from cupy_paged.integrations import transformers as cp_hf  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
NEW_TOKENS = 8


def test_cpu_mode_greedy_tokens_agree_and_the_json_has_the_schema(tmp_path):
    out = tmp_path / "e2e_cpu.json"
    configs = "ours,hf-sdpa,hf-eager"
    if transformers.__version__ in cp_hf.TESTED_VERSIONS:
        configs += ",hf-cupy_paged"
    argv = [sys.executable, str(ROOT / "benchmarks" / "bench_e2e.py"), "--cpu", "--out", str(out), "--no-plot",
            "--configs", configs, "--concurrency", "4", "--max-new-tokens", str(NEW_TOKENS)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "CPU check, greedy tokens of ours and hf sdpa: all equal" in result.stdout, result.stdout[-3000:]

    report = json.loads(out.read_text())
    assert {"device", "date", "versions", "mode", "model", "workload", "cases", "agreement", "targets"} <= set(report)
    assert report["mode"] == "cpu" and report["failed"] == {} and report["skipped"] == []
    assert {"torch", "transformers", "cupy_paged"} <= set(report["versions"])
    cases = {c["config"]: c for c in report["cases"]}
    assert set(cases) == set(configs.split(","))
    for c in cases.values():
        assert {"name", "metric", "value", "peers"} <= set(c)
        assert c["metric"] == "tok/s" and c["value"] > 0 and c["name"] == f"{c['name'].rsplit(' ', 1)[0]} 4"
        assert set(c["peers"]) == {o["name"].rsplit(" ", 1)[0] for o in cases.values() if o is not c}
        assert c["generated_tokens"] == 4 * NEW_TOKENS and c["all_in_flight"] is not False
    ours = cases["ours"]
    assert ours["agreement"]["vs"] == "hf sdpa no-graphs" and ours["agreement"]["fraction_equal"] == 1.0
    assert ours["decode_steps"]["count"] > 0 and ours["preemptions"] == 0
    assert report["cpu_check"] == {"requests_compared": 4, "mismatched": [], "ours_equals_hf_sdpa": True}


def _bench_module():
    spec = importlib.util.spec_from_file_location("_bench_e2e", ROOT / "benchmarks" / "bench_e2e.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _gpu_session(b):
    """A session with the GPU mode's defaults (no model, no device)."""
    gpu = b.DEFAULTS["gpu"]
    args = b.parse_args(["--cpu", "--concurrency", gpu["concurrency"], "--sweep", gpu["sweep"],
                         "--configs", gpu["configs"], "--sweep-configs", gpu["sweep_configs"],
                         "--max-new-tokens", "256", "--max-seconds", "330", "--max-run-seconds", "60"])
    args.device = "gpu"
    return b.Bench(args, None, {})


def test_gpu_plan_runs_the_targets_first_and_keeps_to_the_budget():
    b = _bench_module()
    bench = _gpu_session(b)
    plan = bench.planned()
    assert plan[:6] == [(k, n) for n in (64, 256) for k in ("ours-graphs", "hf-cupy_paged-graphs", "hf-sdpa-graphs")]
    assert [n for k, n in plan if k == "hf-eager"] == [64]
    sweep = [(k, n) for k, n in plan if n not in (64, 256)]
    assert {n for _, n in sweep} == {8, 16, 32, 128}
    assert {k for k, _ in sweep} == {"ours-graphs", "ours", "hf-cupy_paged-graphs", "hf-sdpa-graphs"}
    assert len(plan) == len(set(plan))
    bench.runs[("hf-sdpa", 64)] = b.Run(b.SPECS["hf-sdpa"], 64, wall_s=50.0, warm_s=5.0, tokens=[], detail={})
    assert bench.predicted_seconds("hf-sdpa", 256) == pytest.approx(110.0)  # the measured run, x sqrt(256 / 64)
    assert "--max-run-seconds" in bench.should_skip("hf-sdpa", 256, elapsed=0.0)
    assert "--max-seconds" in bench.should_skip("ours-graphs", 64, elapsed=329.0)
    assert bench.should_skip("ours-graphs", 64, elapsed=0.0) is None


def test_agreement_and_targets_of_made_up_runs():
    b = _bench_module()
    bench = _gpu_session(b)
    bench.args.max_new_tokens = 3

    def run(key, n, tokens, wall):
        bench.runs[(key, n)] = b.Run(b.SPECS[key], n, wall_s=wall, warm_s=1.0, tokens=tokens, detail={})

    run("ours-graphs", 64, [[1, 2, 3], [1, 2, 4], [9, 9, 9]], 3 * 3 / 41000.0)
    run("hf-sdpa-graphs", 64, [[1, 2, 3], [1, 2, 3], [1, 9, 9]], 3 * 3 / 1000.0)
    run("hf-cupy_paged-graphs", 64, [[1, 2, 3]] * 3, 3 * 3 / 10000.0)
    agree = bench.agreement("ours-graphs", 64)
    assert agree["vs"] == "hf sdpa graphs" and agree["median_common_prefix"] == 2.0
    assert agree["fraction_equal"] == pytest.approx(1 / 3, abs=1e-4)
    targets = {t["name"]: t for t in bench.targets()}
    assert targets["ours graphs 64 >= 40,000 tok/s"]["met"] is True
    assert targets["ours graphs 64 >= 20x hf sdpa graphs"]["value"] == pytest.approx(41.0)
    assert targets["ours graphs 64 >= 5x hf cupy_paged graphs"]["met"] is False
    assert targets["ours graphs 256 >= 80,000 tok/s"]["met"] is None  # not run
    bench.prompts[64] = [[5]] * 3
    case = bench.case("ours-graphs", 64, bench.runs[("ours-graphs", 64)])
    assert case["met"] is False and "5x hf cupy_paged graphs" in case["target"]
    assert case["peers"] == {"hf sdpa graphs": 1000.0, "hf cupy_paged graphs": 10000.0}
