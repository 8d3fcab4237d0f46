// flash_attn_with_kvcache: attention of a few query tokens per sequence over a paged KV cache.
//
// Compile-time parameters (cupy_paged/ops/decode.py spells them in the kernel key):
//   SCALAR_T   __half or __nv_bfloat16 (q, caches, new k/v, out)
//   HEAD_DIM   32, 64, 96, 128 or 256
//   TILE_KEYS  keys per pipeline stage (a multiple of 16 keys per warp)
//   STAGES     depth of the cp.async pipeline (>= 3): STAGES - 1 tiles in flight
//   WARPS      warps per CTA (1, 2, 4 or 8); a CTA asks for 8 warps' worth of residency per SM
//   ROTARY     0 or 1: whether the kernel holds the rotary-embedding code (default 0).  The code
//              stays out of the ROTARY=0 kernel entirely, its K/V loop included.
// Everything else (block size, window, softcap, ALiBi, splits, GQA ratio, seqlen_q, rotary layout)
// is a run-time argument, so two dtypes x five head dims (x rotary or not) are the whole family.
//
// paged_decode: one CTA of WARPS warps per (row group, split, kv head, sequence).  A "row" is one
// (query head of the GQA group, query token) pair; a row group is the 16 rows of an mma A operand
// (padding rows are zero), so with group * seqlen_q <= 16 every K/V byte is read once.  K/V tiles
// go global -> shared memory through cp.async (swizzled rows, see cp::SmemTile), STAGES - 1 tiles in
// flight while one is computed.  No cp.async waits on a block-table read: the ids of a tile
// travel in the cp.async group issued STAGES - 1 tiles before the tile's own, so the pipeline's
// wait covers them and a table read gets the same latency budget as the data it addresses
// (NOTES_decode.md, v7: reading them into registers one iteration ahead cost 14% at block 16).
// Each warp takes TILE_KEYS / WARPS keys of a tile in groups of 16 and runs them on tensor cores:
//   S[16 x 16] = Q K^T      mma m16n8k16, Q fragments by ldmatrix, K fragments by ldmatrix
//   online softmax          on the accumulator fragments, log2 domain (S scaled by scale * log2 e)
//   O[16 x D] += P V        P re-packed from the accumulators, V fragments by ldmatrix.trans
// Each warp keeps its own (m, l, O); the warps' states are merged through shared memory at the end.
// With num_splits > 1 each split covers a contiguous key range and writes a normalised partial
// output and its LSE to a float32 workspace; combine_splits merges them (flash-decoding).
//
// New tokens (k_new/v_new): key j >= cache_seqlens[b] is read from k_new/v_new directly by every CTA
// that needs it, and the CTAs of split 0 / row group 0 copy the new tokens into the cache.  No CTA
// reads a cache slot that this launch writes, so the fused append has no race.
//
// A contiguous cache [Bc, S, Hkv, D] is read as Bc * S blocks of one token through an identity table
// (ops/decode.py keeps one per device), and an int cache_seqlens comes as one value for every
// sequence (DecodeParams::cached_all): a call builds no index arrays.  Sequence b reads cache row
// cache_batch_idx[b] (else b) from position L = cache_leftpad[b] (else 0): its table row starts L
// columns into the identity row of that cache row, it has S - L usable columns and
// cache_seqlens[b] - L cached keys.  Keys are numbered from L on, so the masks, the windows and the
// ALiBi distances (all relative) need nothing else; only rotary positions are absolute (L + key).
//
// Rotary embedding (ROTARY=1, rotary_dim > 0; FlashAttention-2's semantics): the Q tile is rotated
// in shared memory after its load (query token i at cache_seqlens[b] + i with rotary_flags bit 1,
// else at cache_seqlens[b]), the new keys in the K stage of each tile that holds some (new key t at
// cache_seqlens[b] + t), and the fused append writes the same rotated keys; v is never rotated.
// Rows are the cp::SmemTile layout, so a rotation moves whole 16-byte chunks: interleaved (GPT-J)
// pairs sit in one chunk, NeoX pairs (i, i + rotary_dim / 2) in chunks c and c + rotary_dim / 16.
// rotary_cos/rotary_sin [seqlen_ro, rotary_dim / 2] are read 2 bytes at a time: any C-contiguous
// array will do.
//
// Safety: a block id outside [0, num_blocks), a block-table column past the usable columns, a
// negative cache_seqlens, a cache row outside the cache are treated as holes: no read, no write, the
// keys count as masked (a new token whose slot is a hole is still attended, from k_new, but not
// appended; a sequence whose cache row is outside the cache sees no key at all).  The bad values are
// reported in the device error word (cp::report_error) outside the K/V loop: the sequence-level
// checks by split 0 / row group 0 / kv head 0, the block ids by the row group 0 / kv head 0 CTA of
// each split over its own key range (split 0 also over the columns before it), so that no CTA reads
// a long table row alone.  A rotary position past seqlen_ro leaves that row unrotated (reported).
#include "common.cuh"
#include "mma.cuh"

