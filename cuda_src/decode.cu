// flash_attn_with_kvcache: attention of a few query tokens per sequence over a paged KV cache.
//
// Compile-time parameters (cupy_paged/ops/decode.py spells them in the kernel key):
//   SCALAR_T   __half or __nv_bfloat16 (q, caches, new k/v, out)
//   HEAD_DIM   32, 64, 96, 128 or 256
//   TILE_KEYS  keys per pipeline stage (TILE_KEYS * HEAD_DIM * 2 bytes of K, as much of V)
//   STAGES     depth of the cp.async pipeline
// Everything else (block size, window, softcap, ALiBi, splits, GQA ratio, seqlen_q) is a run-time
// argument, so two dtypes x five head dims are the whole family.
//
// paged_decode: one CTA of 4 warps per (row group, split, kv head, sequence).  A "row" is one
// (query head of the GQA group, query token) pair; the CTA holds kRows of them, so every K/V byte
// a CTA streams serves all the query heads that share its kv head (GQA packing).  K/V tiles go
// global -> shared memory through cp.async, STAGES - 1 tiles in flight while one is computed; the
// block ids of the tile after next are loaded one iteration ahead so that no cp.async waits on a
// block-table read.  Within a tile each warp takes a quarter of the keys; lanes split head_dim in
// 16-byte vectors.  Each warp keeps its own online-softmax state; the four are merged at the end.
// With num_splits > 1 each split covers a contiguous key range and writes a normalised partial
// output and its LSE to a float32 workspace; combine_splits merges them (flash-decoding).
//
// New tokens (k_new/v_new): key j >= cache_seqlens[b] is read from k_new/v_new directly by every CTA
// that needs it, and the CTAs of split 0 / row group 0 copy the new tokens into the cache.  No CTA
// reads a cache slot that this launch writes, so the fused append has no race.
//
// Safety: a block id outside [0, num_blocks), a block-table column past max_blocks and a negative
// cache_seqlens are treated as holes: no read, no write, the keys count as masked.
#include "common.cuh"

namespace decode {

using T = SCALAR_T;
constexpr int kHeadDim = HEAD_DIM;
constexpr int kTileKeys = TILE_KEYS;
constexpr int kStages = STAGES;
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kRows = 4;  // query rows per CTA; more rows -> more row groups in the grid
constexpr int kVecPerRow = kHeadDim / cp::kVecElems;
// Lanes that share one key: a power of two covering the row's vectors (D=96 leaves 4 of 16 idle).
constexpr int kLanesPerKey = kVecPerRow <= 4 ? 4 : kVecPerRow <= 8 ? 8 : kVecPerRow <= 16 ? 16 : 32;
constexpr int kKeysPerStep = 32 / kLanesPerKey;
constexpr int kKeysPerWarp = kTileKeys / kWarps;
constexpr int kSteps = kKeysPerWarp / kKeysPerStep;
constexpr int kTileVecs = kTileKeys * kVecPerRow;
constexpr int kVecsPerThread = kTileVecs / kThreads;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
// +infinity (NVRTC has no <cmath> INFINITY).
__device__ __forceinline__ float inf() { return __int_as_float(0x7f800000); }
static_assert(kVecPerRow <= 32, "head_dim above 256 needs more than one vector per lane");
static_assert(kSteps >= 1 && kKeysPerWarp % kKeysPerStep == 0, "tile must give every key group work");
static_assert(kTileVecs % kThreads == 0, "each thread issues the same number of cp.async per tile");
static_assert(kStages == 3, "the loaded-tile vote below keeps exactly one tile between issue and use");

// Shared memory: [kStages][kTileKeys][kVecPerRow] vectors of K, the same of V, then one flag per key
// (1 = the key was loaded).  The first bytes are reused for the cross-warp merge at the end.
struct Smem {
  static constexpr int kTensorVecs = kStages * kTileVecs;
  static constexpr int kBytes = 2 * kTensorVecs * 16 + kStages * kTileKeys * 4;
  static constexpr int kMergeBytes = kWarps * kRows * (kHeadDim + 2) * 4;
  static_assert(kMergeBytes <= kBytes, "merge scratch must fit in the pipeline buffers");
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool ok) {
  const cp::u32 dst = static_cast<cp::u32>(__cvta_generic_to_shared(smem));
  const int bytes = ok ? 16 : 0;  // 0 source bytes -> the 16 destination bytes are zero-filled
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void unpack8(const uint4& raw, float (&x)[8]) {
  const cp::u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = cp::to_float2(w[i], T());
    x[2 * i] = f.x;
    x[2 * i + 1] = f.y;
  }
}

// Where the keys of one sequence live: the cache through the block table, the new tokens in k_new.
struct KeySource {
  const cp::Vec8* k_cache;
  const cp::Vec8* v_cache;
  const T* k_new;
  const T* v_new;
  long long kn_token, vn_token;  // element strides of k_new/v_new along seqlen_new
  const int* table_row;          // block_table[b]
  int max_blocks, num_blocks, block_size, block_shift;  // block_shift < 0: block_size not a power of 2
  int num_kv_heads, kv_head, cached;                     // cached = cache_seqlens[b] (>= 0)

