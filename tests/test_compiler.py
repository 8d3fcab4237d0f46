"""The kernel compiler: source folding, keys, and every specialization through NVRTC offline."""
import pytest

from cupy_paged._core import compiler as _compiler
from cupy_paged._core import nvrtc
from cupy_paged.kernels import registry

KEYS = registry.all_keys()


def test_headers_are_folded_into_the_source():
    text = _compiler.load_source("kv_write.cu")
    assert '#include "common.cuh"' not in text
    assert "struct alignas(16) Vec8" in text  # from common.cuh
    assert text.count("struct alignas(16) Vec8") == 1


def test_nested_headers_are_folded_and_hashed(tmp_path, monkeypatch):
    """A header included by a header (sm90.cuh, by wgmma.cuh and varlen_wgmma.cu) is folded in
    once, and is part of the source hash that keys the caches."""
    import shutil

    text = _compiler.load_source("varlen_wgmma.cu")
    assert '#include "' not in text
    assert text.count("struct Sw128Tile") == 1  # from sm90.cuh
    key = next(k for k in KEYS if k.source == "varlen_wgmma.cu")
    shutil.copytree(_compiler.source_dir(), tmp_path / "cuda_src")
    monkeypatch.setattr(_compiler, "source_dir", lambda: tmp_path / "cuda_src")
    try:
        _compiler.load_source.cache_clear()
        before = _compiler.source_hash(key)
        with open(tmp_path / "cuda_src" / "sm90.cuh", "a") as header:
            header.write("// edited\n")
        _compiler.load_source.cache_clear()
        assert _compiler.source_hash(key) != before
    finally:
        _compiler.load_source.cache_clear()


def _macros(source: str) -> tuple[set, set]:
    """(macros the folded source takes from the command line, macros it defines itself): upper-case
    names used in the code (comments and strings left out) that nothing in the source declares,
    and the names of its ``#define``s (a ``#ifndef X / #define X`` default among them)."""
    import re

    text = re.sub(r"/\*.*?\*/", " ", source, flags=re.S)
    text = re.sub(r'"(\\.|[^"\\])*"', '""', re.sub(r"//[^\n]*", " ", text))
    used = set(re.findall(r"\b[A-Z][A-Z0-9_]*[A-Z0-9]\b", text))
    defined = set(re.findall(r"^\s*#\s*define\s+(\w+)", text, re.M))
    macro_params = {p.strip() for params in re.findall(r"^\s*#\s*define\s+\w+\(([^)]*)\)", text, re.M)
                    for p in params.split(",")}
    declared = set(re.findall(r"\b(?:constexpr|const|enum|struct|class|typename|int|unsigned|bool|float)\s+"
                              r"(?:\w+\s+)*?([A-Z][A-Z0-9_]+)\b", text))
    return used - defined - macro_params - declared, defined


def test_keys_are_unique_and_spell_exactly_the_macros_their_source_takes():
    """Two keys never compile the same source with the same macros, and each key spells every
    macro its source takes from the command line (none left to a stale default) and no macro its
    source never reads (so equal keys mean equal code)."""
    texts = [str(k) for k in KEYS]
    assert len(set(texts)) == len(texts)
    assert {k.source for k in KEYS} >= {"decode.cu", "kv_write.cu", "merge.cu", "varlen.cu", "varlen_wgmma.cu"}
    for key in KEYS:
        free, defined = _macros(_compiler.load_source(key.source))
        spelled = {name for name, _ in key.params}
        assert free <= spelled, f"{key} leaves {sorted(free - spelled)} to the command line unspelled"
        assert spelled <= free | defined, f"{key} spells {sorted(spelled - free - defined)}, which its source never reads"


def test_the_macro_check_sees_a_missing_and_a_stray_macro():
    free, defined = _macros("#ifndef ROTARY\n#define ROTARY 0\n#endif\n// HEAD_DIM in a comment\n"
                            "__global__ void f(TILE_T* x) { constexpr int kN = BLOCK_N; x[kN] = ROTARY; }")
    assert free == {"TILE_T", "BLOCK_N"} and "ROTARY" in defined and "HEAD_DIM" not in free


