"""Launch glue of ``cuda_src/varlen_wgmma.cu``: the Hopper (sm_90a, ``wgmma``) kernel of
``flash_attn_varlen_func``, its tile shapes and its specializations.

It computes what ``varlen.cu`` computes and shares its launch (``kernels.varlen``), which picks it
on compute capability 9.0 for the head dims of :data:`WGMMA_TILES`.
"""
from __future__ import annotations

import dataclasses

from .._core.compiler import KernelKey
from .._core.types import KERNEL_DTYPES
from ._launch import cuda_scalar, device_property

SOURCE = "varlen_wgmma.cu"
KERNEL = "varlen_fwd_wgmma"
ARCH = "sm_90a"


@dataclasses.dataclass(frozen=True)
class WgmmaTiles:
    """Tile shape of the wgmma kernel: keys per tile, K/V pipeline stages, warpgroups per CTA
    (64 query rows each; one warpgroup lets two CTAs share an SM), whether a producer warpgroup
    issues the loads (warp specialization, two computing warpgroups only), and whether its CTAs are
    persistent (a grid of at most one CTA per SM, each working through a list of query tiles, for
    batches of at most :data:`PERSISTENT_MAX_SEQS` sequences)."""

    block_n: int
    stages: int
    groups: int = 2
    producer: bool = False
    persistent: bool = False
    staged_store: bool = False  # the output through shared memory (a producer shape, one CTA per tile)
    pv_overlap: bool = False  # a producer shape's softmax of tile t under P V of tile t - 1
    tma: bool = False  # a producer shape's full key tiles copied by the TMA (128 keys, one CTA per query tile)

    def __post_init__(self):
        if self.producer and self.groups != 2:
            raise ValueError("a producer warpgroup serves two computing warpgroups")
        if self.persistent and not self.producer:
            raise ValueError("persistent CTAs are warp-specialized (producer=True)")
        if self.staged_store and (not self.producer or self.persistent):
            raise ValueError("the staged output store is a producer shape's with one CTA per query tile")
        if self.pv_overlap and (not self.producer or self.persistent):
            raise ValueError("the overlap of softmax and P V is a producer shape's with one CTA per query tile"
                             " (untested with persistent CTAs)")
        if self.tma and (not self.producer or self.persistent or self.block_n != 128):
            raise ValueError("the TMA loader is a producer shape's with 128-key tiles and one CTA per query tile")

    @property
    def block_m(self) -> int:
        return 64 * self.groups

    @property
    def threads(self) -> int:
        return 128 * (self.groups + self.producer)

    def label(self) -> str:
        return (f"wg{self.block_m}x{self.block_n}s{self.stages}" + ("p" if self.producer else "")
                + ("P" if self.persistent else "") + ("o" if self.staged_store else "")
                + ("x" if self.pv_overlap else "") + ("t" if self.tma else ""))

    def one_task_per_cta(self) -> "WgmmaTiles":
        """The same shape on a grid of one CTA per task (batches a persistent launch cannot take)."""
        return dataclasses.replace(self, persistent=False)

    def smem_bytes(self, head_dim: int) -> int:
        """Dynamic shared memory of the launch.  The one size: :func:`kernel_key` passes it to the
        compiler as ``SMEM_BYTES``, and varlen_wgmma.cu static_asserts that it equals
        ``WgTraits::kSmemBytes``, so a layout that drifts from this sum fails to build."""
        row_bytes = 2 * head_dim
        # 1024 bytes of alignment slack, Q, the K and V stages, then
        tiles = 1024 + row_bytes * self.block_m + 2 * self.stages * row_bytes * self.block_n
        if self.producer:
            # the producer's barriers (8 bytes each: Q full, Q free when persistent, and four per
            # stage; persistent, the task of the Q in 16 bytes), a hole byte per producer warp and
            # stage, per stage and key a "loadable" byte, and (persistent) the prefix sum of the
            # sequences' tasks (one int per sequence, and one)
            barriers = 8 * (1 + self.persistent + 4 * self.stages) + 16 * self.persistent
            return (tiles + barriers + 4 * self.stages + self.stages * self.block_n
                    + 4 * (PERSISTENT_MAX_SEQS + 1) * self.persistent)
        # per stage and key a "loadable" byte and a block id (int)
        return tiles + self.stages * self.block_n + 4 * self.stages * self.block_n


# Sequences a persistent launch takes at most (WgTraits::kMaxSeqs in varlen_wgmma.cu); its tasks
# are numbered in 31 bits.
PERSISTENT_MAX_SEQS = 512


