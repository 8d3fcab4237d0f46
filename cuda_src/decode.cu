// flash_attn_with_kvcache: attention of a few query tokens per sequence over a paged KV cache.
//
// Compile-time parameters (cupy_paged/kernels/decode.py spells them in the kernel key):
//   SCALAR_T    __half or __nv_bfloat16 (q, caches, new k/v, out)
//   HEAD_DIM    32, 64, 96, 128 or 256
//   TILE_KEYS   keys per pipeline stage (a multiple of 16 keys per warp)
//   STAGES      depth of the cp.async pipeline (>= 3): STAGES - 1 tiles in flight
//   WARPS       warps per CTA (1, 2, 4 or 8); a CTA asks for 8 warps' worth of residency per SM
//   SMEM_BYTES  the dynamic shared memory the host launches with (Tiles.smem_bytes), checked
//               against the layout (Smem) at compile time
//   ROTARY      0 or 1: whether the kernel holds the rotary-embedding code (default 0).  The code
//               stays out of the ROTARY=0 kernel entirely, its K/V loop included.
//   TRACE       0 or 1: whether paged_decode takes a trace buffer and records each CTA's start,
//               the moment it knows its work, its end, its SM and its number in it (default 0;
//               only the benchmarks' keys set it: bench_decode.py, trace_list.py)
//   RAGGED      0 or 1: the work-list kernel of a continuous-batching step, or of a call balanced by
//               length on the device (build_list, by the launch's first CTA), (default 0), below
// Everything else (block size, window, softcap, ALiBi, splits, GQA ratio, seqlen_q, rotary layout)
// is a run-time argument, so two dtypes x five head dims (x rotary or not) are the whole family.
//
// paged_decode: one CTA of WARPS warps per (row group, split, kv head, sequence).  A "row" is one
// (query head of the GQA group, query token) pair; a row group is the 16 rows of an mma A operand
// (padding rows are zero), so with group * seqlen_q <= 16 every K/V byte is read once.  K/V tiles
// go global -> shared memory through cp.async (swizzled rows, see cp::SmemTile), STAGES - 1 tiles in
// flight while one is computed.  No cp.async waits on a block-table read: the ids of a tile
// travel in the cp.async group issued STAGES - 1 tiles before the tile's own, so the pipeline's
// wait covers them and a table read gets the same latency budget as the data it addresses.
// Each warp takes TILE_KEYS / WARPS keys of a tile in groups of 16 and runs them on tensor cores:
//   S[16 x 16] = Q K^T      mma m16n8k16, Q fragments by ldmatrix, K fragments by ldmatrix
//   online softmax          on the accumulator fragments, log2 domain (S scaled by scale * log2 e)
//   O[16 x D] += P V        P re-packed from the accumulators, V fragments by ldmatrix.trans
// Each warp keeps its own (m, l, O); the warps' states are merged through shared memory at the end.
// With num_splits > 1 each split covers a contiguous key range and writes a normalised partial
// output and its LSE to a float32 workspace; combine_splits merges them (flash-decoding).
// The kernel body (paged_decode, at the end) is the sequence of these steps, one function each.
//
// New tokens (k_new/v_new): key j >= cache_seqlens[b] is read from k_new/v_new directly by every CTA
// that needs it, and the CTAs of split 0 / row group 0 copy the new tokens into the cache.  No CTA
// reads a cache slot that this launch writes, so the fused append has no race.
//
// A contiguous cache [Bc, S, Hkv, D] is read as Bc * S blocks of one token through an identity table
// (kernels/decode.py keeps one per device), and an int cache_seqlens comes as one value for every
// sequence (DecodeParams::cached_all): a call builds no index arrays.  Sequence b reads cache row
// cache_batch_idx[b] (else b) from position L = cache_leftpad[b] (else 0): its table row starts L
// columns into the identity row of that cache row, it has S - L usable columns and
// cache_seqlens[b] - L cached keys.  Keys are numbered from L on, so the masks, the windows and the
// ALiBi distances (all relative) need nothing else; only rotary positions are absolute (L + key).
//
// Rotary embedding (ROTARY=1, rotary_dim > 0; FlashAttention-2's semantics, rotary.cuh): the Q tile
// is rotated in shared memory after its load (query token i at cache_seqlens[b] + i with
// rotary_flags bit 1, else at cache_seqlens[b]), the new keys in the K stage of each tile that holds
// some (new key t at cache_seqlens[b] + t), and the fused append writes the same rotated keys; v is
// never rotated.
//
// Safety: a block id outside [0, num_blocks), a block-table column past the usable columns, a
// negative cache_seqlens, a cache row outside the cache are treated as holes: no read, no write, the
// keys count as masked (a new token whose slot is a hole is still attended, from k_new, but not
// appended; a sequence whose cache row is outside the cache sees no key at all).  The bad values are
// reported in the device error word (cp::report_error) outside the K/V loop: the sequence-level
// checks by split 0 / row group 0 / kv head 0, the block ids by the row group 0 / kv head 0 CTA of
// each split over its own key range (split 0 also over the columns before it), so that no CTA reads
// a long table row alone.  A rotary position past seqlen_ro leaves that row unrotated (reported).
//
// RAGGED=1: one launch for a whole step whose sequences have different query lengths (prefill
// chunks, decodes, speculative rows), q / k_new / v_new / out packed as [T, H(kv), D] tokens.  CTA
// number n takes kv head n % Hkv of work item n / Hkv (so the CTAs start in list order, every kv head
// of an item together, and the padding items' CTAs come last); n is blockIdx.x where the step plan
// built the list on the host (runtime/_work.py), and the CTA's ticket (the order it started in,
// wait_for_list) where the launch's first CTA builds it on the device (build_list) from a call's lengths
// (at the end): sequence b, row group, split of its keys, its split count, its first
// token in the packed arrays, its query length, its cached keys, and the first workspace slot of its
// splits.  Rows are (group head, query token) as above, per sequence; a row group whose rows see
// none of a split's keys loads none.  Query token i of b sits at key cached + i (its own key, read
// from k_new), and the CTAs of split 0 append b's new tokens, each row group its share.  A sequence
// of one split writes out directly; the splits of a longer one write partial rows to workspace slot
// (slot + split) and the last of them to finish merges them (merge_if_last).  An item of query length 0 is padding (a graph
// replayed with fewer items) and does nothing.  ROTARY and a contiguous cache are not offered here.
#include "common.cuh"
#include "mma.cuh"
#include "paged.cuh"

#ifndef ROTARY
#define ROTARY 0
#endif
#ifndef TRACE
#define TRACE 0
#endif
#ifndef RAGGED
#define RAGGED 0
#endif
#if RAGGED && ROTARY
#error "RAGGED does not take ROTARY"
#endif

namespace decode {

using T = SCALAR_T;
using cp::u32;
constexpr int kHeadDim = HEAD_DIM;
constexpr int kTileKeys = TILE_KEYS;
constexpr int kStages = STAGES;
// Tiles whose ids are in shared memory at once: ids run STAGES - 1 tiles ahead of the data,
// which runs STAGES - 1 tiles ahead of the math.
constexpr int kIdSlots = 2 * (kStages - 1);
constexpr int kWarps = WARPS;
constexpr int kThreads = kWarps * 32;
static_assert(kWarps == 1 || kWarps == 2 || kWarps == 4 || kWarps == 8, "WARPS must be 1, 2, 4 or 8");
constexpr int kRows = 16;  // query rows per CTA: the M of mma.m16n8k16
constexpr int kChunks = kHeadDim / cp::kVecElems;  // 16-byte chunks per key row
using Tile = cp::SmemTile<kChunks>;
constexpr int kKSteps = kHeadDim / 16;                // k-steps of S = Q K^T
constexpr int kKeysPerWarp = kTileKeys / kWarps;
constexpr int kGroups = kKeysPerWarp / 16;            // 16-key groups per warp per tile
// Resident CTAs per SM that __launch_bounds__ asks registers for: 8 warps per SM in all, however
// they are grouped in CTAs (the kernel's rate follows the warps per SM).
constexpr int kMinCtas = kWarps >= 8 ? 1 : 8 / kWarps;
// Q fragments stay in registers up to D = 128; at D = 256 they are re-read from shared memory
// so that O (128 floats per thread) fits without spills.
constexpr bool kQInRegs = kHeadDim <= 128;
// Tile loads: kChunkLanes consecutive lanes cover one key's row (coalesced 64-128 byte runs), each
// lane kChunksPerThread chunks of it; a pass covers kKeysPerPass keys.
constexpr int kChunkLanes = kChunks % 8 == 0 ? 8 : 4;
constexpr int kChunksPerThread = kChunks / kChunkLanes;
constexpr int kKeysPerPass = kThreads / kChunkLanes;
constexpr int kPasses = kTileKeys / kKeysPerPass;
using cp::inf;
using cp::kLn2;
using cp::kLog2e;
static_assert(kHeadDim % 16 == 0 && kChunks % kChunkLanes == 0, "head_dim must be a multiple of 16");
static_assert(kGroups >= 1 && kKeysPerWarp % 16 == 0, "each warp takes whole groups of 16 keys");
static_assert(kPasses >= 1 && kTileKeys % kKeysPerPass == 0, "each thread issues the same cp.async count");
// The loaded-tile vote (one __syncthreads_and per iteration, on the tile after the one computed)
// needs that tile issued before the barrier: true from 3 stages on.  Each thread keeps its flags
// of the kStages - 2 tiles issued but not yet voted on (Votes::pending).
static_assert(kStages >= 3, "the loaded-tile vote needs the next tile issued an iteration early");

// Shared memory (bytes): K stages, V stages, one flag per key (1 = the key was loaded), the Q tile,
// the block id of each key of kIdSlots tiles, and 16 bytes of the sequence's entries: cache_seqlens,
// cache_batch_idx, cache_leftpad, the smallest bad block-table column found (Seq below).  The first
// bytes are reused for the cross-warp merge at the end.
struct Smem {
  static constexpr int kStageBytes = Tile::bytes(kTileKeys);
  static constexpr int kV = kStages * kStageBytes;
  static constexpr int kFlags = 2 * kStages * kStageBytes;
  static constexpr int kQ = kFlags + kStages * kTileKeys * 4;
  static constexpr int kIds = kQ + Tile::bytes(kRows);
  static constexpr int kSeqlen = kIds + kIdSlots * kTileKeys * 4;  // Seq, 16 bytes
  static constexpr int kBytes = kSeqlen + 16;
  static constexpr int kMergeBytes = kWarps * kRows * (kHeadDim + 2) * 4;
  static_assert(kMergeBytes <= kFlags, "merge scratch must fit in the pipeline buffers");
};
// The host launches with SMEM_BYTES of dynamic shared memory (Tiles.smem_bytes in
// kernels/decode.py): it must be this layout's size.
static_assert(Smem::kBytes == SMEM_BYTES, "Tiles.smem_bytes differs from Smem::kBytes");
// The 4 ints at Smem::kSeqlen.
enum Seq : int { kSeqLength = 0, kSeqRow = 1, kSeqLeftpad = 2, kSeqBadColumn = 3 };
constexpr int kNoColumn = 0x7fffffff;  // kSeqBadColumn before any bad column is found

// The CTA's shared-memory buffers (Smem): shared addresses for cp.async and ldmatrix, pointers
// for plain loads and stores.
struct Buffers {
  unsigned char* raw;  // the dynamic shared memory: stage s of K at raw + s * kStageBytes
  u32 ks, vs, qs;      // K stages, V stages, the Q tile
  u32 ids_s;           // the id slots [kIdSlots][kTileKeys]
  int* flags;          // [kStages][kTileKeys]: 1 = the key was loaded
  const int* ids;      // the id slots
  int* seq;            // the Seq entries
};

__device__ __forceinline__ Buffers buffers(unsigned char* smem_raw) {
  Buffers buf;
  buf.raw = smem_raw;
  buf.ks = cp::smem_address(smem_raw);
  buf.vs = buf.ks + Smem::kV;
  buf.qs = buf.ks + Smem::kQ;
  buf.ids_s = buf.ks + Smem::kIds;
  buf.flags = reinterpret_cast<int*>(smem_raw + Smem::kFlags);
  buf.ids = reinterpret_cast<const int*>(smem_raw + Smem::kIds);
  buf.seq = reinterpret_cast<int*>(smem_raw + Smem::kSeqlen);
  return buf;
}

// Where the keys of one sequence live: the cache through the block table, the new tokens in k_new.
struct KeySource {
  const cp::Vec8* k_cache;
  const cp::Vec8* v_cache;
  const T* k_new;
  const T* v_new;
  long long kn_token, vn_token;  // element strides of k_new/v_new along seqlen_new
  const int* table_row;          // block_table[b] (a contiguous cache: its row's identity, from L on)
  int max_blocks;                // usable columns of table_row (0: none)
  int num_blocks;
  paged::Blocks blocks;          // the cache's block size
  int num_kv_heads, kv_head, cached;  // cached keys: cache_seqlens[b] - L (>= 0)