def test_ptxas_log_is_parsed():
    report = nvrtc.compile_offline(_compiler.KernelKey("kv_write.cu", (("HEAD_DIM", 128),)), "sm_90")
    (kernel,) = report.kernels
    assert kernel.kernel == "write_kv_cache" and kernel.registers > 0
    assert kernel.spill_loads == kernel.spill_stores == 0 and report.cubin_bytes > 0


def test_a_non_inlined_functions_properties_are_not_the_kernels():
    """ptxas prints a block of properties for each non-inlined device function after the
    kernel's own; the kernel's spills are its own block's (a kernel that spills is reported so,
    whatever its callees do)."""
    log = "\n".join([
        "ptxas info    : Compiling entry function 'k' for 'sm_90a'",
        "ptxas info    : Function properties for k",
        "ptxas         .     32 bytes stack frame, 36 bytes spill stores, 40 bytes spill loads",
        "ptxas info    : Used 168 registers, used 16 barriers, 32 bytes cumulative stack size",
        "ptxas info    : Function properties for _ZN6varlen14check_sequenceEPKi",
        "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
    ])
    (kernel,) = nvrtc.parse_ptxas_log(log)
    assert (kernel.kernel, kernel.registers, kernel.stack_bytes) == ("k", 168, 32)
    assert (kernel.spill_stores, kernel.spill_loads) == (36, 40)


def test_compile_error_is_reported():
    broken = _compiler.KernelKey("kv_write.cu", (("HEAD_DIM", "not_a_number"),))
    with pytest.raises(RuntimeError, match="failed to compile"):
        nvrtc.compile_offline(broken, "sm_90")


def _benchmark(name: str):
    """benchmarks/<name>.py as a module (it imports cupy, which the offline builds need anyway)."""
    import importlib.util
    import pathlib
    import sys

    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_benchmark_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _candidate_keys():
    """The kernel keys that reach the GPU only through the tests and the benchmarks: the tile shapes
    the GPU tests check beside the registered ones (``CANDIDATES`` of test_decode_gpu.py,
    ``MMA_CANDIDATES`` and ``WGMMA_CANDIDATES`` of test_varlen_gpu.py; the benchmarks' sweeps time
    only these, test_benchmark_sweeps_are_tested_shapes) and the decode benchmark's TRACE launch."""
    from cupy_paged._core.types import BF16
    from cupy_paged.kernels import decode, varlen, varlen_wgmma
    from test_decode_gpu import CANDIDATES as DECODE_CANDIDATES
    from test_varlen_gpu import MMA_CANDIDATES, WGMMA_CANDIDATES

    def keys(make, candidates):
        return [make(BF16, head_dim, tiles) for head_dim, shapes in sorted(candidates.items()) for tiles in shapes]

    return (keys(decode.kernel_key, DECODE_CANDIDATES) + [decode.kernel_key(BF16, 128, trace=True),
                                                        decode.kernel_key(BF16, 128, trace=True, ragged=True),
                                                        # trace_phases.py's short grids on the small shape
                                                        decode.kernel_key(BF16, 128, decode.SMALL_TILES[128],
                                                                          trace=True)]
            + keys(varlen.kernel_key, MMA_CANDIDATES) + keys(varlen_wgmma.kernel_key, WGMMA_CANDIDATES)
            + [varlen_wgmma.kernel_key(BF16, 128, tiles, trace=True)  # what trace_varlen.py launches
               for tiles in _benchmark("trace_varlen").SHAPES.values()])


@pytest.mark.parametrize("key,arch", [pytest.param(key, arch, id=f"{kind}-{key}-{arch}")
                                      for kind, keys in (("registered", KEYS), ("candidate", _candidate_keys()))
                                      for key in keys for arch in key.archs()])
