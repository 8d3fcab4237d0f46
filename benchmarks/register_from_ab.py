"""Decide from ab_tma.py's JSON whether a TMA shape replaces a registered varlen wgmma shape, and
rewrite ``WGMMA_TILES`` in this tree's ``cupy_paged/kernels/varlen_wgmma.py`` when one does (the
device scripts run it on their copy of the tree, so the tests and benchmarks after it run the new
registration; the decision is printed and goes into the run's log).

Rule: a variant replaces the registered D = 128 shape when the geometric mean of its speed-ups over
every D = 128 case is at least 1.01 and no case is slower than 0.99x, its output within 1e-2 of
the registered kernel's everywhere (bf16; the GPU tests checked it against the reference first);
of two that qualify, the faster.  D = 64 the same over its cases.

Run: ``python benchmarks/register_from_ab.py AB_JSON`` (exit 0 and "registered ..." lines, or "kept").
"""
from __future__ import annotations

import json
import math
import pathlib
import re
import sys

SHAPES = {
    "wg128x128s2pot": "WgmmaTiles(128, 2, producer=True, staged_store=True, tma=True)",
    "wg128x128s2poxt": "WgmmaTiles(128, 2, producer=True, staged_store=True, pv_overlap=True, tma=True)",
    "wg128x128s2pt": "WgmmaTiles(128, 2, producer=True, tma=True)",
}


def choose(rows: list) -> tuple[str | None, dict]:
    """The variant label that qualifies (the fastest), or None; and every variant's (geomean, worst)."""
    labels = set.intersection(*(set(row["variants"]) for row in rows))
    scores = {}
    for label in labels:
        ratios = [row["variants"][label]["tflops"] / row["registered"] for row in rows]
        diffs = [row["variants"][label]["maxdiff"] for row in rows]
        geomean = math.exp(sum(map(math.log, ratios)) / len(ratios))
        ok = geomean >= 1.01 and min(ratios) >= 0.99 and max(diffs) <= 1e-2
        scores[label] = dict(geomean=round(geomean, 4), worst=round(min(ratios), 4), maxdiff=max(diffs), ok=ok)
    qualified = [label for label in scores if scores[label]["ok"] and label in SHAPES]
    return (max(qualified, key=lambda x: scores[x]["geomean"]) if qualified else None), scores


def main() -> int:
    result = json.loads(pathlib.Path(sys.argv[1]).read_text())
    source = pathlib.Path(__file__).resolve().parents[1] / "cupy_paged" / "kernels" / "varlen_wgmma.py"
    text = source.read_text()
    for head_dim, rows in ((128, result["rows"]), (64, result.get("d64", []))):
        if not rows:
            continue
        label, scores = choose(rows)
        print(f"D = {head_dim}: {json.dumps(scores)}")
        if label is None:
            print(f"D = {head_dim}: kept the registered shape")
            continue
        pattern = re.compile(rf"^(    {head_dim}: )WgmmaTiles\([^\n]*?\),(  #[^\n]*)?$", re.M)
        text, count = pattern.subn(rf"\g<1>{SHAPES[label]},  # registered from the A/B", text)
        if count != 1:
            print(f"D = {head_dim}: the WGMMA_TILES line was not found; nothing changed")
            return 1
        print(f"D = {head_dim}: registered {label}")
    source.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
