"""One compute-sanitizer pair's case in ``results/sanitizer.json`` (``sanitize.sh`` calls it per pair).

The case: ``name`` ("TOOL:FILE", "TOOL:FILE -k EXPR", " kernels=REGEX" after where a filter was given, a shard's "[i/n]" last), metric ``errors``
(the tool's summary count; None when the process never finished: cut at its time limit, killed,
or no test selected), the pytest outcome, seconds and date, and where the printed reports are:
``printed_reports`` (count by kernel, most first) and ``project_reports`` (those in the project's
own kernels: every ``__global__`` of ``cuda_src/`` and the example engine's ``examples/llama/*.cu``).
When every report was printed and none is in a project kernel, the case says so
(``project_errors`` 0): the errors are the vendors' (cuBLAS, CUB, cuDNN), which the case's
``explanation`` (written by hand) then has to account for.

    python benchmarks/sanitizer_record.py RESULTS TOOL NAME RC SECONDS LOG [KERNELS] [SELECT]
"""
from __future__ import annotations

import collections
import datetime
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
_GLOBAL = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(")
_DEFINED = re.compile(r"^DEFINE_\w+\((\w+)\s*,", re.M)  # kernels a source defines through a macro
# A report's first line (pytest's progress dots may come before it on the same line).
_REPORT = re.compile(r"^[.sxFE]*========= (?:Invalid|Race reported|Error: Race reported|Uninitialized|Barrier|Error:|Program hit)",
                     re.M)


def project_kernels(root: pathlib.Path = ROOT) -> frozenset:
    """The names of every kernel the project compiles: cupy_paged's and the example engine's."""
    names = set()
    for path in sorted(root.glob("cuda_src/*.cu*")) + sorted(root.glob("examples/llama/*.cu")):
        text = path.read_text()
        names.update(name for name in _GLOBAL.findall(text) if name != "NAME")
        names.update(_DEFINED.findall(text))
    return frozenset(names)


def kernel_name(text: str) -> str:
    """The bare name of a report's kernel: ``void ns::Kernel<T>(args)+0x10`` -> ``Kernel``."""
    text = text.strip()
    text = text[5:] if text.startswith("void ") else text
    text = re.sub(r"\+0x[0-9a-f]+.*$", "", text)
    text = text.split("<", 1)[0].split("(", 1)[0]
    return text.rsplit("::", 1)[-1]


def printed_reports(text: str) -> collections.Counter:
    """Count of the printed reports by the kernel they name: racecheck's "... access at KERNEL+0x..",
    the other tools' "at KERNEL+0x.." on the line after the report."""
    counts = collections.Counter()
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not _REPORT.match(line) or "process didn't terminate" in line or "Target application" in line:
            continue
        inline = re.search(r" at (\S+?\+0x[0-9a-f]+)", line)
        if inline:
            counts[kernel_name(inline.group(1))] += 1
            continue
        following = next((other for other in lines[i + 1:i + 4] if re.match(r"^=========\s+at ", other)), None)
        if following is not None:
            counts[kernel_name(following.split(" at ", 1)[1])] += 1
    return counts


def case(tool: str, name: str, rc: int, seconds: int, text: str, kernels: str | None = None,
         select: str | None = None, ours: frozenset | None = None) -> dict:
    """The results case of one pair from its log ``text`` and exit status."""
    found = re.findall(r"(?:ERROR|RACECHECK) SUMMARY: (\d+) (?:error|hazard)s?\b(?! were not printed)", text)
    outcomes = re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped|deselected|error).*?) in [\d.]+s", text, re.M)
    outcome = outcomes[-1] if outcomes else "no pytest summary"
    # None: no summary (cut short, or no GPU); no test ran (pytest's rc 5: a shard or -k that selects
    # none); or pytest never finished (killed: the tool's summary then counts only what it saw)
    finished = rc not in (124, 5) and outcome != "no pytest summary"
    errors = int(found[-1]) if found and finished else None
    if rc == 124:
        outcome = f"cut short at its time limit ({outcome})"
    ours = project_kernels() if ours is None else ours
    by_kernel = printed_reports(text)
    printed = sum(by_kernel.values())
    result = dict(name=f"{tool}:{name}", metric="errors", value=errors, peers={}, rc=rc, tests=outcome.strip(),
                  seconds=seconds, date=datetime.date.today().isoformat())
    if kernels:
        result["kernels"] = kernels
    if select:
        result["k"] = select
    if errors is None:
        result["reports_before_cut"] = len(_REPORT.findall(text))
    if printed:
        result["printed_reports"] = dict(by_kernel.most_common(8))
        result["project_reports"] = sum(count for kernel, count in by_kernel.items() if kernel in ours)
        if errors is not None and printed >= errors and result["project_reports"] == 0:
            result["project_errors"] = 0
    return result


def merge(results: pathlib.Path, new: dict) -> None:
    """Put ``new`` in the results file: it replaces its own case and every case of the same tool,
    file and selection split into another number of shards."""
    report = json.loads(results.read_text()) if results.exists() else {"cases": []}

    def split(case_name):  # "TOOL:FILE[i/n]" -> ("TOOL:FILE", "n"); "TOOL:FILE -k t[48]" -> itself, ""
        shard = re.fullmatch(r"(.*)\[(\d+)/(\d+)\]", case_name)
        return (shard.group(1), shard.group(3)) if shard else (case_name, "")

    pair, count = split(new["name"])
    report["cases"] = [c for c in report["cases"]
                       if c["name"] != new["name"] and not (split(c["name"])[0] == pair and split(c["name"])[1] != count)]
    report["cases"].append(new)
    report["cases"].sort(key=lambda c: c["name"])
    results.write_text(json.dumps(report, indent=1) + "\n")


def main(argv: list[str]) -> int:
    results, tool, name, rc, seconds, log = argv[:6]
    kernels = argv[6] if len(argv) > 6 and argv[6] else None
    select = argv[7] if len(argv) > 7 and argv[7] else None
    new = case(tool, name, int(rc), int(seconds), pathlib.Path(log).read_text(errors="replace"), kernels, select)
    merge(pathlib.Path(results), new)
    where = "" if "printed_reports" not in new else f"  printed: {new['printed_reports']}"
    print(f"{tool:<10} {name:<34} errors={new['value']} rc={rc} {seconds:>4}s  {new['tests']}{where}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
