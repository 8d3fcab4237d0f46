"""The one place that turns ``cuda_src/`` into CUDA kernels.

Every kernel family registers the compile-time parameters it is specialised on
(dtype, head dim, tile sizes, ...) as a :class:`KernelKey`.  A key spells every
``-D`` option the source is compiled with, so one key is one specialization.

* :func:`get_function` builds the ``cupy.RawModule`` of a key lazily, once per
  process (memoised), and returns one of its kernels.  The local headers that a
  source includes are folded into the source string, so CuPy's disk cache, which
  keys on the source text and the options only, never serves stale code.
* A key may pin an architecture (``arch="sm_90a"``: kernels that use ``wgmma``, which
  runs only on compute capability 9.0).  CuPy always compiles for the device's plain
  architecture, so such a key is compiled here through NVRTC into a cubin, cached on
  disk beside CuPy's own cache under a hash of source, options and NVRTC version, and
  loaded with ``cupy.RawModule(path=...)``.
* :func:`compile_offline` compiles a key through raw NVRTC with no GPU and no
  driver (``cupy.cuda.nvrtc``) for a given architecture and reports registers,
  shared memory and spills per kernel.  CI runs it for every key.
"""
from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import importlib.resources
import os
import pathlib
import re
import sys
from typing import Callable, Iterable

ARCHS = ("sm_80", "sm_90")
BASE_OPTIONS = ("-std=c++17", "--use_fast_math")
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class KernelKey:
    """One specialization: a source file of ``cuda_src/`` and its ``-D`` macros.

    ``params`` is a tuple of ``(macro, value)`` pairs; every compile-time
    parameter of the source must be spelled here, so that two keys that compare
    equal always compile to the same code.
    """

    source: str
    params: tuple[tuple[str, object], ...] = ()
    arch: str = ""  # "" = the device's architecture; else the one target, e.g. "sm_90a"

    def options(self) -> tuple[str, ...]:
        return BASE_OPTIONS + tuple(f"-D{name}={value}" for name, value in self.params)

    def archs(self, default: Iterable[str] = ARCHS) -> tuple[str, ...]:
        """The architectures this key is built for offline: its pinned one, else ``default``."""
        return (self.arch,) if self.arch else tuple(default)

    def __str__(self) -> str:
        inner = ",".join(f"{name}={value}" for name, value in self.params)
        return f"{self.source}[{inner}]" + (f"@{self.arch}" if self.arch else "")


# family name -> function listing every key the package may ever launch
_FAMILIES: dict[str, Callable[[], Iterable[KernelKey]]] = {}
# keys built into a RawModule in this process, for ``python -m cupy_paged info``
_BUILT: list[KernelKey] = []
_MANIFEST = "cupy_paged_built.txt"  # beside CuPy's kernel cache: what earlier processes built


def register_family(name: str, keys: Callable[[], Iterable[KernelKey]]) -> None:
    """Declare a kernel family and every specialization it may launch."""
    _FAMILIES[name] = keys


def all_keys() -> list[KernelKey]:
    """Every specialization of every registered family (imports the ops first)."""
    from . import ops  # noqa: F401  (registers the families)

    keys: list[KernelKey] = []
    for name in sorted(_FAMILIES):
        keys.extend(_FAMILIES[name]())
    return keys


