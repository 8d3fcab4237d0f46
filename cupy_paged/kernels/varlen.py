"""Launch glue of ``cuda_src/varlen.cu`` and ``cuda_src/varlen_wgmma.cu``
(``flash_attn_varlen_func`` on CUDA arrays).

Two kernels compute the same thing: ``varlen_fwd_wgmma`` (Hopper's ``wgmma``, built for
sm_90a, head dims in :data:`WGMMA_TILES`) runs on compute capability 9.0, ``varlen_fwd``
(``mma.sync``, any sm_80+ GPU, every head dim) elsewhere.  One specialization per (dtype,
head dim) each, and on Hopper one more where the K/V layout (contiguous or paged) takes the tensor-
memory accelerator's loader (``varlen_wgmma.WGMMA_TMA_TILES``: its tensor maps are encoded per
launch shape and K/V address, ``_core/tma.py``); tile shapes come from :data:`TILES`,
:data:`WGMMA_TILES` and ``registered_tiles``.  Causal masking, sliding windows, softcap, ALiBi,
the LSE output and paged K/V (any block size) are run-time arguments, so a fresh machine
compiles at most two modules per (dtype, head dim).

The kernel is chosen by the tile shape a launch is given: ``VarlenLaunch(p, tiles)`` and
``run(p, tiles)`` launch the mma.sync kernel for a :class:`Tiles` and the wgmma kernel for a
:class:`WgmmaTiles` (compute capability 9.0 only); ``tiles=None``, what the public functions
pass, takes the registered shape of the kernel this GPU runs.

A call over a paged cache whose rows are all short (``num_heads / num_kv_heads * max_seqlen_q <=
16``: the one-token rows of a decode step, speculative rows) runs on the ragged decode kernel
instead, with a work list built on the device from ``cu_seqlens`` (:meth:`VarlenLaunch.short_rows`):
the choice is made per call from ``max_seqlen_q``, a host value (and inside a CUDA graph capture
only on a stream whose buffers an eager call has sized; else the varlen kernel serves).
"""
from __future__ import annotations

import dataclasses
import functools

from .._core.problems import VarlenProblem
from .._core.types import HEAD_DIMS, KERNEL_DTYPES, alibi_batch_stride, element_strides
from .._core.compiler import KernelKey, get_function
from .._core.errors import word
from .._core.streams import handle, is_capturing
from .._core import tma
from .varlen_wgmma import WGMMA_TILES, WgmmaTiles, persistent_fits, registered_tiles, wgmma_available
from .varlen_wgmma import kernel_key as wgmma_key
from .varlen_wgmma import KERNEL as WGMMA_KERNEL
from ._launch import Launcher, cuda_scalar, device_property, outputs, q_is_the_callers_dense_tensor, smem_row_bytes
from . import ragged
from ._decode_shapes import TILES as DECODE_TILES
from .ragged import ROWS

SOURCE = "varlen.cu"
KERNEL = "varlen_fwd"


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Tile shape of one head dim (mma.sync kernel): query rows per CTA, keys per tile, warps,
    K/V pipeline stages, and the CTAs per SM that the register allocation must leave room for."""

    block_m: int
    block_n: int
    warps: int
    stages: int
    min_blocks: int = 1

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def label(self) -> str:
        return f"{self.block_m}x{self.block_n}w{self.warps}s{self.stages}m{self.min_blocks}"

    def smem_bytes(self, head_dim: int) -> int:
        """Dynamic shared memory of the launch.  The one size: :func:`kernel_key` passes it to the
        compiler as ``SMEM_BYTES``, and varlen.cu static_asserts that it equals
        ``Traits::kSmemBytes``, so a layout that drifts from this sum fails to build."""
        row_bytes = smem_row_bytes(head_dim)
        # Q, the K and V stages, then per stage and key a "loadable" byte and a block id (int)
        return (row_bytes * self.block_m + 2 * self.stages * row_bytes * self.block_n
                + self.stages * self.block_n + 4 * self.stages * self.block_n)


# Each warp owns block_m / warps query rows (a multiple of 16).
TILES = {
    32: Tiles(128, 64, 4, 3),
    64: Tiles(128, 64, 4, 3),
    96: Tiles(128, 64, 8, 2, 1),
    128: Tiles(128, 128, 8, 2, 1),  # 2 stages: the faster depth through a block table (NOTES_varlen.md)
    256: Tiles(64, 32, 4, 2),
}


def kernel_key(dtype, head_dim: int, tiles: Tiles | None = None) -> KernelKey:
    """The specialization for ``dtype`` (float16 or bfloat16), ``head_dim`` and ``tiles`` (default
    ``TILES[head_dim]``)."""
    tiles = tiles or TILES[head_dim]
    params = (("SCALAR_T", cuda_scalar(dtype)), ("HEAD_DIM", head_dim),
              ("BLOCK_M", tiles.block_m), ("BLOCK_N", tiles.block_n),
              ("NUM_WARPS", tiles.warps), ("NUM_STAGES", tiles.stages),
              ("MIN_BLOCKS", tiles.min_blocks), ("SMEM_BYTES", tiles.smem_bytes(head_dim)))
    return KernelKey(SOURCE, params)


def specialization(dtype, head_dim: int, tiles: Tiles | WgmmaTiles) -> tuple[KernelKey, str]:
    """(kernel key, kernel name) of a tile shape of either kernel; the shape's type picks it."""
    if isinstance(tiles, WgmmaTiles):
        return wgmma_key(dtype, head_dim, tiles), WGMMA_KERNEL
    return kernel_key(dtype, head_dim, tiles), KERNEL