  __device__ __forceinline__ int column(int j) const { return block_shift >= 0 ? j >> block_shift : j / block_size; }
  __device__ __forceinline__ int offset(int j) const {
    return block_shift >= 0 ? j & (block_size - 1) : j - (j / block_size) * block_size;
  }
  // Block id of cached key j, or -1 for a hole (column past the table or id out of range).
  __device__ __forceinline__ int block_of(int j) const {
    if (j >= cached) return -1;
    const int col = column(j);
    if (col >= max_blocks) return -1;
    const int id = __ldg(table_row + col);
    return (id >= 0 && id < num_blocks) ? id : -1;
  }
  __device__ __forceinline__ long long cache_vec(int block, int j, int vec) const {
    return (((long long)block * block_size + offset(j)) * num_kv_heads + kv_head) * kVecPerRow + vec;
  }
};

// Rows of a CTA: row r of row group g is (group head, query token) = divmod(g*kRows + r, seqlen_q).
struct RowInfo {
  int head[kRows];   // query head, -1 for a padding row
  int token[kRows];  // query token i
  int lo[kRows], hi[kRows];  // visible keys lo <= j <= hi
  float slope[kRows];        // ALiBi slope, 0 without ALiBi
};

template <bool kNewTokens>
__device__ __forceinline__ bool issue_tile(const KeySource& src, int start, int end, int stage,
                                           const int (&blocks)[kVecsPerThread], cp::Vec8* ks, cp::Vec8* vs,
                                           int* flags) {
  bool all_ok = true;  // every key of this thread's share loaded (no hole, none past the range)
#pragma unroll
  for (int v = 0; v < kVecsPerThread; ++v) {
    const int index = threadIdx.x + v * kThreads;
    const int key = index / kVecPerRow, vec = index % kVecPerRow;
    const int j = start + key;
    const cp::Vec8* kp = src.k_cache;
    const cp::Vec8* vp = src.v_cache;
    bool ok = false;
    if (j < end) {
      if (j < src.cached) {
        if (blocks[v] >= 0) {
          const long long at = src.cache_vec(blocks[v], j, vec);
          kp = src.k_cache + at;
          vp = src.v_cache + at;
          ok = true;
        }
      } else if (kNewTokens) {
        const long long t = j - src.cached;
        kp = reinterpret_cast<const cp::Vec8*>(src.k_new + t * src.kn_token) + vec;
        vp = reinterpret_cast<const cp::Vec8*>(src.v_new + t * src.vn_token) + vec;
        ok = true;
      }
    }
    const int slot = stage * kTileVecs + index;
    cp_async16(ks + slot, kp, ok);
    cp_async16(vs + slot, vp, ok);
    if (vec == 0) flags[stage * kTileKeys + key] = ok;
    all_ok &= ok;
  }
  return all_ok;
}

__device__ __forceinline__ void load_blocks(const KeySource& src, int start, int (&blocks)[kVecsPerThread]) {
#pragma unroll
  for (int v = 0; v < kVecsPerThread; ++v) {
    const int key = (threadIdx.x + v * kThreads) / kVecPerRow;
    blocks[v] = src.block_of(start + key);
  }
}

}  // namespace decode

using namespace decode;