  // The 16-byte vector `vec` of this kv head's row of key j, which lives in block `block`.
  __device__ __forceinline__ long long cache_vec(int block, int j, int vec) const {
    return (blocks.slot_wide(block, j) * num_kv_heads + kv_head) * kChunks + vec;
  }
};

// The key of pass p that this thread loads, relative to the tile start.
__device__ __forceinline__ int pass_key(int p) { return p * kKeysPerPass + threadIdx.x / kChunkLanes; }

// This thread's share of the K and V rows of the tile at `start` -> pipeline stage `stage`, keys
// past `end` or in holes zero-filled, each key's loaded flag recorded.  Returns whether every key
// of its share was loaded.
template <bool kNewTokens>
__device__ __forceinline__ bool issue_tile(const KeySource& src, int start, int end, int stage,
                                           const int (&blocks)[kPasses], u32 ks, u32 vs, int* flags) {
  bool all_ok = true;  // every key of this thread's share loaded (no hole, none past the range)
  const int lane_chunk = threadIdx.x % kChunkLanes;
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int key = pass_key(p);
    const int j = start + key;
    const cp::Vec8* kp = src.k_cache;
    const cp::Vec8* vp = src.v_cache;
    bool ok = false;
    if (j < end) {
      if (j < src.cached) {
        if (blocks[p] >= 0) {
          const long long at = src.cache_vec(blocks[p], j, 0);
          kp = src.k_cache + at;
          vp = src.v_cache + at;
          ok = true;
        }
      } else if (kNewTokens) {
        const long long t = j - src.cached;
        kp = reinterpret_cast<const cp::Vec8*>(src.k_new + t * src.kn_token);
        vp = reinterpret_cast<const cp::Vec8*>(src.v_new + t * src.vn_token);
        ok = true;
      }
    }
    const u32 row = stage * Smem::kStageBytes;
#pragma unroll
    for (int c = 0; c < kChunksPerThread; ++c) {
      const int chunk = lane_chunk + c * kChunkLanes;
      const u32 at = row + Tile::offset(key, chunk);
      cp::cp_async_16(ks + at, kp + (ok ? chunk : 0), ok);
      cp::cp_async_16(vs + at, vp + (ok ? chunk : 0), ok);
    }
    if (lane_chunk == 0) flags[stage * kTileKeys + key] = ok;
    all_ok &= ok;
  }
  return all_ok;
}

// The block-table entries of the tile at `start` -> its id slot (`slot`, a shared-memory
// address), one 4-byte cp.async per key.  Keys outside [0, limit) read nothing (the slot gets 0,
// which read_blocks discards); `limit` (Loader::id_limit) stops at the usable columns too.
// Not unrolled: a thread has at most one key in the registered shapes, and the unrolled loop's
// remainder code (the trip count is not a constant to the compiler) would sit in the K/V loop.
__device__ __forceinline__ void issue_ids(const KeySource& src, int start, int limit, u32 slot) {
#pragma unroll 1
  for (int key = threadIdx.x; key < kTileKeys; key += kThreads) {
    const int j = start + key;
    const bool ok = static_cast<unsigned>(j) < static_cast<unsigned>(limit);  // 0 <= j < limit
    cp::cp_async_4(slot + 4 * key, src.table_row + (ok ? static_cast<unsigned>(src.blocks.column(j)) : 0u), ok);
  }
}

// This thread's block ids of the tile at `start` from its id slot, -1 for a hole (and for a key
// outside [0, limit), whose slot issue_ids left 0).
__device__ __forceinline__ void read_blocks(const KeySource& src, int start, int limit, const int* slot,
                                            int (&blocks)[kPasses]) {
#pragma unroll
  for (int p = 0; p < kPasses; ++p) {
    const int key = pass_key(p);
    const int j = start + key;
    const int id = slot[key];
    const bool ok = static_cast<unsigned>(j) < static_cast<unsigned>(limit) && paged::is_block(id, src.num_blocks);
    blocks[p] = ok ? id : -1;
  }
}

}  // namespace decode

#if ROTARY
#include "rotary.cuh"
#endif