#ifndef ROTARY
#define ROTARY 0
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
// Resident CTAs per SM that __launch_bounds__ asks registers for: 8 warps per SM in all
// (NOTES_decode.md, v13: the rate goes with warps per SM, however they are grouped in CTAs).
constexpr int kMinCtas = kWarps >= 8 ? 1 : 8 / kWarps;
// Q fragments stay in registers up to D = 128; at D = 256 they are re-read from shared memory
// so that O (128 floats per thread) fits without spills.
constexpr bool kQInRegs = kHeadDim <= 128;
// Tile loads: kChunkLanes consecutive lanes cover one key's row (coalesced 64-128 byte runs), each
// lane kChunksPerThread chunks of it; a pass covers kKeysPerPass keys.
// (NOTES_decode.md, v13c: 2 or 4 lanes per row, fewer passes, ran 12-30% slower; 16 no faster.)
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
// of the kStages - 2 tiles issued but not yet voted on (`pending` in the kernel).  (Two stages,
// with more warps per SM, measured slower: NOTES_decode.md, v13b.)
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
// The 4 ints at Smem::kSeqlen.
enum Seq : int { kSeqLength = 0, kSeqRow = 1, kSeqLeftpad = 2, kSeqBadColumn = 3 };
constexpr int kNoColumn = 0x7fffffff;  // kSeqBadColumn before any bad column is found

// Where the keys of one sequence live: the cache through the block table, the new tokens in k_new.
struct KeySource {
  const cp::Vec8* k_cache;
  const cp::Vec8* v_cache;
  const T* k_new;
  const T* v_new;
  long long kn_token, vn_token;  // element strides of k_new/v_new along seqlen_new
  const int* table_row;          // block_table[b] (a contiguous cache: its row's identity, from L on)
  int max_blocks;                // usable columns of table_row (0: none)
  int num_blocks, block_size, block_shift;  // block_size = 1 << block_shift
  int num_kv_heads, kv_head, cached;        // cached keys: cache_seqlens[b] - L (>= 0)

  // The block size is a power of two: no division (NOTES_decode.md, v13c: +4% at 256 x 2048).
  __device__ __forceinline__ int column(int j) const { return j >> block_shift; }
  __device__ __forceinline__ int offset(int j) const { return j & (block_size - 1); }
  __device__ __forceinline__ long long cache_vec(int block, int j, int vec) const {
    return (((long long)block * block_size + offset(j)) * num_kv_heads + kv_head) * kChunks + vec;
  }
};

// The key of pass p that this thread loads, relative to the tile start.
__device__ __forceinline__ int pass_key(int p) { return p * kKeysPerPass + threadIdx.x / kChunkLanes; }

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
// which read_blocks discards); `limit` (id_limit in the kernel) stops at the usable columns too.
// Not unrolled: a thread has at most one key in the registered shapes, and the unrolled loop's
// remainder code (the trip count is not a constant to the compiler) would sit in the K/V loop.
__device__ __forceinline__ void issue_ids(const KeySource& src, int start, int limit, u32 slot) {
#pragma unroll 1
  for (int key = threadIdx.x; key < kTileKeys; key += kThreads) {
    const int j = start + key;
    const bool ok = static_cast<unsigned>(j) < static_cast<unsigned>(limit);  // 0 <= j < limit
    cp::cp_async_4(slot + 4 * key, src.table_row + (ok ? static_cast<unsigned>(src.column(j)) : 0u), ok);
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
    const bool ok = static_cast<unsigned>(j) < static_cast<unsigned>(limit) &&
                    static_cast<unsigned>(id) < static_cast<unsigned>(src.num_blocks);
    blocks[p] = ok ? id : -1;
  }
}

