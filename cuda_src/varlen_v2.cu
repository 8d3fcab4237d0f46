// FROZEN COPY of varlen.cu v2 (commit 254e045), kept only so that benchmarks/bench_varlen.py --sweep
// can time the previous kernel next to the current one in one device run; not used by the package.
//
// varlen_fwd: FlashAttention-2 style forward pass over a batch of variable-length sequences
// (flash_attn_varlen_func), with K/V either contiguous [total_k, Hkv, D] or read straight
// from a paged cache [num_blocks, block_size, Hkv, D] through a block table (no gather).
//
// One CTA computes one tile of BLOCK_M query rows of one head of one sequence:
//   grid = (ceil(max_seqlen_q / BLOCK_M), num_heads, batch), tiles launched longest-first.
// The Q tile stays in shared memory; K/V tiles of BLOCK_N keys stream through NUM_STAGES
// cp.async buffers; each warp owns BLOCK_M / NUM_WARPS query rows and runs
//   S = Q K^T (mma.sync m16n8k16, fp32) -> score mods -> mask -> online softmax (exp2, the
//   scale folded in) -> O += P V with P re-packed from the S accumulators, never stored;
// one division by the row sum at the end.  Key tiles that no row of the CTA can see (causal,
// sliding window) are never visited; only tiles that straddle a bound are masked.
//
// Compile-time parameters (cupy_paged/ops/varlen.py spells them in the KernelKey):
//   SCALAR_T (__half | __nv_bfloat16), HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES,
//   MIN_BLOCKS (CTAs per SM the register allocation must allow).
// Everything else (causal/window, softcap, ALiBi, LSE, paged or not, block size) is a
// run-time argument, so one specialization serves all of them.
//
// Safety: rows past a sequence's end, block ids outside [0, num_blocks), block-table columns
// past its width and cu_seqlens entries outside the arrays are never dereferenced: such keys
// are loaded as zeros and masked out ("holes"), such query rows are neither read nor written.
#include "common.cuh"
#include "mma.cuh"