extern "C" __global__ void __launch_bounds__(kThreads, 4) paged_decode(
    const T* __restrict__ q, long long q_batch, long long q_token, long long q_head,  // element strides
    const cp::Vec8* k_cache, const cp::Vec8* v_cache,  // [num_blocks, block_size, Hkv, D]
    cp::Vec8* k_cache_w, cp::Vec8* v_cache_w,  // the same caches, written by the append (no restrict: aliases)
    const T* __restrict__ k_new, const T* __restrict__ v_new,                        // [B, Sn, Hkv, D] or null
    long long kn_batch, long long kn_token, long long kn_head,
    long long vn_batch, long long vn_token, long long vn_head,
    const int* __restrict__ cache_seqlens, const int* __restrict__ block_table, int max_blocks,
    int num_blocks, int block_size, int block_shift,
    int seqlen_q, int seqlen_new, int num_heads, int num_kv_heads, int num_rows, int row_groups,
    float softmax_scale, float softcap, const float* __restrict__ alibi_slopes, int win_left, int win_right,
    int num_splits,
    T* __restrict__ out,                  // [B, Sq, H, D] contiguous
    float* __restrict__ lse,              // [B, H, Sq] or null
    float* __restrict__ part_out,         // [num_splits, B*Sq*H, D] when num_splits > 1
    float* __restrict__ part_lse) {       // [num_splits, B*Sq*H]
  extern __shared__ __align__(16) unsigned char smem_raw[];
  cp::Vec8* ks = reinterpret_cast<cp::Vec8*>(smem_raw);
  cp::Vec8* vs = ks + Smem::kTensorVecs;
  int* flags = reinterpret_cast<int*>(vs + Smem::kTensorVecs);

  const int row_group = blockIdx.x % row_groups;
  const int split = blockIdx.x / row_groups;
  const int kv_head = blockIdx.y;
  const int b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int key_sub = lane / kLanesPerKey, vec = lane % kLanesPerKey;
  const bool lane_has_vec = vec < kVecPerRow;
  const int group = num_heads / num_kv_heads;
  const int batch = gridDim.z;

  KeySource src;
  src.k_cache = k_cache;
  src.v_cache = v_cache;
  src.k_new = k_new ? k_new + b * kn_batch + kv_head * kn_head : nullptr;
  src.v_new = v_new ? v_new + b * vn_batch + kv_head * vn_head : nullptr;
  src.kn_token = kn_token;
  src.vn_token = vn_token;
  src.table_row = block_table + (long long)b * max_blocks;
  src.max_blocks = max_blocks;
  src.num_blocks = num_blocks;
  src.block_size = block_size;
  src.block_shift = block_shift;
  src.num_kv_heads = num_kv_heads;
  src.kv_head = kv_head;
  src.cached = max(cache_seqlens[b], 0);
  const int num_keys = src.cached + seqlen_new;  // Lk

  // Fused append: split 0 / row group 0 writes this kv head's new tokens into the cache.
  if (seqlen_new > 0 && split == 0 && row_group == 0) {
    for (int index = threadIdx.x; index < seqlen_new * kVecPerRow; index += kThreads) {
      const int t = index / kVecPerRow, v = index % kVecPerRow;
      const int j = src.cached + t;
      const int col = src.column(j);
      if (col >= max_blocks) continue;
      const int id = __ldg(src.table_row + col);
      if (id < 0 || id >= num_blocks) continue;
      const long long at = src.cache_vec(id, j, v);
      k_cache_w[at] = reinterpret_cast<const cp::Vec8*>(src.k_new + t * kn_token)[v];
      v_cache_w[at] = reinterpret_cast<const cp::Vec8*>(src.v_new + t * vn_token)[v];
    }
  }

  // Rows and their visible key ranges (bottom-right aligned: query i sits at key i + Lk - Sq).
  RowInfo rows;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = row_group * kRows + r;
    const bool real = row < num_rows;
    const int i = row % seqlen_q;
    const int pos = i + num_keys - seqlen_q;
    rows.head[r] = real ? kv_head * group + row / seqlen_q : -1;
    rows.token[r] = i;
    rows.lo[r] = win_left >= 0 ? max(pos - win_left, 0) : 0;
    rows.hi[r] = win_right >= 0 ? min(pos + win_right, num_keys - 1) : num_keys - 1;
    // Scores live in the log2 domain (Q is pre-scaled by scale * log2 e), so the slope is too.
    rows.slope[r] = (real && alibi_slopes) ? alibi_slopes[rows.head[r]] * kLog2e : 0.f;
  }
  // Keys every real row sees: a tile inside [lo_all, hi_all] with every key loaded needs no mask.
  int lo_all = 0, hi_all = num_keys - 1;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (rows.head[r] < 0) continue;
    lo_all = max(lo_all, rows.lo[r]);
    hi_all = min(hi_all, rows.hi[r]);
  }
  // Softcap c on natural-log scores, rewritten for log2-domain scores x: c' tanh(x / c'), c' = c log2 e.
  const bool plain = softcap <= 0.f && alibi_slopes == nullptr;
  const float cap2 = softcap * kLog2e;
  const float inv_cap2 = softcap > 0.f ? 1.f / cap2 : 0.f;
  // Keys any row of the sequence can see; the splits share them out in whole tiles.
  const int first_key = win_left >= 0 ? max(num_keys - seqlen_q - win_left, 0) : 0;
  const int span = max(num_keys - first_key, 0);
  const int per_split = ((span + num_splits - 1) / num_splits + kTileKeys - 1) / kTileKeys * kTileKeys;
  const int start = min(first_key + split * per_split, num_keys);
  const int end = min(start + per_split, num_keys);
  const int num_tiles = (end - start + kTileKeys - 1) / kTileKeys;

  // Q of this lane's vector for each row, as float.
  float qf[kRows][8];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    if (rows.head[r] >= 0 && lane_has_vec) {
      const T* qp = q + b * q_batch + rows.token[r] * q_token + rows.head[r] * q_head;
      unpack8(reinterpret_cast<const cp::Vec8*>(qp)[vec].raw, qf[r]);
#pragma unroll
      for (int e = 0; e < 8; ++e) qf[r][e] *= softmax_scale * kLog2e;
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) qf[r][e] = 0.f;
    }
  }

  // Online softmax state in the log2 domain; m is the same on every lane of a warp.
  float m[kRows], l[kRows], acc[kRows][8];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m[r] = -inf();
    l[r] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[r][e] = 0.f;
  }

  int blocks[kVecsPerThread];
  load_blocks(src, start, blocks);
  bool issued_ok[kStages - 1] = {};
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_tiles) {
      issued_ok[s] = k_new ? issue_tile<true>(src, start + s * kTileKeys, end, s, blocks, ks, vs, flags)
                           : issue_tile<false>(src, start + s * kTileKeys, end, s, blocks, ks, vs, flags);
      load_blocks(src, start + (s + 1) * kTileKeys, blocks);
    }
    cp_async_commit();
  }
  // Whether all of tile t's keys were loaded, voted at the barrier before its use; the barrier of
  // iteration t votes on tile t + 1 (issued one iteration earlier), so one vote is kept in hand.
  bool tile_loaded = __syncthreads_and(issued_ok[0]);
  bool pending_ok = issued_ok[1];

  for (int tile = 0; tile < num_tiles; ++tile) {
    cp_async_wait<kStages - 2>();
    // Tile landed for every thread; every warp is done with the stage refilled next.
    const bool next_loaded = __syncthreads_and(pending_ok);
    const int next = tile + kStages - 1;
    if (next < num_tiles) {
      pending_ok = k_new ? issue_tile<true>(src, start + next * kTileKeys, end, next % kStages, blocks, ks, vs, flags)
                         : issue_tile<false>(src, start + next * kTileKeys, end, next % kStages, blocks, ks, vs, flags);
      load_blocks(src, start + (next + 1) * kTileKeys, blocks);
    }
    cp_async_commit();

    const int stage = tile % kStages;
    const int tile_start = start + tile * kTileKeys;
    // S = Q K^T for this warp's keys: lanes of a key group reduce their partial dots.
    float s[kSteps][kRows];
#pragma unroll
    for (int st = 0; st < kSteps; ++st) {
      const int key = warp * kKeysPerWarp + st * kKeysPerStep + key_sub;
      float kf[8];
      if (lane_has_vec) {
        unpack8(ks[stage * kTileVecs + key * kVecPerRow + vec].raw, kf);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) kf[e] = 0.f;
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) dot = fmaf(qf[r][e], kf[e], dot);
#pragma unroll
        for (int off = kLanesPerKey / 2; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
        s[st][r] = dot;
      }
    }
    // Score transforms and masks, then the tile's row max across the warp.  The common tile (every
    // key loaded and visible to every row, no softcap, no ALiBi) skips them: a uniform branch.
    const bool unmasked = plain && tile_loaded && tile_start >= lo_all && tile_start + kTileKeys - 1 <= hi_all;
    tile_loaded = next_loaded;
    float tile_max[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) tile_max[r] = -inf();
    if (unmasked) {
#pragma unroll
      for (int st = 0; st < kSteps; ++st)
#pragma unroll
        for (int r = 0; r < kRows; ++r) tile_max[r] = fmaxf(tile_max[r], s[st][r]);
    } else {
#pragma unroll
    for (int st = 0; st < kSteps; ++st) {
      const int key = warp * kKeysPerWarp + st * kKeysPerStep + key_sub;
      const int j = tile_start + key;
      const bool loaded = flags[stage * kTileKeys + key] != 0;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        float x = s[st][r];
        if (softcap > 0.f) x = cap2 * tanhf(x * inv_cap2);
        const int pos = rows.token[r] + num_keys - seqlen_q;
        x -= rows.slope[r] * fabsf(static_cast<float>(pos - j));
        const bool visible = loaded && rows.head[r] >= 0 && j >= rows.lo[r] && j <= rows.hi[r];
        s[st][r] = visible ? x : -inf();
        tile_max[r] = fmaxf(tile_max[r], s[st][r]);
      }
    }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int off = kLanesPerKey; off < 32; off <<= 1)
        tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], off));
      // Rescale the running state to the new max; a max of -inf (nothing visible yet) uses 0.
      const float m_new = fmaxf(m[r], tile_max[r]);
      const float m_use = m_new == -inf() ? 0.f : m_new;
      const float alpha = exp2f(m[r] - m_use);
      m[r] = m_new;
      l[r] *= alpha;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[r][e] *= alpha;
