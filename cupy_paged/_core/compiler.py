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
import hashlib
import importlib.resources
import os
import pathlib
import re
from typing import Iterable

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


# keys built into a RawModule in this process, for ``python -m cupy_paged info``
_BUILT: list[KernelKey] = []
_MANIFEST = "cupy_paged_built.txt"  # beside CuPy's kernel cache: what earlier processes built


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
    tree = pathlib.Path(__file__).resolve().parents[2] / "cuda_src"
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
        from .nvrtc import nvrtc_compile

        cubin = nvrtc_compile(key, key.arch)[1]
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