#if ROTARY
// Rotary embedding on 16-byte chunks of 8 elements.  Each product and each sum is rounded on its
// own (no FMA contraction, as NumPy's float32 arithmetic in the reference): the fused append and
// the K stage rotate the same key, and the cache must get the bits the attended key had.
__device__ __forceinline__ float2 to_float2(u32 w, __half) {
  return __half22float2(*reinterpret_cast<const __half2*>(&w));
}
__device__ __forceinline__ float2 to_float2(u32 w, __nv_bfloat16) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
}
// (x, y) -> (x cos - y sin, x sin + y cos).
__device__ __forceinline__ void rotate(float& x, float& y, float c, float s) {
  const float xr = __fsub_rn(__fmul_rn(x, c), __fmul_rn(y, s));
  y = __fadd_rn(__fmul_rn(x, s), __fmul_rn(y, c));
  x = xr;
}
// 2 * kWords consecutive elements of a cos/sin row, packed in pairs like a chunk's words.
template <int kWords>
__device__ __forceinline__ void load_pairs(const T* row, u32 (&w)[kWords]) {
  const unsigned short* h = reinterpret_cast<const unsigned short*>(row);
#pragma unroll
  for (int k = 0; k < kWords; ++k)
    w[k] = static_cast<u32>(__ldg(h + 2 * k)) | (static_cast<u32>(__ldg(h + 2 * k + 1)) << 16);
}
// Interleaved (GPT-J): chunk u holds pairs 4u..4u+3 as elements (2i, 2i + 1); cw/sw: cos/sin[4u..4u+3].
__device__ __forceinline__ uint4 rotate_interleaved(uint4 v, const u32 (&cw)[2], const u32 (&sw)[2]) {
  u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 cf = to_float2(cw[k / 2], T()), sf = to_float2(sw[k / 2], T());
    float2 p = to_float2(w[k], T());
    rotate(p.x, p.y, k % 2 ? cf.y : cf.x, k % 2 ? sf.y : sf.x);
    w[k] = cp::from_float2(p.x, p.y, T());
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}
// NeoX: x = chunk u (elements i = 8u..8u+7), y = the chunk rotary_dim / 2 elements on; cw/sw: cos/sin[8u..8u+7].
__device__ __forceinline__ void rotate_neox(uint4& x, uint4& y, const u32 (&cw)[4], const u32 (&sw)[4]) {
  u32 xw[4] = {x.x, x.y, x.z, x.w}, yw[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float2 xf = to_float2(xw[k], T()), yf = to_float2(yw[k], T());
    const float2 cf = to_float2(cw[k], T()), sf = to_float2(sw[k], T());
    rotate(xf.x, yf.x, cf.x, sf.x);
    rotate(xf.y, yf.y, cf.y, sf.y);
    xw[k] = cp::from_float2(xf.x, xf.y, T());
    yw[k] = cp::from_float2(yf.x, yf.y, T());
  }
  x = make_uint4(xw[0], xw[1], xw[2], xw[3]);
  y = make_uint4(yw[0], yw[1], yw[2], yw[3]);
}

// Where the rotation of one row reads its cos/sin rows: rotary_cos/sin + position * (rotary_dim / 2).
struct Rotary {
  const T* cos;
  const T* sin;
  int dim;           // rotary_dim (> 0, a multiple of 16, <= head dim)
  int seqlen_ro;     // rows of cos/sin: a position from seqlen_ro on is left unrotated
  bool interleaved;
  // Work units of one row: a chunk of 4 pairs (interleaved), a pair of chunks (NeoX).
  __device__ __forceinline__ int units() const { return interleaved ? dim / 8 : dim / 16; }
  __device__ __forceinline__ long long row_at(long long position) const { return position * (dim / 2); }
};

// Unit `unit` of row `row` of a swizzled tile at `tile` (shared memory), at `position` (< seqlen_ro).
__device__ __forceinline__ void rotate_tile_unit(const Rotary& ro, unsigned char* tile, int row, int unit,
                                                 long long position) {
  const T* c = ro.cos + ro.row_at(position);
  const T* s = ro.sin + ro.row_at(position);
  if (ro.interleaved) {
    u32 cw[2], sw[2];
    load_pairs(c + 4 * unit, cw);
    load_pairs(s + 4 * unit, sw);
    uint4* p = reinterpret_cast<uint4*>(tile + Tile::offset(row, unit));
    *p = rotate_interleaved(*p, cw, sw);
  } else {
    u32 cw[4], sw[4];
    load_pairs(c + 8 * unit, cw);
    load_pairs(s + 8 * unit, sw);
    uint4* px = reinterpret_cast<uint4*>(tile + Tile::offset(row, unit));
    uint4* py = reinterpret_cast<uint4*>(tile + Tile::offset(row, unit + ro.dim / 16));
    uint4 x = *px, y = *py;
    rotate_neox(x, y, cw, sw);
    *px = x;
    *py = y;
  }
}

// Chunk `v` of a new key row `key` (global memory) after rotation at `position` (< seqlen_ro): the
// fused append's value, computed by the same arithmetic as rotate_tile_unit.
__device__ __forceinline__ cp::Vec8 rotated_chunk(const Rotary& ro, const cp::Vec8* key, int v, long long position) {
  const T* c = ro.cos + ro.row_at(position);
  const T* s = ro.sin + ro.row_at(position);
  cp::Vec8 out = key[v];
  if (ro.interleaved) {
    if (v < ro.dim / 8) {
      u32 cw[2], sw[2];
      load_pairs(c + 4 * v, cw);
      load_pairs(s + 4 * v, sw);
      out.raw = rotate_interleaved(out.raw, cw, sw);
    }
  } else {
    const int half = ro.dim / 16;  // chunks of one half of the rotated dims
    if (v < 2 * half) {
      const int unit = v < half ? v : v - half;
      u32 cw[4], sw[4];
      load_pairs(c + 8 * unit, cw);
      load_pairs(s + 8 * unit, sw);
      uint4 x = key[unit].raw, y = key[unit + half].raw;
      rotate_neox(x, y, cw, sw);
      out.raw = v < half ? x : y;
    }
  }
  return out;
}
#endif  // ROTARY

// The benchmark's trace row of this CTA: start ns, end ns, SM.
__device__ __forceinline__ unsigned long long* trace_row(unsigned long long* trace) {
  return trace + 3 * (blockIdx.x + (long long)gridDim.x * (blockIdx.y + (long long)gridDim.y * blockIdx.z));
}

