"""Launch glue of ``cuda_src/decode.cu`` (``flash_attn_with_kvcache`` on CUDA arrays).

One launch of ``paged_decode`` appends the new tokens (if any) and computes attention; with
``num_splits > 1`` a second launch, ``combine_splits``, merges the per-split partial outputs.
:func:`launch_for` picks, for ``num_splits=0`` over a paged cache with a grid of one or two waves (see
:func:`balances`), :class:`BalancedDecodeLaunch` instead: the ragged kernel on a work list that the
GPU builds from ``cache_seqlens`` (one launch, ``kernels/ragged.py``), so that one long sequence
does not run on one CTA per kv head while the rest of the batch has finished.

Split-KV and CUDA graphs
------------------------
The partial outputs of a split launch live in a float32 workspace that this module keeps per
(device, stream) and only ever grows.  Growing allocates, which a CUDA graph capture must not
do, so before capturing either make one eager call with the same shapes on the capturing stream
(the usual warm-up) or call :func:`reserve_workspace`.  A call that would need to grow the
workspace while its stream is capturing raises ``RuntimeError`` instead of allocating.  Retired
workspaces are kept alive, so a graph captured earlier never points at freed memory.

With ``num_splits=0`` the split count is chosen on the host from shapes alone (batch, heads,
the cache's capacity per sequence: ``max_blocks * block_size``, or S of a contiguous ``[B, S, Hkv, D]``
cache), never from ``cache_seqlens`` values on the host, so choosing it needs no device-to-host copy
and a captured graph replays the same choice (the balanced launch splits by those values on the
device, inside the launch a graph captures).  Its work-list buffer, like the workspace, is sized by
an eager call on the capturing stream; a capture on a stream without one launches the decode kernel
instead.  What the shapes decide (kernels, grid, split count) is kept per shape, so a decode loop
computes it once; the scalar arguments travel as one packed struct (``DecodeParams`` in decode.cu).
A contiguous cache is read as blocks of one token through one identity table per device (grown like
the workspace, so it too must be sized before a capture: one eager call), and an int ``cache_seqlens``
travels as one value in that struct, so a call builds no index arrays.

Tile shapes and tracing
-----------------------
A plain specialization per (dtype, head dim) of the main pipeline shape (keys per stage, stages,
warps: :data:`TILES`), and at head dim 128 one of the small shape (:data:`SMALL_TILES`, half the
keys on half the warps), which a plain launch takes when it runs the grid in fewer waves, unsplit
(:func:`choose_tiles`, from shapes alone, kept per shape like the split count; its module loads
at the first such call, so a warm-up call of each captured shape, which the split workspace needs
anyway, also loads it outside the capture).  ``DecodeLaunch(p, tiles)`` and ``run(p, tiles)``
launch a named shape (the benchmark's sweep and the GPU tests name theirs).  ``trace=`` launches the ``TRACE``
specialization, which records each CTA's start, end, SM and more for the benchmarks' traces: the
registered keys (:func:`all_keys`) hold no trace code and take no trace argument.
"""
from __future__ import annotations

import dataclasses
import functools

from .._core.arrays import CUPY
from .._core.problems import DecodeProblem
from .._core.types import alibi_batch_stride, element_strides
from .._core.compiler import get_function
from .._core.errors import word
from .._core.streams import handle
from ._launch import Launcher, outputs, q_is_the_callers_dense_tensor
from ._workspace import identity_table, split_workspace

# The shapes and what a launch decides from shapes alone (re-exported: part of this module's API).
from ._decode_shapes import (COMBINE_THREADS, MAX_SPLITS, ROWS_PER_CTA, SMALL_TILES, SOURCE, STAGES, TILE_ELEMS,
                             TILES, WARPS, Tiles, all_keys, choose_splits, choose_tiles, ctas_per_sm,
                             fewer_waves, kernel_key, slots, tile_keys)