namespace decode {

#if !ROTARY
// ROTARY=0 holds no rotation code: the steps that rotate under ROTARY=1 take this empty stand-in.
struct Rotary {};
#endif

// Scalar arguments of paged_decode, passed as one struct by value (kernels/decode.py packs it with
// struct.pack("<9q20i2f")): one kernel argument instead of 41 keeps the host's launch cost down.
struct DecodeParams {
  long long q_batch, q_token, q_head;     // element strides of q
  long long kn_batch, kn_token, kn_head;  // of k_new (0 without new tokens)
  long long vn_batch, vn_token, vn_head;  // of v_new
  int max_blocks, num_blocks, block_shift;  // a contiguous cache: S, Bc * S, 0
  int cached_all;                         // every sequence's cache_seqlens when that pointer is null
  int seqlen_q, seqlen_new, num_heads, num_kv_heads;
  int num_rows, row_groups, win_left, win_right;
  int num_splits;
  int cache_rows;                         // Bc of a contiguous cache, 0 for a paged one
  int rotary_dim;                         // 0: no rotary embedding (always 0 for ROTARY=0)
  int rotary_flags;                       // bit 0: interleaved (else NeoX); bit 1: q token i at +i
  int seqlen_ro;                          // rows of rotary_cos / rotary_sin
  int alibi_batch_stride;                 // 0: alibi_slopes [H]; H: [B, H]
  int unused0, unused1;                   // pad the struct to its 8-byte alignment
  float softmax_scale, softcap;
};
static_assert(sizeof(DecodeParams) == 9 * 8 + 20 * 4 + 2 * 4 && sizeof(DecodeParams) == 160,
              "DecodeParams must match the host's struct.pack layout");

// ---------------------------------------------------------------------------- setup

// This CTA's place in the launch, grid = (row groups x splits, kv heads, sequences) (with RAGGED:
// items x kv heads, see locate), and the launch's shape.  Read once at entry: the output steps after the K/V loop take the shape from
// here, since reading the parameters again there changes the loop's register allocation.
struct Cta {
  int row_group, split, kv_head, b;
  int warp, lane;
  int g, t;   // fragment row and column pair (mma.cuh)
  int group;  // query heads per kv head
  int batch, seqlen_q, num_heads, num_rows, num_splits;
#if RAGGED
  int q_start, cached, slot, row_groups, total_q;  // the work item's (see WorkItem), T
  int num_kv_heads;
#endif
};

#if RAGGED
// One entry of the work list (8 ints, 32 bytes): built by the step plan (runtime/_work.py).
struct WorkItem {
  int b, row_group, split, num_splits;
  int q_start, q_len, cached, slot;
};

__device__ __forceinline__ WorkItem load_item(const int* work, int index) {
  const int4* at = reinterpret_cast<const int4*>(work) + 2 * (long long)index;
  const int4 a = __ldcg(at), c = __ldcg(at + 1);  // L2: the device list is written by this launch's first CTA
  return WorkItem{a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
}
#endif

// Where this CTA's sequence starts in q / k_new / v_new, in elements: token q_start of the packed
// tokens with RAGGED (``token_stride`` per token), else batch row b (``batch_stride`` per row).
__device__ __forceinline__ long long sequence_offset(const Cta& cta, long long token_stride, long long batch_stride) {
#if RAGGED
  return cta.q_start * token_stride;
#else
  return cta.b * batch_stride;
#endif
}

// The query length, the rows and the split count of this CTA's sequence: the launch's, or with
// RAGGED the work item's.
__device__ __forceinline__ int seq_len_q(const DecodeParams& params, const Cta& cta) {
  return RAGGED ? cta.seqlen_q : params.seqlen_q;
}
__device__ __forceinline__ int seq_rows(const DecodeParams& params, const Cta& cta) {
  return RAGGED ? cta.num_rows : params.num_rows;
}
__device__ __forceinline__ int seq_splits(const DecodeParams& params, const Cta& cta) {
  return RAGGED ? cta.num_splits : params.num_splits;
}

// What every CTA of either kind finds the same way: this thread's warp and fragment coordinates, the
// GQA group (and its kv head in the 3-D grid; locate sets the RAGGED one's).
__device__ __forceinline__ void place_thread(Cta& cta, const DecodeParams& params) {
  cta.kv_head = blockIdx.y;
  cta.warp = threadIdx.x / 32;
  cta.lane = threadIdx.x % 32;
  cta.g = cta.lane / 4;
  cta.t = cta.lane % 4;
  cta.group = params.num_heads / params.num_kv_heads;
  cta.num_heads = params.num_heads;
}

#if RAGGED
__device__ __forceinline__ Cta locate(const DecodeParams& params, const WorkItem& item, int number) {
  Cta cta;
  place_thread(cta, params);
  cta.kv_head = number % params.num_kv_heads;
  cta.num_kv_heads = params.num_kv_heads;
  cta.row_group = item.row_group;
  cta.split = item.split;
  cta.b = item.b;
  cta.batch = 0;
  cta.seqlen_q = item.q_len;
  cta.num_rows = cta.group * item.q_len;
  cta.num_splits = item.num_splits;
  cta.q_start = item.q_start;
  cta.cached = item.cached;
  cta.slot = item.slot;
  cta.row_groups = (cta.num_rows + kRows - 1) / kRows;
  cta.total_q = params.seqlen_q;
  return cta;
}
#else
__device__ __forceinline__ Cta locate(const DecodeParams& params) {
  Cta cta;
  place_thread(cta, params);
  cta.row_group = blockIdx.x % params.row_groups;
  cta.split = blockIdx.x / params.row_groups;
  cta.b = blockIdx.z;
  cta.batch = gridDim.z;
  cta.seqlen_q = params.seqlen_q;
  cta.num_rows = params.num_rows;
  cta.num_splits = params.num_splits;
  return cta;
}
#endif

// Prologue, first round trip: the sequence's entries (Seq) and the Q tile [16 rows][D] (padding
// rows zero) -> shared memory by cp.async, all in flight together; waited for.  With RAGGED the
// work item has already named the sequence and its cached keys, so the first tiles' block ids need
// nothing from this load: Loader::prologue issues them into the same round trip and waits for both.
__device__ __forceinline__ void load_sequence_and_q(const DecodeParams& params, const Cta& cta, const Buffers& buf,
                                                    const T* q, const int* cache_seqlens, const int* cache_batch_idx,
                                                    const int* cache_leftpad) {
  if (threadIdx.x == 0) {
#if RAGGED
    buf.seq[kSeqLength] = cta.cached;  // the work item's: cache_seqlens, cache_batch_idx, cache_leftpad unused
    buf.seq[kSeqRow] = cta.b;
    buf.seq[kSeqLeftpad] = 0;
#else
    if (cache_seqlens) cp::cp_async_4(buf.ks + Smem::kSeqlen + 4 * kSeqLength, cache_seqlens + cta.b, true);
    else buf.seq[kSeqLength] = params.cached_all;
    if (cache_batch_idx) cp::cp_async_4(buf.ks + Smem::kSeqlen + 4 * kSeqRow, cache_batch_idx + cta.b, true);
    else buf.seq[kSeqRow] = cta.b;
    if (cache_leftpad) cp::cp_async_4(buf.ks + Smem::kSeqlen + 4 * kSeqLeftpad, cache_leftpad + cta.b, true);
    else buf.seq[kSeqLeftpad] = 0;
#endif
    buf.seq[kSeqBadColumn] = kNoColumn;
  }
  const int seqlen_q = seq_len_q(params, cta);
  for (int index = threadIdx.x; index < kRows * kChunks; index += kThreads) {
    const int r = index / kChunks, c = index % kChunks;
    const int row = cta.row_group * kRows + r;
    const bool real = row < seq_rows(params, cta);
    const cp::Vec8* qp = reinterpret_cast<const cp::Vec8*>(q);
    if (real) qp = reinterpret_cast<const cp::Vec8*>(q + sequence_offset(cta, params.q_token, params.q_batch) +
                                                      (row % seqlen_q) * params.q_token +
                                                      (cta.kv_head * cta.group + row / seqlen_q) * params.q_head) + c;
    cp::cp_async_16(buf.qs + Tile::offset(r, c), qp, real);
  }
  cp::cp_async_commit();
#if !RAGGED
  cp::cp_async_wait<0>();
  __syncthreads();
#endif
}

// The parts of the key source that need no sequence entry: the caches, this kv head's new tokens.
__device__ __forceinline__ KeySource key_source(const DecodeParams& params, const Cta& cta, const cp::Vec8* k_cache,
                                                const cp::Vec8* v_cache, const T* k_new, const T* v_new) {
  KeySource src;
  src.k_cache = k_cache;
  src.v_cache = v_cache;
  src.k_new = k_new ? k_new + sequence_offset(cta, params.kn_token, params.kn_batch) + cta.kv_head * params.kn_head
                    : nullptr;
  src.v_new = v_new ? v_new + sequence_offset(cta, params.vn_token, params.vn_batch) + cta.kv_head * params.vn_head
                    : nullptr;
  src.kn_token = params.kn_token;
  src.vn_token = params.vn_token;
  src.num_blocks = params.num_blocks;
  src.blocks = paged::Blocks(params.block_shift);
  src.num_kv_heads = params.num_kv_heads;
  src.kv_head = cta.kv_head;
  return src;
}

// The sequence, from its Seq entries (landed): its keys are cache positions [L, length) through
// its table row, then the new tokens.  A contiguous cache folds the row and L into the table row
// (see the header); a paged one has L = 0 and no row choice (the host allows neither with a table).
struct Sequence {
  int length;               // cache_seqlens[b] as given
  int cached_end;           // max(length, 0): a negative length counts as 0
  int cache_row, leftpad;   // as given
  bool row_ok, leftpad_ok;  // inside the cache (always, for a paged one)
  int first_pos;            // L: the cache position of key 0
  int new_keys;             // 0 for a cache row outside the cache, else seqlen_new
  int num_keys;             // Lk
};

// Fills the sequence's fields of `src` too: its table row, usable columns and cached keys.
__device__ __forceinline__ Sequence resolve_sequence(KeySource& src, const DecodeParams& params, const Cta& cta,
                                                     const int* seq, const int* block_table) {
  Sequence sq;
#if RAGGED
  (void)seq;  // the work item's entries, from registers: the Seq entries have not landed yet
  sq.length = cta.cached;
  sq.cache_row = cta.b;
  sq.leftpad = 0;
#else
  sq.length = seq[kSeqLength];
  sq.cache_row = seq[kSeqRow];
  sq.leftpad = seq[kSeqLeftpad];
#endif
  sq.cached_end = max(sq.length, 0);
  sq.row_ok = sq.leftpad_ok = true;
  sq.first_pos = 0;
  long long table_at = (long long)cta.b * params.max_blocks;
  int width = params.max_blocks;  // usable columns of the table row
  if (params.cache_rows > 0) {
    sq.row_ok = sq.cache_row >= 0 && sq.cache_row < params.cache_rows;
    sq.leftpad_ok = sq.leftpad >= 0 && sq.leftpad <= sq.cached_end;
    sq.first_pos = sq.leftpad_ok ? sq.leftpad : 0;
    table_at = (long long)(sq.row_ok ? sq.cache_row : 0) * params.max_blocks + sq.first_pos;
    width = sq.row_ok ? max(params.max_blocks - sq.first_pos, 0) : 0;
  }
  src.table_row = block_table + table_at;
  src.max_blocks = width;
  // A cache row outside the cache: no key at all (cached or new), nothing appended.
  src.cached = sq.row_ok ? sq.cached_end - sq.first_pos : 0;
#if RAGGED
  sq.new_keys = params.seqlen_new > 0 ? cta.seqlen_q : 0;  // the query tokens are the new keys, or already cached
#else
  sq.new_keys = sq.row_ok ? params.seqlen_new : 0;
#endif
  sq.num_keys = src.cached + sq.new_keys;
  return sq;
}

// The CTA's rows: row r is (group head, query token) = divmod(row_group * 16 + r, seqlen_q),
// bottom-right aligned (query i sits at key i + Lk - Sq).  The keys every real row sees bound the
// tiles that need no mask; this thread's own rows are g and g + 8 of the fragments.
struct Rows {
  int lo_all, hi_all;        // keys [lo_all, hi_all] are visible to every real row
  int lo[2], hi[2], pos[2];  // rows g and g + 8: visible keys [lo, hi] (none for a padding row), position
#if RAGGED
  int hi_any;                // the last key any real row sees
#endif
  float slope[2];            // their ALiBi slopes, in the log2 domain of the scores (0: none)
};

__device__ __forceinline__ Rows row_bounds(const DecodeParams& params, const Cta& cta, int num_keys,
                                           const float* alibi_slopes) {
  Rows rows;
  rows.lo_all = 0;
  rows.hi_all = num_keys - 1;
  const int seqlen_q = seq_len_q(params, cta), num_rows = seq_rows(params, cta);
#if RAGGED
  rows.hi_any = -1;
#endif
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = cta.row_group * kRows + r;
    const bool real = row < num_rows;
    const int pos = row % seqlen_q + num_keys - seqlen_q;
    const int lo = params.win_left >= 0 ? max(pos - params.win_left, 0) : 0;
    const int hi = params.win_right >= 0 ? min(pos + params.win_right, num_keys - 1) : num_keys - 1;
    if (real) {
      rows.lo_all = max(rows.lo_all, lo);
      rows.hi_all = min(rows.hi_all, hi);
#if RAGGED
      rows.hi_any = max(rows.hi_any, hi);
#endif
    }
    if (r % 8 == cta.g) {
      const int hr = r / 8;
      rows.lo[hr] = real ? lo : num_keys;  // a padding row sees nothing
      rows.hi[hr] = hi;
      rows.pos[hr] = pos;
      rows.slope[hr] = (real && alibi_slopes)
                           ? alibi_slopes[(long long)cta.b * params.alibi_batch_stride + cta.kv_head * cta.group +
                                          row / seqlen_q] * kLog2e
                           : 0.f;
    }
  }
  return rows;
}

// The score transforms, for scores in the log2 domain: S * softmax_scale * log2 e, softcap c on
// natural-log scores rewritten as c' tanh(x / c') with c' = c log2 e, ALiBi (Rows::slope).
struct ScoreMods {
  bool plain;  // no softcap, no ALiBi: a tile every real row sees whole only scales
  float scale2, softcap, cap2, inv_cap2;
};

__device__ __forceinline__ ScoreMods score_mods(const DecodeParams& params, const float* alibi_slopes) {
  ScoreMods mods;
  mods.plain = params.softcap <= 0.f && alibi_slopes == nullptr;
  mods.scale2 = params.softmax_scale * kLog2e;
  mods.softcap = params.softcap;
  mods.cap2 = params.softcap * kLog2e;
  mods.inv_cap2 = params.softcap > 0.f ? 1.f / mods.cap2 : 0.f;
  return mods;
}

// This split's keys [start, end): the keys any row of the sequence can see, shared out among the
// splits in whole tiles.
struct KeyRange {
  int start, end, num_tiles;
};

__device__ __forceinline__ KeyRange split_range(const DecodeParams& params, const Cta& cta, int num_keys) {
  const int num_splits = seq_splits(params, cta);
  const int first_key = params.win_left >= 0 ? max(num_keys - seq_len_q(params, cta) - params.win_left, 0) : 0;
  const int span = max(num_keys - first_key, 0);
  const int per_split = ((span + num_splits - 1) / num_splits + kTileKeys - 1) / kTileKeys * kTileKeys;
  KeyRange range;
  range.start = min(first_key + cta.split * per_split, num_keys);
  range.end = min(range.start + per_split, num_keys);
  range.num_tiles = (range.end - range.start + kTileKeys - 1) / kTileKeys;
  return range;
}

#if RAGGED
// The split's keys that some row of the CTA sees (a causal row group early in a prefill chunk stops
// before the chunk's last keys): the tiles loaded.  The index checks keep the whole split range.
__device__ __forceinline__ KeyRange seen_range(const KeyRange& range, const Rows& rows) {
  KeyRange seen = range;
  seen.end = max(min(range.end, rows.hi_any + 1), range.start);
  seen.num_tiles = (seen.end - seen.start + kTileKeys - 1) / kTileKeys;
  return seen;
}
#endif

// ---------------------------------------------------------------------------- the pipeline's loads

// The K/V pipeline's loads: tile t of the range goes to stage t % kStages; its block ids, staged
// in id slot t % kIdSlots, travel in the cp.async group of tile t - (kStages - 1).
struct Loader {
  const KeySource& src;
  const Buffers& buf;
  KeyRange range;
  int id_limit;     // keys [0, id_limit) have block ids to read (see make_loader)
  bool new_tokens;  // k_new given

  // The block ids of `tile` (in their slot: their group has landed), then the tile; the ids of
  // tile + kStages - 1 join this tile's group.  Returns whether this thread's keys all loaded.
  __device__ __forceinline__ bool issue(int tile) const {
    const int tile_start = range.start + tile * kTileKeys;
    int blocks[kPasses];
    read_blocks(src, tile_start, id_limit, buf.ids + (tile % kIdSlots) * kTileKeys, blocks);
    const int ahead = tile + kStages - 1;
    if (ahead < range.num_tiles)
      issue_ids(src, range.start + ahead * kTileKeys, id_limit, buf.ids_s + (ahead % kIdSlots) * kTileKeys * 4);
    return new_tokens ? issue_tile<true>(src, tile_start, range.end, tile % kStages, blocks, buf.ks, buf.vs, buf.flags)
                      : issue_tile<false>(src, tile_start, range.end, tile % kStages, blocks, buf.ks, buf.vs, buf.flags);
  }

  // Prologue, second round trip (the table row needs the sequence's entries): the block ids of the
  // first kStages - 1 tiles, waited for; then those tiles, one cp.async group each.
  // issued_ok[s]: this thread's keys of tile s all loaded.
  __device__ __forceinline__ void prologue(bool (&issued_ok)[kStages - 1]) const {
    for (int s = 0; s < kStages - 1 && s < range.num_tiles; ++s)
      issue_ids(src, range.start + s * kTileKeys, id_limit, buf.ids_s + s * kTileKeys * 4);
    cp::cp_async_commit();
    cp::cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      issued_ok[s] = false;
      if (s < range.num_tiles) issued_ok[s] = issue(s);
      cp::cp_async_commit();
    }
  }
};