// Scalar arguments of paged_decode, passed as one struct by value (ops/decode.py packs it with
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
    int* errors,                          // the device error word (cp::report_error) or null
    unsigned long long* __restrict__ trace) {  // null, or [CTAs][3]: start ns, end ns, SM (benchmark)
  // The benchmark's trace gets the start now, so that no clock value stays live through the K/V loop.
  if (trace && threadIdx.x == 0) trace_row(trace)[0] = cp::global_ns();
  const long long q_batch = params.q_batch, q_token = params.q_token, q_head = params.q_head;
  const long long kn_batch = params.kn_batch, kn_token = params.kn_token, kn_head = params.kn_head;
  const long long vn_batch = params.vn_batch, vn_token = params.vn_token, vn_head = params.vn_head;
  const int max_blocks = params.max_blocks, num_blocks = params.num_blocks;
  const int block_shift = params.block_shift;
  const int seqlen_q = params.seqlen_q, seqlen_new = params.seqlen_new;
  const int num_heads = params.num_heads, num_kv_heads = params.num_kv_heads;
  const int num_rows = params.num_rows, row_groups = params.row_groups;
  const int win_left = params.win_left, win_right = params.win_right;
  const int num_splits = params.num_splits;
  const float softmax_scale = params.softmax_scale, softcap = params.softcap;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const u32 ks = cp::smem_address(smem_raw);
  const u32 vs = ks + Smem::kV;
  const u32 qs = ks + Smem::kQ;
  int* flags = reinterpret_cast<int*>(smem_raw + Smem::kFlags);
  const int* ids = reinterpret_cast<const int*>(smem_raw + Smem::kIds);  // [kIdSlots][kTileKeys]
  const u32 ids_s = ks + Smem::kIds;

  const int row_group = blockIdx.x % row_groups;
  const int split = blockIdx.x / row_groups;
  const int kv_head = blockIdx.y;
  const int b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;  // fragment row and column pair (mma.cuh)
  const int group = num_heads / num_kv_heads;
  const int batch = gridDim.z;

  KeySource src;
  src.k_cache = k_cache;
  src.v_cache = v_cache;
  src.k_new = k_new ? k_new + b * kn_batch + kv_head * kn_head : nullptr;
  src.v_new = v_new ? v_new + b * vn_batch + kv_head * vn_head : nullptr;
  src.kn_token = kn_token;
  src.vn_token = vn_token;
  src.num_blocks = num_blocks;
  src.block_size = 1 << block_shift;
  src.block_shift = block_shift;
  src.num_kv_heads = num_kv_heads;
  src.kv_head = kv_head;
  // Prologue, first round trip: the sequence's entries (Seq) and the Q tile [16 rows][D] (padding
  // rows zero) -> shared memory by cp.async, so that all are in flight together.
  int* seq = reinterpret_cast<int*>(smem_raw + Smem::kSeqlen);
  if (threadIdx.x == 0) {
    if (cache_seqlens) cp::cp_async_4(ks + Smem::kSeqlen + 4 * kSeqLength, cache_seqlens + b, true);
    else seq[kSeqLength] = params.cached_all;
    if (cache_batch_idx) cp::cp_async_4(ks + Smem::kSeqlen + 4 * kSeqRow, cache_batch_idx + b, true);
    else seq[kSeqRow] = b;
    if (cache_leftpad) cp::cp_async_4(ks + Smem::kSeqlen + 4 * kSeqLeftpad, cache_leftpad + b, true);
    else seq[kSeqLeftpad] = 0;
    seq[kSeqBadColumn] = kNoColumn;
  }
  for (int index = threadIdx.x; index < kRows * kChunks; index += kThreads) {
    const int r = index / kChunks, c = index % kChunks;
    const int row = row_group * kRows + r;
    const bool real = row < num_rows;
    const cp::Vec8* qp = reinterpret_cast<const cp::Vec8*>(q);
    if (real) qp = reinterpret_cast<const cp::Vec8*>(q + b * q_batch + (row % seqlen_q) * q_token +
                                                      (kv_head * group + row / seqlen_q) * q_head) + c;
    cp::cp_async_16(qs + Tile::offset(r, c), qp, real);
  }
  cp::cp_async_commit();
  cp::cp_async_wait<0>();
  __syncthreads();
  // The sequence's keys: cache positions [L, length) through its table row, then the new tokens.
  // A contiguous cache folds the row and L into the table row (see the header); a paged one has
  // L = 0 and no row choice (the host allows neither with a table).
  const int length = seq[kSeqLength];         // cache_seqlens[b] as given
  const int cached_end = max(length, 0);      // a negative length counts as 0
  const int cache_row = seq[kSeqRow], leftpad = seq[kSeqLeftpad];
  const int cache_rows = params.cache_rows;
  bool row_ok = true, leftpad_ok = true;
  int first_pos = 0;                          // L: the cache position of key 0
  long long table_at = (long long)b * max_blocks;
  int width = max_blocks;                     // usable columns of the table row
  if (cache_rows > 0) {
    row_ok = cache_row >= 0 && cache_row < cache_rows;
    leftpad_ok = leftpad >= 0 && leftpad <= cached_end;
    first_pos = leftpad_ok ? leftpad : 0;
    table_at = (long long)(row_ok ? cache_row : 0) * max_blocks + first_pos;
    width = row_ok ? max(max_blocks - first_pos, 0) : 0;
  }
  src.table_row = block_table + table_at;
  src.max_blocks = width;
  // A cache row outside the cache: no key at all (cached or new), nothing appended.
  src.cached = row_ok ? cached_end - first_pos : 0;
  const int new_keys = row_ok ? seqlen_new : 0;
  const int num_keys = src.cached + new_keys;  // Lk

  // Rows of the CTA: row r is (group head, query token) = divmod(row_group * 16 + r, seqlen_q),
  // bottom-right aligned (query i sits at key i + Lk - Sq).  The keys every real row sees bound the
  // tiles that need no mask; this thread's own rows are g and g + 8 of the fragments.
  int lo_all = 0, hi_all = num_keys - 1;
  int my_lo[2], my_hi[2], my_pos[2];
  float my_slope[2];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = row_group * kRows + r;
    const bool real = row < num_rows;
    const int pos = row % seqlen_q + num_keys - seqlen_q;
    const int lo = win_left >= 0 ? max(pos - win_left, 0) : 0;
    const int hi = win_right >= 0 ? min(pos + win_right, num_keys - 1) : num_keys - 1;
    if (real) {
      lo_all = max(lo_all, lo);
      hi_all = min(hi_all, hi);
    }
    if (r % 8 == g) {
      const int hr = r / 8;
      my_lo[hr] = real ? lo : num_keys;  // a padding row sees nothing
      my_hi[hr] = hi;
      my_pos[hr] = pos;
      // Scores live in the log2 domain, so the slope does too.
      my_slope[hr] = (real && alibi_slopes)
                         ? alibi_slopes[(long long)b * params.alibi_batch_stride + kv_head * group + row / seqlen_q] * kLog2e
                         : 0.f;
    }
  }
  // Softcap c on natural-log scores, rewritten for log2-domain scores x: c' tanh(x / c'), c' = c log2 e.
  const bool plain = softcap <= 0.f && alibi_slopes == nullptr;
  const float scale2 = softmax_scale * kLog2e;
  const float cap2 = softcap * kLog2e;
  const float inv_cap2 = softcap > 0.f ? 1.f / cap2 : 0.f;
  // Keys any row of the sequence can see; the splits share them out in whole tiles.
  const int first_key = win_left >= 0 ? max(num_keys - seqlen_q - win_left, 0) : 0;
  const int span = max(num_keys - first_key, 0);
  const int per_split = ((span + num_splits - 1) / num_splits + kTileKeys - 1) / kTileKeys * kTileKeys;
  const int start = min(first_key + split * per_split, num_keys);
  const int end = min(start + per_split, num_keys);
  const int num_tiles = (end - start + kTileKeys - 1) / kTileKeys;

  // Prologue, second round trip: the block ids of the first tiles (NOTES_decode.md, v9: issuing
  // them with the first round trip where the keys start at 0 gained nothing).
  // Keys whose block ids are read: the cached keys of [start, end) in the usable columns (a key
  // j >= 0 has column(j) < src.max_blocks exactly when j < src.max_blocks << block_shift), so
  // that issue_ids and read_blocks check one bound.
  const long long table_keys = (long long)src.max_blocks << block_shift;
  const int id_limit = (int)max(min((long long)min(end, src.cached), table_keys), 0ll);
  for (int s = 0; s < kStages - 1 && s < num_tiles; ++s) issue_ids(src, start + s * kTileKeys, id_limit, ids_s + s * kTileKeys * 4);
  cp::cp_async_commit();
  cp::cp_async_wait<0>();
  __syncthreads();

  // Block ids of the tile about to be issued (in their slot: their group has landed), then the
  // tile; the ids of tile + kStages - 1 join this tile's group.
  int blocks[kPasses];
  auto issue = [&](int tile) -> bool {
    const int tile_start = start + tile * kTileKeys;
    read_blocks(src, tile_start, id_limit, ids + (tile % kIdSlots) * kTileKeys, blocks);
    const int ahead = tile + kStages - 1;
    if (ahead < num_tiles) issue_ids(src, start + ahead * kTileKeys, id_limit, ids_s + (ahead % kIdSlots) * kTileKeys * 4);
    return k_new ? issue_tile<true>(src, tile_start, end, tile % kStages, blocks, ks, vs, flags)
                 : issue_tile<false>(src, tile_start, end, tile % kStages, blocks, ks, vs, flags);
  };
  bool issued_ok[kStages - 1] = {};  // this thread's keys of tile s all loaded
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_tiles) issued_ok[s] = issue(s);
    cp::cp_async_commit();
  }