def persistent_fits(tiles: WgmmaTiles, batch: int, heads: int, max_seqlen_q: int) -> bool:
    """Whether a persistent launch of ``tiles`` takes a call of these sizes."""
    levels = -(-max_seqlen_q // tiles.block_m)
    return batch <= PERSISTENT_MAX_SEQS and levels * batch * heads < 2 ** 31 - 2 ** 16  # task numbers + 2 grids


# The registered shape of each head dim: the fastest of those NOTES_varlen.md compares on the H200.
WGMMA_TILES = {
    64: WgmmaTiles(128, 2, producer=True),  # 83 KB: a producer warpgroup, two computing ones
    128: WgmmaTiles(128, 2, producer=True, staged_store=True),  # 165 KB: the same, output staged (v11)
    256: WgmmaTiles(64, 2),            # 198 KB
}
# Where a shape with the TMA loader is the faster, by (head dim, paged) (NOTES_varlen.md, v16): D = 128
# (contiguous K/V one 128-row box a column block, a paged cache 16-row boxes issued by each run's
# first row; the softmax under P V: 1.10-1.15x the cp.async shape at causal 8 x 2048 / 8 x 4096 on
# contiguous K/V on an H100) and D = 64 over a paged cache (1.10x).  The others keep WGMMA_TILES, as
# do paged caches of blocks smaller than the TMA's 16-row box and calls whose K/V no tensor map
# describes (VarlenLaunch).
_TMA_128 = WgmmaTiles(128, 2, producer=True, staged_store=True, pv_overlap=True, tma=True)
WGMMA_TMA_TILES = {(128, False): _TMA_128, (128, True): _TMA_128, (64, True): WgmmaTiles(128, 2, producer=True, tma=True)}
TMA_MIN_BLOCK = 16  # a paged box's rows (varlen_ws.cuh kBoxRows): smaller blocks copy every tile by cp.async


def registered_tiles(head_dim: int, paged: bool, block_size: int = TMA_MIN_BLOCK) -> WgmmaTiles:
    """The registered wgmma shape of ``head_dim`` for K/V in a paged cache (of ``block_size`` keys a
    block) or contiguous."""
    if paged and block_size < TMA_MIN_BLOCK:
        return WGMMA_TILES[head_dim]
    return WGMMA_TMA_TILES.get((head_dim, paged), WGMMA_TILES[head_dim])


# The TRACE specialization's row per CTA (varlen_ws.cuh; global ns unless said): a producer shape
# with one CTA per query tile takes the trace buffer (16 int64 per CTA) as its last argument.
TRACE_COLUMNS = ("entry", "sm", "task_known", "q_issued", "all_issued", "q_landed", "first_s",
                 "last_softmax", "last_pv", "stored", "stored_group1", "tiles")
TRACE_ROW = 16


def kernel_key(dtype, head_dim: int, tiles: WgmmaTiles | None = None, trace: bool = False) -> KernelKey:
    """The wgmma specialization (sm_90a) for ``dtype``, ``head_dim`` and ``tiles`` (default
    ``WGMMA_TILES[head_dim]``); ``trace``: its TRACE specialization (a producer shape, one CTA per
    query tile), for ``benchmarks/trace_varlen.py``."""
    tiles = tiles or WGMMA_TILES[head_dim]
    if trace and (not tiles.producer or tiles.persistent):
        raise ValueError("the trace is of a producer shape with one CTA per query tile")
    params = (("SCALAR_T", cuda_scalar(dtype)), ("HEAD_DIM", head_dim), ("WARPGROUPS", tiles.groups),
              ("BLOCK_N", tiles.block_n), ("NUM_STAGES", tiles.stages), ("PRODUCER", int(tiles.producer)),
              ("PERSISTENT", int(tiles.persistent)), ("SMEM_BYTES", tiles.smem_bytes(head_dim)))
    return KernelKey(SOURCE, params + ((("STAGED_STORE", 1),) if tiles.staged_store else ())
                     + ((("PV_OVERLAP", 1),) if tiles.pv_overlap else ())
                     + ((("TMA", 1),) if tiles.tma else ())
                     + ((("TRACE", 1),) if trace else ()), arch=ARCH)


def all_keys():
    return ([kernel_key(dtype, d) for dtype in KERNEL_DTYPES for d in WGMMA_TILES]
            + [kernel_key(dtype, d, tiles) for dtype in KERNEL_DTYPES
               for d, tiles in dict.fromkeys((d, tiles) for (d, _), tiles in WGMMA_TMA_TILES.items())])


def wgmma_available(head_dim: int, device: int | None = None) -> bool:
    """Whether the wgmma kernel serves ``head_dim`` on ``device`` (default: the current one): a
    registered shape for the head dim and a compute capability 9.0 GPU."""
    if head_dim not in WGMMA_TILES:
        return False
    if device is None:
        import cupy

        device = cupy.cuda.runtime.getDevice()
    return device_property(device, "major") == 9 and device_property(device, "minor") == 0
