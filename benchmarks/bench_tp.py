"""Tensor-parallel serving: decode throughput of the example engine at tp = 1, 2, 4 (one GPU a rank).

Runs ``examples/serve_llama.py --tp N`` once per tp (the script starts its ranks itself, one
process per GPU, NCCL between them; under ``torchrun`` it would take the launcher's), every run on
random weights of the same shape (default: 32 layers, hidden 4096, 32 query / 8 kv heads, MLP
14336, vocab 32000: a Llama-3-8B shape), greedy, the same synthetic requests, and reads each run's
figures from ``--stats-json``.  Targets (issue: tensor parallelism): generated tokens per second at
tp = 2 at least 1.8x tp = 1, at tp = 4 at least 3.2x.  Writes ``benchmarks/results/tp.json``
(cases ``tp N``, metric ``tok/s``, ``peers`` holding tp = 1, ``ratio``, ``target``) and prints a
table.  ``--cpu`` runs the CPU backend (a smoke run of the same code, no figures that mean
anything: give a small ``--shape``).

    python benchmarks/bench_tp.py [--tp 1 2 4] [--requests 256] [--max-new-tokens 128] [--shape ...]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
SERVE = HERE.parent / "examples" / "serve_llama.py"
RESULTS = HERE / "results" / "tp.json"
TARGETS = {2: 1.8, 4: 3.2}
LLAMA_8B_SHAPE = "32,4096,32,8,14336,32000"


def run(tp: int, args, out_dir: pathlib.Path) -> dict:
    stats = out_dir / f"tp{tp}.json"
    command = [sys.executable, str(SERVE), "--tp", str(tp), "--no-progress", "--greedy", "--shape", args.shape,
               "--requests", str(args.requests), "--max-new-tokens", str(args.max_new_tokens),
               "--max-num-seqs", str(args.requests), "--stats-json", str(stats)]
    command += ["--cpu"] if args.cpu else []
    command += args.serve_args
    print("$", " ".join(command), flush=True)
    # The checkout's package first on the path, so that a clone runs without installing it.
    path = os.pathsep.join(filter(None, (str(HERE.parent), os.environ.get("PYTHONPATH"))))
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path})
    print(done.stdout[-2000:], done.stderr[-2000:], sep="\n", flush=True)
    if done.returncode:
        raise SystemExit(f"tp = {tp}: serve_llama.py exited with {done.returncode}")
    return json.loads(stats.read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--shape", default=LLAMA_8B_SHAPE)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("serve_args", nargs="*", help="passed on to serve_llama.py (after --)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        figures = {tp: run(tp, args, pathlib.Path(tmp)) for tp in args.tp}
    base = figures.get(1, {}).get("tokens_per_second")
    cases = []
    for tp, f in figures.items():
        ratio = f["tokens_per_second"] / base if base else None
        target = TARGETS.get(tp)
        cases.append(dict(name=f"tp {tp}", metric="tok/s", value=round(f["tokens_per_second"], 1),
                          peers={"tp 1": round(base, 1)} if base else {}, ratio=None if ratio is None else round(ratio, 3),
                          target=target, met=None if target is None or ratio is None else ratio >= target,
                          detail=f))
    report = dict(date=datetime.date.today().isoformat(), device="cpu" if args.cpu else "gpu", shape=args.shape,
                  requests=args.requests, max_new_tokens=args.max_new_tokens, cases=cases)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print("\n| tp | tok/s | vs tp 1 | target | met? |\n| --- | ---: | ---: | --- | --- |")
    for c in cases:
        print(f"| {c['name']} | {c['value']} | {c['ratio']} | {c['target'] or '-'} | {c['met']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