#pragma unroll
      for (int st = 0; st < kSteps; ++st) {
        s[st][r] = exp2f(s[st][r] - m_use);
        l[r] += s[st][r];
      }
    }
    // O += P V.
#pragma unroll
    for (int st = 0; st < kSteps; ++st) {
      const int key = warp * kKeysPerWarp + st * kKeysPerStep + key_sub;
      if (lane_has_vec) {
        float vf[8];
        unpack8(vs[stage * kTileVecs + key * kVecPerRow + vec].raw, vf);
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[r][e] = fmaf(s[st][r], vf[e], acc[r][e]);
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // pipeline drained: its buffers become the merge scratch

  // Sum the key groups of each warp, then merge the four warps' states through shared memory.
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int off = kLanesPerKey; off < 32; off <<= 1) {
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], off);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[r][e] += __shfl_xor_sync(0xffffffffu, acc[r][e], off);
    }
  }
  float* merge_o = reinterpret_cast<float*>(smem_raw);             // [kWarps][kRows][D]
  float* merge_m = merge_o + kWarps * kRows * kHeadDim;            // [kWarps][kRows]
  float* merge_l = merge_m + kWarps * kRows;                       // [kWarps][kRows]
  if (key_sub == 0 && lane_has_vec) {
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int e = 0; e < 8; ++e) merge_o[(warp * kRows + r) * kHeadDim + vec * 8 + e] = acc[r][e];
  }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      merge_m[warp * kRows + r] = m[r];
      merge_l[warp * kRows + r] = l[r];
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
    const float m_use = m_all == -inf() ? 0.f : m_all;
    float l_all = 0.f, o_all = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float weight = exp2f(merge_m[w * kRows + r] - m_use);
      l_all += merge_l[w * kRows + r] * weight;
      o_all += merge_o[(w * kRows + r) * kHeadDim + d] * weight;
    }
    // A row that saw no key: zeros and LSE -inf, never 0/0.
    const float o = l_all > 0.f ? o_all / l_all : 0.f;
    const float row_lse = l_all > 0.f ? (m_all + __log2f(l_all)) * kLn2 : -inf();
    const long long out_row = ((long long)b * seqlen_q + i) * num_heads + head;
    if (num_splits == 1) {
      out[out_row * kHeadDim + d] = cp::from_float<T>(o);
      if (lse && d == 0) lse[((long long)b * num_heads + head) * seqlen_q + i] = row_lse;
    } else {
      part_out[(split * rows_total + out_row) * kHeadDim + d] = o;
      if (d == 0) part_lse[split * rows_total + out_row] = row_lse;
    }
  }
}