def all_keys():
    return [kernel_key(dtype, d) for dtype in KERNEL_DTYPES for d in HEAD_DIMS]


@functools.lru_cache(maxsize=512)
def _launch(device: int, dtype, head_dim: int, tiles: Tiles | WgmmaTiles):
    """(kernel, dynamic shared memory) of a tile shape: what a call's shapes decide, looked up
    once per (device, dtype, head dim, shape)."""
    smem = tiles.smem_bytes(head_dim)
    return get_function(*specialization(dtype, head_dim, tiles), smem), smem


# varlen_fwd / varlen_fwd_wgmma parameters (VARLEN_FWD_PARAMS in varlen_common.cuh): q, k, v, out,
# lse, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes; q_row, q_head, k_row, k_head, v_row,
# v_head; total_q, kv_rows, num_heads, group_size, table_width, block_shift; softmax_scale, softcap;
# window_left, window_right, max_seqlen_q, alibi_batch_stride; errors; batch.
_LAYOUT = "9P" + "qqiqiq" + "iiiiii" + "ff" + "iiii" + "P" + "i"


def default_tiles(head_dim: int, device: int | None = None, block_size: int | None = None) -> Tiles | WgmmaTiles:
    """The registered shape of the kernel that ``device`` runs for ``head_dim`` and K/V in a paged
    cache of ``block_size`` keys a block (None: contiguous): wgmma's where it serves the head dim on
    this GPU (compute capability 9.0), else mma.sync's."""
    if not wgmma_available(head_dim, device):
        return TILES[head_dim]
    return registered_tiles(head_dim, block_size is not None, block_size or 0)