namespace varlen {

using cp::u32;
using T = SCALAR_T;

template <int D, int BM, int BN, int WARPS, int STAGES, int MIN_CTAS>
struct Traits {
  static constexpr int kHeadDim = D, kBlockM = BM, kBlockN = BN, kWarps = WARPS, kStages = STAGES;
  static constexpr int kMinBlocks = MIN_CTAS;
  static constexpr int kThreads = WARPS * 32;
  static constexpr int kWarpRows = BM / WARPS;  // query rows per warp
  static constexpr int kMTiles = kWarpRows / 16;  // m16 tiles per warp
  static constexpr int kNTiles = BN / 8;          // n8 tiles of S per warp row tile
  static constexpr int kDTiles = D / 8;           // n8 tiles of O
  static constexpr int kChunks = D / 8;           // 16-byte chunks per row of Q, K, V
  using Tile = cp::SmemTile<kChunks>;
  // Shared memory: Q tile, then K and V stages, then one "key is loadable" byte per key per stage.
  static constexpr int kQBytes = Tile::bytes(BM);
  static constexpr int kKVBytes = Tile::bytes(BN);
  static constexpr int kSmemBytes = kQBytes + 2 * STAGES * kKVBytes + STAGES * BN;
  static_assert(D % 16 == 0 && BN % 16 == 0, "head dim and key tile must be multiples of 16");
  static_assert(kWarpRows % 16 == 0 && kMTiles >= 1, "each warp owns whole m16 tiles");
  static_assert(STAGES >= 2, "at least double buffering");
};

using Tr = Traits<HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES, MIN_BLOCKS>;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
__device__ __forceinline__ float infinity() { return __int_as_float(0x7f800000); }

// Where the keys of one (sequence, kv head) live: rows of a contiguous k/v, or slots
// (block * block_size + offset) of a paged cache whose blocks are block_size rows apart.
struct KvSource {
  const T* k;  // already offset to the kv head
  const T* v;
  const int* table;         // block_table row of the sequence, or nullptr (contiguous)
  int k_row, v_row;         // element stride between consecutive rows (slots)
  int first_row;            // contiguous: row of key 0
  int num_rows;             // contiguous: rows in k/v; paged: num_blocks
  int length;               // keys of the sequence
  int loadable;             // contiguous: keys [0, loadable) lie inside k/v (all, unless
                            // cu_seqlens_k disagrees with k's size)
  int table_width, block_shift;
};

// Per-warp softmax state and output accumulator (registers).
struct WarpState {
  float o[Tr::kMTiles][Tr::kDTiles][4];
  float row_max[Tr::kMTiles][2];  // raw (pre-scale) units, -inf until a key is seen
  float row_sum[Tr::kMTiles][2];  // this thread's partial sum; the quad is reduced at the end
};

// ---------------------------------------------------------------------------- loads

// A tile of kRows rows is loaded in passes of kThreads 16-byte chunks; the shapes of TILES
// divide evenly, so every pass is full and the loops unroll without bounds checks.
template <int kRows>
struct TilePasses {
  static constexpr int kTotal = kRows * Tr::kChunks;
  static constexpr int kCount = kTotal / Tr::kThreads;
  static_assert(kTotal % Tr::kThreads == 0, "tile chunks must divide evenly among the threads");
  __device__ static __forceinline__ int row(int pass) { return (threadIdx.x + pass * Tr::kThreads) / Tr::kChunks; }
  __device__ static __forceinline__ int chunk(int pass) { return (threadIdx.x + pass * Tr::kThreads) % Tr::kChunks; }
};

// Q tile -> shared memory (rows past the sequence or outside q are zero-filled).
__device__ __forceinline__ void load_q_tile(u32 s_q, const T* q, long long q_row, int first_row,
                                            int rows, int total_q) {
  using P = TilePasses<Tr::kBlockM>;
#pragma unroll
  for (int pass = 0; pass < P::kCount; ++pass) {
    const int r = P::row(pass), c = P::chunk(pass);
    const long long row = (long long)first_row + r;
    const bool ok = r < rows && row >= 0 && row < total_q;
    cp::cp_async_16(s_q + Tr::Tile::offset(r, c), q + (ok ? row * q_row + c * 8 : 0), ok);
  }
}

// K and V tile of keys [n0, n0 + BLOCK_N) -> one pipeline stage.  Also records which keys are
// loadable, and returns whether this thread met a hole (an in-range key it could not load).
// This runs for every tile, so the per-row work is kept to a few integer instructions: the
// paged/contiguous choice is made once per tile, contiguous rows are consecutive, and a
// paged row costs one block-table load (an L1 hit for all but the first row of a block).
__device__ __forceinline__ int load_kv_tile(u32 s_k, u32 s_v, unsigned char* s_loadable,
                                            const KvSource& src, int n0) {
  using P = TilePasses<Tr::kBlockN>;
  int hole = 0;
  if (src.table != nullptr) {
    const int offset_mask = (1 << src.block_shift) - 1;
#pragma unroll
    for (int pass = 0; pass < P::kCount; ++pass) {
      const int r = P::row(pass), c = P::chunk(pass), j = n0 + r;
      const int column = j >> src.block_shift;
      const bool listed = j < src.length && column < src.table_width;
      const int block = listed ? __ldg(src.table + column) : -1;
      const bool ok = listed && static_cast<unsigned>(block) < static_cast<unsigned>(src.num_rows);
      const int slot = ok ? (block << src.block_shift) | (j & offset_mask) : 0;
      cp::cp_async_16(s_k + Tr::Tile::offset(r, c), src.k + (long long)slot * src.k_row + c * 8, ok);
      cp::cp_async_16(s_v + Tr::Tile::offset(r, c), src.v + (long long)slot * src.v_row + c * 8, ok);
      if (c == 0) s_loadable[r] = ok;
      hole |= !ok && j < src.length;
    }
  } else {
    const long long k_tile = (long long)(src.first_row + n0) * src.k_row;
    const long long v_tile = (long long)(src.first_row + n0) * src.v_row;
#pragma unroll
    for (int pass = 0; pass < P::kCount; ++pass) {
      const int r = P::row(pass), c = P::chunk(pass);
      const bool ok = n0 + r < src.loadable;
      cp::cp_async_16(s_k + Tr::Tile::offset(r, c), src.k + (ok ? k_tile + r * src.k_row + c * 8 : 0ll), ok);
      cp::cp_async_16(s_v + Tr::Tile::offset(r, c), src.v + (ok ? v_tile + r * src.v_row + c * 8 : 0ll), ok);
      if (c == 0) s_loadable[r] = ok;
      hole |= !ok && n0 + r < src.length;
    }
  }
  return hole;
}

// ---------------------------------------------------------------------------- math steps

// S = Q K^T for this warp's rows and one key tile.
__device__ __forceinline__ void qk_tile(float (&s)[Tr::kMTiles][Tr::kNTiles][4], u32 s_q, u32 s_k,
                                        int warp_row0, int lane) {
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < Tr::kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
  for (int kk = 0; kk < Tr::kHeadDim / 16; ++kk) {
    u32 a[Tr::kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt)
      cp::ldmatrix_x4(a[mt], s_q + Tr::Tile::offset(warp_row0 + mt * 16 + (lane & 15), 2 * kk + (lane >> 4)));
#pragma unroll
    for (int np = 0; np < Tr::kNTiles / 2; ++np) {
      u32 b[4];  // keys np*16 .. +15, head dims kk*16 .. +15
      cp::ldmatrix_x4(b, s_k + Tr::Tile::offset(np * 16 + (lane >> 4) * 8 + (lane & 7), 2 * kk + ((lane >> 3) & 1)));
#pragma unroll
      for (int mt = 0; mt < Tr::kMTiles; ++mt) {
        cp::mma_16816(s[mt][2 * np], a[mt], b[0], b[1], T());
        cp::mma_16816(s[mt][2 * np + 1], a[mt], b[2], b[3], T());
      }
    }
  }
}

// Score modifications on the scaled score (natural units): softcap c * tanh(s / c), then ALiBi
// -slope * |i + Lk - Lq - j|.  Only called when one of them is on; the caller then uses
// log2(e) as the exp2 scale, since the scores already carry softmax_scale.
__device__ __forceinline__ void apply_score_mods(float (&s)[Tr::kMTiles][Tr::kNTiles][4], float scale,
                                                 float softcap, float slope, int row0, int offset,
                                                 int n0, int lane) {
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < Tr::kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = row0 + mt * 16 + (lane >> 2) + (e >> 1) * 8;
        const int j = n0 + nt * 8 + 2 * (lane & 3) + (e & 1);
        float x = s[mt][nt][e] * scale;
        if (softcap > 0.f) x = softcap * tanhf(x / softcap);
        x -= slope * fabsf(static_cast<float>(i + offset - j));
        s[mt][nt][e] = x;
      }
}