// combine_splits: out = sum_s w_s * part_out[s] with w_s = exp(lse_s - lse) and
// lse = log(sum_s exp(lse_s)).  One warp per (b, i, h) row; 4 rows per 128-thread CTA.
extern "C" __global__ void __launch_bounds__(128) combine_splits(
    const float* __restrict__ part_out, const float* __restrict__ part_lse, int num_splits,
    long long rows_total, int seqlen_q, int num_heads,
    T* __restrict__ out, float* __restrict__ lse) {
  constexpr int kMaxSplits = 128;
  __shared__ float weights[4][kMaxSplits];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long long row = (long long)blockIdx.x * 4 + warp;
  if (row >= rows_total) return;  // whole warps leave together; no block barrier below
  float m_all = -inf();
  for (int s = lane; s < num_splits; s += 32) m_all = fmaxf(m_all, part_lse[s * rows_total + row]);
  m_all = cp::warp_max(m_all);
  const float m_use = m_all == -inf() ? 0.f : m_all;
  float total = 0.f;
  for (int s = lane; s < num_splits; s += 32) {
    const float w = __expf(part_lse[s * rows_total + row] - m_use);
    weights[warp][s] = w;
    total += w;
  }
  total = cp::warp_sum(total);
  __syncwarp();
  const float inv = total > 0.f ? 1.f / total : 0.f;
  for (int d = lane; d < kHeadDim; d += 32) {
    float o = 0.f;
    for (int s = 0; s < num_splits; ++s) {
      const float w = weights[warp][s];
      if (w > 0.f) o = fmaf(w, part_out[(s * rows_total + row) * kHeadDim + d], o);
    }
    out[row * kHeadDim + d] = cp::from_float<T>(o * inv);
  }
  if (lse && lane == 0) {
    const long long h = row % num_heads, bi = row / num_heads;
    const long long b = bi / seqlen_q, i = bi % seqlen_q;
    lse[(b * num_heads + h) * seqlen_q + i] = total > 0.f ? m_all + __logf(total) : -inf();
  }
}

