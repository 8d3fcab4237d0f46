"""Launch glue of ``cuda_src/decode.cu`` (``flash_attn_with_kvcache`` on CUDA arrays).

One launch of ``paged_decode`` appends the new tokens (if any) and computes attention; with
``num_splits > 1`` a second launch, ``combine_splits``, merges the per-split partial outputs.

Split-KV and CUDA graphs
------------------------
The partial outputs of a split launch live in a float32 workspace that this module keeps per
(device, stream) and only ever grows.  Growing allocates, which a CUDA graph capture must not
do, so before capturing either make one eager call with the same shapes on the capturing stream
(the usual warm-up) or call :func:`reserve_workspace`.  A call that would need to grow the
workspace while its stream is capturing raises ``RuntimeError`` instead of allocating.  Retired
workspaces are kept alive, so a graph captured earlier never points at freed memory.

With ``num_splits=0`` the split count is chosen on the host from shapes alone (batch, heads,
the cache's capacity per sequence: ``max_blocks * block_size``, or S of a contiguous
``[B, S, Hkv, D]`` cache), never from ``cache_seqlens`` values, so
choosing it needs no device-to-host copy and a captured graph replays the same choice.  What the
shapes decide (kernels, grid, split count) is kept per shape, so a decode loop computes it once;
the scalar arguments travel as one packed struct (``DecodeParams`` in decode.cu).  A contiguous
cache is read as blocks of one token through one identity table per device (grown like the
workspace, so it too must be sized before a capture: one eager call), and an int
``cache_seqlens`` travels as one value in that struct, so a call builds no index arrays.

Tile shapes
-----------
One specialization per (dtype, head dim); its pipeline shape (keys per stage, stages, warps)
comes from :data:`TILES`.  ``run(p, tiles)`` launches another shape: :data:`CANDIDATES` are the ones the
benchmark's ``--sweep`` times and ``tests/test_decode_gpu.py`` checks (NOTES_decode.md, v5).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import struct

import numpy as np

from .._checks import HEAD_DIMS, KERNEL_DTYPES, DecodeProblem
from .._compiler import KernelKey, get_function, register_family
from ._common import cuda_scalar, device_property, element_strides, smem_row_bytes, vectorised

SOURCE = "decode.cu"
WARPS = 4               # warps per CTA of the registered shapes
COMBINE_THREADS = 128   # kCombineThreads in decode.cu
ROWS_PER_CTA = 16       # kRows in decode.cu: query rows (GQA heads x query tokens) per CTA, mma M
STAGES = 3              # cp.async pipeline depth
TILE_ELEMS = 8192       # keys * head_dim per stage and tensor: about 16 KiB of K and 16 KiB of V
MAX_SPLITS = COMBINE_THREADS  # combine_splits: one thread per split's LSE


def tile_keys(head_dim: int) -> int:
    """Keys per pipeline stage: the largest power of two with keys * head_dim <= TILE_ELEMS,
    at least 64 (16 keys per warp, the K of one P V mma) and at most 128."""
    keys = 64
    while keys * 2 * head_dim <= TILE_ELEMS and keys < 128:
        keys *= 2
    return keys


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Pipeline shape of ``paged_decode``: keys per stage (a multiple of 16 per warp), cp.async
    stages (at least 3: decode.cu's loaded-tile vote; ``stages - 1`` tiles in flight) and warps
    per CTA (1, 2, 4 or 8)."""

    keys: int
    stages: int = STAGES
    warps: int = WARPS

    def __post_init__(self):
        if self.warps not in (1, 2, 4, 8) or self.keys % (16 * self.warps) or self.stages < 3:
            raise ValueError(f"no paged_decode shape with {self.keys} keys, {self.stages} stages, {self.warps} warps")

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def label(self) -> str:
        return f"k{self.keys}s{self.stages}" + ("" if self.warps == WARPS else f"w{self.warps}")

    def smem_bytes(self, head_dim: int) -> int:
        """Dynamic shared memory: K and V stages, one flag per key, the Q tile, the id slots and
        16 bytes for the sequence's length (decode.cu's Smem)."""
        id_slots = 2 * (self.stages - 1)
        return ((2 * self.stages * self.keys + ROWS_PER_CTA) * smem_row_bytes(head_dim)
                + (self.stages + id_slots) * self.keys * 4 + 16)