__all__ = ["COMBINE_THREADS", "MAX_SPLITS", "ROWS_PER_CTA", "SMALL_TILES", "SOURCE", "STAGES", "TILE_ELEMS", "TILES",
           "TRACE_COLUMNS", "TRACE_PHASES", "WARPS", "BalancedDecodeLaunch", "DecodeLaunch", "Tiles", "all_keys", "balances",
           "choose_splits", "choose_tiles", "ctas_per_sm", "fewer_waves", "kernel_key", "launch_for", "plan",
           "problem_args", "ptr", "reserve_workspace", "run", "slots", "tile_keys", "trace_size"]


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
# A trace row per CTA (decode.cu trace_row): start ns, ready ns (its work known), end ns, SM, number,
# then seven stamps of the device list's build (the RAGGED builder's row only, else zeros; decode.cu
# build_stamp), then the CTA's phases (decode.cu trace_phase): tile 0 landed, the K/V loop drained,
# the rows stored.
TRACE_COLUMNS = 15
TRACE_PHASES = (12, 13, 14)
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
    tiles: Tiles       # the pipeline shape launched

    @property
    def threads(self) -> int:
        """Of a paged_decode CTA."""
        return self.tiles.threads


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
    num_ctas = batch * num_kv_heads * row_groups
    chosen = tiles is None and not (rotary or trace)
    # The split count on the given (else the main) shape first; the shape chosen after it, since
    # choose_tiles takes the small shape only for an unsplit grid.
    given = tiles or TILES[head_dim]
    splits = min(num_splits, MAX_SPLITS) or choose_splits(
        num_ctas, max_keys, given.keys, slots(device, dtype, head_dim, given, rotary=rotary, trace=trace))
    tiles = choose_tiles(device, dtype, head_dim, num_ctas, splits) if chosen else given
    kernels = kernel_key(dtype, head_dim, tiles, rotary, trace)
    smem = tiles.smem_bytes(head_dim)
    decode = get_function(kernels, "paged_decode", smem)
    return _Shape(decode, get_function(kernels, "combine_splits") if splits > 1 else None, smem,
                  splits, rows, row_groups, tiles)


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
    shape than :func:`choose_tiles`'s; ``trace``: a uint64 CuPy array of ``TRACE_COLUMNS`` per CTA
    (:func:`trace_size`) that each launch fills with every CTA's start, ready and end on the GPU's
    nanosecond clock, its SM and its number (the TRACE specialization; for the benchmarks).
    """

    def __init__(self, p: DecodeProblem, tiles: Tiles | None = None, trace=None):
        self.device = p.q.device
        max_blocks, num_blocks, shift = _cache_geometry(p)
        shape = _problem_shape(p, tiles, trace is not None)
        self.shape = shape
        self.splits = shape.splits
        batch, seqlen_q, num_heads, head_dim = (int(x) for x in p.q.shape)
        self.batch = batch
        self.out_shape, self.lse_shape = (batch, seqlen_q, num_heads, head_dim), (batch, num_heads, seqlen_q)
        self.dtype = p.q.dtype
        self.want_lse = p.want_lse or p.lse is not None
        self.contiguous_cache = p.block_table is None
        self.identity_size = num_blocks
        self.capacity = max_blocks << shift
        self.cached_default = p.cache_seqlens if isinstance(p.cache_seqlens, int) else 0
        # The largest int cache_seqlens a memoised call takes: room for the new tokens and rotary rows.
        self.int_length_max = self.capacity - p.seqlen_new
        if p.rotary_cos is not None and batch:
            self.int_length_max = min(self.int_length_max, int(p.rotary_cos.shape[0]) - max(p.seqlen_new, 1))
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


def _token_strides(array, seqlen: int):
    """``(token, head)`` element strides of ``[B, seqlen, heads, D]`` read as ``[B * seqlen, heads,
    D]`` packed tokens, or None when its rows are not evenly spaced so."""
    batch_stride, token, head = _strides3(array)
    if seqlen == 1:
        return batch_stride, head
    return (token, head) if batch_stride == seqlen * token or int(array.shape[0]) <= 1 else None


def balances(p: DecodeProblem) -> bool:
    """Whether ``flash_attn_with_kvcache`` takes :class:`BalancedDecodeLaunch` for ``p``.

    It can when the cache is paged, ``cache_seqlens`` an array, no rotary, no LSE asked for,
    ``num_splits=0``, the new tokens (if any) are the query tokens and q, k, v read as packed tokens.
    By default (``ragged.BALANCE`` None) it does when the decode kernel's own choice would not split
    the grid (a full wave of CTAs or more) and runs it in at most ``ragged.BALANCE_MAX_WAVES`` waves,
    so that one long sequence would run on one CTA per kv head while the rest finish, and a sequence
    can be long enough to split (more than 1.5 ranges of the rule's shortest).  A grid of more waves
    keeps the decode kernel: the GPU starts each CTA as a slot frees, so a long sequence's CTAs
    overlap the later waves', and measured on the H200 the balanced launch's build cost more than it
    saved, except where a long sequence comes last among short ones (its CTAs then start after
    all others: 1.29x the list's time with one 2,048-key sequence after 255 of 128; NOTES_calls.md,
    nineteenth session).  Never for a table whose rows hold ``ragged.MAX_LIST_KEYS`` keys or more
    (the device list counts keys in 32 bits).  The lengths themselves are on the device: batches of
    equal lengths take it too (the list then splits nothing)."""
    from . import ragged

    if ragged.BALANCE is False or p.block_table is None or isinstance(p.cache_seqlens, int):
        return False
    seqlen_q = int(p.q.shape[1])
    if (p.rotary_cos is not None or p.num_splits != 0 or p.want_lse or p.lse is not None
            or p.seqlen_new not in (0, seqlen_q) or int(p.q.shape[3]) not in TILES
            or _token_strides(p.q, seqlen_q) is None
            or (p.seqlen_new and (_token_strides(p.k_new, seqlen_q) is None
                                  or _token_strides(p.v_new, seqlen_q) is None))):
        return False
    max_blocks, _, shift = _cache_geometry(p)
    if max_blocks << shift >= ragged.MAX_LIST_KEYS:
        return False
    if ragged.BALANCE:
        return True
    shortest = ragged.MIN_SPLIT_TILES * ragged.tile_keys(int(p.q.shape[3]))
    if 2 * (max_blocks << shift) <= 3 * shortest:
        return False
    shape = _problem_shape(p, None)
    ctas = p.batch * p.num_kv_heads * shape.row_groups
    wave = slots(p.q.device, p.q.dtype, int(p.q.shape[3]), shape.tiles)
    return shape.splits == 1 and ctas <= ragged.BALANCE_MAX_WAVES * wave


class BalancedDecodeLaunch(DecodeLaunch):
    """A ``flash_attn_with_kvcache`` call on the ragged kernel with its work list built on the
    device (:class:`ragged.DeviceListLaunch`): each sequence's keys shared out in ranges of one size
    for the whole batch, long sequences split and merged by LSE, so a batch of mixed lengths runs
    at about the rate of a uniform one.  Chosen by :func:`launch_for`; inside a CUDA graph capture
    on a stream that no eager call has prepared (its work-list buffer and split workspace), it runs
    as the :class:`DecodeLaunch` it also is."""

    def __init__(self, p: DecodeProblem):
        from .ragged import ROWS, DeviceListLaunch, RaggedLaunch

        super().__init__(p)
        batch, seqlen_q, num_heads, head_dim = self.out_shape
        max_blocks, num_blocks, shift = _cache_geometry(p)
        appends = p.seqlen_new > 0  # k / v of no tokens append nothing
        ragged = RaggedLaunch(
            self.device, p.q.dtype, (batch * seqlen_q, num_heads, head_dim), _token_strides(p.q, seqlen_q),
            _token_strides(p.k_new, seqlen_q) if appends else None, _token_strides(p.v_new, seqlen_q) if appends else None,
            (num_blocks, 1 << shift, p.num_kv_heads), max_blocks, p.softmax_scale, p.window, p.softcap,
            alibi_batch_stride(p.alibi_slopes))
        row_groups = -(-(num_heads // p.num_kv_heads) * seqlen_q // ROWS)
        self.balanced = DeviceListLaunch(ragged, batch, row_groups, seqlen_q, self.capacity)

    def run(self, kind: str, like, ptrs: tuple, cached_all: int, out, lse_out, stream: int,
            alloc_stream: int | None = None):
        """As :meth:`DecodeLaunch.run` (no LSE: :func:`balances` takes no call that asks for one)."""
        if not self.balanced.ready(stream):
            return super().run(kind, like, ptrs, cached_all, out, lse_out, stream, alloc_stream)
        out_obj, out_ptr, _, _ = outputs(kind, like, out, None, self.out_shape, self.lse_shape, self.dtype, False,
                                         self.q_contiguous, alloc_stream)
        if self.batch:
            q, k_cache, v_cache, k_new, v_new, seqlens, table, _, _, _, _, alibi = ptrs
            self.balanced.run((q, k_cache, v_cache, k_new, v_new, table, alibi), (seqlens, 0, 0), self.out_shape[1],
                              out_ptr, 0, stream)
        return out_obj, None


def launch_for(p: DecodeProblem):
    """The launch of a ``flash_attn_with_kvcache`` call: :class:`BalancedDecodeLaunch` where
    :func:`balances`, else :class:`DecodeLaunch`."""
    return BalancedDecodeLaunch(p) if balances(p) else DecodeLaunch(p)


def plan(p: DecodeProblem, tiles: Tiles | None = None) -> int:
    """The split count ``run`` will use for ``p`` (``p.num_splits``, or the heuristic for 0)."""
    return _problem_shape(p, tiles).splits


def trace_size(p: DecodeProblem, tiles: Tiles | None = None) -> int:
    """Elements of the ``trace`` buffer that ``run(p, tiles, trace=...)`` fills: ``TRACE_COLUMNS``
    per CTA of the decode launch."""
    shape = _problem_shape(p, tiles, trace=True)
    return TRACE_COLUMNS * shape.row_groups * shape.splits * p.num_kv_heads * p.batch


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