#if ROTARY
  // Rotary embedding: a rotary_dim the kernel cannot take (the host checks it) counts as none.
  Rotary ro;
  {
    const int dim = params.rotary_dim;
    const bool usable = dim > 0 && dim <= kHeadDim && dim % 16 == 0 && rotary_cos && rotary_sin;
    ro.cos = rotary_cos;
    ro.sin = rotary_sin;
    ro.dim = usable ? dim : 0;
    ro.seqlen_ro = params.seqlen_ro;
    ro.interleaved = (params.rotary_flags & 1) != 0;
  }
  const bool q_per_token = (params.rotary_flags & 2) != 0;
  // The Q tile rotated in place, once the first tiles are in flight; the barrier below (the first
  // loaded-tile vote) orders it before the Q fragments are read.
  if (ro.dim > 0) {
    const int units = ro.units();
    for (int index = threadIdx.x; index < kRows * units; index += kThreads) {
      const int r = index / units, unit = index % units;
      const int row = row_group * kRows + r;
      const long long position = (long long)cached_end + (q_per_token ? row % seqlen_q : 0);
      if (row < num_rows && position < ro.seqlen_ro) rotate_tile_unit(ro, smem_raw + Smem::kQ, r, unit, position);
    }
  }
#endif

  // Fused append, once the first tiles are in flight: split 0 / row group 0 writes this kv
  // head's new tokens into the cache (slots no CTA of this launch reads), k rotated like the
  // keys attended.
  if (new_keys > 0 && split == 0 && row_group == 0) {
    for (int index = threadIdx.x; index < new_keys * kChunks; index += kThreads) {
      const int tok = index / kChunks, v = index % kChunks;
      const int j = src.cached + tok;
      const int col = src.column(j);
      if (col >= src.max_blocks) continue;
      const int id = __ldg(src.table_row + col);
      if (id < 0 || id >= num_blocks) continue;
      const long long at = src.cache_vec(id, j, v);
      const cp::Vec8* key = reinterpret_cast<const cp::Vec8*>(src.k_new + tok * kn_token);
#if ROTARY
      const long long position = (long long)cached_end + tok;
      k_cache_w[at] = ro.dim > 0 && position < ro.seqlen_ro ? rotated_chunk(ro, key, v, position) : key[v];
#else
      k_cache_w[at] = key[v];
#endif
      v_cache_w[at] = reinterpret_cast<const cp::Vec8*>(src.v_new + tok * vn_token)[v];
    }
  }

  // Checks of the index values (cp::report_error), off the K/V loop: the sequence-level ones by
  // one thread of split 0 / row group 0 / kv head 0; the block ids by the row group 0 / kv head 0
  // CTA of every split, over the columns whose first key is in its range (split 0: from column 0),
  // which together are the columns of the keys [0, Lk) once each.  A contiguous cache's table is
  // the host's identity: its ids are never checked.
  const bool checker = row_group == 0 && kv_head == 0;
  const long long needed = (long long)src.cached + new_keys;  // keys needing a slot
  if (checker && split == 0 && threadIdx.x == 0) {
    if (length < 0) cp::report_error(errors, cp::kErrSeqlen, b, length);
    if (!row_ok) cp::report_error(errors, cp::kErrBatchIdx, b, cache_row);
    if (!leftpad_ok) cp::report_error(errors, cp::kErrLeftpad, b, leftpad);
    if (needed > 0 && ((needed - 1) >> block_shift) >= width)
      cp::report_error(errors, cp::kErrTableShort, b, first_pos + needed);
#if ROTARY
    if (ro.dim > 0) {
      const long long last = (long long)cached_end + max(q_per_token ? seqlen_q - 1 : 0, new_keys - 1);
      if (last >= ro.seqlen_ro) cp::report_error(errors, cp::kErrRotary, b, last);
    }
#endif
  }
  const bool check_ids = checker && cache_rows == 0;
  if (check_ids) {
    const long long round_up = src.block_size - 1;
    const long long columns = min((needed + round_up) >> block_shift, (long long)width);
    const int from = split == 0 ? 0 : (int)min(((long long)start + round_up) >> block_shift, columns);
    const int to = (int)min(((long long)end + round_up) >> block_shift, columns);
    int bad = kNoColumn;
    for (int c = from + threadIdx.x; c < to; c += kThreads) {
      const int id = __ldg(src.table_row + c);
      if (static_cast<unsigned>(id) >= static_cast<unsigned>(num_blocks)) bad = min(bad, c);
    }
    bad = __reduce_min_sync(0xffffffffu, bad);
    if (lane == 0 && bad != kNoColumn) atomicMin(seq + kSeqBadColumn, bad);
  }

  // Whether all of tile t's keys were loaded, voted at the barrier before its use; the barrier of
  // iteration t votes on tile t + 1 (issued at least one iteration earlier), so one vote is kept
  // in hand.  At the top of iteration t, pending[i] is this thread's flag of tile t + 1 + i (the
  // kStages - 2 tiles issued and not yet voted on; a flag of a tile past num_tiles is never used).
  bool tile_loaded = __syncthreads_and(issued_ok[0]);
  bool pending[kStages - 2];