def kernel_cache_dir() -> pathlib.Path:
    """CuPy's on-disk kernel cache (``CUPY_CACHE_DIR``, default ``~/.cupy/kernel_cache``)."""
    return pathlib.Path(os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache")))


def built_keys() -> list[str]:
    """Specializations built in this process and recorded by earlier ones, with a source hash."""
    lines = [f"{key} {source_hash(key)}" for key in _BUILT]
    try:
        lines += (kernel_cache_dir() / _MANIFEST).read_text().splitlines()
    except OSError:
        pass
    return sorted(set(lines))


def source_hash(key: KernelKey) -> str:
    return hashlib.sha256(load_source(key.source).encode()).hexdigest()[:12]


# --------------------------------------------------------------------------- sources

def source_dir() -> pathlib.Path:
    """``cuda_src/``: inside the installed package, else beside the package in a checkout."""
    try:
        # cuda_src is a namespace package in the wheel: ask for a file, then take its folder.
        marker = importlib.resources.files("cupy_paged.cuda_src").joinpath("common.cuh")
        if marker.is_file():
            return pathlib.Path(str(marker)).parent
    except ModuleNotFoundError:
        pass
    tree = pathlib.Path(__file__).resolve().parent.parent / "cuda_src"
    if tree.is_dir():
        return tree
    raise FileNotFoundError("cupy_paged cannot find its CUDA sources (cuda_src/)")


@functools.cache
def load_source(name: str) -> str:
    """The source text of ``cuda_src/<name>`` with its local ``#include "..."`` folded in."""
    root = source_dir()
    seen: set[str] = set()

    def expand(file_name: str) -> str:
        if file_name in seen:  # headers are guarded by #pragma once; include each once
            return ""
        seen.add(file_name)
        path = root / file_name
        if not path.is_file():
            raise FileNotFoundError(f"cuda_src/{file_name} not found")
        text = path.read_text()
        return _INCLUDE_RE.sub(lambda m: f"// ---- {m.group(1)}\n" + expand(m.group(1)), text)

    return expand(name)


# --------------------------------------------------------------------------- runtime build

@functools.cache
def get_module(key: KernelKey):
    """The ``cupy.RawModule`` of ``key``, compiled on first use (needs a GPU)."""
    import cupy

    if key.arch:
        module = cupy.RawModule(path=str(_cached_cubin(key)))
    else:
        module = cupy.RawModule(code=load_source(key.source), options=key.options())
        module.compile()
    _BUILT.append(key)
    try:  # best effort: a read-only cache folder only loses the record
        kernel_cache_dir().mkdir(parents=True, exist_ok=True)
        with open(kernel_cache_dir() / _MANIFEST, "a") as manifest:
            manifest.write(f"{key} {source_hash(key)}\n")
    except OSError:
        pass
    return module


def _cached_cubin(key: KernelKey) -> pathlib.Path:
    """The cubin of an architecture-pinned key, compiled through NVRTC on first use."""
    from cupy.cuda import nvrtc

    digest = hashlib.sha256("\0".join(
        (load_source(key.source), *key.options(), key.arch, str(nvrtc.getVersion()))).encode()).hexdigest()
    path = kernel_cache_dir() / f"cupy_paged_{digest[:32]}.cubin"
    if not path.is_file():
        cubin = _nvrtc_compile(key, key.arch)[1]
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_bytes(cubin)
        os.replace(partial, path)  # atomic: concurrent builders (warm) never see half a file
    return path


def get_function(key: KernelKey, kernel: str, dynamic_smem: int = 0):
    """Kernel ``kernel`` of ``key``'s module on the current device, allowed ``dynamic_smem``
    bytes of shared memory."""
    import cupy

    return _device_function(key, kernel, dynamic_smem, cupy.cuda.runtime.getDevice())


@functools.cache
def _device_function(key: KernelKey, kernel: str, dynamic_smem: int, device: int):
    # The shared-memory limit is an attribute of the function as loaded on one device: another
    # device gets its own function object, with the limit raised there.
    function = get_module(key).get_function(kernel)
    if dynamic_smem > 48 * 1024:
        function.max_dynamic_shared_size_bytes = dynamic_smem
    return function


def _build_key(key_text: str) -> str:
    """Worker of :func:`warm` (module level, so spawned processes can import it)."""
    key = next(k for k in all_keys() if str(k) == key_text)
    get_module(key)
    return key_text


def warm(jobs: int, filter_text: str = "") -> int:
    """Fill CuPy's disk cache with every specialization, one process per compile (needs a GPU)."""
    import multiprocessing
    import time

    keys = [str(k) for k in all_keys() if filter_text in str(k)]
    start = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        for done in pool.imap_unordered(_build_key, keys):
            print(f"  built {done}", flush=True)
    print(f"{len(keys)} specializations built in {time.perf_counter() - start:.1f} s")
    return 0


# --------------------------------------------------------------------------- offline build

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
_USED_RE = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas_log(log: str) -> list[KernelResources]:
    """Per-kernel resources from ``ptxas -v`` output."""
    kernels: list[KernelResources] = []
    current = None
    for line in log.splitlines():
        if m := _FUNC_RE.search(line):
            current = KernelResources(m.group(1), 0, 0, 0, 0, 0)
            kernels.append(current)
        elif current is not None and (m := _PROPS_RE.search(line)):
            current.stack_bytes, current.spill_stores, current.spill_loads = map(int, m.groups())
        elif current is not None and (m := _USED_RE.search(line)):
            current.registers = int(m.group(1))
            current.shared_bytes = int(m.group(2) or 0)
    return kernels


def _nvrtc_compile(key: KernelKey, arch: str, verbose: bool = False) -> tuple[str, bytes]:
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
    log, cubin = _nvrtc_compile(key, arch, verbose=True)
    return CompileReport(key, arch, parse_ptxas_log(log), log, len(cubin))


def format_reports(reports: Iterable[CompileReport]) -> str:
    rows = ["arch   regs  smem  stack spill  kernel  (key)"]
    for report in reports:
        for k in report.kernels:
            rows.append(f"{report.arch:6} {k.registers:4} {k.shared_bytes:5} {k.stack_bytes:5} "
                        f"{k.spill_stores + k.spill_loads:5}  {k.kernel}  ({report.key})")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """``python -m cupy_paged.compile_all``: compile every specialization offline, print resources."""
    import argparse
    from concurrent.futures import ThreadPoolExecutor

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--arch", action="append", help="repeatable; default sm_80 and sm_90")
    parser.add_argument("--filter", default="", help="only keys whose text contains this")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    jobs = [(key, arch) for key in all_keys() if args.filter in str(key) for arch in key.archs(args.arch or ARCHS)]
    # NVRTC releases the GIL while compiling, so threads compile in parallel.
    with ThreadPoolExecutor(args.jobs) as pool:
        reports = list(pool.map(lambda job: compile_offline(*job), jobs))
    print(format_reports(reports))
    spills = [(r.key, k.kernel) for r in reports for k in r.kernels if k.spill_stores or k.spill_loads]
    print(f"{len(reports)} compiled ({len(set(k for k, _ in jobs))} keys), {len(spills)} kernels spill")
    return 0