// Keys whose block ids are read: the cached keys of the range in the usable columns (a key j >= 0
// has column(j) < src.max_blocks exactly when j < positions(src.max_blocks)), so that issue_ids
// and read_blocks check one bound.
__device__ __forceinline__ Loader make_loader(const KeySource& src, const Buffers& buf, const KeyRange& range,
                                              bool new_tokens) {
  const long long table_keys = src.blocks.positions(src.max_blocks);
  const int id_limit = (int)max(min((long long)min(range.end, src.cached), table_keys), 0ll);
  return Loader{src, buf, range, id_limit, new_tokens};
}

// ---------------------------------------------------------------------------- off the K/V loop

#if ROTARY
// The rotation of this launch; a rotary_dim the kernel cannot take (the host checks it) counts as none.
__device__ __forceinline__ Rotary make_rotary(const DecodeParams& params, const T* rotary_cos, const T* rotary_sin) {
  const int dim = params.rotary_dim;
  const bool usable = dim > 0 && dim <= kHeadDim && dim % 16 == 0 && rotary_cos && rotary_sin;
  Rotary ro;
  ro.cos = rotary_cos;
  ro.sin = rotary_sin;
  ro.dim = usable ? dim : 0;
  ro.seqlen_ro = params.seqlen_ro;
  ro.interleaved = (params.rotary_flags & 1) != 0;
  return ro;
}

// The Q tile rotated in place, once the first tiles are in flight (query token i at
// cache_seqlens[b] + i with rotary_flags bit 1, else at cache_seqlens[b]); the first vote's
// barrier orders it before the Q fragments are read.
__device__ __forceinline__ void rotate_q(const Rotary& ro, const DecodeParams& params, const Cta& cta,
                                         unsigned char* smem_raw, int cached_end) {
  if (ro.dim <= 0) return;
  const bool q_per_token = (params.rotary_flags & 2) != 0;
  const int units = ro.units();
  for (int index = threadIdx.x; index < kRows * units; index += kThreads) {
    const int r = index / units, unit = index % units;
    const int row = cta.row_group * kRows + r;
    const long long position = (long long)cached_end + (q_per_token ? row % params.seqlen_q : 0);
    if (row < params.num_rows && position < ro.seqlen_ro) rotate_tile_unit(ro, smem_raw + Smem::kQ, r, unit, position);
  }
}
#else
__device__ __forceinline__ Rotary make_rotary(const DecodeParams&, const T*, const T*) { return Rotary{}; }
__device__ __forceinline__ void rotate_q(const Rotary&, const DecodeParams&, const Cta&, unsigned char*, int) {}
#endif

// The fused append, once the first tiles are in flight: split 0 / row group 0 writes this kv
// head's new tokens into the cache (slots no CTA of this launch reads), k rotated like the keys
// attended.  A token whose slot is a hole is not written.
// With RAGGED, the row groups of split 0 share the tokens out, so that a prefill chunk's append
// is not one CTA's.
__device__ __forceinline__ void append_new_tokens(const KeySource& src, const Sequence& sq, const Cta& cta,
                                                  const Rotary& ro, cp::Vec8* k_cache_w, cp::Vec8* v_cache_w) {
#if RAGGED
  if (sq.new_keys <= 0 || cta.split != 0) return;
  const int share = (sq.new_keys + cta.row_groups - 1) / cta.row_groups;
  const int first = cta.row_group * share, count = min(share, sq.new_keys - first);
#else
  if (sq.new_keys <= 0 || cta.split != 0 || cta.row_group != 0) return;
  constexpr int first = 0;
  const int count = sq.new_keys;
#endif
  for (int index = threadIdx.x; index < count * kChunks; index += kThreads) {
    const int tok = first + index / kChunks, v = index % kChunks;
    const int j = src.cached + tok;
    const int col = src.blocks.column(j);
    if (col >= src.max_blocks) continue;
    const int id = __ldg(src.table_row + col);
    if (!paged::is_block(id, src.num_blocks)) continue;
    const long long at = src.cache_vec(id, j, v);
    const cp::Vec8* key = reinterpret_cast<const cp::Vec8*>(src.k_new + tok * src.kn_token);
#if ROTARY
    const long long position = (long long)sq.cached_end + tok;
    k_cache_w[at] = ro.dim > 0 && position < ro.seqlen_ro ? rotated_chunk(ro, key, v, position) : key[v];
#else
    k_cache_w[at] = key[v];
#endif
    v_cache_w[at] = reinterpret_cast<const cp::Vec8*>(src.v_new + tok * src.vn_token)[v];
  }
}

// Checks of the index values (cp::report_error), off the K/V loop: the sequence-level ones by
// one thread of split 0 / row group 0 / kv head 0; the block ids by the row group 0 / kv head 0
// CTA of every split, over the columns whose first key is in its range (split 0: from column 0),
// which together are the columns of the keys [0, Lk) once each.  Each warp's smallest bad column
// goes to the Seq entry kSeqBadColumn, which report_bad_column reports after a barrier.  A
// contiguous cache's table is the host's identity: its ids are never checked.  Returns whether
// this CTA checks block ids.
__device__ __forceinline__ bool check_indices(const KeySource& src, const Sequence& sq, const KeyRange& range,
                                              const DecodeParams& params, const Cta& cta, const Rotary& ro, int* seq,
                                              int* errors) {
  const bool checker = cta.row_group == 0 && cta.kv_head == 0;
  const long long needed = (long long)src.cached + sq.new_keys;  // keys needing a slot
  if (checker && cta.split == 0 && threadIdx.x == 0) {
    if (sq.length < 0) cp::report_error(errors, cp::kErrSeqlen, cta.b, sq.length);
    if (!sq.row_ok) cp::report_error(errors, cp::kErrBatchIdx, cta.b, sq.cache_row);
    if (!sq.leftpad_ok) cp::report_error(errors, cp::kErrLeftpad, cta.b, sq.leftpad);
    if (src.blocks.columns(needed) > src.max_blocks)
      cp::report_error(errors, cp::kErrTableShort, cta.b, sq.first_pos + needed);
#if ROTARY
    if (ro.dim > 0) {
      const bool q_per_token = (params.rotary_flags & 2) != 0;
      const long long last = (long long)sq.cached_end + max(q_per_token ? params.seqlen_q - 1 : 0, sq.new_keys - 1);
      if (last >= ro.seqlen_ro) cp::report_error(errors, cp::kErrRotary, cta.b, last);
    }
#endif
  }
  const bool check_ids = checker && params.cache_rows == 0;
  if (check_ids) {
    const long long columns = min(src.blocks.columns(needed), (long long)src.max_blocks);
    const int from = cta.split == 0 ? 0 : (int)min(src.blocks.columns(range.start), columns);
    const int to = (int)min(src.blocks.columns(range.end), columns);
    int bad = kNoColumn;
    for (int c = from + threadIdx.x; c < to; c += kThreads) {
      if (!paged::is_block(__ldg(src.table_row + c), src.num_blocks)) bad = min(bad, c);
    }
    bad = __reduce_min_sync(0xffffffffu, bad);
    if (cta.lane == 0 && bad != kNoColumn) atomicMin(seq + kSeqBadColumn, bad);
  }
  return check_ids;
}

// The split's smallest bad block-table column, merged over the warps before the barrier that
// precedes this call.
__device__ __forceinline__ void report_bad_column(bool check_ids, const int* seq, int b, int* errors) {
  if (check_ids && threadIdx.x == 0 && seq[kSeqBadColumn] != kNoColumn)
    cp::report_error(errors, cp::kErrBlockId, b, seq[kSeqBadColumn]);
}

// ---------------------------------------------------------------------------- the K/V loop

// Whether all of tile t's keys were loaded, voted at the barrier before its use; the barrier of
// iteration t votes on tile t + 1 (issued at least one iteration earlier), so one vote is kept
// in hand.  At the top of iteration t, pending[i] is this thread's flag of tile t + 1 + i (the
// kStages - 2 tiles issued and not yet voted on; a flag of a tile past num_tiles is never used).
struct Votes {
  bool tile_loaded;  // the vote on the tile computed next
  bool pending[kStages - 2];
};

// The vote on tile 0: also the barrier that orders the Q rotation and the warps' bad columns
// before what follows.
__device__ __forceinline__ Votes first_vote(const bool (&issued_ok)[kStages - 1]) {
  Votes votes;
  votes.tile_loaded = __syncthreads_and(issued_ok[0]);
#pragma unroll
  for (int i = 0; i < kStages - 2; ++i) votes.pending[i] = issued_ok[i + 1];
  return votes;
}

// A warp's online-softmax state in the log2 domain for rows g and g + 8; o[n-tile] are C fragments.
struct WarpState {
  float m[2], l[2];
  float o[kHeadDim / 8][4];
};

// Per-lane parts of the ldmatrix addresses of a 16-key group (see mma.cuh for the fragment layouts).
struct LaneRows {
  int k_row, k_chunk;  // B of Q K^T
  int v_row, v_chunk;  // B of P V (.trans)
};

// Q fragments (A operand, one per k-step): lanes 0-15 address rows 0-15 of chunk 2kk, 16-31 of 2kk+1.
using QFrags = u32[kQInRegs ? kKSteps : 1][4];

#if ROTARY
// The new keys of the tile at tile_start (one that holds some: a CTA-uniform branch) rotated in its
// K stage (landed: the barrier before this call); the barrier after it orders them before Q K^T.
__device__ __forceinline__ void rotate_new_keys(const Rotary& ro, const KeySource& src, unsigned char* stage_raw,
                                                int tile_start, int end, int first_pos) {
  const int units = ro.units();
  const int first = max(src.cached - tile_start, 0);
  const int rows = min(end - tile_start, kTileKeys) - first;
  for (int index = threadIdx.x; index < rows * units; index += kThreads) {
    const int key = first + index / units, unit = index % units;
    const long long position = (long long)first_pos + tile_start + key;
    if (position < ro.seqlen_ro) rotate_tile_unit(ro, stage_raw, key, unit, position);
  }
  __syncthreads();
}
#endif

// S = Q K^T for this warp's keys of the K stage at k_tile: s[group][n-tile of 8 keys][C fragment].
__device__ __forceinline__ void qk_tile(float (&s)[kGroups][2][4], const QFrags& qa, u32 qs, u32 k_tile, int warp_key,
                                        const LaneRows& lr, int lane) {
#pragma unroll
  for (int kg = 0; kg < kGroups; ++kg)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[kg][0][e] = s[kg][1][e] = 0.f;
#pragma unroll
  for (int kk = 0; kk < kKSteps; ++kk) {
    u32 a[4];
    if (kQInRegs) {
#pragma unroll
      for (int e = 0; e < 4; ++e) a[e] = qa[kQInRegs ? kk : 0][e];
    } else {
      cp::ldmatrix_x4(a, qs + Tile::offset(lane & 15, 2 * kk + (lane >> 4)));
    }
#pragma unroll
    for (int kg = 0; kg < kGroups; ++kg) {
      u32 bk[4];
      cp::ldmatrix_x4(bk, k_tile + Tile::offset(warp_key + kg * 16 + lr.k_row, 2 * kk + lr.k_chunk));
      cp::mma_16816(s[kg][0], a, bk[0], bk[1], T());
      cp::mma_16816(s[kg][1], a, bk[2], bk[3], T());
    }
  }
}

// Score transforms and masks of this warp's scores of the tile at tile_start, then the tile's row
// max.  The common tile (`unmasked`: every key loaded and visible to every real row, no softcap,
// no ALiBi) only scales: a CTA-uniform branch.
__device__ __forceinline__ void transform_scores(float (&s)[kGroups][2][4], float (&tile_max)[2], bool unmasked,
                                                 const ScoreMods& mods, const Rows& rows, const int* stage_flags,
                                                 int tile_start, int warp_key, int t) {
  tile_max[0] = tile_max[1] = -inf();
  if (unmasked) {
#pragma unroll
    for (int kg = 0; kg < kGroups; ++kg)
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[kg][n][e] *= mods.scale2;
          tile_max[e / 2] = fmaxf(tile_max[e / 2], s[kg][n][e]);
        }
    return;
  }