#pragma unroll
  for (int i = 0; i < kStages - 2; ++i) pending[i] = issued_ok[i + 1];
  // The split's smallest bad column, merged over the warps before that barrier.
  if (check_ids && threadIdx.x == 0 && seq[kSeqBadColumn] != kNoColumn)
    cp::report_error(errors, cp::kErrBlockId, b, seq[kSeqBadColumn]);

  // Q fragments (A operand, one per k-step): lanes 0-15 address rows 0-15 of chunk 2kk, 16-31 of 2kk+1.
  u32 qa[kQInRegs ? kKSteps : 1][4];
  if (kQInRegs) {
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) cp::ldmatrix_x4(qa[kQInRegs ? kk : 0], qs + Tile::offset(lane & 15, 2 * kk + (lane >> 4)));
  }
  // Per-lane parts of the ldmatrix addresses of a 16-key group (see mma.cuh for the fragment layouts).
  const int k_row = (lane >> 4) * 8 + (lane & 7), k_chunk = (lane >> 3) & 1;  // B of Q K^T
  const int v_row = ((lane >> 3) & 1) * 8 + (lane & 7), v_chunk = lane >> 4;  // B of P V (.trans)

#if ROTARY
  const bool rotates_keys = ro.dim > 0 && end > src.cached;  // the CTA's range holds new keys