# The registered shape of each head dim (the keys ``all_keys`` lists).
TILES = {head_dim: Tiles(tile_keys(head_dim)) for head_dim in HEAD_DIMS}
# Head dim -> shapes that ``bench_decode.py --sweep`` times against TILES and the GPU tests check
# (NOTES_decode.md, v5: bytes in flight per SM against warps per SM at D = 128).
# v5's shapes -- Tiles(64, 4), Tiles(64, 6), Tiles(128, 3): more bytes in flight, one CTA per SM --
# ran 32-45% slower than the registered shape on the H200.  v7-v12 compared kernel variants the
# same way.  v13: the rate follows warps per SM; two stages, other warp counts and other load
# layouts were slower.  Kept: 4 CTAs of 2 warps, +3% at 256 x 2048 but -1 to -2% on split
# launches (its own heuristic splits for 528 slots).
CANDIDATES: dict[int, tuple[Tiles, ...]] = {
    128: (Tiles(32, 3, warps=2),),
}


def kernel_key(dtype, head_dim: int, tiles: Tiles | None = None) -> KernelKey:
    """The specialization for ``dtype`` (float16 or bfloat16), ``head_dim`` and ``tiles``."""
    tiles = tiles or TILES[head_dim]
    return KernelKey(SOURCE, (("SCALAR_T", cuda_scalar(dtype)), ("HEAD_DIM", head_dim),
                              ("TILE_KEYS", tiles.keys), ("STAGES", tiles.stages), ("WARPS", tiles.warps)))


def all_keys():
    return [kernel_key(dtype, d) for dtype in KERNEL_DTYPES for d in HEAD_DIMS]


register_family("decode", all_keys)


# --------------------------------------------------------------------------- split heuristic

def _num_sms(device_id: int) -> int:
    return int(device_property(device_id, "multiProcessorCount"))