// merge_states: cascade / shared-prefix merge of two partial attentions over the same queries.
// out_x [tokens, H, D] (contiguous, dtype X); lse_x [num_seqs, H, seqlen] float32 with
// tokens = num_seqs * seqlen (varlen: [H, tokens], one sequence; decode: [B, H, Sq]).  One thread per element;
// a side whose LSE is -inf contributes nothing (its output is never read).
template <typename X>
__device__ __forceinline__ void merge_states_impl(const X* a, const float* lse_a, const X* b, const float* lse_b,
                                                  X* out, float* lse_out, long long tokens, int seqlen,
                                                  int heads, int dim) {
  const long long index = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (index >= tokens * heads * dim) return;
  const long long t = index / ((long long)heads * dim);
  const int h = (index / dim) % heads, d = index % dim;
  // LSE of token t = (sequence, position) in [num_seqs, H, seqlen]; varlen is one sequence of all tokens.
  const long long at = ((t / seqlen) * heads + h) * seqlen + t % seqlen;
  const float la = lse_a[at], lb = lse_b[at];
  const float mx = fmaxf(la, lb);
  float value = 0.f, merged = -inf();
  if (mx != -inf()) {
    const float wa = __expf(la - mx), wb = __expf(lb - mx);
    float sum = 0.f;
    if (wa > 0.f) sum = fmaf(wa, static_cast<float>(a[index]), sum);
    if (wb > 0.f) sum = fmaf(wb, static_cast<float>(b[index]), sum);
    value = sum / (wa + wb);
    merged = mx + __logf(wa + wb);
  }
  out[index] = static_cast<X>(value);
  if (lse_out && d == 0) lse_out[at] = merged;
}

#define DEFINE_MERGE(NAME, X)                                                                        \
  extern "C" __global__ void NAME(const X* a, const float* lse_a, const X* b, const float* lse_b,   \
                                  X* out, float* lse_out, long long tokens, int seqlen, int heads,  \
                                  int dim) {                                                         \
    merge_states_impl<X>(a, lse_a, b, lse_b, out, lse_out, tokens, seqlen, heads, dim);              \
  }
DEFINE_MERGE(merge_states_float32, float)
DEFINE_MERGE(merge_states_float16, __half)
DEFINE_MERGE(merge_states_bfloat16, __nv_bfloat16)