def test_every_specialization_compiles(key, arch):
    """CI has no GPU: this is where every kernel is compiled, for sm_80 and sm_90 (and the
    wgmma kernels for the one target they run on, sm_90a): every registered key, and every
    candidate of the GPU tests and benchmarks, which reaches the GPU only there and must build,
    unspilled, before that."""
    report = nvrtc.compile_offline(key, arch)
    assert report.arch == arch and report.kernels, f"{key}: no kernel in the cubin"
    for kernel in report.kernels:
        assert kernel.spill_stores == kernel.spill_loads == 0, f"{kernel.kernel} spills on {arch}"
    params = dict(key.params)
    if key.source == "varlen_wgmma.cu" and params.get("PRODUCER") == 1:
        # varlen_ws.cuh's setmaxnreg split of the registers assumes the launch allocation of
        # kLaunchRegisters a thread (the most 384 threads can have): fewer, and its consumer
        # warps would wait forever for registers the producer never released.
        (kernel,) = report.kernels
        assert kernel.registers == 65536 // 384 // 8 * 8, f"{key}: {kernel.registers} registers at launch"


def test_benchmark_sweeps_are_tested_shapes():
    """Every shape a benchmark's --sweep times is one the GPU tests check (and the compile test
    builds): a shape adopted from a sweep is already verified."""
    pytest.importorskip("cupy")
    from test_decode_gpu import CANDIDATES as DECODE_CANDIDATES
    from test_varlen_gpu import WGMMA_CANDIDATES

    for sweep, tested in ((_benchmark("bench_decode").SWEEP, DECODE_CANDIDATES),
                          (_benchmark("bench_varlen").WGMMA_SWEEP, WGMMA_CANDIDATES)):
        for head_dim, shapes in sweep.items():
            assert set(shapes) <= set(tested.get(head_dim, ())), (head_dim, shapes)


def test_smem_bytes_are_checked_against_the_layout():
    """The host's dynamic shared memory (``SMEM_BYTES``, from the Tiles classes) is checked at
    compile time against each kernel's own layout: a key whose size is off does not build."""
    from cupy_paged._core.types import BF16
    from cupy_paged.kernels import decode, varlen, varlen_wgmma

    for key in (decode.kernel_key(BF16, 64), varlen.kernel_key(BF16, 64), varlen_wgmma.kernel_key(BF16, 64),
                varlen_wgmma.kernel_key(BF16, 128, varlen_wgmma.WgmmaTiles(128, 2, producer=True)),
                varlen_wgmma.kernel_key(BF16, 128, varlen_wgmma.WgmmaTiles(128, 2, producer=True, persistent=True))):
        wrong = tuple((name, value + 16 if name == "SMEM_BYTES" else value) for name, value in key.params)
        with pytest.raises(RuntimeError, match="smem_bytes differs"):
            nvrtc.compile_offline(_compiler.KernelKey(key.source, wrong, key.arch), key.archs()[0])


def test_a_producer_shape_is_three_warpgroups_of_which_two_compute():
    """``WgmmaTiles(..., producer=True)``: 128 query rows (two computing warpgroups), 384 threads
    (a third, loading warpgroup), ``PRODUCER=1`` in its key; a one-warpgroup shape cannot have one."""
    from cupy_paged._core.types import BF16
    from cupy_paged.kernels import varlen_wgmma

    tiles = varlen_wgmma.WgmmaTiles(128, 2, producer=True)
    assert (tiles.block_m, tiles.threads, tiles.label()) == (128, 384, "wg128x128s2p")
    assert ("PRODUCER", 1) in varlen_wgmma.kernel_key(BF16, 128, tiles).params
    assert ("PRODUCER", 0) in varlen_wgmma.kernel_key(BF16, 256).params
    with pytest.raises(ValueError, match="producer"):
        varlen_wgmma.WgmmaTiles(64, 2, groups=1, producer=True)


