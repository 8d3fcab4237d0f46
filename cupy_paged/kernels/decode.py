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

Tile shapes and tracing
-----------------------
Two specializations per (dtype, head dim); their pipeline shapes (keys per stage, stages, warps)
are :data:`TILES` and :data:`SMALL_TILES` (half the keys on half the warps), the second taken
when it runs a grid in fewer waves than the first (:func:`choose_tiles`, from shapes alone, kept
per shape like the split count).  ``DecodeLaunch(p, tiles)`` and ``run(p, tiles)`` launch another shape
(the benchmark's sweep and the GPU tests name theirs).  ``trace=`` launches the ``TRACE``
specialization, which records each CTA's start, end and SM for the benchmark's ``--trace``: the
registered keys (:func:`all_keys`) hold no trace code and take no trace argument.
"""
from __future__ import annotations

import dataclasses
import functools
import math

from .._core.arrays import CUPY
from .._core.problems import DecodeProblem
from .._core.types import HEAD_DIMS, KERNEL_DTYPES, alibi_batch_stride, element_strides
from .._core.compiler import KernelKey, get_function
from .._core.errors import word
from .._core.streams import handle
from ._launch import Launcher, cuda_scalar, device_property, outputs, q_is_the_callers_dense_tensor, smem_row_bytes
from ._workspace import identity_table, split_workspace

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
        16 bytes for the sequence's entries.  The one size: :func:`kernel_key` passes it to the
        compiler as ``SMEM_BYTES``, and decode.cu static_asserts that it equals ``Smem::kBytes``,
        so a layout that drifts from this sum fails to build."""
        id_slots = 2 * (self.stages - 1)
        return ((2 * self.stages * self.keys + ROWS_PER_CTA) * smem_row_bytes(head_dim)
                + (self.stages + id_slots) * self.keys * 4 + 16)


# The registered shape of each head dim (the keys ``all_keys`` lists).
TILES = {head_dim: Tiles(tile_keys(head_dim)) for head_dim in HEAD_DIMS}
# Half its keys on half its warps: twice as many CTAs fit an SM, so a grid of more than one wave
# of the registered CTAs runs in about half the waves (:func:`choose_tiles`).
SMALL_TILES = {head_dim: Tiles(tiles.keys // 2, tiles.stages, tiles.warps // 2) for head_dim, tiles in TILES.items()}


def kernel_key(dtype, head_dim: int, tiles: Tiles | None = None, rotary: bool = False,
               trace: bool = False, ragged: bool = False) -> KernelKey:
    """The specialization for ``dtype`` (float16 or bfloat16), ``head_dim`` and ``tiles``;
    ``rotary``: the variant that rotates q and the new keys (its own code, so that the plain
    kernel's loop carries none of it); ``trace``: the benchmark's variant with a trace buffer;
    ``ragged``: the work-list kernel of a whole step (``kernels/ragged.py``)."""
    tiles = tiles or TILES[head_dim]
    params = (("SCALAR_T", cuda_scalar(dtype)), ("HEAD_DIM", head_dim), ("TILE_KEYS", tiles.keys),
              ("STAGES", tiles.stages), ("WARPS", tiles.warps), ("SMEM_BYTES", tiles.smem_bytes(head_dim)))
    flags = (("ROTARY", rotary), ("TRACE", trace), ("RAGGED", ragged))
    return KernelKey(SOURCE, params + tuple((name, 1) for name, on in flags if on))


def all_keys():
    return [kernel_key(dtype, d, rotary=r, ragged=g) for r, g in ((False, False), (True, False), (False, True))
            for dtype in KERNEL_DTYPES for d in HEAD_DIMS] + [
        kernel_key(dtype, d, SMALL_TILES[d]) for dtype in KERNEL_DTYPES for d in HEAD_DIMS]


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


def fewer_waves(num_ctas: int, slots: int, small_slots: int) -> bool:
    """Whether a grid of ``num_ctas`` takes the small shape: it runs in fewer waves of the small
    CTAs (``small_slots`` at once) than of the registered ones (``slots``)."""
    return -(-num_ctas // small_slots) < -(-num_ctas // slots)


def _slots(device: int, dtype, head_dim: int, tiles: Tiles) -> int:
    smem = tiles.smem_bytes(head_dim)
    function = get_function(kernel_key(dtype, head_dim, tiles), "paged_decode", smem)
    return _num_sms(device) * ctas_per_sm(function.num_regs, smem, tiles.threads)


def choose_tiles(device: int, dtype, head_dim: int, num_ctas: int, num_splits: int) -> Tiles:
    """The pipeline shape of a plain launch (no rotary, no trace) of ``num_ctas`` CTAs a split:
    :data:`SMALL_TILES` when that takes fewer waves (:func:`fewer_waves`) and no split was asked
    for, else :data:`TILES`.  Each wave costs a fixed part (its CTAs' start and drain) beside the
    bytes it streams, which both shapes stream at the same rate, so fewer waves is less time; a
    grid of one wave of registered CTAs keeps them (the small shape's two warps a CTA would leave
    half its slots empty)."""
    tiles = TILES[head_dim]
    if num_splits > 1:
        return tiles
    small = SMALL_TILES[head_dim]
    if fewer_waves(num_ctas, _slots(device, dtype, head_dim, tiles), _slots(device, dtype, head_dim, small)):
        return small
    return tiles


# --------------------------------------------------------------------------- workspace

def _workspace_floats(splits: int, rows_total: int, head_dim: int) -> int:
    return splits * rows_total * (head_dim + 1)


def reserve_workspace(batch: int, seqlen_q: int, num_heads: int, head_dim: int,
                      num_splits: int = MAX_SPLITS, stream=None) -> None:
    """Grow the split-KV workspace of ``stream`` (default CuPy's current stream) for calls up to
    these shapes.

    Call it outside CUDA graph capture, for the stream that will capture, so that
    ``flash_attn_with_kvcache`` allocates nothing while the graph is being captured.

    Parameters
    ----------
    batch, seqlen_q, num_heads, head_dim : int
        The largest ``q`` shape ``[batch, seqlen_q, num_heads, head_dim]`` to be captured.
    num_splits : int
        The largest split count (default: the most the kernel uses, 128).
    stream : optional
        As ``flash_attn_with_kvcache``'s ``stream=``.

    >>> reserve_workspace(64, 1, 32, 128)            # doctest: +SKIP
    """
    import cupy

    splits = min(max(int(num_splits), 1), MAX_SPLITS)
    device = cupy.cuda.runtime.getDevice()
    split_workspace(_workspace_floats(splits, batch * seqlen_q * num_heads, head_dim), device,
                    handle(stream, CUPY, device))


# --------------------------------------------------------------------------- launch

# paged_decode's parameters: DecodeParams by value (9 int64 strides, 20 int32, 2 float32: 160
# bytes), then 19 pointers, in decode.cu's order; the TRACE specialization takes the trace
# buffer last.
_PARAMS_LAYOUT = "9q20i2f"
_DECODE_LAYOUT = _PARAMS_LAYOUT + "19P"
_TRACE_LAYOUT = _DECODE_LAYOUT + "P"
# combine_splits(part_out, part_lse, num_splits, rows_total, seqlen_q, num_heads, out, lse)
_COMBINE_LAYOUT = "PPiqiiPP"
_NO_STRIDES = (0, 0, 0)


@dataclasses.dataclass(frozen=True)
class _Shape:
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
    through its table; a contiguous ``[Bc, S, Hkv, D]`` one as Bc * S blocks of one token (any S)."""
    if p.block_table is None:
        seqlen_cache = int(p.k_cache.shape[1])
        return seqlen_cache, int(p.k_cache.shape[0]) * seqlen_cache, 0
    return int(p.block_table.shape[1]), int(p.k_cache.shape[0]), p.block_size.bit_length() - 1


@functools.lru_cache(maxsize=4096)
def _shape(device: int, dtype, q_shape: tuple, num_kv_heads: int, max_keys: int, num_splits: int,
           tiles: Tiles | None, rotary: bool, trace: bool) -> _Shape:
    """What these shapes decide, kept per shape: a decode loop pays the kernel look-up and the
    split heuristic once."""
    batch, seqlen_q, num_heads, head_dim = q_shape
    rows = (num_heads // num_kv_heads) * seqlen_q
    row_groups = -(-rows // ROWS_PER_CTA)
    if tiles is None:
        tiles = (TILES[head_dim] if rotary or trace else
                 choose_tiles(device, dtype, head_dim, batch * num_kv_heads * row_groups, num_splits))
    kernels = kernel_key(dtype, head_dim, tiles, rotary, trace)
    smem = tiles.smem_bytes(head_dim)
    decode = get_function(kernels, "paged_decode", smem)
    if num_splits:
        splits = min(num_splits, MAX_SPLITS)
    else:
        splits = choose_splits(batch * num_kv_heads * row_groups, max_keys, tiles.keys,
                               _num_sms(device), ctas_per_sm(decode.num_regs, smem, tiles.threads))
    return _Shape(decode, get_function(kernels, "combine_splits") if splits > 1 else None, smem,
                  splits, rows, row_groups, tiles.threads)


def _problem_shape(p: DecodeProblem, tiles: Tiles | None, trace: bool = False) -> _Shape:
    """:func:`_shape` of a problem (``tiles`` None: :func:`choose_tiles`'s, or ``TILES[head_dim]``
    for the rotary and trace variants)."""
    max_blocks, _, shift = _cache_geometry(p)
    return _shape(p.q.device, p.q.dtype, tuple(p.q.shape), p.num_kv_heads, max_blocks << shift,
                  p.num_splits, tiles, p.rotary_cos is not None, trace)


def _strides3(array) -> tuple:
    return tuple(int(s) for s in element_strides(array)[:3])


class DecodeLaunch:
    """One ``flash_attn_with_kvcache`` call shape, resolved: kernels, grid, split count and every
    scalar argument packed once; :meth:`run` adds the pointers and launches.

    Built from a checked problem whose arrays are device :class:`~cupy_paged._core.arrays.Array`
    descriptors; valid for every call with the same shapes, strides, dtypes, device and
    scalar arguments (the call memo of ``api/_call.py`` keys it so).  ``tiles``: another pipeline
    shape than ``TILES[head_dim]``; ``trace``: a uint64 CuPy array of 3 per CTA (:func:`trace_size`)
    that each launch fills with every CTA's start and end on the GPU's nanosecond clock and its SM
    (the TRACE specialization; for the benchmark).
    """

    def __init__(self, p: DecodeProblem, tiles: Tiles | None = None, trace=None):
        self.device = p.q.device
        max_blocks, num_blocks, shift = _cache_geometry(p)
        shape = _problem_shape(p, tiles, trace is not None)
        self.shape = shape
        self.splits = shape.splits
        batch, seqlen_q, num_heads, head_dim = (int(x) for x in p.q.shape)
        self.batch = batch
        self.out_shape = (batch, seqlen_q, num_heads, head_dim)
        self.lse_shape = (batch, num_heads, seqlen_q)
        self.dtype = p.q.dtype
        self.want_lse = p.want_lse or p.lse is not None
        self.contiguous_cache = p.block_table is None
        self.identity_size = num_blocks
        self.capacity = max_blocks << shift
        self.seqlen_new = p.seqlen_new
        self.cached_default = p.cache_seqlens if isinstance(p.cache_seqlens, int) else 0
        self.rows_total = batch * seqlen_q * num_heads
        self.workspace_floats = _workspace_floats(shape.splits, self.rows_total, head_dim)
        self.lse_offset = 4 * shape.splits * self.rows_total * head_dim  # bytes: part_lse after part_out
        self.grid = (shape.row_groups * shape.splits, p.num_kv_heads, batch)
        self.combine_grid = (self.rows_total, 1, 1)
        self.trace = () if trace is None else (int(trace.data.ptr),)
        k_strides = _strides3(p.k_new) if p.k_new is not None else _NO_STRIDES
        v_strides = _strides3(p.v_new) if p.v_new is not None else _NO_STRIDES
        left, right = p.window
        rotary_flags = int(p.rotary_interleaved) | (int(p.rotary_per_token) << 1)
        seqlen_ro = 0 if p.rotary_cos is None else int(p.rotary_cos.shape[0])
        # DecodeParams, cached_all (index 12) filled per call.
        self.params = [*_strides3(p.q), *k_strides, *v_strides,
                       max_blocks, num_blocks, shift, 0,
                       seqlen_q, p.seqlen_new, num_heads, p.num_kv_heads, shape.rows, shape.row_groups,
                       left, right, shape.splits, int(p.k_cache.shape[0]) if self.contiguous_cache else 0,
                       p.rotary_dim, rotary_flags, seqlen_ro, alibi_batch_stride(p.alibi_slopes), 0, 0,
                       p.softmax_scale, p.softcap]
        self.errors = word(self.device)
        pointers = 19 + len(self.trace)
        self.launch = Launcher(shape.decode, _TRACE_LAYOUT if self.trace else _DECODE_LAYOUT)
        # The scalars are packed once; a call rewrites cached_all (field 12) and the pointers.
        self.launch.pack(*self.params, *([0] * pointers))
        self._cached_span = self.launch.span(12, 1)
        self._pointer_span = self.launch.span(len(self.params), pointers)
        self.combine = Launcher(shape.combine, _COMBINE_LAYOUT) if shape.combine is not None else None
        self.q_contiguous = q_is_the_callers_dense_tensor(p.q)

    def run(self, kind: str, like, ptrs: tuple, cached_all: int, out, lse_out, stream: int,
            alloc_stream: int | None = None):
        """Launch on ``stream``.  ``ptrs``: q, k_cache, v_cache, k_new, v_new, cache_seqlens,
        block_table, cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin, alibi_slopes (0 for
        none); ``out``/``lse_out``: ``(object, pointer)`` or None (made here, in ``kind`` like
        ``like``, on ``alloc_stream`` when the caller named a stream).  Returns (out, lse or None)."""
        out_obj, out_ptr, lse_obj, lse_ptr = outputs(kind, like, out, lse_out, self.out_shape, self.lse_shape,
                                                     self.dtype, self.want_lse, self.q_contiguous, alloc_stream)
        if self.batch == 0:
            return out_obj, lse_obj
        q, k_cache, v_cache, k_new, v_new, seqlens, table, batch_idx, leftpad, cos, sin, alibi = ptrs
        if self.contiguous_cache:
            table = identity_table(self.identity_size, self.device, stream).data.ptr
        part_out = part_lse = 0
        if self.splits > 1:
            workspace = split_workspace(self.workspace_floats, self.device, stream)
            part_out = workspace.data.ptr
            part_lse = part_out + self.lse_offset
        shape = self.shape
        cached_struct, cached_at = self._cached_span
        pointer_struct, pointer_at = self._pointer_span
        self.launch.launch(self.grid, shape.threads, shape.smem, stream, (cached_struct, cached_at, (cached_all,)),
                           (pointer_struct, pointer_at,
                            (q, k_cache, v_cache, k_cache, v_cache, k_new, v_new, seqlens, table, batch_idx, leftpad,
                             cos, sin, alibi, out_ptr, lse_ptr, part_out, part_lse, self.errors, *self.trace)))
        if self.combine is not None:
            self.combine(self.combine_grid, COMBINE_THREADS, 0, stream, part_out, part_lse, self.splits,
                         self.rows_total, self.out_shape[1], self.out_shape[2], out_ptr, lse_ptr)
        return out_obj, lse_obj


def plan(p: DecodeProblem, tiles: Tiles | None = None) -> int:
    """The split count ``run`` will use for ``p`` (``p.num_splits``, or the heuristic for 0)."""
    return _problem_shape(p, tiles).splits


def trace_size(p: DecodeProblem, tiles: Tiles | None = None) -> int:
    """Elements of the ``trace`` buffer that ``run(p, tiles, trace=...)`` fills: 3 per CTA of the
    decode launch."""
    shape = _problem_shape(p, tiles, trace=True)
    return 3 * shape.row_groups * shape.splits * p.num_kv_heads * p.batch


def ptr(array) -> int:
    """The address of a problem's array (0 for None)."""
    return 0 if array is None else array.ptr


def problem_args(p: DecodeProblem) -> tuple:
    """(ptrs, cached_all, out, lse_out) of :meth:`DecodeLaunch.run` for a checked problem."""
    seqlens = p.cache_seqlens
    ptrs = (p.q.ptr, p.k_cache.ptr, p.v_cache.ptr, ptr(p.k_new), ptr(p.v_new),
            0 if isinstance(seqlens, int) else seqlens.ptr, ptr(p.block_table), ptr(p.cache_batch_idx),
            ptr(p.cache_leftpad), ptr(p.rotary_cos), ptr(p.rotary_sin), ptr(p.alibi_slopes))
    out = None if p.out is None else (p.out.obj, p.out.ptr)
    lse = None if p.lse is None else (p.lse.obj, p.lse.ptr)
    return ptrs, seqlens if isinstance(seqlens, int) else 0, out, lse


def run(p: DecodeProblem, tiles: Tiles | None = None, trace=None, stream: int | None = None):
    """Append ``p.k_new``/``p.v_new`` to the caches and compute attention on the GPU, on ``stream``
    (default: the caller's current stream for ``p.q``'s kind).  ``tiles`` and ``trace``: as
    :class:`DecodeLaunch` takes them.  Returns (out, lse or None) in ``p.q``'s kind."""
    launch = DecodeLaunch(p, tiles, trace)
    if stream is None:
        stream = handle(None, p.q.kind, p.q.device)
    return launch.run(p.q.kind, p.q.obj, *problem_args(p), stream)
