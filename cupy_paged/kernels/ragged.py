"""Launch glue of ``decode.cu``'s ``RAGGED`` specialization: one launch for a whole step, and the
same launch on a work list built on the device for calls without host lengths (:class:`DeviceListLaunch`).

A continuous-batching step mixes prefill chunks, one-token decodes and short multi-token rows.
``paged_decode`` with ``RAGGED=1`` takes them all in one launch over the packed tokens
(``q`` ``[T, H, D]``, the new keys and values ``[T, Hkv, D]``), one CTA per (work item, kv head),
issued in list order (the kv heads of an item together, padding items last):
the step plan lists the items on the host (``runtime/_work.py``) and uploads them with its other
index arrays.  Each item appends its share of the new tokens to the paged cache and attends its
rows; the partial rows of a sequence split over several items are merged by the split CTA that
finishes last (``merge_if_last``: a count per row group and kv head, zeros between launches), so a
step is one launch.  It reads the item list's pointer and count from the plan, so a CUDA graph
replays it with another list of the same length.

``flash_attn_with_kvcache`` and ``flash_attn_varlen_func`` have their lengths on the device only
(``cache_seqlens``, ``cu_seqlens``).  :class:`DeviceListLaunch` has the first CTA of the same launch read
them and write the list by the same rule (the constants below), padded to capacities fixed by host
values (:func:`list_capacities`), while the other CTAs wait for it: one launch, capturable.
"""
from __future__ import annotations

from .._core.errors import word
from .._core.types import alibi_batch_stride, element_strides
from .._core.compiler import get_function
from ._launch import Launcher
from .._core.streams import is_capturing, stream_key
from ._workspace import holds, merge_counts, split_workspace, work_buffer
from .decode import _DECODE_LAYOUT, ROWS_PER_CTA, TILES, kernel_key, slots

# paged_decode's arguments, then the work list and merge counts, then the device list's: the lengths
# (cache_seqlens, cu_seqlens_q, cu_seqlens_k), batch, seqlen_q, max_seqlen_q, key_limit, slots_per_head,
# max_items, max_slots, and the hand-over's ints (null: the host listed the work)
_RAGGED_LAYOUT = _DECODE_LAYOUT + "PP" + "PPP" + "iiiiiii" + "P"
_POINTERS = 21   # paged_decode's pointers, the work list's and the merge counts'
_LIST_ARGS = 11  # the device list's arguments (all zeros: a host list)

# The balance rule, shared by the plan's host list (runtime/_work.py) and the device list (decode.cu's
# build_list, kList* constants): the keys of a step shared out over WAVES waves of CTA slots per kv head, a
# range at least MIN_SPLIT_TILES tiles, at most MAX_SPLITS splits a sequence; nothing splits in a step whose
# longest sequence holds at most 1.5 times one wave's share of the keys (about level, about one wave).
ROWS = 16          # decode.cu kRows: rows of a row group
WORK_INTS = 8      # decode.cu WorkItem
SYNC_INTS = 8      # the device list's hand-over (3 ints used: ready, ticket, direct), ahead of its items
WAVES = 2
MIN_SPLIT_TILES = 4
MAX_SPLITS = 128   # decode.cu kMaxSplits: merge_if_last's weights, [16 rows][MAX_SPLITS] floats
# The device list counts a sequence's keys in 32 bits: it serves tables whose rows hold fewer keys.
MAX_LIST_KEYS = 1 << 30

# Whether calls without host lengths take the device-built list (DeviceListLaunch): None lets
# kernels.decode.balances (flash_attn_with_kvcache) and VarlenLaunch (short rows) decide; True /
# False: always where it can serve / never.  For benchmarks and tests.  flash_attn_with_kvcache reads
# it when its launch is made (a memoised call keeps that choice: clear api._call.MEMO after a
# change); flash_attn_varlen_func at every call.
BALANCE = None
# flash_attn_with_kvcache's default balances a grid of at most this many waves of the decode
# kernel's CTAs (kernels.decode.balances; read when a launch is made, kept by a memoised call as
# BALANCE is).
BALANCE_MAX_WAVES = 2