#endif
  // Online softmax state in the log2 domain for rows g and g + 8; o[n-tile] are C fragments.
  float m[2] = {-inf(), -inf()}, l[2] = {0.f, 0.f};
  float o[kHeadDim / 8][4];
#pragma unroll
  for (int n = 0; n < kHeadDim / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] = 0.f;

  for (int tile = 0; tile < num_tiles; ++tile) {
    cp::cp_async_wait<kStages - 2>();
    // Tile landed for every thread; every warp is done with the stage refilled next.
    const bool next_loaded = __syncthreads_and(pending[0]);
#pragma unroll
    for (int i = 0; i + 1 < kStages - 2; ++i) pending[i] = pending[i + 1];
    const int next = tile + kStages - 1;  // = (tile + 1) + 1 + (kStages - 3): the last flag
    if (next < num_tiles) pending[kStages - 3] = issue(next);
    cp::cp_async_commit();

    const int stage = tile % kStages;
    const u32 k_tile = ks + stage * Smem::kStageBytes, v_tile = vs + stage * Smem::kStageBytes;
    const int warp_key = warp * kKeysPerWarp;  // first key of this warp in the tile
    const int tile_start = start + tile * kTileKeys;
#if ROTARY
    // The new keys of this tile rotated in its K stage (landed: the barrier above), a CTA-uniform
    // branch taken by the tiles that hold some; the barrier after it orders them before Q K^T.
    if (rotates_keys && tile_start + kTileKeys > src.cached) {
      const int units = ro.units();
      const int first = max(src.cached - tile_start, 0);
      const int rows = min(end - tile_start, kTileKeys) - first;
      for (int index = threadIdx.x; index < rows * units; index += kThreads) {
        const int key = first + index / units, unit = index % units;
        const long long position = (long long)first_pos + tile_start + key;
        if (position < ro.seqlen_ro) rotate_tile_unit(ro, smem_raw + stage * Smem::kStageBytes, key, unit, position);
      }
      __syncthreads();
    }
#endif

    // S = Q K^T for this warp's keys: s[group][n-tile of 8 keys][C fragment].
    float s[kGroups][2][4];
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
        cp::ldmatrix_x4(bk, k_tile + Tile::offset(warp_key + kg * 16 + k_row, 2 * kk + k_chunk));
        cp::mma_16816(s[kg][0], a, bk[0], bk[1], T());
        cp::mma_16816(s[kg][1], a, bk[2], bk[3], T());
      }
    }
    // Score transforms and masks, then the tile's row max.  The common tile (every key loaded and
    // visible to every real row, no softcap, no ALiBi) only scales: a CTA-uniform branch.
    const bool unmasked = plain && tile_loaded && tile_start >= lo_all && tile_start + kTileKeys - 1 <= hi_all;
    tile_loaded = next_loaded;
    float tile_max[2] = {-inf(), -inf()};
    if (unmasked) {
#pragma unroll
      for (int kg = 0; kg < kGroups; ++kg)
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            s[kg][n][e] *= scale2;
            tile_max[e / 2] = fmaxf(tile_max[e / 2], s[kg][n][e]);
          }
    } else {
#pragma unroll
      for (int kg = 0; kg < kGroups; ++kg)
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = warp_key + kg * 16 + n * 8 + 2 * t + (e & 1);
            const int j = tile_start + key;
            const int hr = e / 2;
            float x = s[kg][n][e] * scale2;
            if (softcap > 0.f) x = cap2 * tanhf(x * inv_cap2);
            x -= my_slope[hr] * fabsf(static_cast<float>(my_pos[hr] - j));
            const bool visible = flags[stage * kTileKeys + key] != 0 && j >= my_lo[hr] && j <= my_hi[hr];
            s[kg][n][e] = visible ? x : -inf();
            tile_max[hr] = fmaxf(tile_max[hr], s[kg][n][e]);
          }
    }
    // Rescale the running state to the new max (a row's 4 lanes share it); a max of -inf (nothing
    // visible yet) uses 0, so exp2 gives 0 and never NaN.
    float m_use[2];
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const float m_new = fmaxf(m[hr], cp::quad_max(tile_max[hr]));
      m_use[hr] = m_new == -inf() ? 0.f : m_new;
      const float alpha = exp2f(m[hr] - m_use[hr]);
      m[hr] = m_new;
      l[hr] *= alpha;
