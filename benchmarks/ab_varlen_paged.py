"""A/B of the varlen kernel's source across revisions: paged against contiguous K/V.

Builds the wgmma kernel (bf16, D=128) from the CUDA sources of earlier revisions and from
``cuda_src/``, launches each with the argument list of its revision, and times back to back (CUDA
events around 10 launches, median of 7) the causal 8 x 4096 batch and a 512-token chunk after a
32k prefix, on contiguous K/V and through a shuffled block table of block 16.

The device machine has no git history: export the revisions first, into the ignored ``.ab/``
folder that the device call carries::

    python benchmarks/ab_varlen_paged.py --export 4e5d103 3471a0a     # here, from git
    python benchmarks/ab_varlen_paged.py                              # on the GPU machine
"""
from __future__ import annotations

import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import cupy  # noqa: E402

from cupy_paged._core import compiler as _compiler  # noqa: E402
from cupy_paged._core.types import BF16  # noqa: E402
from cupy_paged.api.varlen import prepare_varlen  # noqa: E402
from cupy_paged._core.errors import word  # noqa: E402
from cupy_paged.kernels import varlen as varlen_ops  # noqa: E402
from cupy_paged.kernels._launch import Launcher  # noqa: E402

from bench_varlen import Batch  # noqa: E402


# The argument lists of earlier revisions: before the error word (4e5d103 and earlier), and with
# it but before the trailing batch size (the eighteenth session); a revision's is read from its
# varlen_common.cuh (abi_of).
LAYOUTS = {"old": "9P" + "qqiqiq" + "iiiiii" + "ff" + "ii", "errors": varlen_ops._LAYOUT[:-1],
           "batch": varlen_ops._LAYOUT}
EXPORTS = ROOT / ".ab"


def abi_of(source: pathlib.Path) -> str:
    """Which argument list the varlen kernels of ``source`` (a cuda_src folder) take."""
    text = (source / "varlen_common.cuh").read_text()
    return "batch" if "int batch" in text else "errors" if "int *errors" in text else "old"


def export(revisions) -> None:
    """``cuda_src/`` of each git revision -> ``.ab/<revision>/``."""
    import subprocess
    import tarfile
    import io

    for revision in revisions:
        archive = subprocess.run(["git", "archive", revision, "cuda_src"], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        target = EXPORTS / revision
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(target, filter="data")
        print(f"{revision}: {target / 'cuda_src'}")


def variants() -> dict:
    """Revision label -> its cuda_src folder: every export under .ab/, then the working tree's."""
    found = {path.name: path / "cuda_src" for path in sorted(EXPORTS.glob("*")) if (path / "cuda_src").is_dir()}
    found["now"] = ROOT / "cuda_src"
    return found


def build(source: pathlib.Path):
    _compiler.source_dir = lambda: source  # noqa: E731 - the revision's sources
    _compiler.load_source.cache_clear()
    _compiler.get_module.cache_clear()
    _compiler._device_function.cache_clear()
    tiles = varlen_ops.WGMMA_TILES[128]
    smem = tiles.smem_bytes(128)
    function = _compiler.get_function(varlen_ops.wgmma_key(BF16, 128), varlen_ops.WGMMA_KERNEL, smem)
    return function, smem, tiles


def arguments(p, abi: str):
    launch = varlen_ops.VarlenLaunch(p)
    table = 0 if p.block_table is None else p.block_table.ptr
    ptrs = [p.q.ptr, p.k.ptr, p.v.ptr, p.out.ptr, 0, p.cu_seqlens_q.ptr, p.cu_seqlens_k.ptr, table, 0]
    tail = {"old": [], "errors": [p.max_seqlen_q, 0, word(p.q.device)],
            "batch": [p.max_seqlen_q, 0, word(p.q.device), p.batch]}[abi]
    return ptrs + list(launch.scalars) + tail


def time_us(fn, reps: int = 7, inner: int = 10) -> float:
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    fn()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(inner):
            fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3 / inner)
    return float(np.median(times))


def main() -> None:
    if len(sys.argv) > 1:
        if sys.argv[1] != "--export" or len(sys.argv) < 3:
            raise SystemExit("usage: ab_varlen_paged.py [--export REV [REV ...]]")
        export(sys.argv[2:])
        return
    cases = {"8x4096": Batch([4096] * 8, [4096] * 8, 128), "chunk512 after 32k": Batch([512], [32768 + 512], 128)}
    problems = {}
    for name, batch in cases.items():
        k_cache, v_cache, table = batch.paged(16)
        for label, (k, v, t) in (("contiguous", (batch.k, batch.v, None)), ("paged bs16", (k_cache, v_cache, table))):
            problems[(name, label)] = prepare_varlen(batch.q, k, v, batch.cu_q, batch.cu_k, batch.max_q,
                                                             batch.max_k, None, True, (-1, -1), 0.0, None, t, False,
                                                             batch.out, False)
    rows = []
    for variant, source in variants().items():
        function, smem, tiles = build(source)
        abi = abi_of(source)
        launcher = Launcher(function, LAYOUTS[abi])
        for (name, label), p in problems.items():
            args = arguments(p, abi)
            grid = (-(-p.max_seqlen_q // tiles.block_m), p.num_heads, p.batch)
            stream = cupy.cuda.get_current_stream().ptr
            rows.append((variant, name, label, time_us(lambda: launcher(grid, tiles.threads, smem, stream, *args)),
                         function.num_regs))
    print("| revision | case | K/V | us | registers |")
    print("| --- | --- | --- | ---: | ---: |")
    for row in rows:
        print(f"| {row[0]} | {row[1]} | {row[2]} | {row[3]:.1f} | {row[4]} |")
    print("\npaged / contiguous time:")
    for variant in variants():
        for name in cases:
            t = {r[2]: r[3] for r in rows if r[0] == variant and r[1] == name}
            print(f"  {variant:10} {name:20} contiguous / paged = {t['contiguous'] / t['paged bs16']:.3f}")


if __name__ == "__main__":
    main()