#pragma unroll
  for (int kg = 0; kg < kGroups; ++kg)
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = warp_key + kg * 16 + n * 8 + 2 * t + (e & 1);
        const int j = tile_start + key;
        const int hr = e / 2;
        float x = s[kg][n][e] * mods.scale2;
        if (mods.softcap > 0.f) x = mods.cap2 * tanhf(x * mods.inv_cap2);
        x -= rows.slope[hr] * fabsf(static_cast<float>(rows.pos[hr] - j));
        const bool visible = stage_flags[key] != 0 && j >= rows.lo[hr] && j <= rows.hi[hr];
        s[kg][n][e] = visible ? x : -inf();
        tile_max[hr] = fmaxf(tile_max[hr], s[kg][n][e]);
      }
}

// The running state rescaled to the new row max (a row's 4 lanes share it); a max of -inf (nothing
// visible yet) uses 0, so exp2 gives 0 and never NaN.  m_use: the max that P subtracts.
__device__ __forceinline__ void rescale(WarpState& st, const float (&tile_max)[2], float (&m_use)[2]) {
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const float m_new = fmaxf(st.m[hr], cp::quad_max(tile_max[hr]));
    m_use[hr] = m_new == -inf() ? 0.f : m_new;
    const float alpha = exp2f(st.m[hr] - m_use[hr]);
    st.m[hr] = m_new;
    st.l[hr] *= alpha;
#pragma unroll
    for (int n = 0; n < kHeadDim / 8; ++n) {
      st.o[n][2 * hr] *= alpha;
      st.o[n][2 * hr + 1] *= alpha;
    }
  }
}

// P = exp2(S - m), then O += P V with P re-packed as the A operand of each 16-key group.
__device__ __forceinline__ void pv_tile(WarpState& st, float (&s)[kGroups][2][4], const float (&m_use)[2], u32 v_tile,
                                        int warp_key, const LaneRows& lr) {
#pragma unroll
  for (int kg = 0; kg < kGroups; ++kg) {
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[kg][n][e] = exp2f(s[kg][n][e] - m_use[e / 2]);
        st.l[e / 2] += s[kg][n][e];
      }
    u32 pa[4];
    cp::pack_a(pa, s[kg][0], s[kg][1], T());
#pragma unroll
    for (int dp = 0; dp < kHeadDim / 16; ++dp) {
      u32 bv[4];
      cp::ldmatrix_x4_trans(bv, v_tile + Tile::offset(warp_key + kg * 16 + lr.v_row, 2 * dp + lr.v_chunk));
      cp::mma_16816(st.o[2 * dp], pa, bv[0], bv[1], T());
      cp::mma_16816(st.o[2 * dp + 1], pa, bv[2], bv[3], T());
    }
  }
}

// The K/V loop over the split's tiles.  Iteration t waits for tile t, votes on tile t + 1 at the
// barrier that also frees the stage refilled next, issues tile t + kStages - 1 into it, and then
// runs this warp's keys of tile t: S = Q K^T, the score transforms and masks, the online softmax,
// O += P V.  Returns with the pipeline drained and every warp past it.
__device__ __forceinline__ void attend(WarpState& st, Votes& votes, const Loader& loader, const Buffers& buf,
                                       const Cta& cta, const Rows& rows, const ScoreMods& mods, const Rotary& ro,
                                       int first_pos) {
  const int num_tiles = loader.range.num_tiles, start = loader.range.start;
  QFrags qa;
  if (kQInRegs) {
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk)
      cp::ldmatrix_x4(qa[kQInRegs ? kk : 0], buf.qs + Tile::offset(cta.lane & 15, 2 * kk + (cta.lane >> 4)));
  }
  const int lane = cta.lane;
  const LaneRows lr = {(lane >> 4) * 8 + (lane & 7), (lane >> 3) & 1, ((lane >> 3) & 1) * 8 + (lane & 7), lane >> 4};
#if ROTARY
  const bool rotates_keys = ro.dim > 0 && loader.range.end > loader.src.cached;  // the range holds new keys
#endif
  st.m[0] = st.m[1] = -inf();
  st.l[0] = st.l[1] = 0.f;
#pragma unroll
  for (int n = 0; n < kHeadDim / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) st.o[n][e] = 0.f;

  for (int tile = 0; tile < num_tiles; ++tile) {
    cp::cp_async_wait<kStages - 2>();
    // Tile landed for every thread; every warp is done with the stage refilled next.
    const bool next_loaded = __syncthreads_and(votes.pending[0]);
#pragma unroll
    for (int i = 0; i + 1 < kStages - 2; ++i) votes.pending[i] = votes.pending[i + 1];
    const int next = tile + kStages - 1;  // = (tile + 1) + 1 + (kStages - 3): the last flag
    if (next < num_tiles) votes.pending[kStages - 3] = loader.issue(next);
    cp::cp_async_commit();

    const int stage = tile % kStages;
    const u32 k_tile = buf.ks + stage * Smem::kStageBytes, v_tile = buf.vs + stage * Smem::kStageBytes;
    const int warp_key = cta.warp * kKeysPerWarp;  // first key of this warp in the tile
    const int tile_start = start + tile * kTileKeys;
#if ROTARY
    if (rotates_keys && tile_start + kTileKeys > loader.src.cached)
      rotate_new_keys(ro, loader.src, buf.raw + stage * Smem::kStageBytes, tile_start, loader.range.end, first_pos);
#endif
    float s[kGroups][2][4];
    qk_tile(s, qa, buf.qs, k_tile, warp_key, lr, lane);
    const bool unmasked =
        mods.plain && votes.tile_loaded && tile_start >= rows.lo_all && tile_start + kTileKeys - 1 <= rows.hi_all;
    votes.tile_loaded = next_loaded;
    float tile_max[2];
    transform_scores(s, tile_max, unmasked, mods, rows, buf.flags + stage * kTileKeys, tile_start, warp_key, cta.t);
    float m_use[2];
    rescale(st, tile_max, m_use);
    pv_tile(st, s, m_use, v_tile, warp_key, lr);
  }
  cp::cp_async_wait<0>();
  __syncthreads();  // pipeline drained: its buffers become the merge scratch
}

// ---------------------------------------------------------------------------- the output

// Rows of this CTA's row group that are real (the rest of the 16 are the mma's padding).
__device__ __forceinline__ int rows_here(const Cta& cta) { return min(kRows, cta.num_rows - cta.row_group * kRows); }

// Row sums over each row's 4 lanes, then every warp's state -> the merge scratch (the drained
// pipeline's buffers), published by a barrier.
__device__ __forceinline__ void share_state(WarpState& st, unsigned char* smem_raw, const Cta& cta) {
  float* merge_o = reinterpret_cast<float*>(smem_raw);             // [kWarps][kRows][D]
  float* merge_m = merge_o + kWarps * kRows * kHeadDim;            // [kWarps][kRows]
  float* merge_l = merge_m + kWarps * kRows;                       // [kWarps][kRows]
  const int real = rows_here(cta);
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    st.l[hr] = cp::quad_sum(st.l[hr]);
    const int r = cta.g + 8 * hr;
    if (r >= real) continue;  // a padding row: store_rows never reads it
#pragma unroll
    for (int n = 0; n < kHeadDim / 8; ++n)
      *reinterpret_cast<float2*>(merge_o + (cta.warp * kRows + r) * kHeadDim + n * 8 + 2 * cta.t) =
          make_float2(st.o[n][2 * hr], st.o[n][2 * hr + 1]);
    if (cta.t == 0) {
      merge_m[cta.warp * kRows + r] = st.m[hr];
      merge_l[cta.warp * kRows + r] = st.l[hr];
    }
  }
  __syncthreads();
}

// The warps' states merged and stored, 8 dims (one 16-byte vector) of one real row per thread and
// step: out and the LSE, or with num_splits > 1 the split's normalised partial output and LSE in the
// workspace.  A row that saw no key: zeros and LSE -inf, never 0/0.  Padding rows are skipped (at
// GQA 4 a CTA holds 4 real rows of 16), so a CTA of 64 threads stores 4 rows x 128 dims in one step.
__device__ __forceinline__ void store_rows(const Cta& cta, const unsigned char* smem_raw, T* out, float* lse,
                                           float* part_out, float* part_lse) {
  constexpr int kVecs = kHeadDim / 8;  // 8-dim vectors per row
  const float* merge_o = reinterpret_cast<const float*>(smem_raw);
  const float* merge_m = merge_o + kWarps * kRows * kHeadDim;
  const float* merge_l = merge_m + kWarps * kRows;
  const int seqlen_q = cta.seqlen_q, num_heads = cta.num_heads;
  const long long rows_total = (long long)cta.batch * seqlen_q * num_heads;
  // out is the caller's: 16-byte stores where its start allows (rows are kHeadDim apart, a multiple of 8).
  const bool out_vec = (reinterpret_cast<unsigned long long>(out) & 15) == 0;
  const int items = rows_here(cta) * kVecs;
  for (int index = threadIdx.x; index < items; index += kThreads) {
    const int r = index / kVecs, d = (index % kVecs) * 8;
    const int row = cta.row_group * kRows + r;
    const int head = cta.kv_head * cta.group + row / seqlen_q, i = row % seqlen_q;
    float m_all = -inf();
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m_all = fmaxf(m_all, merge_m[w * kRows + r]);
    const float m_max = m_all == -inf() ? 0.f : m_all;
    float l_all = 0.f, o[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float weight = exp2f(merge_m[w * kRows + r] - m_max);
      l_all += merge_l[w * kRows + r] * weight;
      const float4* src = reinterpret_cast<const float4*>(merge_o + (w * kRows + r) * kHeadDim + d);
      const float4 a = src[0], c = src[1];
      o[0] += a.x * weight; o[1] += a.y * weight; o[2] += a.z * weight; o[3] += a.w * weight;
      o[4] += c.x * weight; o[5] += c.y * weight; o[6] += c.z * weight; o[7] += c.w * weight;
    }
    const float inv = l_all > 0.f ? 1.f / l_all : 0.f;
    const float row_lse = l_all > 0.f ? (m_all + __log2f(l_all)) * kLn2 : -inf();
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] *= inv;
    const bool single = cta.num_splits == 1;
#if RAGGED
    // out [T, H, D], lse [H, T] (FlashAttention-2's varlen layout), the slots [slot][Hkv][16][D].
    const long long token = (long long)cta.q_start + i;
    const long long out_at = (token * num_heads + head) * kHeadDim + d;
    const long long part_row = ((long long)(cta.slot + cta.split) * cta.num_kv_heads + cta.kv_head) * kRows + r;
    const long long lse_at = single ? (long long)head * cta.total_q + token : part_row;
    (void)rows_total;
#else
    const long long out_row = ((long long)cta.b * seqlen_q + i) * num_heads + head;
    const long long out_at = out_row * kHeadDim + d;
    const long long part_row = cta.split * rows_total + out_row;
    const long long lse_at = single ? ((long long)cta.b * num_heads + head) * seqlen_q + i : part_row;
#endif
    if (single) {
      if (out_vec) {
        uint4 packed;
        packed.x = cp::from_float2(o[0], o[1], T());
        packed.y = cp::from_float2(o[2], o[3], T());
        packed.z = cp::from_float2(o[4], o[5], T());
        packed.w = cp::from_float2(o[6], o[7], T());
        *reinterpret_cast<uint4*>(out + out_at) = packed;
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) out[out_at + e] = cp::from_float<T>(o[e]);
      }
      if (lse && d == 0) lse[lse_at] = row_lse;
    } else {
      float4* dst = reinterpret_cast<float4*>(part_out + part_row * kHeadDim + d);
      dst[0] = make_float4(o[0], o[1], o[2], o[3]);
      dst[1] = make_float4(o[4], o[5], o[6], o[7]);
      if (d == 0) part_lse[lse_at] = row_lse;
    }
  }
}