def test_a_persistent_shape_is_a_producer_shape_on_a_grid_of_sms():
    """``persistent=True``: a producer shape whose key says ``PERSISTENT=1``; its twin of one CTA per
    query tile is the same shape; it takes a call of at most PERSISTENT_MAX_SEQS sequences whose
    task numbers, past the last by up to two grids, fit 31 bits."""
    from cupy_paged._core.types import BF16
    from cupy_paged.kernels import varlen_wgmma

    tiles = varlen_wgmma.WgmmaTiles(128, 2, producer=True, persistent=True)
    assert (tiles.threads, tiles.label()) == (384, "wg128x128s2pP")
    assert ("PERSISTENT", 1) in varlen_wgmma.kernel_key(BF16, 128, tiles).params
    assert tiles.one_task_per_cta() == varlen_wgmma.WgmmaTiles(128, 2, producer=True)
    assert tiles.smem_bytes(128) > tiles.one_task_per_cta().smem_bytes(128)
    with pytest.raises(ValueError, match="producer"):
        varlen_wgmma.WgmmaTiles(128, 2, persistent=True)
    most = varlen_wgmma.PERSISTENT_MAX_SEQS
    assert varlen_wgmma.persistent_fits(tiles, most, 32, 128 * 1000)
    assert not varlen_wgmma.persistent_fits(tiles, most + 1, 32, 1)
    assert varlen_wgmma.persistent_fits(tiles, 1, 1, 128 * 2 ** 20)
    assert varlen_wgmma.persistent_fits(tiles, most, 64, 128 * (2 ** 16 - 3))  # 2^31 - 98304 tasks
    assert not varlen_wgmma.persistent_fits(tiles, most, 64, 128 * (2 ** 16 - 2))  # 2^31 - 65536


def test_pinned_architecture_keys():
    pinned = [key for key in KEYS if key.arch]
    assert pinned and all(key.arch == "sm_90a" and key.archs() == ("sm_90a",) for key in pinned)
    assert all(str(key).endswith("@sm_90a") for key in pinned)
    # wgmma only assembles for sm_90a: a plain sm_90 build must fail, or the key would not need pinning
    with pytest.raises(RuntimeError, match="failed to compile"):
        nvrtc.compile_offline(_compiler.KernelKey(pinned[0].source, pinned[0].params), "sm_90")
    # a pinned key is built for its architecture only: another is refused, not replaced
    with pytest.raises(ValueError, match="pinned"):
        nvrtc.compile_offline(pinned[0], "sm_90")