// Mask: key j is kept for query row i iff i + off - left <= j <= i + off + right (a bound is off
// when negative), j < Lk and the key was loadable.  Only called on tiles that straddle a bound.
__device__ __forceinline__ void apply_mask(float (&s)[Tr::kMTiles][Tr::kNTiles][4], int row0, int offset,
                                           int n0, int length_k, int left, int right, bool hole,
                                           const unsigned char* s_loadable, int lane) {
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = row0 + mt * 16 + (lane >> 2) + half * 8;
      const int lo = left >= 0 ? i + offset - left : -1;
      const int hi = right >= 0 ? min(i + offset + right, length_k - 1) : length_k - 1;
#pragma unroll
      for (int nt = 0; nt < Tr::kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = nt * 8 + 2 * (lane & 3) + e;
          const int j = n0 + c;
          if (j < lo || j > hi || (hole && !s_loadable[c])) s[mt][nt][2 * half + e] = -infinity();
        }
    }
}

// Online softmax: new row max, rescale O and the running sum by exp2((m_old - m_new) * scale),
// S -> P = exp2(S * scale - m_new * scale).  A row that has seen no key keeps max -inf; its
// base is taken as 0 so that exp2(-inf - 0) = 0 and nothing becomes NaN.
__device__ __forceinline__ void online_softmax(float (&s)[Tr::kMTiles][Tr::kNTiles][4], WarpState& st,
                                               float scale_log2) {
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float tile_max = -infinity();
#pragma unroll
      for (int nt = 0; nt < Tr::kNTiles; ++nt)
        tile_max = fmaxf(tile_max, fmaxf(s[mt][nt][2 * half], s[mt][nt][2 * half + 1]));
      // The four threads of a quad hold the same two rows.
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float old_max = st.row_max[mt][half];
      const float new_max = fmaxf(old_max, tile_max);
      const float base = new_max == -infinity() ? 0.f : new_max * scale_log2;
      const float alpha = exp2f(old_max * scale_log2 - base);
      st.row_max[mt][half] = new_max;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < Tr::kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float p = exp2f(fmaf(s[mt][nt][2 * half + e], scale_log2, -base));
          s[mt][nt][2 * half + e] = p;
          sum += p;
        }
      st.row_sum[mt][half] = st.row_sum[mt][half] * alpha + sum;
