"""The pipeline shapes of ``paged_decode`` and what a launch decides from shapes alone: the
specialization keys, the split count and, between the two registered shapes of a head dim, which
one runs (:func:`choose_tiles`).  ``kernels/decode.py`` launches what these decide; ``kernels/ragged.py``
builds its work list on the registered shapes."""
from __future__ import annotations

import dataclasses
import math

from .._core.compiler import KernelKey, get_function
from .._core.types import HEAD_DIMS, KERNEL_DTYPES
from ._launch import cuda_scalar, device_property, smem_row_bytes

SOURCE = "decode.cu"
WARPS = 4               # warps per CTA of the main shapes (TILES)
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


# The main shape of each head dim: every variant (plain, rotary, ragged) has it.
TILES = {head_dim: Tiles(tile_keys(head_dim)) for head_dim in HEAD_DIMS}
# The small shape, plain launches only: half the keys on half the warps, about half the shared
# memory, so about twice the CTAs an SM and a grid of more than one wave of main-shape CTAs runs
# in about half the waves (:func:`choose_tiles`).  Registered where it was measured against the
# main shape (head dim 128, benchmarks/NOTES_decode.md v15); ``Tiles(keys // 2, warps=2)`` of
# another head dim builds and passes the GPU tests, unmeasured.
SMALL_TILES = {128: Tiles(TILES[128].keys // 2, TILES[128].stages, TILES[128].warps // 2)}


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
        kernel_key(dtype, d, tiles) for dtype in KERNEL_DTYPES for d, tiles in SMALL_TILES.items()]


# --------------------------------------------------------------------------- split count and shape

def _num_sms(device_id: int) -> int:
    return int(device_property(device_id, "multiProcessorCount"))


def ctas_per_sm(num_regs: int, smem: int, threads: int) -> int:
    """Resident CTAs of ``threads`` per SM for ``num_regs`` registers and ``smem`` bytes of dynamic
    shared memory (Hopper limits: 64 Ki registers, 228 KiB of shared memory, 1 KiB per CTA)."""
    regs_per_warp = -(-int(num_regs) * 32 // 256) * 256
    by_regs = 65536 // max(regs_per_warp * (threads // 32), 1)
    by_smem = (228 * 1024) // (smem + 1024)
    return max(1, min(by_regs, by_smem, 2048 // threads, 32))


def choose_splits(num_ctas: int, max_keys: int, keys_per_tile: int, slots: int) -> int:
    """Split count for ``num_splits=0``: fill the GPU's CTA slots in whole waves.

    ``num_ctas`` is batch * kv heads * row groups; ``max_keys`` the longest a sequence can be;
    ``keys_per_tile`` the launched shape's keys per pipeline stage; ``slots`` its CTAs of one wave
    (:func:`slots`).
    Enough CTAs already (>= 80% of one wave) means no split.  Otherwise take the smallest split
    count whose wave efficiency (CTAs / slots of the waves they need) is within 5% of the best,
    with at least two tiles of keys per split so each split amortises its fixed costs.
    """
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


def slots(device: int, dtype, head_dim: int, tiles: Tiles, **variant) -> int:
    """CTAs of one wave of ``tiles``' paged_decode on ``device`` (``variant``: :func:`kernel_key`'s
    rotary / trace / ragged flags): what a wave of that launch holds."""
    smem = tiles.smem_bytes(head_dim)
    function = get_function(kernel_key(dtype, head_dim, tiles, **variant), "paged_decode", smem)
    return _num_sms(device) * ctas_per_sm(function.num_regs, smem, tiles.threads)


def choose_tiles(device: int, dtype, head_dim: int, num_ctas: int, num_splits: int) -> Tiles:
    """The pipeline shape of a plain launch (no rotary, no trace) of ``num_ctas`` CTAs a split:
    :data:`SMALL_TILES` when it runs them in fewer waves (:func:`fewer_waves`) and no split was
    asked for, else :data:`TILES`.  Each wave costs a fixed part (its CTAs' start and drain) beside
    the bytes it streams, which both shapes streamed at the same rate where measured, so fewer
    waves is less time.  A grid of at most one wave of main-shape CTAs keeps the main shape (whose
    split count then fills the machine; the small shape is not loaded); a grid of more is not split
    (``choose_splits`` keeps a full wave whole), so ``num_splits`` > 1 only comes from the caller."""
    tiles = TILES[head_dim]
    small = SMALL_TILES.get(head_dim)
    if small is None or num_splits > 1:
        return tiles
    main = slots(device, dtype, head_dim, tiles)
    if num_ctas > main and fewer_waves(num_ctas, main, slots(device, dtype, head_dim, small)):
        return small
    return tiles