class VarlenLaunch:
    """One ``flash_attn_varlen_func`` call shape, resolved: the kernel, its shared memory and every
    scalar argument packed once; :meth:`run` adds the pointers and ``max_seqlen_q`` (the grid).

    ``tiles`` picks the kernel and its shape (see the module docstring); None: :func:`default_tiles`.
    """

    def __init__(self, p: VarlenProblem, tiles: Tiles | WgmmaTiles | None = None):
        head_dim, num_heads = p.head_dim, p.num_heads
        self.device = device = p.q.device
        given = tiles is not None  # a named shape runs that kernel, short rows too
        self.tiles = tiles = tiles or default_tiles(head_dim, device, p.block_size)
        self.batch = p.batch
        self._maps = _kv_maps(p, tiles)
        if isinstance(tiles, WgmmaTiles) and tiles.tma and self._maps is None:
            # K/V no map describes: a named shape runs its cp.async twin, a registered one the registered
            # cp.async shape.
            self.tiles = tiles = dataclasses.replace(tiles, tma=False) if given else WGMMA_TILES[head_dim]
        # A persistent shape runs a grid of one CTA per SM over every query tile, for the calls it
        # takes (persistent_fits); the others run the same shape with one CTA per query tile.
        self.persistent = isinstance(tiles, WgmmaTiles) and tiles.persistent
        if self.persistent and not persistent_fits(tiles, p.batch, num_heads, 1):
            self.tiles = tiles = tiles.one_task_per_cta()
            self.persistent = False
        self._sms = device_property(device, "multiProcessorCount") if self.persistent else 0
        self._per_tile = None  # (launcher, shared memory), made when a call's max_seqlen_q needs it
        self.head_dim = head_dim
        function, self.smem = _launch(device, p.q.dtype, head_dim, tiles)
        # The TMA shape takes the K and V tensor maps (256 bytes, 64-byte aligned) before the other
        # parameters, which puts them past the buffer's C layout: launched by parameter pointers.
        self._first = 1 if self._maps is not None else 0
        self.launch = Launcher(function, ("256s" if self._first else "") + _LAYOUT, param_pointers=bool(self._first))
        self.total_q = total_q = int(p.q.shape[0])
        self.out_shape = (total_q, num_heads, head_dim)
        self.lse_shape = (num_heads, total_q)
        self.dtype = p.q.dtype
        self.want_lse = p.want_lse or p.lse is not None
        paged = p.block_table is not None
        if not paged:
            (k_row, k_head, _), (v_row, v_head, _) = element_strides(p.k), element_strides(p.v)
            table_width, block_shift = 0, 0
        else:
            _, k_row, k_head, _ = element_strides(p.k)
            _, v_row, v_head, _ = element_strides(p.v)
            table_width = int(p.block_table.shape[1])
            block_shift = int(p.block_size).bit_length() - 1
        kv_rows = int(p.k.shape[0])  # rows, or blocks when paged
        if kv_rows * (p.block_size or 1) >= 2 ** 31:
            raise ValueError(f"k has {kv_rows} rows/blocks: the kernel indexes rows (slots) with int32")
        # varlen_common.cuh offsets a row within a key tile by (row < BLOCK_N) * row stride in int32.
        if max(k_row, v_row) * tiles.block_n >= 2 ** 31:
            raise ValueError(f"k and v rows must be less than {2 ** 31 // tiles.block_n} elements apart; "
                             f"got {max(k_row, v_row)}")
        q_row, q_head, _ = element_strides(p.q)
        left, right = p.window
        self.heads = num_heads
        self.scalars = [q_row, q_head, k_row, k_head, v_row, v_head,
                        total_q, kv_rows, num_heads, num_heads // p.num_kv_heads, table_width, block_shift,
                        p.softmax_scale, p.softcap, left, right]
        self.alibi_stride = alibi_batch_stride(p.alibi_slopes)
        self.errors = word(device)
        # The scalars are packed once; a call rewrites the 9 pointers and max_seqlen_q (field 25).
        self.launch.pack(*self._packed())
        self._pointer_span = self.launch.span(self._first, 9)
        self._max_q_span = self.launch.span(self._first + 9 + len(self.scalars), 1)
        self._maps_span = self.launch.span(0, 1) if self._first else None
        self.q_contiguous = q_is_the_callers_dense_tensor(p.q)
        # Short rows over a paged cache go to the ragged kernel, its launch made at the first such call
        # outside a graph capture (paged prefill shapes never make it).
        self.group = num_heads // p.num_kv_heads
        self._short = None
        self._short_keys = table_width << block_shift  # keys a table row holds
        self._short_args = None if (given or not paged or head_dim not in DECODE_TILES or self.group > ROWS
                                    or self._short_keys >= ragged.MAX_LIST_KEYS) else (
            device, p.q.dtype, self.out_shape, (q_row, q_head), None, None,
            (kv_rows, p.block_size, p.num_kv_heads), table_width, p.softmax_scale, p.window, p.softcap,
            self.alibi_stride)

    def _packed(self) -> tuple:
        """Every argument but the pointers and max_seqlen_q (zeros there)."""
        maps = (bytes(2 * tma.MAP_BYTES),) if self._first else ()
        return (*maps, *([0] * 9), *self.scalars, 0, self.alibi_stride, self.errors, self.batch)

    def _grid(self, max_seqlen_q: int) -> tuple:
        """(launcher, grid, threads, shared memory) of a call with this ``max_seqlen_q``."""
        tiles = self.tiles
        query_tiles = (max_seqlen_q + tiles.block_m - 1) // tiles.block_m
        if not self.persistent:
            return self.launch, (query_tiles, self.heads, self.batch), tiles.threads, self.smem
        if persistent_fits(tiles, self.batch, self.heads, max_seqlen_q):
            return self.launch, (min(self._sms, query_tiles * self.heads * self.batch), 1, 1), tiles.threads, self.smem
        if self._per_tile is None:
            per_tile = tiles.one_task_per_cta()
            function, smem = _launch(self.device, self.dtype, self.head_dim, per_tile)
            launcher = Launcher(function, _LAYOUT)
            launcher.pack(*self._packed())
            self._per_tile = launcher, smem
        launcher, smem = self._per_tile
        return launcher, (query_tiles, self.heads, self.batch), tiles.threads, smem

    def run(self, kind: str, like, ptrs: tuple, max_seqlen_q: int, out, lse_out, stream: int,
            alloc_stream: int | None = None):
        """Launch on ``stream``.  ``ptrs``: q, k, v, cu_seqlens_q, cu_seqlens_k, block_table,
        alibi_slopes (0 for none); ``out``/``lse_out`` ``(object, pointer)`` or None (made here).
        Returns (out, lse or None)."""
        out_obj, out_ptr, lse_obj, lse_ptr = outputs(kind, like, out, lse_out, self.out_shape, self.lse_shape,
                                                     self.dtype, self.want_lse, self.q_contiguous, alloc_stream)
        if self.batch == 0 or self.total_q == 0 or max_seqlen_q == 0:
            return out_obj, lse_obj
        q, k, v, cu_q, cu_k, table, alibi = ptrs
        short = None
        if self._short_args is not None and self.group * max_seqlen_q <= ROWS and ragged.BALANCE is not False:
            short = self._short or (None if is_capturing(stream) else self.short_rows())
        if short is not None and short.ready(stream):
            short.run((q, k, v, 0, 0, table, alibi), (0, cu_q, cu_k), max_seqlen_q, out_ptr, lse_ptr, stream)
            return out_obj, lse_obj
        launcher, grid, threads, smem = self._grid(max_seqlen_q)
        pointer_struct, pointer_at = self._pointer_span
        max_q_struct, max_q_at = self._max_q_span
        spans = ((pointer_struct, pointer_at, (q, k, v, out_ptr, lse_ptr, cu_q, cu_k, table, alibi)),
                 (max_q_struct, max_q_at, (max_seqlen_q,)))
        if self._maps is not None:
            maps_struct, maps_at = self._maps_span
            spans += ((maps_struct, maps_at, (self._maps.maps(k, v),)),)
        launcher.launch(grid, threads, smem, stream, *spans)
        return out_obj, lse_obj


    def short_rows(self):
        """The launch of calls whose rows are all short (``num_heads / num_kv_heads * max_seqlen_q
        <= 16``: decodes, speculative rows) over a paged cache: the ragged kernel on a work list
        built on the device from ``cu_seqlens`` (:class:`ragged.DeviceListLaunch`), so that a row of
        one to a few tokens does not fill a 64- or 128-row tile alone and its kv head's keys are read
        once for the whole GQA group."""
        if self._short is None:
            launch = ragged.RaggedLaunch(*self._short_args)
            self._short = ragged.DeviceListLaunch(launch, self.batch, 1, 0, self._short_keys)
        return self._short


