"""Offline builds through NVRTC alone: no GPU and no driver (``cupy.cuda.nvrtc``).

:func:`compile_offline` compiles one specialization for one architecture and reports its
registers, shared memory and spills from ptxas; CI runs it for every key
(``python -m cupy_paged compile``).  :func:`nvrtc_compile` is also what builds the cubins of
architecture-pinned keys at run time (``compiler``).
"""
from __future__ import annotations

import dataclasses
import glob
import os
import re
import sys
from typing import Iterable

from .compiler import KernelKey, load_source

@dataclasses.dataclass
class KernelResources:
    kernel: str
    registers: int
    shared_bytes: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int


@dataclasses.dataclass
class CompileReport:
    key: KernelKey
    arch: str
    kernels: list[KernelResources]
    log: str
    cubin_bytes: int


def cuda_include_dirs() -> list[str]:
    """Folders holding the CUDA headers (``cuda_bf16.h``): the pip CTK wheels, then CUDA_PATH."""
    found = []
    for entry in sys.path:
        for pattern in ("nvidia/cu*/include", "nvidia/cuda_runtime/include", "nvidia/cuda_nvrtc/include"):
            found.extend(sorted(glob.glob(os.path.join(entry, pattern))))
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            found.append(os.path.join(os.environ[env], "include"))
    found.append("/usr/local/cuda/include")
    return [d for d in dict.fromkeys(found) if os.path.isfile(os.path.join(d, "cuda_fp16.h"))]


_FUNC_RE = re.compile(r"Compiling entry function '(\w+)' for")
_PROPS_RE = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PROPERTIES_RE = re.compile(r"Function properties for (\S+)")
_USED_RE = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas_log(log: str) -> list[KernelResources]:
    """Per-kernel resources from ``ptxas -v`` output."""
    kernels: list[KernelResources] = []
    current = None
    properties_of = None  # the function whose "Function properties" block the next lines belong to
    for line in log.splitlines():
        if m := _FUNC_RE.search(line):
            current = KernelResources(m.group(1), 0, 0, 0, 0, 0)
            kernels.append(current)
        elif m := _PROPERTIES_RE.search(line):
            properties_of = m.group(1)
        elif current is not None and (m := _PROPS_RE.search(line)):
            # a non-inlined device function's own block follows the kernel's: not the kernel's
            if properties_of in (None, current.kernel):
                current.stack_bytes, current.spill_stores, current.spill_loads = map(int, m.groups())
        elif current is not None and (m := _USED_RE.search(line)):
            current.registers = int(m.group(1))
            current.shared_bytes = int(m.group(2) or 0)
    return kernels


def nvrtc_compile(key: KernelKey, arch: str, verbose: bool = False) -> tuple[str, bytes]:
    """(NVRTC log, cubin) of ``key`` for ``arch``, through NVRTC alone (no GPU needed);
    ``verbose`` adds ptxas's resource report (``-Xptxas=-v``) to the log."""
    from cupy.cuda import nvrtc

    options = list(key.options()) + [f"-arch={arch}"] + (["-Xptxas=-v"] if verbose else [])
    options += [f"-I{d}" for d in cuda_include_dirs()]
    program = nvrtc.createProgram(load_source(key.source), key.source, [], [])
    try:
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as error:
            raise RuntimeError(f"{key} failed to compile for {arch}:\n"
                               f"{nvrtc.getProgramLog(program)}") from error
        log = nvrtc.getProgramLog(program)
        cubin = nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)
    return log, cubin


def compile_offline(key: KernelKey, arch: str | None = None) -> CompileReport:
    """Compile ``key`` for ``arch`` (default: its pinned one, else sm_90) through NVRTC alone
    (no GPU); raise on a compile error.  A key that pins an architecture is built for that one
    only (``key.archs()``): asking it for another is a ValueError."""
    arch = arch or key.archs(("sm_90",))[0]
    if arch not in key.archs((arch,)):
        raise ValueError(f"{key} is pinned to {key.arch}; it cannot be compiled for {arch}")
    log, cubin = nvrtc_compile(key, arch, verbose=True)
    return CompileReport(key, arch, parse_ptxas_log(log), log, len(cubin))


def format_reports(reports: Iterable[CompileReport]) -> str:
    rows = ["arch   regs  smem  stack spill  kernel  (key)"]
    for report in reports:
        for k in report.kernels:
            rows.append(f"{report.arch:6} {k.registers:4} {k.shared_bytes:5} {k.stack_bytes:5} "
                        f"{k.spill_stores + k.spill_loads:5}  {k.kernel}  ({report.key})")
    return "\n".join(rows)