#pragma unroll
      for (int n = 0; n < kHeadDim / 8; ++n) {
        o[n][2 * hr] *= alpha;
        o[n][2 * hr + 1] *= alpha;
      }
    }
    // P = exp2(S - m), then O += P V with P re-packed as the A operand of each 16-key group.
#pragma unroll
    for (int kg = 0; kg < kGroups; ++kg) {
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[kg][n][e] = exp2f(s[kg][n][e] - m_use[e / 2]);
          l[e / 2] += s[kg][n][e];
        }
      u32 pa[4];
      cp::pack_a(pa, s[kg][0], s[kg][1], T());
#pragma unroll
      for (int dp = 0; dp < kHeadDim / 16; ++dp) {
        u32 bv[4];
        cp::ldmatrix_x4_trans(bv, v_tile + Tile::offset(warp_key + kg * 16 + v_row, 2 * dp + v_chunk));
        cp::mma_16816(o[2 * dp], pa, bv[0], bv[1], T());
        cp::mma_16816(o[2 * dp + 1], pa, bv[2], bv[3], T());
      }
    }
  }
  cp::cp_async_wait<0>();
  __syncthreads();  // pipeline drained: its buffers become the merge scratch

  // Row sums over each row's 4 lanes, then the warps' states merged through shared memory.
  float* merge_o = reinterpret_cast<float*>(smem_raw);             // [kWarps][kRows][D]
  float* merge_m = merge_o + kWarps * kRows * kHeadDim;            // [kWarps][kRows]
  float* merge_l = merge_m + kWarps * kRows;                       // [kWarps][kRows]
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    l[hr] = cp::quad_sum(l[hr]);
    const int r = g + 8 * hr;
#pragma unroll
    for (int n = 0; n < kHeadDim / 8; ++n)
      *reinterpret_cast<float2*>(merge_o + (warp * kRows + r) * kHeadDim + n * 8 + 2 * t) =
          make_float2(o[n][2 * hr], o[n][2 * hr + 1]);
    if (t == 0) {
      merge_m[warp * kRows + r] = m[hr];
      merge_l[warp * kRows + r] = l[hr];
    }
  }
  __syncthreads();

  const long long rows_total = (long long)batch * seqlen_q * num_heads;
  for (int index = threadIdx.x; index < kRows * kHeadDim; index += kThreads) {
    const int r = index / kHeadDim, d = index % kHeadDim;
    const int row = row_group * kRows + r;
    if (row >= num_rows) continue;
    const int head = kv_head * group + row / seqlen_q, i = row % seqlen_q;
    float m_all = -inf();
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m_all = fmaxf(m_all, merge_m[w * kRows + r]);
    const float m_max = m_all == -inf() ? 0.f : m_all;
    float l_all = 0.f, o_all = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float weight = exp2f(merge_m[w * kRows + r] - m_max);
      l_all += merge_l[w * kRows + r] * weight;
      o_all += merge_o[(w * kRows + r) * kHeadDim + d] * weight;
    }
    // A row that saw no key: zeros and LSE -inf, never 0/0.
    const float value = l_all > 0.f ? o_all / l_all : 0.f;
    const float row_lse = l_all > 0.f ? (m_all + __log2f(l_all)) * kLn2 : -inf();
    const long long out_row = ((long long)b * seqlen_q + i) * num_heads + head;
    if (num_splits == 1) {
      out[out_row * kHeadDim + d] = cp::from_float<T>(value);
      if (lse && d == 0) lse[((long long)b * num_heads + head) * seqlen_q + i] = row_lse;
    } else {
      part_out[(split * rows_total + out_row) * kHeadDim + d] = value;
      if (d == 0) part_lse[split * rows_total + out_row] = row_lse;
    }
  }
  if (trace && threadIdx.x == 0) {
    unsigned long long* row = trace_row(trace);
    row[1] = cp::global_ns();
    row[2] = cp::sm_id();
  }
}

// combine_splits: out = sum_s w_s * part_out[s] with w_s = exp(lse_s - lse) and
// lse = log(sum_s exp(lse_s)).  One CTA of kCombineThreads per (b, i, h) row.  Thread s reads
// LSE s (at most kCombineThreads splits); warp w then sums splits w, w + 4, ..., all its loads
// issued before their FMAs, and the four warps' sums meet in shared memory.  A row costs two memory round trips whatever
// the split count (v1-v7: one warp per row, one round trip per 8 splits: 6.6 us at 32 splits).
constexpr int kCombineThreads = 128;  // ops/decode.py: COMBINE_THREADS, MAX_SPLITS
constexpr int kCombineWarps = kCombineThreads / 32;

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