def _kv_maps(p: VarlenProblem, tiles) -> "tma.KvMaps | None":
    """The tensor maps of a TMA shape's launch (K and V as [slots, kv heads, head dim]), or None
    for other shapes and where no map describes K and V (strides the TMA cannot take, more slots
    than int32 coordinates reach) or the driver cannot encode one."""
    if not (isinstance(tiles, WgmmaTiles) and tiles.tma) or not tma.available():
        return None
    if p.block_table is None:
        (k_slot, k_head, _), (v_slot, v_head, _) = element_strides(p.k), element_strides(p.v)
        slots = int(p.k.shape[0])
    else:
        k_block, k_slot, k_head, _ = element_strides(p.k)
        v_block, v_slot, v_head, _ = element_strides(p.v)
        if k_block != p.block_size * k_slot or v_block != p.block_size * v_slot:
            return None  # blocks not evenly spaced as slots: no one slot axis
        slots = int(p.k.shape[0]) * p.block_size
    kv_heads = p.num_kv_heads
    if not all(tma.kv_map_fits(p.k.dtype, p.head_dim, kv_heads, head, slots, slot)
               for slot, head in ((k_slot, k_head), (v_slot, v_head))):
        return None
    box_rows = tma.CONTIGUOUS_BOX_ROWS if p.block_table is None else tma.PAGED_BOX_ROWS
    maps = tma.KvMaps(p.k.dtype, p.head_dim, kv_heads, (k_slot, k_head, v_slot, v_head), slots, box_rows)
    try:  # the first call's K/V, encoded now: a map the driver rejects takes the cp.async shape instead
        maps.maps(p.k.ptr, p.v.ptr)
    except RuntimeError:
        return None
    return maps


def problem_args(p: VarlenProblem) -> tuple:
    """(ptrs, max_seqlen_q, out, lse_out) of :meth:`VarlenLaunch.run` for a checked problem."""
    table = 0 if p.block_table is None else p.block_table.ptr
    alibi = 0 if p.alibi_slopes is None else p.alibi_slopes.ptr
    ptrs = (p.q.ptr, p.k.ptr, p.v.ptr, p.cu_seqlens_q.ptr, p.cu_seqlens_k.ptr, table, alibi)
    out = None if p.out is None else (p.out.obj, p.out.ptr)
    lse = None if p.lse is None else (p.lse.obj, p.lse.ptr)
    return ptrs, p.max_seqlen_q, out, lse


def run(p: VarlenProblem, tiles: Tiles | WgmmaTiles | None = None, stream: int | None = None):
    """Launch the varlen kernel on a checked CUDA problem whose arrays the kernel can read as they
    are (see ``api/varlen.py``); returns (out, lse or None) in ``p.q``'s kind.  ``tiles``: the
    kernel and shape to launch, as :class:`VarlenLaunch` takes it."""
    launch = VarlenLaunch(p, tiles)
    if stream is None:
        stream = handle(None, p.q.kind, p.q.device)
    return launch.run(p.q.kind, p.q.obj, *problem_args(p), stream)