def test_generated_wgmma_header_is_current():
    """cuda_src/wgmma.cuh is what tools/gen_wgmma.py writes."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "tools" / "gen_wgmma.py"
    spec = importlib.util.spec_from_file_location("gen_wgmma", path)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.TARGET.read_text() == gen.render()


def test_a_tma_shape_takes_its_maps_first_and_falls_back_where_none_fits():
    """``tma=True``: a producer shape of 128-key tiles with one CTA per query tile whose key says
    ``TMA=1``; the maps describe K/V only where the strides nest (heads inside a row), are whole
    16-byte steps, and the rows fit int32 coordinates; without the driver's encoder (no GPU) a
    launch of the shape takes no maps."""
    import numpy as np

    from cupy_paged._core import tma
    from cupy_paged._core.types import BF16
    from cupy_paged.kernels import varlen_wgmma

    tiles = varlen_wgmma.WgmmaTiles(128, 2, producer=True, staged_store=True, tma=True)
    assert tiles.label() == "wg128x128s2pot" and ("TMA", 1) in varlen_wgmma.kernel_key(BF16, 128, tiles).params
    assert ("TMA", 1) not in varlen_wgmma.kernel_key(BF16, 128).params
    for wrong in (dict(), dict(persistent=True, producer=True), dict(producer=True, block_n=64)):
        args = dict(block_n=128, stages=2, tma=True) | wrong
        with pytest.raises(ValueError, match="TMA"):
            varlen_wgmma.WgmmaTiles(**args)
    fits = tma.kv_map_fits
    assert fits(BF16, 128, 8, 128, 10_000, 8 * 128) and fits(np.float16, 64, 2, 64, 1, 128)
    assert not fits(np.float32, 128, 8, 128, 10, 1024)        # not a 16-bit type
    assert not fits(BF16, 96, 8, 96, 10, 768)                  # not whole 64-element column blocks
    assert not fits(BF16, 128, 2, 10_000 * 128, 10_000, 128)   # heads outside the rows ([H, T, D])
    assert not fits(BF16, 128, 8, 128, 2 ** 31, 1024)          # rows past int32 coordinates
    assert not fits(BF16, 128, 8, 132, 10, 8 * 132)            # a head stride of 264 bytes
    # A map's box is a paged cache's 16 rows or a contiguous tile's 128, as the kernel issues its copies.
    for rows in (tma.PAGED_BOX_ROWS, tma.CONTIGUOUS_BOX_ROWS):
        tma.KvMaps(BF16, 128, 8, (1024, 128, 1024, 128), 10_000, rows)
    with pytest.raises(ValueError, match="box_rows"):
        tma.KvMaps(BF16, 128, 8, (1024, 128, 1024, 128), 10_000, 64)
    if not tma.available():
        from cupy_paged.kernels.varlen import _kv_maps

        assert _kv_maps(None, tiles) is None


def test_registered_wgmma_shapes_by_layout():
    """Since v16b the registered wgmma shape depends on the K/V layout: D = 128 takes the TMA loader
    with the softmax under P V for contiguous K/V and paged caches, D = 64 the TMA loader for paged
    caches only, D = 256, D = 64 contiguous and paged blocks of 8 keys the cp.async shapes; every
    registered shape is built
    with the registry's keys (so `warm` and CI compile it)."""
    from cupy_paged._core.types import BF16
    from cupy_paged.kernels import registry, varlen_wgmma
    from cupy_paged.kernels.varlen_wgmma import WGMMA_TILES, registered_tiles

    for paged in (False, True):
        assert registered_tiles(128, paged).label() == "wg128x128s2poxt"
        assert registered_tiles(256, paged) == WGMMA_TILES[256]
    assert registered_tiles(64, True).label() == "wg128x128s2pt"
    assert registered_tiles(64, False) == WGMMA_TILES[64]
    for head_dim in (64, 128):  # paged blocks of 8 keys: smaller than a TMA box, the cp.async shape
        assert registered_tiles(head_dim, True, 8) == WGMMA_TILES[head_dim]
    keys = set(registry.all_keys())
    for head_dim in (64, 128, 256):
        for paged in (False, True):
            assert varlen_wgmma.kernel_key(BF16, head_dim, registered_tiles(head_dim, paged)) in keys


def test_tensor_maps_encoded_by_two_threads_at_once_are_each_their_own(monkeypatch):
    """The driver's encoder releases the GIL: two threads encoding maps of one launch shape at once
    must each get (and memoise) the map of their own address.  A stand-in encoder writes the address
    into the map and sleeps between its two writes, so a shared output buffer would hand one thread the
    other's map."""
    import ctypes
    import threading
    import time

    import numpy as np

    from cupy_paged._core import tma
    from cupy_paged._core.types import BF16

    def encode(out, data_type, rank, ptr, *rest):
        out[0] = ptr
        time.sleep(0.01)
        out[1] = ptr
        return 0

    monkeypatch.setattr(tma, "_encoder", lambda: encode)
    maps = tma.KvMaps(BF16, 128, 8, (1024, 128, 1024, 128), 10_000, tma.CONTIGUOUS_BOX_ROWS)
    results = {}

    def run(base):
        results[base] = maps.maps(base, base + 16)

    threads = [threading.Thread(target=run, args=(base,)) for base in (1 << 20, 2 << 20, 3 << 20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for base, both in results.items():
        words = np.frombuffer(both, np.uint64)
        assert list(words[[0, 1, 16, 17]]) == [base, base, base + 16, base + 16]
        assert maps.maps(base, base + 16) == both
    assert ctypes.sizeof(ctypes.c_uint64 * 16) == tma.MAP_BYTES
