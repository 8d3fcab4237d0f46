"""Digest of the cubin of every kernel specialization, to show a refactor left the code alone.

    python tools/cubin_digests.py > before.json     # on one revision
    python tools/cubin_digests.py > after.json      # on the other
    diff before.json after.json                      # nothing: byte-identical machine code

Compiles through NVRTC alone (no GPU), for sm_80 and sm_90 (a key pinned to one architecture
is built for that one), the same builds as ``python -m cupy_paged compile``.  The keys are
printed as they are spelled; a key whose spelling changed shows as one line removed and one
added, and its digest tells whether the code did.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor


def main() -> int:
    from cupy_paged._core.compiler import ARCHS
    from cupy_paged._core.nvrtc import nvrtc_compile
    from cupy_paged.kernels.registry import all_keys

    jobs = [(key, arch) for key in all_keys() for arch in key.archs(ARCHS)]

    def digest(job):
        key, arch = job
        cubin = nvrtc_compile(key, arch)[1]
        return f"{key}@{arch}", hashlib.sha256(cubin).hexdigest()[:16]

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        digests = dict(sorted(pool.map(digest, jobs)))
    json.dump(digests, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