#if RAGGED
// The splits of a sequence's row group merged by whichever of its CTAs (one kv head) finishes last,
// so a ragged launch needs no second one.  Each split CTA publishes its partial rows (store_rows),
// fences, and counts itself in merge_count[slot][kv head]; the CTA that brings the count to the
// split count reads every split's rows back from L2 (__ldcg: none of them were ever in this SM's
// L1), writes out = sum_s w_s * part_s with w_s = exp(lse_s - lse) and the LSE, and sets the count
// back to zero, so the counts stay zero between launches (the host allocates them zeroed).  A split
// that saw no key has weight 0 and a partial row of zeros, so every term is finite.
constexpr int kMaxSplits = 128;  // kernels/ragged.py MAX_SPLITS; the merge's weights are [kRows][kMaxSplits]
static_assert((kRows * kMaxSplits + kRows) * 4 <= Smem::kBytes, "the merge's weights fit the dynamic shared memory");
__device__ __forceinline__ void merge_if_last(const Cta& cta, unsigned char* smem_raw, T* out, float* lse,
                                              const float* part_out, const float* part_lse, int* merge_count) {
  if (cta.num_splits <= 1) return;  // CTA-uniform
  __shared__ int last;
  __threadfence();  // this thread's partial rows visible to the device before the count
  __syncthreads();  // every thread fenced; the merge area of shared memory free again
  int* const count = merge_count + (long long)cta.slot * cta.num_kv_heads + cta.kv_head;
  if (threadIdx.x == 0) last = atomicAdd(count, 1) == cta.num_splits - 1;
  __syncthreads();
  if (!last) return;  // CTA-uniform
  __threadfence();
  const int num_splits = min(cta.num_splits, kMaxSplits);
  float* weights = reinterpret_cast<float*>(smem_raw);  // [kRows][kMaxSplits], then the scale of each row
  float* scale = weights + kRows * kMaxSplits;
  const long long split_rows = (long long)cta.num_kv_heads * kRows;  // rows between split s and s + 1
  const long long first = ((long long)cta.slot * cta.num_kv_heads + cta.kv_head) * kRows;
  for (int r = cta.warp; r < kRows; r += kWarps) {
    const int row = cta.row_group * kRows + r;
    if (row >= cta.num_rows) continue;  // warp-uniform
    float m = -inf();
    for (int s = cta.lane; s < num_splits; s += 32) m = fmaxf(m, __ldcg(part_lse + first + s * split_rows + r));
    m = cp::warp_max(m);
    const float m_use = m == -inf() ? 0.f : m;
    float sum = 0.f;
    for (int s = cta.lane; s < num_splits; s += 32) {
      const float w = __expf(__ldcg(part_lse + first + s * split_rows + r) - m_use);
      weights[r * kMaxSplits + s] = w;
      sum += w;
    }
    sum = cp::warp_sum(sum);
    if (cta.lane == 0) {
      scale[r] = sum > 0.f ? 1.f / sum : 0.f;
      const int head = cta.kv_head * cta.group + row / cta.seqlen_q;
      if (lse) lse[(long long)head * cta.total_q + cta.q_start + row % cta.seqlen_q] = sum > 0.f ? m_use + __logf(sum) : -inf();
    }
  }
  __syncthreads();
  constexpr int kUnroll = 4;
  for (int index = threadIdx.x; index < kRows * kHeadDim; index += kThreads) {
    const int r = index / kHeadDim, d = index % kHeadDim;
    const int row = cta.row_group * kRows + r;
    if (row >= cta.num_rows) continue;
    const float* part = part_out + (first + r) * kHeadDim + d;
    float acc = 0.f;
    for (int s0 = 0; s0 < num_splits; s0 += kUnroll) {
      float x[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) x[u] = s0 + u < num_splits ? __ldcg(part + (s0 + u) * split_rows * kHeadDim) : 0.f;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) acc = fmaf(s0 + u < num_splits ? weights[r * kMaxSplits + s0 + u] : 0.f, x[u], acc);
    }
    const int head = cta.kv_head * cta.group + row / cta.seqlen_q;
    const long long token = (long long)cta.q_start + row % cta.seqlen_q;
    out[(token * cta.num_heads + head) * kHeadDim + d] = cp::from_float<T>(acc * scale[r]);
  }
  if (threadIdx.x == 0) *count = 0;
}
#endif

#if RAGGED
// ---------------------------------------------------------------------------- the device list

// build_list: the work list of a ragged launch built on the device, for the calls that have no
// host lengths -- flash_attn_with_kvcache (cache_seqlens on the GPU) and flash_attn_varlen_func's
// short rows over a paged cache (cu_seqlens_q / cu_seqlens_k on the GPU).  The CTA of ticket 0 (the
// first to start) builds it while the other CTAs wait for it (wait_for_list); the rule is the step plan's
// (runtime/_work.py): the row groups' keys shared out over kListWaves waves of CTA slots per kv
// head (at least kListMinTiles tiles a range), a sequence split only past 1.5 ranges and only in a
// batch whose longest sequence holds more than 1.5 times one wave's share of the keys, the range
// doubled while the list would not fit the host's capacities.  Items go by their keys, most
// first, in kListBuckets classes (the order within a class is the atomics'; results do not depend
// on it: each row is written by one item, or merged by merge_if_last in split order).  Rows past the list are zeroed (padding:
// query length 0), so the launch's fixed grid (the capacity) does nothing there.  The lengths are
// staged in shared memory once (stage_lengths) and every pass reads them there.
//
// Bad values: a cu_seqlens_q entry that decreases, leaves q or exceeds max_seqlen_q drops the
// sequence (no item: its rows are not where q says); a cu_seqlens_k entry that decreases gives
// the sequence's items a negative key count, which paged_decode treats as a sequence without keys
// (zero rows, LSE -inf, as the reference); both are reported.  cache_seqlens travels in the items
// as given (paged_decode checks it), counted within [0, key_limit] here.
constexpr int kListBuckets = 32;
// kernels/ragged.py's MIN_SPLIT_TILES, WAVES and (kMaxSplits, above) MAX_SPLITS: the host list's
// rule too (tests/test_launch_layout.py reads these lines and compares).
constexpr int kListMinTiles = 4;
constexpr int kListWaves = 2;

struct ListArgs {
  const int* cache_seqlens;  // [B]: decode calls, else null
  const int* cu_seqlens_q;   // [B + 1]: varlen calls, else null
  const int* cu_seqlens_k;
  int batch, seqlen_q, total_q, max_seqlen_q, appends, group, key_limit;
#if TRACE
  unsigned long long* stamps;  // the builder's stamps (build_stamp), or null
#endif
};

// The builder runs once a launch, in one CTA, cold: its instructions are fetched from L2 or memory
// as it goes, so it is written small -- per-sequence values in 32 bits (a table row holds fewer than
// 2^30 keys: kernels/ragged.py MAX_LIST_KEYS, which the host checks), one path for every batch
// (the lengths staged in shared memory), and list_sequence not inlined into each pass.
struct ListSeq {
  int q_start, q_len, cached;  // as the WorkItem carries them
  int keys;                    // what the sequence's items read, for the balance
  int row_groups;
};

__device__ __noinline__ ListSeq list_sequence(const ListArgs& a, int b, int* errors, bool report) {
  ListSeq s;
  if (a.cache_seqlens) {
    s.q_start = b * a.seqlen_q;
    s.q_len = a.seqlen_q;
    s.cached = a.cache_seqlens[b];
    s.keys = min(max(s.cached, 0), a.key_limit) + (a.appends ? s.q_len : 0);
  } else {
    const int q0 = a.cu_seqlens_q[b], q1 = a.cu_seqlens_q[b + 1];
    const int k0 = a.cu_seqlens_k[b], k1 = a.cu_seqlens_k[b + 1];
    const bool q_ok = q0 >= 0 && q1 >= q0 && q1 <= a.total_q && q1 - q0 <= a.max_seqlen_q && (b > 0 || q0 == 0);
    const bool k_ok = k0 >= 0 && k1 >= k0;
    if (report && !q_ok) cp::report_error(errors, cp::kErrCuSeqlensQ, b, (long long)q1 - q0);
    else if (report && !k_ok) cp::report_error(errors, cp::kErrCuSeqlensK, b, (long long)k1 - k0);
    s.q_start = q0;
    s.q_len = q_ok ? q1 - q0 : 0;  // a decreasing k keeps its rows: they see no key (paged_decode's hole)
    s.cached = k1 - k0;
    s.keys = q_ok && k_ok ? min(s.cached, a.key_limit) : 0;
  }
  s.row_groups = s.q_len > 0 ? (a.group * s.q_len + kRows - 1) / kRows : 0;
  return s;
}

// The hand-over's release (wait_for_list): whether the waiting CTAs take their items directly
// (direct_item) or from the list, then the count of the other CTAs added to the ready word, whose
// release orders this thread's writes before it (the list's were fenced by the caller).
__device__ __forceinline__ void release_list(int* sync, bool direct) {
  sync[2] = direct;
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(sync), "r"(gridDim.x - 1) : "memory");
}

// Item `index` of a level decode list in sequence order (build_list's `direct`): what the list
// holds for it, nothing split; past the batch, padding (query length 0).
__device__ __forceinline__ WorkItem direct_item(const int* cache_seqlens, int batch, int seqlen_q, int group,
                                                int index) {
  const int row_groups = (group * seqlen_q + kRows - 1) / kRows;
  const int b = index / row_groups;
  if (b >= batch) return WorkItem{0, 0, 0, 0, 0, 0, 0, 0};
  return WorkItem{b, index - b * row_groups, 0, 1, b * seqlen_q, seqlen_q, __ldcg(cache_seqlens + b), 0};
}

// The range (chunk, keys) is at most kListMaxChunk: past every sequence's keys, so nothing splits.
constexpr int kListMaxChunk = (1 << 30) / kTileKeys * kTileKeys;

__device__ __forceinline__ int list_splits(const ListSeq& s, int chunk) {
  if (s.row_groups == 0 || 2LL * s.keys <= 3LL * chunk) return 1;
  return (int)min(((unsigned)s.keys + (unsigned)chunk - 1u) / (unsigned)chunk, (unsigned)kMaxSplits);
}

// The keys of each of a sequence's n ranges.
__device__ __forceinline__ int list_span(const ListSeq& s, int n) {
  return (int)(((unsigned)s.keys + (unsigned)(n - 1)) / (unsigned)n);
}

// The sums over the CTA of every thread's N values (of the last one the max, where last_max), in
// place: every thread gets them, through one pair of barriers.
constexpr int kListReduceMax = 3;
template <int N>
__device__ __forceinline__ void list_reduce(long long (&v)[N], long long (*scratch)[kWarps], bool last_max) {
  static_assert(N <= kListReduceMax, "scratch holds kListReduceMax values a warp");
  auto combine = [&](int i, long long x, long long y) { return last_max && i == N - 1 ? max(x, y) : x + y; };
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v[i] = combine(i, v[i], __shfl_xor_sync(0xffffffffu, v[i], o));
  __syncthreads();  // scratch free: every thread has read the last reduction
  if (threadIdx.x % 32 == 0)
#pragma unroll
    for (int i = 0; i < N; ++i) scratch[i][threadIdx.x / 32] = v[i];
  __syncthreads();
#pragma unroll
  for (int i = 0; i < N; ++i) {
    long long all = scratch[i][0];
    for (int w = 1; w < kWarps; ++w) all = combine(i, all, scratch[i][w]);
    v[i] = all;
  }
}