def ctas_per_sm(num_regs: int, smem: int, threads: int = 32 * WARPS) -> int:
    """Resident CTAs of ``threads`` per SM for ``num_regs`` registers and ``smem`` bytes of dynamic
    shared memory (Hopper limits: 64 Ki registers, 228 KiB of shared memory, 1 KiB per CTA)."""
    regs_per_warp = -(-int(num_regs) * 32 // 256) * 256
    by_regs = 65536 // max(regs_per_warp * (threads // 32), 1)
    by_smem = (228 * 1024) // (smem + 1024)
    return max(1, min(by_regs, by_smem, 2048 // threads, 32))


def choose_splits(num_ctas: int, max_keys: int, keys_per_tile: int, num_sms: int, ctas_per_sm: int) -> int:
    """Split count for ``num_splits=0``: fill the GPU's CTA slots in whole waves.

    ``num_ctas`` is batch * kv heads * row groups; ``max_keys`` the longest a sequence can be;
    ``keys_per_tile`` the launched shape's keys per pipeline stage.
    Enough CTAs already (>= 80% of one wave) means no split.  Otherwise take the smallest split
    count whose wave efficiency (CTAs / slots of the waves they need) is within 5% of the best,
    with at least two tiles of keys per split so each split amortises its fixed costs.
    """
    slots = num_sms * ctas_per_sm
    tiles = -(-max_keys // keys_per_tile)
    if num_ctas >= 0.8 * slots or tiles < 4:
        return 1
    limit = max(1, min(MAX_SPLITS, tiles // 2))

    def efficiency(n: int) -> float:
        total = num_ctas * n
        return total / (math.ceil(total / slots) * slots)

    best = max(efficiency(n) for n in range(1, limit + 1))
    return next(n for n in range(1, limit + 1) if efficiency(n) >= 0.95 * best)


# --------------------------------------------------------------------------- workspace

_WORKSPACES: dict[tuple[int, int], object] = {}
_IDENTITIES: dict[int, object] = {}
_RETIRED: list[object] = []  # outgrown buffers: a captured graph may still use them


def _grown(store: dict, key, size: int, make, what: str):
    """``store[key]``, replaced by ``make(n)`` (n >= size, at least doubling) when it holds fewer
    than ``size`` elements.  Growing allocates, so under graph capture it raises instead; an
    outgrown buffer is kept alive for the graphs captured with it."""
    import cupy

    current = store.get(key)
    if current is None or current.size < size:
        if cupy.cuda.get_current_stream().is_capturing():
            raise RuntimeError(
                f"{what} must hold {size} elements but holds {0 if current is None else current.size}: "
                "make one eager call with the same shapes on this stream before capture (for the "
                "split-KV workspace, cupy_paged.ops.decode.reserve_workspace(...) also does)")
        if current is not None:
            _RETIRED.append(current)
        current = make(max(size, 2 * (0 if current is None else current.size)))
        store[key] = current
    return current


def _workspace(num_floats: int):
    """The current stream's float32 split-KV workspace, of at least ``num_floats``."""
    import cupy

    key = (cupy.cuda.Device().id, cupy.cuda.get_current_stream().ptr)
    return _grown(_WORKSPACES, key, num_floats, lambda n: cupy.empty(n, np.float32), "the split-KV workspace")


def _identity_table(size: int):
    """int32 ``0, 1, ..., size - 1`` (at least) on the current device: the block table of a
    contiguous cache ``[B, S, Hkv, D]`` read as B * S blocks of one token (row b starts at b * S).
    One per device, grown, never built per call."""
    import cupy

    def make(n):
        table = cupy.arange(n, dtype=np.int32)
        cupy.cuda.get_current_stream().synchronize()  # filled before another stream reads it
        return table

    return _grown(_IDENTITIES, cupy.cuda.Device().id, size, make, "the identity block table")


def _workspace_floats(splits: int, rows_total: int, head_dim: int) -> int:
    return splits * rows_total * (head_dim + 1)


def reserve_workspace(batch: int, seqlen_q: int, num_heads: int, head_dim: int,
                      num_splits: int = MAX_SPLITS) -> None:
    """Grow the current stream's split-KV workspace for calls up to these shapes.

    Call it outside CUDA graph capture, on the stream that will capture, so that
    ``flash_attn_with_kvcache`` allocates nothing while the graph is being captured.

    Parameters
    ----------
    batch, seqlen_q, num_heads, head_dim : int
        The largest ``q`` shape ``[batch, seqlen_q, num_heads, head_dim]`` to be captured.
    num_splits : int
        The largest split count (default: the most the kernel uses, 128).

    >>> reserve_workspace(64, 1, 32, 128)            # doctest: +SKIP
    """
    splits = min(max(int(num_splits), 1), MAX_SPLITS)
    _workspace(_workspace_floats(splits, batch * seqlen_q * num_heads, head_dim))


# --------------------------------------------------------------------------- launch

# The scalar arguments of paged_decode as one struct (DecodeParams in decode.cu): 9 int64 strides,
# 14 int32, 2 float32, no padding (136 bytes).  CuPy passes a NumPy array of one element by value.
_PARAMS = struct.Struct("<9q14i2f")
_PARAMS_DTYPE = np.dtype((np.void, _PARAMS.size))
_NO_STRIDES = (0, 0, 0)


@dataclasses.dataclass(frozen=True)
class _Launch:
    """What a call's shapes decide: kernels, shared memory, grid and split count."""

    decode: object
    combine: object
    smem: int
    splits: int
    rows: int          # rows of a GQA group: (H / Hkv) * seqlen_q
    row_groups: int    # CTAs per (split, kv head, sequence)
    threads: int       # of a paged_decode CTA


def _cache_geometry(p: DecodeProblem) -> tuple[int, int, int]:
    """``(max_blocks, num_blocks, block_shift)`` as paged_decode reads the cache: a paged one
    through its table; a contiguous ``[B, S, Hkv, D]`` one as B * S blocks of one token (any S)."""
    if p.block_table is None:
        seqlen_cache = int(p.k_cache.shape[1])
        return seqlen_cache, p.batch * seqlen_cache, 0
    return int(p.block_table.shape[1]), int(p.k_cache.shape[0]), p.block_size.bit_length() - 1


def _launch_plan(p: DecodeProblem, tiles: Tiles | None = None) -> _Launch:
    import cupy

    max_blocks, _, shift = _cache_geometry(p)
    return _launch(cupy.cuda.runtime.getDevice(), p.q.dtype, p.q.shape, p.num_kv_heads, max_blocks << shift,
                   p.num_splits, tiles or TILES[p.head_dim])


@functools.lru_cache(maxsize=4096)
def _launch(device: int, dtype, q_shape: tuple, num_kv_heads: int, max_keys: int, num_splits: int,
            tiles: Tiles) -> _Launch:
    """What these shapes decide, kept per shape: a decode loop pays the kernel look-up and the
    split heuristic once."""
    batch, seqlen_q, num_heads, head_dim = q_shape
    rows = (num_heads // num_kv_heads) * seqlen_q
    row_groups = -(-rows // ROWS_PER_CTA)
    kernels = kernel_key(dtype, head_dim, tiles)
    smem = tiles.smem_bytes(head_dim)
    decode = get_function(kernels, "paged_decode", smem)
    if num_splits:
        splits = min(num_splits, MAX_SPLITS)
    else:
        splits = choose_splits(batch * num_kv_heads * row_groups, max_keys, tiles.keys,
                               _num_sms(device), ctas_per_sm(decode.num_regs, smem, tiles.threads))
    return _Launch(decode, get_function(kernels, "combine_splits") if splits > 1 else None, smem,
                   splits, rows, row_groups, tiles.threads)


def plan(p: DecodeProblem, tiles: Tiles | None = None) -> int:
    """The split count ``run`` will use for ``p`` (``p.num_splits``, or the heuristic for 0)."""
    return _launch_plan(p, tiles).splits


def trace_size(p: DecodeProblem, tiles: Tiles | None = None) -> int:
    """Elements of the ``trace`` buffer ``run`` fills for ``p``: 3 per CTA of the decode launch."""
    launch = _launch_plan(p, tiles)
    return 3 * launch.row_groups * launch.splits * p.num_kv_heads * p.batch


def run(p: DecodeProblem, tiles: Tiles | None = None, trace=None) -> None:
    """Append ``p.k_new``/``p.v_new`` to the caches and fill ``p.out`` (and ``p.lse``) on the GPU.

    Launches on CuPy's current stream with no host synchronisation; allocates only when an
    input needs realignment or the split workspace must grow (see the module docstring).
    ``tiles`` (a candidate shape, default ``TILES[head_dim]``) is for the benchmark's sweep;
    ``trace`` (a uint64 CuPy array of 3 per CTA, ``trace_size``) receives each CTA's start and
    end on the GPU's nanosecond clock and its SM, for the benchmark's ``--trace``.
    """
    batch, seqlen_q, num_heads, head_dim = p.q.shape
    if batch == 0:
        return
    num_kv_heads = p.k_cache.shape[2]
    max_blocks, num_blocks, shift = _cache_geometry(p)
    table = p.block_table if p.block_table is not None else _identity_table(num_blocks)
    launch = _launch_plan(p, tiles)
    splits = launch.splits

    q = vectorised(p.q)
    null = np.uint64(0)
    if p.k_new is not None:
        k_new, v_new = vectorised(p.k_new), vectorised(p.v_new)
        k_strides, v_strides = element_strides(k_new, 3), element_strides(v_new, 3)
        seqlen_new = k_new.shape[1]
    else:
        k_new = v_new = null
        k_strides = v_strides = _NO_STRIDES
        seqlen_new = 0
    rows_total = batch * seqlen_q * num_heads
    if splits > 1:
        workspace = _workspace(_workspace_floats(splits, rows_total, head_dim))
        part_out = workspace
        part_lse = workspace[splits * rows_total * head_dim:]
    else:
        part_out = part_lse = null
    lse = null if p.lse is None else p.lse
    # cache_seqlens: an int32 array, or one int for every sequence (passed by value, no array)
    lengths, cached_all = (null, p.cache_seqlens) if isinstance(p.cache_seqlens, int) else (p.cache_seqlens, 0)
    window_left, window_right = p.window
    params = np.frombuffer(_PARAMS.pack(
        *element_strides(q, 3), *k_strides, *v_strides,
        max_blocks, num_blocks, shift, cached_all,
        seqlen_q, seqlen_new, num_heads, num_kv_heads, launch.rows, launch.row_groups,
        window_left, window_right, splits, 0,
        p.softmax_scale, p.softcap), dtype=_PARAMS_DTYPE)
    launch.decode((launch.row_groups * splits, num_kv_heads, batch), (launch.threads,),
                  (params, q, p.k_cache, p.v_cache, p.k_cache, p.v_cache, k_new, v_new,
                   lengths, table,
                   null if p.alibi_slopes is None else p.alibi_slopes,
                   p.out, lse, part_out, part_lse, null if trace is None else trace),
                  shared_mem=launch.smem)
    if splits > 1:
        launch.combine((rows_total,), (COMBINE_THREADS,),
                       (part_out, part_lse, np.int32(splits), np.int64(rows_total), np.int32(seqlen_q),
                        np.int32(num_heads), p.out, lse))