#pragma unroll
      for (int dt = 0; dt < Tr::kDTiles; ++dt) {
        st.o[mt][dt][2 * half] *= alpha;
        st.o[mt][dt][2 * half + 1] *= alpha;
      }
    }
}

// O += P V: the S accumulators of two n8 tiles are exactly an m16k16 A fragment once packed.
__device__ __forceinline__ void pv_tile(const float (&p)[Tr::kMTiles][Tr::kNTiles][4], WarpState& st,
                                        u32 s_v, int lane) {
#pragma unroll
  for (int kk = 0; kk < Tr::kBlockN / 16; ++kk) {
    u32 a[Tr::kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt) {
      a[mt][0] = cp::from_float2(p[mt][2 * kk][0], p[mt][2 * kk][1], T());
      a[mt][1] = cp::from_float2(p[mt][2 * kk][2], p[mt][2 * kk][3], T());
      a[mt][2] = cp::from_float2(p[mt][2 * kk + 1][0], p[mt][2 * kk + 1][1], T());
      a[mt][3] = cp::from_float2(p[mt][2 * kk + 1][2], p[mt][2 * kk + 1][3], T());
    }
#pragma unroll
    for (int dp = 0; dp < Tr::kHeadDim / 16; ++dp) {
      u32 b[4];  // keys kk*16 .. +15, head dims dp*16 .. +15, transposed to k-major
      cp::ldmatrix_x4_trans(b, s_v + Tr::Tile::offset(kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7), 2 * dp + (lane >> 4)));
#pragma unroll
      for (int mt = 0; mt < Tr::kMTiles; ++mt) {
        cp::mma_16816(st.o[mt][2 * dp], a[mt], b[0], b[1], T());
        cp::mma_16816(st.o[mt][2 * dp + 1], a[mt], b[2], b[3], T());
      }
    }
  }
}

// O / rowsum -> out, natural-log LSE -> lse.  A row that saw no key writes zeros and -inf.
__device__ __forceinline__ void store_output(WarpState& st, T* out, long long out_row, float* lse,
                                             long long lse_base, int q_start, int row0, int length_q,
                                             int total_q, float scale_log2, int lane) {
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float sum = st.row_sum[mt][half];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int i = row0 + mt * 16 + (lane >> 2) + half * 8;
      const long long row = (long long)q_start + i;
      if (i >= length_q || row < 0 || row >= total_q) continue;
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      u32* dst = reinterpret_cast<u32*>(out + row * out_row) + (lane & 3);
#pragma unroll
      for (int dt = 0; dt < Tr::kDTiles; ++dt)
        dst[dt * 4] = cp::from_float2(st.o[mt][dt][2 * half] * inv, st.o[mt][dt][2 * half + 1] * inv, T());
      if (lse != nullptr && (lane & 3) == 0)
        lse[lse_base + row] = sum > 0.f ? (st.row_max[mt][half] * scale_log2 + log2f(sum)) * kLn2 : -infinity();
    }
}