__device__ __forceinline__ void store_item(int* list, long long index, int b, int row_group, int split, int splits,
                                           const ListSeq& s, int slot) {
  int4* at = reinterpret_cast<int4*>(list) + 2 * index;
  at[0] = make_int4(b, row_group, split, splits);
  at[1] = make_int4(s.q_start, s.q_len, s.cached, slot);
}

// The builder's clock stamps in the TRACE specialization (the benchmark's trace row, its columns 5
// to 11: kTraceColumns below; ListArgs::stamps, null for the other CTAs): its ticket known, the
// lengths staged, the first pass reduced, the rounds done, the bucket scan done, the items stored,
// the release made.  LIST_STAMP(a, i) is nothing in the other specializations.
#if TRACE
constexpr int kBuildStamps = 7;
__device__ __forceinline__ void build_stamp(unsigned long long* stamps, int i) {
  if (stamps && threadIdx.x == 0) stamps[i] = cp::global_ns();
}
#define LIST_STAMP(a, i) build_stamp((a).stamps, i)
#else
#define LIST_STAMP(a, i)
#endif

// The lengths staged in the launch's dynamic shared memory (the pipeline's buffers, free until the
// CTA attends), so that the passes read them there.  Returns the arguments reading the staged copy,
// or those given where the batch does not fit.
__device__ __forceinline__ ListArgs stage_lengths(ListArgs a, int* stage) {
  constexpr int kStageInts = Smem::kBytes / 4;
  if (a.cache_seqlens && a.batch <= kStageInts) {
    #pragma unroll 1
    for (int i = threadIdx.x; i < a.batch; i += kThreads) stage[i] = a.cache_seqlens[i];
    a.cache_seqlens = stage;
  } else if (!a.cache_seqlens && 2 * (a.batch + 1) <= kStageInts) {
    #pragma unroll 1
    for (int i = threadIdx.x; i <= a.batch; i += kThreads) {
      stage[i] = a.cu_seqlens_q[i];
      stage[a.batch + 1 + i] = a.cu_seqlens_k[i];
    }
    a.cu_seqlens_q = stage;
    a.cu_seqlens_k = stage + a.batch + 1;
  }
  __syncthreads();
  return a;
}

__device__ __noinline__ bool build_list(const ListArgs given, int slots_per_head, int max_items, int max_slots,
                                       int* work, int* errors, int* stage, int* sync) {
  static_assert(kListBuckets == 32, "one warp scans the bucket counts");
  __shared__ long long scratch[kListReduceMax][kWarps];
  __shared__ int bucket_start[kListBuckets];
  __shared__ int slot_cursor;
  const ListArgs a = stage_lengths(given, stage);
  LIST_STAMP(a, 1);
  long long sums[3] = {0, 0, 0};  // keys times row groups, row groups, the most keys of a sequence with rows
  #pragma unroll 1
  for (int b = threadIdx.x; b < a.batch; b += kThreads) {
    const ListSeq s = list_sequence(a, b, errors, true);
    sums[0] += (long long)s.row_groups * s.keys;
    sums[1] += s.row_groups;
    if (s.row_groups) sums[2] = max(sums[2], (long long)s.keys);
  }
  list_reduce(sums, scratch, true);
  LIST_STAMP(a, 2);
  const long long per_range = max(kListWaves * slots_per_head, 1);
  int chunk = (int)min(max((long long)kListMinTiles * kTileKeys, (sums[0] + per_range - 1) / per_range),
                       (long long)kListMaxChunk);
  // A batch whose longest sequence holds at most 1.5 times the keys one wave of slots would give
  // each (the keys over slots_per_head) splits nothing: its unsplit items already fill about one wave
  // level, and splitting them would only add a wave and the merges.
  const long long one_wave = (sums[0] + max(slots_per_head, 1) - 1) / max(slots_per_head, 1);
  const bool level = 2 * sums[2] <= 3 * one_wave;
  if (level) chunk = kListMaxChunk;
  // A level decode list (cache_seqlens: every sequence seqlen_q rows) is item i = (sequence, row
  // group) i in order, which every CTA can make itself (direct_item): the waiting CTAs are let go
  // now, and the list below is still written (the same items, longest first) for whoever reads it.
  const bool direct = level && a.cache_seqlens != nullptr;
  if (direct && threadIdx.x == 0) release_list(sync, true);
  long long items = 0;
  int longest = 0;
  #pragma unroll 1
  for (int round = 0; round < 48; ++round) {
    chunk = (chunk + kTileKeys - 1) / kTileKeys * kTileKeys;
    long long counts[3] = {0, 0, 0};  // items, items of split sequences (workspace slots), the longest range
    #pragma unroll 1
    for (int b = threadIdx.x; b < a.batch; b += kThreads) {
      const ListSeq s = list_sequence(a, b, errors, false);
      const int n = list_splits(s, chunk);
      counts[0] += s.row_groups * n;
      if (n > 1) counts[1] += s.row_groups * n;
      if (s.row_groups) counts[2] = max(counts[2], (long long)list_span(s, n));
    }
    list_reduce(counts, scratch, true);
    items = counts[0];
    longest = (int)counts[2];
    if ((items <= max_items && counts[1] <= max_slots) || items == sums[1]) break;
    chunk = chunk >= kListMaxChunk / 2 ? kListMaxChunk : 2 * chunk;
  }
  LIST_STAMP(a, 3);
  // Bucket k holds the items of span (keys) in the k-th 1/kListBuckets below the longest (an
  // order, not a result: float rounding may move an item to the next bucket).
  if (threadIdx.x < kListBuckets) bucket_start[threadIdx.x] = 0;
  if (threadIdx.x == 0) slot_cursor = 0;
  __syncthreads();
  const float per_bucket = longest > 0 ? (kListBuckets - 1) / (float)longest : 0.0f;
  auto bucket = [&](const ListSeq& s, int n) {
    return min((int)((float)(longest - list_span(s, n)) * per_bucket), kListBuckets - 1);
  };
  #pragma unroll 1
  for (int b = threadIdx.x; b < a.batch; b += kThreads) {
    const ListSeq s = list_sequence(a, b, errors, false);
    const int n = list_splits(s, chunk);
    if (s.row_groups) atomicAdd(&bucket_start[bucket(s, n)], s.row_groups * n);
  }
  __syncthreads();
  if (threadIdx.x < 32) {  // exclusive prefix of the bucket counts, one lane a bucket
    const int count = bucket_start[threadIdx.x];
    int upto = count;
    for (int o = 1; o < 32; o <<= 1) {
      const int below = __shfl_up_sync(0xffffffffu, upto, o);
      if ((int)threadIdx.x >= o) upto += below;
    }
    bucket_start[threadIdx.x] = upto - count;
  }
  __syncthreads();
  LIST_STAMP(a, 4);
  // Item i of a sequence's count (row group i / n, split i % n) goes to first + i.  A sequence of a
  // few items is written by its thread; one of more (split many times) by its whole warp, so that
  // no thread writes a long sequence's 128 items alone.  The loop runs the same passes in every
  // thread (whole warps at the ballot).
  constexpr int kOwnItems = 4;
  auto store = [&](int i, int b, int first, int n, int slot, const ListSeq& s) {
    const int rg = i / n, split = i - rg * n;
    if (first + i < max_items) store_item(work, first + i, b, rg, split, n, s, n > 1 ? slot + rg * n : 0);
  };
  #pragma unroll 1
  for (int b0 = 0; b0 < a.batch; b0 += kThreads) {
    const int b = b0 + threadIdx.x;
    ListSeq s{};
    int n = 1, count = 0, first = 0, slot = 0;
    if (b < a.batch) {
      s = list_sequence(a, b, errors, false);
      n = list_splits(s, chunk);
      count = s.row_groups * n;
      if (count) first = atomicAdd(&bucket_start[bucket(s, n)], count);
      if (count && n > 1) slot = atomicAdd(&slot_cursor, count);
    }
    if (count <= kOwnItems)
      #pragma unroll 1
      for (int i = 0; i < count; ++i) store(i, b, first, n, slot, s);
    #pragma unroll 1
    for (unsigned many = __ballot_sync(0xffffffffu, count > kOwnItems); many; many &= many - 1) {
      const int from = __ffs(many) - 1;
      const auto take = [&](int v) { return __shfl_sync(0xffffffffu, v, from); };
      const ListSeq t{take(s.q_start), take(s.q_len), take(s.cached), 0, 0};
      const int tb = take(b), tn = take(n), tcount = take(count), tfirst = take(first), tslot = take(slot);
      #pragma unroll 1
      for (int i = threadIdx.x % 32; i < tcount; i += 32) store(i, tb, tfirst, tn, tslot, t);
    }
  }
  // Padding past the list (the launch's grid is the capacity).
  const int4 zero = make_int4(0, 0, 0, 0);
  #pragma unroll 1
  for (long long i = items + threadIdx.x; i < max_items; i += kThreads) {
    reinterpret_cast<int4*>(work)[2 * i] = zero;
    reinterpret_cast<int4*>(work)[2 * i + 1] = zero;
  }
  LIST_STAMP(a, 5);
  return direct;
}

// An int of global memory read with acquire semantics at GPU scope.
__device__ __forceinline__ unsigned load_acquire(const int* at) {
  unsigned value;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(at) : "memory");
  return value;
}

// The device list's hand-over inside one launch, through two ints that are zero between launches
// and graph replays (the host allocates them zeroed).  sync[1] hands out tickets in the order CTAs
// start, wrapping to zero after the grid's last (atomicInc).  The CTA of ticket 0 builds the list
// and then adds the number of other CTAs to sync[0] (a release); each other CTA waits until sync[0]
// is not zero (an acquire) and takes one off without waiting for the result, so the last one leaves
// it zero.  A CTA asks for its ticket and reads sync[0] at once: after the first wave the list is
// out, and the hand-over costs one round trip.  Whatever order the GPU starts a grid's CTAs in,
// every waiting CTA waits behind a builder that is already running, and each CTA takes the work of
// its ticket (so the work goes in list order as CTAs start).  Two launches must not share the ints
// at once (one stream's buffers; kernels/ragged.py).  The work items are then read through L2
// (load_item's __ldcg).  A third int, sync[2], written before each release, says whether the list
// is level (`direct`): then the builder lets the others go before it writes the list, and each CTA
// makes its item itself (direct_item).  Returns the ticket.
__device__ __forceinline__ int wait_for_list(const ListArgs& a, int slots_per_head, int max_items, int max_slots,
                                             int* work, int* sync, int* errors, int* stage, bool& direct) {
  __shared__ int ticket_shared, direct_shared;
  if (threadIdx.x == 0) {
    const unsigned ticket = atomicInc(reinterpret_cast<unsigned*>(sync + 1), gridDim.x - 1);
    unsigned ready = load_acquire(sync);
    if (ticket != 0) {
      for (; !ready; ready = load_acquire(sync)) __nanosleep(64);
      direct_shared = (int)load_acquire(sync + 2);  // written before the release just seen
      asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" ::"l"(sync), "r"(0xffffffffu) : "memory");
    }
    ticket_shared = (int)ticket;
  }
  __syncthreads();
  const int ticket = ticket_shared;
  if (ticket == 0) {
    LIST_STAMP(a, 0);
    direct = build_list(a, slots_per_head, max_items, max_slots, work, errors, stage, sync);
    if (!direct) {
      __threadfence();
      __syncthreads();
      if (threadIdx.x == 0) release_list(sync, false);
    } else {
      __syncthreads();  // the staged lengths read to the end before Q and the block ids land over them
    }
    LIST_STAMP(a, 6);
  } else {
    direct = direct_shared != 0;
  }
  return ticket;
}
#endif