def tile_keys(head_dim: int) -> int:
    """Keys per pipeline stage of the ragged kernel (the plan's split ranges are whole tiles)."""
    return TILES[head_dim].keys


def slots_per_head(device: int, dtype, head_dim: int, num_kv_heads: int) -> int:
    """CTA slots of one wave per kv head: what the plan shares the keys out over."""
    return max(1, slots(device, dtype, head_dim, TILES[head_dim], ragged=True) // max(num_kv_heads, 1))


def workspace_floats(slots: int, num_kv_heads: int, head_dim: int) -> int:
    """Floats of the split workspace: each slot's partial rows ``[Hkv][16][D]`` and their LSEs."""
    return slots * num_kv_heads * ROWS_PER_CTA * (head_dim + 1)


class RaggedLaunch:
    """One layer shape of a ragged step, resolved: kernels, scalars packed once; :meth:`run` adds
    the pointers and launches.

    Parameters
    ----------
    device : int
    dtype : numpy.dtype
    q_shape : tuple
        ``(T, H, D)``: the packed query tokens (16-byte aligned rows).
    q_strides : tuple
        Their ``(token, head)`` element strides.
    kn_strides, vn_strides : tuple or None
        The same of the new keys and values ``[T, Hkv, D]``, appended to the cache; None when the
        cache already holds them (query token i of a sequence is then its key cached - q_len + i).
    cache_shape : tuple
        ``(num_blocks, block_size, Hkv)`` of the paged cache.
    max_blocks : int
        Block table width.
    softmax_scale, softcap : float
    window : tuple of int
    alibi_stride : int
        ``alibi_batch_stride`` of the slopes (0 for ``[H]`` or none).
    trace : cupy.ndarray, optional
        A uint64 buffer of ``decode.TRACE_COLUMNS`` per CTA of the grid: launches the ``TRACE``
        specialization, which records each CTA's start, the moment it knows its item, its end, SM
        and number (for ``benchmarks/trace_list.py``; registered keys hold no trace code).

    :meth:`from_arrays` takes the step's arrays instead.
    """

    @classmethod
    def from_arrays(cls, q, k_cache, k_new, v_new, max_blocks: int, softmax_scale: float, window=(-1, -1),
                    softcap: float = 0.0, alibi_slopes=None, trace=None) -> "RaggedLaunch":
        """The launch of Array descriptors: ``q`` ``[T, H, D]``, ``k_cache`` ``[num_blocks,
        block_size, Hkv, D]``, ``k_new``/``v_new`` ``[T, Hkv, D]`` or None, ``alibi_slopes`` or None;
        ``trace`` as the constructor takes it."""
        return cls(q.device, q.dtype, tuple(int(x) for x in q.shape), element_strides(q)[:2],
                   None if k_new is None else element_strides(k_new)[:2],
                   None if v_new is None else element_strides(v_new)[:2], tuple(int(x) for x in k_cache.shape[:3]),
                   max_blocks, softmax_scale, window, softcap, alibi_batch_stride(alibi_slopes), trace)

    def __init__(self, device: int, dtype, q_shape: tuple, q_strides: tuple, kn_strides, vn_strides,
                 cache_shape: tuple, max_blocks: int, softmax_scale: float, window, softcap: float, alibi_stride: int,
                 trace=None):
        total, num_heads, head_dim = q_shape
        num_blocks, block_size, num_kv_heads = cache_shape
        self.device, self.dtype = device, dtype
        self.out_shape, self.lse_shape = (total, num_heads, head_dim), (num_heads, total)
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        tiles = TILES[head_dim]
        self.threads, self.smem = tiles.threads, tiles.smem_bytes(head_dim)
        self.key = key = kernel_key(dtype, head_dim, trace=trace is not None, ragged=True)
        decode = get_function(key, "paged_decode", self.smem)
        appends = kn_strides is not None
        kn = tuple(int(s) for s in kn_strides) if appends else (0, 0)
        vn = tuple(int(s) for s in vn_strides) if appends else (0, 0)
        left, right = window
        params = [0, *(int(s) for s in q_strides), 0, *kn, 0, *vn, max_blocks, num_blocks,
                  block_size.bit_length() - 1, 0, total, int(appends), num_heads, num_kv_heads, 0, 0, left, right,
                  0, 0, 0, 0, 0, alibi_stride, 0, 0, float(softmax_scale), float(softcap)]
        self.launch = Launcher(decode, _RAGGED_LAYOUT + ("" if trace is None else "P"))
        self.launch.pack(*params, *([0] * (_POINTERS + _LIST_ARGS)), *(() if trace is None else (trace.data.ptr,)))
        self._pointer_span = self.launch.span(len(params), _POINTERS)
        self._list_span = self.launch.span(len(params) + _POINTERS, _LIST_ARGS)
        self.listed_on_device = False  # DeviceListLaunch's: every run passes the list's arguments
        self.errors = word(self.device)
        # (stream_key, slots) -> (part_out, part_lse, counts) pointers.  Safe to keep: the buffers are
        # only ever replaced by larger ones, and the replaced ones stay allocated (_workspace).
        self._split_ptrs: dict[tuple, tuple[int, int, int]] = {}

    def _split_buffers(self, slots: int, stream: int) -> tuple[int, int, int]:
        floats = workspace_floats(slots, self.num_kv_heads, self.head_dim)
        part_out = split_workspace(floats, self.device, stream).data.ptr
        part_lse = part_out + 4 * slots * self.num_kv_heads * ROWS_PER_CTA * self.head_dim
        counts = merge_counts(slots * self.num_kv_heads, self.device, stream).data.ptr
        self._split_ptrs[(stream_key(stream), slots)] = found = (part_out, part_lse, counts)
        return found

    def run(self, ptrs: tuple, work: tuple, out_ptr: int, lse_ptr: int, stream: int, *spans) -> None:
        """Launch on ``stream``.  ``ptrs``: q, k_cache, v_cache, k_new, v_new, block_table,
        alibi_slopes (0 for none); ``work``: (work pointer, items, slots) of the plan: slots 0
        when no sequence is split; ``spans``: more ``(struct, offset, values)`` to rewrite (the
        device list's arguments, :class:`DeviceListLaunch`)."""
        q, k_cache, v_cache, k_new, v_new, table, alibi = ptrs
        work_ptr, items, slots = work
        if items == 0:
            return
        if self.listed_on_device and not spans:
            raise RuntimeError("this launch lists its work on the device: run it through its DeviceListLaunch")
        part_out = part_lse = counts = 0
        if slots:
            part_out, part_lse, counts = (self._split_ptrs.get((stream_key(stream), slots))
                                          or self._split_buffers(slots, stream))
        struct_, at = self._pointer_span
        self.launch.launch((items * self.num_kv_heads, 1, 1), self.threads, self.smem, stream,
                           (struct_, at, (q, k_cache, v_cache, k_cache, v_cache, k_new, v_new, 0, table, 0, 0,
                                          0, 0, alibi, out_ptr, lse_ptr, part_out, part_lse, self.errors,
                                          work_ptr, counts)), *spans)


def list_capacities(batch: int, row_groups: int, per_head: int) -> tuple[int, int]:
    """``(items, workspace slots)`` that any list of ``batch`` sequences of at most ``row_groups``
    row groups needs under the balance rule with ``per_head`` CTA slots a kv head
    (:class:`DeviceListLaunch` gives the reasoning)."""
    spread = -(-10 * per_head // 3) + 1
    return row_groups * batch + spread, spread


class DeviceListLaunch:
    """A ragged launch whose work list the device builds: for calls that have no host lengths
    (``flash_attn_with_kvcache``'s ``cache_seqlens``, ``flash_attn_varlen_func``'s ``cu_seqlens``
    on the GPU).  The first CTA of the ragged launch to start lists the items by the plan's rule from the lengths
    while the others wait (decode.cu ``wait_for_list``), on a grid of the list's capacity (padding
    items do nothing), so a CUDA graph captures the one launch and replays it with other lengths.

    The capacities follow from the rule: a split sequence has more than 1.5 ranges of at least
    ``total / (WAVES * slots)`` keys, so its items number less than 5/3 of its keys over a range,
    and all split items together less than ``10/3 * slots`` (``slots``: CTA slots of a wave per kv
    head).  The device list also doubles the range while a list would not fit, as the host list
    does.

    Parameters
    ----------
    ragged : RaggedLaunch
    batch : int
        Sequences.
    row_groups : int
        The most row groups a sequence has (its query heads of a kv head times its query tokens,
        in 16s).
    seqlen_q : int
        Query tokens of every sequence (``flash_attn_with_kvcache``); 0 for ``cu_seqlens`` calls.
    key_limit : int
        Keys a block table row holds: lengths beyond it are counted at it (the kernel reports them).
    """

    def __init__(self, ragged: RaggedLaunch, batch: int, row_groups: int, seqlen_q: int, key_limit: int):
        self.ragged = ragged
        ragged.listed_on_device = True
        per_head = slots_per_head(ragged.device, ragged.dtype, ragged.head_dim, ragged.num_kv_heads)
        self.max_items, self.max_slots = list_capacities(batch, row_groups, per_head)
        self.ints = WORK_INTS * self.max_items
        self.floats = workspace_floats(self.max_slots, ragged.num_kv_heads, ragged.head_dim)
        self.counts = self.max_slots * ragged.num_kv_heads
        self._work_ptrs: dict = {}  # stream_key -> its work list and hand-over ints (kept: see RaggedLaunch)
        self._batch, self._seqlen_q, self._key_limit, self._per_head = batch, seqlen_q, key_limit, per_head

    def ready(self, stream: int) -> bool:
        """Whether :meth:`run` can launch on ``stream`` now: always, except inside a CUDA graph
        capture before an eager call on that stream has sized its buffers (the callers then take
        the kernel they would take without balancing, which needs none)."""
        return (stream_key(stream) in self._work_ptrs
                or holds(self.floats, self.ints + SYNC_INTS, self.counts, self.ragged.device, stream)
                or not is_capturing(stream))

    def run(self, ptrs: tuple, lengths: tuple, max_seqlen_q: int, out_ptr: int, lse_ptr: int, stream: int) -> None:
        """Launch on ``stream``.  ``ptrs``: as :meth:`RaggedLaunch.run`; ``lengths``: the
        pointers of cache_seqlens, cu_seqlens_q, cu_seqlens_k (0 for those not given).

        The work list lives in a buffer of (device, stream), like the split workspace: calls on one
        stream are ordered, so each call's list is read before the next call writes it; two host
        threads launching on the same stream at once must not share it, nor may a CUDA graph
        captured on this stream be replayed on another while this stream runs the same shapes (the
        hand-over's ints and the merge counts would be shared by two launches at once).  The
        hand-over's ints sit at the buffer's start (a fixed place, whatever list a launch writes
        after them)."""
        key = stream_key(stream)
        found = self._work_ptrs.get(key)
        if found is None:
            sync = work_buffer(self.ints + SYNC_INTS, self.ragged.device, stream).data.ptr
            found = self._work_ptrs[key] = (sync + 4 * SYNC_INTS, sync)
        work, sync = found
        ragged = self.ragged
        ragged.run(ptrs, (work, self.max_items, self.max_slots), out_ptr, lse_ptr, stream,
                   (*ragged._list_span, (*lengths, self._batch, self._seqlen_q, max_seqlen_q, self._key_limit,
                                         self._per_head, self.max_items, self.max_slots, sync)))