// Rows [first, last) of a tile that sees no key at all: zeros and LSE -inf.
__device__ __forceinline__ void store_empty_rows(T* out, long long out_row, float* lse, long long lse_base,
                                                 int q_start, int first, int last, int total_q) {
  for (int index = threadIdx.x; index < (last - first) * Tr::kChunks; index += Tr::kThreads) {
    const long long row = (long long)q_start + first + index / Tr::kChunks;
    if (row < 0 || row >= total_q) continue;
    reinterpret_cast<uint4*>(out + row * out_row)[index % Tr::kChunks] = make_uint4(0, 0, 0, 0);
    if (lse != nullptr && index % Tr::kChunks == 0) lse[lse_base + row] = -infinity();
  }
}

}  // namespace varlen

extern "C" __global__ void __launch_bounds__(varlen::Tr::kThreads, varlen::Tr::kMinBlocks) varlen_fwd(
    const varlen::T* __restrict__ q, const varlen::T* __restrict__ k, const varlen::T* __restrict__ v,
    varlen::T* __restrict__ out, float* __restrict__ lse,          // out [total_q, H, D]; lse [H, total_q] or null
    const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k,
    const int* __restrict__ block_table,                             // [B, table_width] or null
    const float* __restrict__ alibi_slopes,                          // [H] or null
    long long q_row, long long q_head,                               // strides in elements
    int k_row, long long k_head, int v_row, long long v_head,         // paged: per slot
    int total_q, int kv_rows,                                        // total_k, or num_blocks when paged
    int num_heads, int group_size, int table_width, int block_shift,
    float softmax_scale, float softcap, int window_left, int window_right) {
  using namespace varlen;
  extern __shared__ __align__(128) unsigned char smem[];
  const u32 s_q = cp::smem_address(smem);
  const u32 s_kv = s_q + Tr::kQBytes;
  unsigned char* s_loadable = smem + Tr::kQBytes + 2 * Tr::kStages * Tr::kKVBytes;

  // Longest-running query tiles (the last ones, under causal masking) start first.
  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int head = blockIdx.y, seq = blockIdx.z;
  const int q_start = cu_seqlens_q[seq], length_q = cu_seqlens_q[seq + 1] - q_start;
  const int k_start = cu_seqlens_k[seq], length_k = cu_seqlens_k[seq + 1] - k_start;
  const int m0 = m_block * Tr::kBlockM;
  if (m0 >= length_q) return;
  const int m_end = min(m0 + Tr::kBlockM, length_q);
  const int offset = length_k - length_q;  // bottom-right alignment of causal / window bounds

  const long long out_row = (long long)num_heads * Tr::kHeadDim;
  T* out_head = out + (long long)head * Tr::kHeadDim;
  const long long lse_base = (long long)head * total_q;

  // Key range [n_lo, n_hi) that any row of this tile may see; tiles outside it are skipped.
  int n_hi = length_k, n_lo = 0;
  if (window_right >= 0) n_hi = min(n_hi, m_end - 1 + offset + window_right + 1);
  if (window_left >= 0) n_lo = max(n_lo, m0 + offset - window_left);
  if (n_hi <= n_lo) {
    store_empty_rows(out_head, out_row, lse, lse_base, q_start, m0, m_end, total_q);
    return;
  }
  const int tile_first = (n_hi + Tr::kBlockN - 1) / Tr::kBlockN - 1;  // visited high to low
  const int num_tiles = tile_first - n_lo / Tr::kBlockN + 1;

  const int kv_head = head / group_size;
  KvSource src;
  src.k = k + kv_head * k_head;
  src.v = v + kv_head * v_head;
  src.table = block_table == nullptr ? nullptr : block_table + (long long)seq * table_width;
  src.k_row = k_row; src.v_row = v_row;
  src.first_row = k_start; src.num_rows = kv_rows; src.length = length_k;
  src.loadable = k_start < 0 ? 0 : max(0, min(length_k, kv_rows - k_start));
  src.table_width = table_width; src.block_shift = block_shift;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warp_row0 = warp * Tr::kWarpRows;   // within the tile
  const int row0 = m0 + warp_row0;              // within the sequence
  const int row_last = min(row0 + Tr::kWarpRows, length_q) - 1;
  const bool warp_active = row0 < length_q;     // a warp past the sequence's end only loads

  const bool mods = softcap > 0.f || alibi_slopes != nullptr;
  const float slope = alibi_slopes != nullptr ? alibi_slopes[head] : 0.f;
  // With mods the scores already carry softmax_scale; otherwise it is folded into exp2.
  const float scale_log2 = mods ? kLog2e : softmax_scale * kLog2e;

  WarpState st;
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) { st.row_max[mt][half] = -infinity(); st.row_sum[mt][half] = 0.f; }
#pragma unroll
    for (int dt = 0; dt < Tr::kDTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) st.o[mt][dt][e] = 0.f;
  }

  // Prologue: Q, then the first NUM_STAGES - 1 key tiles, one cp.async group each.
  load_q_tile(s_q, q + (long long)head * q_head, q_row, q_start + m0, m_end - m0, total_q);
  cp::cp_async_commit();
  int hole_bits = 0;  // bit s: this thread met a hole in the tile now in stage s