#if TRACE
// The benchmark's trace row of this CTA (kernels/decode.py TRACE_COLUMNS): start ns, ready ns (its
// work item known: after a device list's wait, the start elsewhere), end ns, SM, number (the
// ticket of a device-listed CTA, else its linear index), then the device list builder's seven stamps
// (columns 5-11; zeros in every other row and in the other kernels), then the CTA's phases
// (trace_phase, columns 12-14): its first tile landed, its K/V loop drained, its rows stored.
constexpr int kTraceColumns = 15;
#if RAGGED
static_assert(kTraceColumns == 5 + kBuildStamps + 3, "the builder's stamps follow the five columns, the phases them");
#endif
__device__ __forceinline__ unsigned long long* trace_row(unsigned long long* trace) {
  return trace + kTraceColumns * (blockIdx.x + (long long)gridDim.x * (blockIdx.y + (long long)gridDim.y * blockIdx.z));
}
enum TracePhase { kTileZeroLanded = 12, kLoopDrained = 13, kRowsStored = 14 };
__device__ __forceinline__ void trace_phase(unsigned long long* trace, TracePhase column) {
  if (trace && threadIdx.x == 0) trace_row(trace)[column] = cp::global_ns();
}
__device__ __forceinline__ void trace_ready(unsigned long long* trace, int number) {
  if (trace && threadIdx.x == 0) {
    trace_row(trace)[1] = cp::global_ns();
    trace_row(trace)[4] = (unsigned long long)number;
  }
}
#endif

}  // namespace decode

using namespace decode;

extern "C" __global__ void __launch_bounds__(kThreads, kMinCtas) paged_decode(
    const DecodeParams params,
    const T* __restrict__ q,                           // [B, Sq, H, D], strides in params
    const cp::Vec8* k_cache, const cp::Vec8* v_cache,  // [num_blocks, block_size, Hkv, D]
    cp::Vec8* k_cache_w, cp::Vec8* v_cache_w,  // the same caches, written by the append (no restrict: aliases)
    const T* __restrict__ k_new, const T* __restrict__ v_new,                        // [B, Sn, Hkv, D] or null
    const int* __restrict__ cache_seqlens,  // [B], or null: params.cached_all for every sequence
    const int* __restrict__ block_table,    // [B, max_blocks] (a contiguous cache: the identity)
    const int* __restrict__ cache_batch_idx,  // [B] or null: the contiguous cache's row of sequence b
    const int* __restrict__ cache_leftpad,    // [B] or null: sequence b's first position (contiguous cache)
    const T* __restrict__ rotary_cos,         // [seqlen_ro, rotary_dim / 2] or null
    const T* __restrict__ rotary_sin,
    const float* __restrict__ alibi_slopes,   // [H] or [B, H] (params.alibi_batch_stride) or null
    T* __restrict__ out,                  // [B, Sq, H, D] contiguous
    float* __restrict__ lse,              // [B, H, Sq] or null
    float* __restrict__ part_out,         // [num_splits, B*Sq*H, D] when num_splits > 1
    float* __restrict__ part_lse,         // [num_splits, B*Sq*H]
    int* errors                           // the device error word (cp::report_error) or null
#if RAGGED
    , int* work                           // [gridDim.x / Hkv][8]: the WorkItem of each Hkv CTAs
    , int* merge_count                    // [slots][Hkv], zero between launches (merge_if_last)
    // The device list (list_sync non-null): the lengths (cache_seqlens, or cu_seqlens_q / _k), the
    // rule's arguments, and the hand-over's two ints (wait_for_list); null: the host listed the work.
    , const int* __restrict__ list_seqlens, const int* __restrict__ list_cu_q, const int* __restrict__ list_cu_k
    , int list_batch, int list_seqlen_q, int list_max_seqlen_q, int list_key_limit
    , int list_slots_per_head, int list_max_items, int list_max_slots, int* list_sync
#endif
#if TRACE
    , unsigned long long* __restrict__ trace  // [CTAs][kTraceColumns] (trace_row)
#endif
    ) {
#if TRACE
  // The start is stored at entry, so that no clock value stays live through the K/V loop.
  if (trace && threadIdx.x == 0) trace_row(trace)[0] = cp::global_ns();
#endif
  // The steps of the header, in order: setup, the block-id prologue and the first tiles, what runs
  // while they fly (Q rotation, fused append, index checks), the K/V loop, the warp merge, the store.
  extern __shared__ __align__(128) unsigned char smem_raw[];
#if RAGGED
  int number = blockIdx.x;  // which CTA of the list this one is (see RAGGED above)
  bool direct = false;      // a level decode list: the item made here, not read (wait_for_list)
  if (list_sync) {
    const ListArgs a{list_seqlens, list_cu_q, list_cu_k, list_batch, list_seqlen_q, params.seqlen_q, list_max_seqlen_q,
                     params.seqlen_new, params.num_heads / params.num_kv_heads, list_key_limit
#if TRACE
                     , trace ? trace_row(trace) + 5 : nullptr
#endif
                     };
    number = wait_for_list(a, list_slots_per_head, list_max_items, list_max_slots, work, list_sync, errors,
                           reinterpret_cast<int*>(smem_raw), direct);
  }
  const WorkItem item = direct ? direct_item(list_seqlens, list_batch, list_seqlen_q, params.num_heads / params.num_kv_heads,
                                             number / params.num_kv_heads)
                               : load_item(work, number / params.num_kv_heads);
#if TRACE
  trace_ready(trace, number);
  if (item.q_len <= 0 && trace && threadIdx.x == 0) {  // padding: its end and SM now
    trace_row(trace)[2] = cp::global_ns();
    trace_row(trace)[3] = cp::sm_id();
  }
#endif
  if (item.q_len <= 0) return;  // padding: the whole CTA leaves before any barrier
  const Cta cta = locate(params, item, number);
#else
  const Cta cta = locate(params);
#if TRACE
  trace_ready(trace, blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z));
#endif
#endif
  const Buffers buf = buffers(smem_raw);
  load_sequence_and_q(params, cta, buf, q, cache_seqlens, cache_batch_idx, cache_leftpad);
  KeySource src = key_source(params, cta, k_cache, v_cache, k_new, v_new);
  const Sequence sq = resolve_sequence(src, params, cta, buf.seq, block_table);
  const Rows rows = row_bounds(params, cta, sq.num_keys, alibi_slopes);
  const ScoreMods mods = score_mods(params, alibi_slopes);
  const KeyRange range = split_range(params, cta, sq.num_keys);

#if RAGGED
  const Loader loader = make_loader(src, buf, seen_range(range, rows), k_new != nullptr);
#else
  const Loader loader = make_loader(src, buf, range, k_new != nullptr);
#endif
  bool issued_ok[kStages - 1];
  loader.prologue(issued_ok);
  const Rotary ro = make_rotary(params, rotary_cos, rotary_sin);
  rotate_q(ro, params, cta, smem_raw, sq.cached_end);
  append_new_tokens(src, sq, cta, ro, k_cache_w, v_cache_w);
  const bool check_ids = check_indices(src, sq, range, params, cta, ro, buf.seq, errors);
  Votes votes = first_vote(issued_ok);
  report_bad_column(check_ids, buf.seq, cta.b, errors);

  WarpState st;
#if TRACE
  // Tile 0's wait, which the loop's first iteration makes anyway, made here to stamp it.
  cp::cp_async_wait<kStages - 2>();
  __syncthreads();
  trace_phase(trace, kTileZeroLanded);
#endif
  attend(st, votes, loader, buf, cta, rows, mods, ro, sq.first_pos);
#if TRACE
  trace_phase(trace, kLoopDrained);
#endif
  share_state(st, smem_raw, cta);
  store_rows(cta, smem_raw, out, lse, part_out, part_lse);
#if TRACE
  trace_phase(trace, kRowsStored);
#endif
#if RAGGED
  merge_if_last(cta, smem_raw, out, lse, part_out, part_lse, merge_count);
#endif
#if TRACE
  if (trace && threadIdx.x == 0) {
    unsigned long long* row = trace_row(trace);
    row[2] = cp::global_ns();
    row[3] = cp::sm_id();
  }
#endif
}

// ---------------------------------------------------------------------------- combine_splits

// combine_splits: out = sum_s w_s * part_out[s] with w_s = exp(lse_s - lse) and
// lse = log(sum_s exp(lse_s)).  One CTA of kCombineThreads per (b, i, h) row.  Thread s reads
// LSE s (at most kCombineThreads splits); warp w then sums splits w, w + 4, ..., all its loads
// issued before their FMAs, and the four warps' sums meet in shared memory.  A row costs two
// memory round trips whatever the split count.
constexpr int kCombineThreads = 128;  // kernels/decode.py: COMBINE_THREADS, MAX_SPLITS
constexpr int kCombineWarps = kCombineThreads / 32;

#if !RAGGED  // the ragged launch merges its splits itself (merge_if_last)
extern "C" __global__ void __launch_bounds__(kCombineThreads) combine_splits(
    const float* __restrict__ part_out, const float* __restrict__ part_lse, int num_splits,
    long long rows_total, int seqlen_q, int num_heads,
    T* __restrict__ out, float* __restrict__ lse) {
  constexpr int kPerLane = kHeadDim / 32;
  constexpr int kUnroll = 8;  // splits in flight per warp
  static_assert(kHeadDim % 32 == 0, "a warp covers a row in whole 32-element columns");
  __shared__ float weights[kCombineThreads];
  __shared__ float warp_max[kCombineWarps], warp_sum[kCombineWarps];
  __shared__ float partial[kCombineWarps][kHeadDim];
  const long long row = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int own = threadIdx.x;  // the split whose LSE this thread reads
  const float own_lse = own < num_splits ? part_lse[own * rows_total + row] : -inf();
  const float m = cp::warp_max(own_lse);
  if (lane == 0) warp_max[warp] = m;
  __syncthreads();
  float m_all = warp_max[0];
#pragma unroll
  for (int w = 1; w < kCombineWarps; ++w) m_all = fmaxf(m_all, warp_max[w]);
  const float m_use = m_all == -inf() ? 0.f : m_all;
  const float own_weight = own < num_splits ? __expf(own_lse - m_use) : 0.f;
  weights[own] = own_weight;
  const float sum = cp::warp_sum(own_weight);
  if (lane == 0) warp_sum[warp] = sum;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kCombineWarps; ++w) total += warp_sum[w];
  const float inv = total > 0.f ? 1.f / total : 0.f;
  // Lane l of warp w sums elements d = l + 32 e over splits w, w + kCombineWarps, ... (a split with
  // weight 0 -- LSE -inf, no key seen -- is skipped, never multiplied).
  const float* row_part = part_out + row * kHeadDim + lane;
  const long long split_stride = rows_total * kHeadDim;
  float acc[kPerLane];
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) acc[e] = 0.f;
  for (int first = warp; first < num_splits; first += kCombineWarps * kUnroll) {
    float x[kUnroll][kPerLane];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int s = first + u * kCombineWarps;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) x[u][e] = s < num_splits ? row_part[s * split_stride + 32 * e] : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int s = first + u * kCombineWarps;
      const float w = s < num_splits ? weights[s] : 0.f;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e)
        if (w > 0.f) acc[e] = fmaf(w, x[u][e], acc[e]);
    }
  }
#pragma unroll
  for (int e = 0; e < kPerLane; ++e) partial[warp][lane + 32 * e] = acc[e];
  __syncthreads();
  for (int d = threadIdx.x; d < kHeadDim; d += kCombineThreads) {
    float value = 0.f;
#pragma unroll
    for (int w = 0; w < kCombineWarps; ++w) value += partial[w][d];
    out[row * kHeadDim + d] = cp::from_float<T>(value * inv);
  }
  if (lse && threadIdx.x == 0) {
    const long long h = row % num_heads, bi = row / num_heads;
    const long long b = bi / seqlen_q, i = bi % seqlen_q;
    lse[(b * num_heads + h) * seqlen_q + i] = total > 0.f ? m_all + __logf(total) : -inf();
  }
}
#endif
