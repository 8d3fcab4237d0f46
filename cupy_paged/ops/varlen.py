"""Launch glue of ``cuda_src/varlen.cu`` (``flash_attn_varlen_func`` on CUDA arrays).

One specialization per (dtype, head dim); its tile shape comes from :data:`TILES`.
Causal masking, sliding windows, softcap, ALiBi, the LSE output and paged K/V (any
block size) are run-time arguments of the same kernel, so a fresh machine compiles
at most ``2 x len(HEAD_DIMS)`` modules for this family.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from .._checks import BF16, HEAD_DIMS, KERNEL_DTYPES, VarlenProblem
from .._compiler import KernelKey, get_function, register_family

SOURCE = "varlen.cu"
KERNEL = "varlen_fwd"
_WINDOW_CAP = 1 << 30  # windows wider than any sequence are clamped so int32 bounds never overflow


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Tile shape of one head dim: query rows per CTA, keys per tile, warps, K/V pipeline
    stages, the CTAs per SM that the register allocation must leave room for, whether each
    warp keeps its Q fragments in registers for the whole key loop, and whether half of the
    warps run P V one iteration late (``pingpong``: needs 8 warps and 3 stages; varlen.cu)."""

    block_m: int
    block_n: int
    warps: int
    stages: int
    min_blocks: int = 1
    q_regs: bool = False
    pingpong: bool = False

    def label(self) -> str:
        return (f"{self.block_m}x{self.block_n}w{self.warps}s{self.stages}m{self.min_blocks}"
                + ("q" if self.q_regs else "") + ("p" if self.pingpong else ""))

    def smem_bytes(self, head_dim: int) -> int:
        """Dynamic shared memory, as ``Traits::kSmemBytes`` in varlen.cu computes it."""
        chunks = head_dim // 8
        row_bytes = 16 * (chunks if chunks % 8 == 0 else chunks + 1)
        return (row_bytes * self.block_m + 2 * self.stages * row_bytes * self.block_n
                + self.stages * self.block_n)


# Each warp owns block_m / warps query rows (a multiple of 16).
TILES = {
    32: Tiles(128, 64, 4, 3),
    64: Tiles(128, 64, 4, 3),
    96: Tiles(128, 64, 8, 2, 1),
    128: Tiles(128, 128, 8, 2, 1),  # 2 stages: 3 ran contiguous +1.5% but paged -13% (NOTES_varlen.md)
    256: Tiles(64, 32, 4, 2),
}


def kernel_key(dtype, head_dim: int, tiles: Tiles | None = None) -> KernelKey:
    """The specialization for ``dtype`` (float16 or bfloat16) and ``head_dim``."""
    tiles = tiles or TILES[head_dim]
    scalar = "__nv_bfloat16" if np.dtype(dtype) == BF16 else "__half"
    params = (("SCALAR_T", scalar), ("HEAD_DIM", head_dim),
              ("BLOCK_M", tiles.block_m), ("BLOCK_N", tiles.block_n),
              ("NUM_WARPS", tiles.warps), ("NUM_STAGES", tiles.stages),
              ("MIN_BLOCKS", tiles.min_blocks),
              ("Q_IN_REGS", int(tiles.q_regs)), ("PINGPONG", int(tiles.pingpong)))
    return KernelKey(SOURCE, params)


def all_keys():
    return [kernel_key(dtype, d) for dtype in KERNEL_DTYPES for d in HEAD_DIMS]


register_family("varlen", all_keys)


def _aligned(array) -> bool:
    """16-byte loads need a 16-byte aligned base and strides that are multiples of 16 bytes."""
    return array.data.ptr % 16 == 0 and all(s % 16 == 0 for s in array.strides[:-1])


def _slot_addressable(cache) -> bool:
    """The kernel addresses a paged cache by slot (block * block_size + offset) with one stride:
    its blocks must be block_size rows apart, as in any C-contiguous cache."""
    return _aligned(cache) and cache.strides[0] == cache.shape[1] * cache.strides[1]


def _strides(array) -> list[np.int64]:
    return [np.int64(s // array.itemsize) for s in array.strides]


def run(p: VarlenProblem, tiles: Tiles | None = None) -> None:
    """Launch ``varlen_fwd`` on a checked CUDA problem; writes ``p.out`` (and ``p.lse``).
    ``tiles`` (a candidate shape) is for the benchmark's sweep."""
    import cupy

    total_q = int(p.q.shape[0])
    if p.batch == 0 or total_q == 0 or p.max_seqlen_q == 0:
        return
    head_dim, num_heads = p.head_dim, p.num_heads
    tiles = tiles or TILES[head_dim]
    smem = tiles.smem_bytes(head_dim)
    function = get_function(kernel_key(p.q.dtype, head_dim, tiles), KERNEL, smem)

    paged = p.block_table is not None
    usable = _slot_addressable if paged else _aligned
    q = p.q if _aligned(p.q) else cupy.ascontiguousarray(p.q)
    k, v = (a if usable(a) else cupy.ascontiguousarray(a) for a in (p.k, p.v))
    out = p.out if _aligned(p.out) else cupy.empty_like(p.out)
    null = np.uintp(0)
    if not paged:
        (k_row, k_head, _), (v_row, v_head, _) = _strides(k), _strides(v)
        table, table_width, block_shift = null, 0, 0
    else:
        _, k_row, k_head, _ = _strides(k)
        _, v_row, v_head, _ = _strides(v)
        table, table_width = p.block_table, int(p.block_table.shape[1])
        block_shift = int(p.block_size).bit_length() - 1
    kv_rows = int(k.shape[0])  # rows, or blocks when paged
    if kv_rows * (p.block_size or 1) >= 2 ** 31 or max(k_row, v_row) >= 2 ** 31:
        raise ValueError(f"k has {kv_rows} rows/blocks: the kernel indexes rows (slots) with int32")
    q_row, q_head, _ = _strides(q)
    left, right = (min(w, _WINDOW_CAP) for w in p.window)

    grid = ((p.max_seqlen_q + tiles.block_m - 1) // tiles.block_m, num_heads, p.batch)
    function(grid, (32 * tiles.warps,),
             (q, k, v, out, p.lse if p.lse is not None else null,
              p.cu_seqlens_q, p.cu_seqlens_k, table,
              p.alibi_slopes if p.alibi_slopes is not None else null,
              q_row, q_head, np.int32(k_row), k_head, np.int32(v_row), v_head,
              np.int32(total_q), np.int32(kv_rows), np.int32(num_heads),
              np.int32(num_heads // p.num_kv_heads), np.int32(table_width), np.int32(block_shift),
              np.float32(p.softmax_scale), np.float32(p.softcap), np.int32(left), np.int32(right)),
             shared_mem=smem)
    if out is not p.out:
        p.out[...] = out