#pragma unroll
  for (int s = 0; s < Tr::kStages - 1; ++s) {
    if (s < num_tiles)
      hole_bits |= load_kv_tile(s_kv + 2 * s * Tr::kKVBytes, s_kv + (2 * s + 1) * Tr::kKVBytes,
                                s_loadable + s * Tr::kBlockN, src, (tile_first - s) * Tr::kBlockN) << s;
    cp::cp_async_commit();
  }

  for (int it = 0; it < num_tiles; ++it) {
    const int stage = it % Tr::kStages;
    const int n0 = (tile_first - it) * Tr::kBlockN;
    // Wait for this tile; the barrier also frees the stage computed last iteration.
    cp::cp_async_wait<Tr::kStages - 2>();
    const bool hole = __syncthreads_or((hole_bits >> stage) & 1);

    // Prefetch the tile NUM_STAGES - 1 ahead into the stage freed by the barrier.
    {
      const int ahead = it + Tr::kStages - 1, ps = ahead % Tr::kStages;
      hole_bits &= ~(1 << ps);
      if (ahead < num_tiles)
        hole_bits |= load_kv_tile(s_kv + 2 * ps * Tr::kKVBytes, s_kv + (2 * ps + 1) * Tr::kKVBytes,
                                  s_loadable + ps * Tr::kBlockN, src, (tile_first - ahead) * Tr::kBlockN) << ps;
      cp::cp_async_commit();
    }

    if (!warp_active) continue;
    // Does this warp see any key of the tile, and does the tile straddle one of its bounds?
    const bool visible = (window_right < 0 || n0 <= row_last + offset + window_right) &&
                         (window_left < 0 || n0 + Tr::kBlockN - 1 >= row0 + offset - window_left);
    if (!visible) continue;
    const bool needs_mask = hole || n0 + Tr::kBlockN > length_k ||
                            (window_right >= 0 && n0 + Tr::kBlockN - 1 > row0 + offset + window_right) ||
                            (window_left >= 0 && n0 < row_last + offset - window_left);

    const u32 s_k = s_kv + 2 * stage * Tr::kKVBytes, s_v = s_k + Tr::kKVBytes;
    float s[Tr::kMTiles][Tr::kNTiles][4];
    qk_tile(s, s_q, s_k, warp_row0, lane);                                       // S = Q K^T
    if (mods) apply_score_mods(s, softmax_scale, softcap, slope, row0, offset, n0, lane);
    if (needs_mask)
      apply_mask(s, row0, offset, n0, length_k, window_left, window_right, hole,
                 s_loadable + stage * Tr::kBlockN, lane);
    online_softmax(s, st, scale_log2);                                           // P = softmax(S)
    pv_tile(s, st, s_v, lane);                                                   // O += P V
  }
  cp::cp_async_wait<0>();  // no copy may still target shared memory when the CTA exits

  if (warp_active)
    store_output(st, out_head, out_row, lse, lse_base, q_start, row0, length_q, total_q, scale_log2, lane);
}
