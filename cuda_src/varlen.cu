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
//   MIN_BLOCKS (CTAs per SM the register allocation must allow), Q_IN_REGS (1: the warp's Q
//   A-fragments are read from shared memory once and stay in registers for the whole key loop),
//   PINGPONG (1: the upper half of the warps computes P V of a tile one iteration late, see below).
// Everything else (causal/window, softcap, ALiBi, LSE, paged or not, block size) is a
// run-time argument, so one specialization serves all of them.
//
// v3 (see benchmarks/NOTES_varlen.md): Q fragments optionally in registers; ldmatrix addresses
// as one per-lane base XOR a compile-time step (no per-use swizzle arithmetic); a full
// contiguous key tile is copied with one pointer step per pass and no predicates, a full paged
// one with unconditional block-table loads; the prefetch
// of the next tile is issued after S = Q K^T, while the tensor cores drain it; tree reductions
// for the row max and sum.
//
// PINGPONG (a candidate, timed by the benchmark's sweep): all warps meet at one barrier per key
// tile, so without it they run in phase and the tensor cores idle while every warp computes its
// softmax.  With it, warps [NUM_WARPS/2, NUM_WARPS) (each shares a scheduler with warp w - NUM_WARPS/2)
// run P V of tile j at the start of iteration j + 1, before their Q K^T of tile j + 1: so one warp
// of each scheduler is in its softmax while the other issues mma.  They keep P of tile j packed
// in registers across the barrier, and V of tile j must stay in shared memory one iteration
// longer: at least 3 stages, and the prefetch runs NUM_STAGES - 2 tiles ahead instead of - 1.
//
// Safety: rows past a sequence's end, block ids outside [0, num_blocks), block-table columns
// past its width and cu_seqlens entries outside the arrays are never dereferenced: such keys
// are loaded as zeros and masked out ("holes"), such query rows are neither read nor written.
#include "common.cuh"
#include "mma.cuh"

namespace varlen {

using cp::u32;
using T = SCALAR_T;

#ifndef Q_IN_REGS
#define Q_IN_REGS 0
#endif
#ifndef PINGPONG
#define PINGPONG 0
#endif

template <int D, int BM, int BN, int WARPS, int STAGES, int MIN_CTAS, bool Q_REGS, bool PING_PONG>
struct Traits {
  static constexpr int kHeadDim = D, kBlockM = BM, kBlockN = BN, kWarps = WARPS, kStages = STAGES;
  static constexpr int kMinBlocks = MIN_CTAS;
  static constexpr bool kQInRegs = Q_REGS;
  static constexpr bool kPingPong = PING_PONG;
  // Key tiles in flight ahead of the one computed: a stage is rewritten only after every warp is
  // done with it (the late warps of PINGPONG read V one iteration later).
  static constexpr int kAhead = PING_PONG ? STAGES - 2 : STAGES - 1;
  static constexpr int kThreads = WARPS * 32;
  static constexpr int kWarpRows = BM / WARPS;  // query rows per warp
  static constexpr int kMTiles = kWarpRows / 16;  // m16 tiles per warp
  static constexpr int kNTiles = BN / 8;          // n8 tiles of S per warp row tile
  static constexpr int kDTiles = D / 8;           // n8 tiles of O
  static constexpr int kChunks = D / 8;           // 16-byte chunks per row of Q, K, V
  using Tile = cp::SmemTile<kChunks>;
  static constexpr int kRowBytes = Tile::kRowChunks * 16;
  static constexpr int kKSteps = D / 16;          // k16 steps of Q K^T
  // Shared memory: Q tile, then K and V stages, then one "key is loadable" byte per key per stage.
  static constexpr int kQBytes = Tile::bytes(BM);
  static constexpr int kKVBytes = Tile::bytes(BN);
  static constexpr int kSmemBytes = kQBytes + 2 * STAGES * kKVBytes + STAGES * BN;
  static_assert(D % 16 == 0 && BN % 16 == 0, "head dim and key tile must be multiples of 16");
  static_assert(kWarpRows % 16 == 0 && kMTiles >= 1, "each warp owns whole m16 tiles");
  static_assert(STAGES >= 2, "at least double buffering");
  static_assert(!PING_PONG || (STAGES >= 3 && WARPS % 8 == 0),
                "PINGPONG: a stage is held one more iteration; warp w and w + WARPS/2 share a scheduler");
};

using Tr = Traits<HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES, MIN_BLOCKS, Q_IN_REGS != 0, PINGPONG != 0>;
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
  // Contiguous, when every thread copies the same chunk of rows kRowsPerPass apart in each pass
  // (TilePasses::kLaneFixed): element offset of this thread's first row and chunk, and the
  // element step from one pass to the next.
  long long k_lane, v_lane, k_pass, v_pass;
};

// ldmatrix addressing.  In every ldmatrix of this kernel lane l names one 16-byte chunk,
// c0 + 2 * step, of one row of a tile, where c0 (0 or 1) and the row depend on the lane only and
// `step` is the k16 step (of the head dim for Q and K, of the output dims for V).  In a swizzled
// tile (SmemTile::kSwizzle) chunk c of row r sits at r * kRowBytes + 16 * (c ^ (r & 7)); since
// c0 + 2 * step == c0 ^ (2 * step) and (2 * step) ^ y stays inside the row for y < 8, the offset
// of step s is the offset of step 0 XOR 32 * s.  In a padded tile it is the offset of step 0
// plus 32 * s.  Rows 16 apart keep r & 7, so they are a constant 16 * kRowBytes apart.  Each
// lane therefore computes one base per operand, once, and every address is that base combined
// with compile-time constants, plus the tile's (stage's) shared-memory address.
__device__ __forceinline__ u32 step_offset(u32 base, int step) {
  return Tr::Tile::kSwizzle ? (base ^ static_cast<u32>(32 * step)) : base + static_cast<u32>(32 * step);
}

struct LaneOffsets {
  u32 q;  // A of Q K^T: row warp_row0 + (lane & 15), chunk lane >> 4
  u32 k;  // B of Q K^T: key (lane >> 4) * 8 + (lane & 7), chunk (lane >> 3) & 1
  u32 v;  // B of P V (transposed): key ((lane >> 3) & 1) * 8 + (lane & 7), chunk lane >> 4
};

__device__ __forceinline__ LaneOffsets lane_offsets(int warp_row0, int lane) {
  LaneOffsets lo;
  lo.q = Tr::Tile::offset(warp_row0 + (lane & 15), lane >> 4);
  lo.k = Tr::Tile::offset((lane >> 4) * 8 + (lane & 7), (lane >> 3) & 1);
  lo.v = Tr::Tile::offset(((lane >> 3) & 1) * 8 + (lane & 7), lane >> 4);
  return lo;
}

// The warp's Q A-fragments [m16 tile][k16 step] when Q_IN_REGS (else a 1x1 placeholder).
using QFrags = u32[Tr::kQInRegs ? Tr::kMTiles : 1][Tr::kQInRegs ? Tr::kKSteps : 1][4];

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
  // Every pass, the thread copies chunk threadIdx.x % kChunks of a row kRowsPerPass below the
  // last one (all head dims but 96, whose 12 chunks do not divide the threads).
  static constexpr bool kLaneFixed = Tr::kThreads % Tr::kChunks == 0;
  static constexpr int kRowsPerPass = Tr::kThreads / Tr::kChunks;
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
    if (P::kLaneFixed && n0 + Tr::kBlockN <= src.length &&
        ((n0 + Tr::kBlockN - 1) >> src.block_shift) < src.table_width) {
      // A tile inside the sequence and inside the block table (every tile but a sequence's
      // last): every row is listed, so the table loads are unconditional (and can all be in
      // flight at once); only a block id outside [0, num_blocks) can still make a hole.
      const int c = threadIdx.x % Tr::kChunks;  // P::chunk(pass) for every pass
      const T* k_chunk = src.k + c * 8;
      const T* v_chunk = src.v + c * 8;
#pragma unroll
      for (int pass = 0; pass < P::kCount; ++pass) {
        const int r = P::row(pass), j = n0 + r;
        const int block = __ldg(src.table + (j >> src.block_shift));
        const bool ok = static_cast<unsigned>(block) < static_cast<unsigned>(src.num_rows);
        const int slot = ok ? (block << src.block_shift) | (j & offset_mask) : 0;
        cp::cp_async_16(s_k + Tr::Tile::offset(r, c), k_chunk + (long long)slot * src.k_row, ok);
        cp::cp_async_16(s_v + Tr::Tile::offset(r, c), v_chunk + (long long)slot * src.v_row, ok);
        if (c == 0) s_loadable[r] = ok;
        hole |= !ok;
      }
      return hole;
    }
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
  } else if (P::kLaneFixed && n0 + Tr::kBlockN <= src.loadable) {
    // A full tile (every key but those of a sequence's last, partial tile): no predicate, no
    // select, one 64-bit pointer step per pass.  s_loadable is left stale: it is read only when
    // some thread met a hole in this tile, and a full tile has none.
    const T* kp = src.k + ((long long)(src.first_row + n0) * src.k_row + src.k_lane);
    const T* vp = src.v + ((long long)(src.first_row + n0) * src.v_row + src.v_lane);
#pragma unroll
    for (int pass = 0; pass < P::kCount; ++pass) {
      const int r = P::row(pass), c = P::chunk(pass);
      cp::cp_async_16(s_k + Tr::Tile::offset(r, c), kp, true);
      cp::cp_async_16(s_v + Tr::Tile::offset(r, c), vp, true);
      kp += src.k_pass;
      vp += src.v_pass;
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

// Q A-fragments of this warp's rows, from the Q tile in shared memory.
__device__ __forceinline__ void load_q_frags(u32 (&a)[Tr::kMTiles][4], u32 s_q, const LaneOffsets& lo, int kk) {
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt)
    cp::ldmatrix_x4(a[mt], s_q + mt * 16 * Tr::kRowBytes + step_offset(lo.q, kk));
}

// S = Q K^T for this warp's rows and one key tile (Q from `qf` when Q_IN_REGS, else from s_q).
__device__ __forceinline__ void qk_tile(float (&s)[Tr::kMTiles][Tr::kNTiles][4], const QFrags& qf, u32 s_q,
                                        u32 s_k, const LaneOffsets& lo) {
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < Tr::kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
  for (int kk = 0; kk < Tr::kKSteps; ++kk) {
    u32 a[Tr::kMTiles][4];
    if constexpr (Tr::kQInRegs) {
#pragma unroll
      for (int mt = 0; mt < Tr::kMTiles; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) a[mt][e] = qf[Tr::kQInRegs ? mt : 0][Tr::kQInRegs ? kk : 0][e];
    } else {
      load_q_frags(a, s_q, lo, kk);
    }
    const u32 k_address = s_k + step_offset(lo.k, kk);
#pragma unroll
    for (int np = 0; np < Tr::kNTiles / 2; ++np) {
      u32 b[4];  // keys np*16 .. +15, head dims kk*16 .. +15
      cp::ldmatrix_x4(b, k_address + np * 16 * Tr::kRowBytes);
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
      // Pairwise tree over the row's values (depth log2 instead of a chain of kNTiles).
      float m[Tr::kNTiles];
#pragma unroll
      for (int nt = 0; nt < Tr::kNTiles; ++nt) m[nt] = fmaxf(s[mt][nt][2 * half], s[mt][nt][2 * half + 1]);
#pragma unroll
      for (int width = 1; width < Tr::kNTiles; width *= 2)
#pragma unroll
        for (int nt = 0; nt + width < Tr::kNTiles; nt += 2 * width) m[nt] = fmaxf(m[nt], m[nt + width]);
      float tile_max = m[0];
      // The four threads of a quad hold the same two rows.
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float old_max = st.row_max[mt][half];
      const float new_max = fmaxf(old_max, tile_max);
      const float base = new_max == -infinity() ? 0.f : new_max * scale_log2;
      const float alpha = exp2f(old_max * scale_log2 - base);
      st.row_max[mt][half] = new_max;
      float sums[Tr::kNTiles];
#pragma unroll
      for (int nt = 0; nt < Tr::kNTiles; ++nt) {
        const float p0 = exp2f(fmaf(s[mt][nt][2 * half], scale_log2, -base));
        const float p1 = exp2f(fmaf(s[mt][nt][2 * half + 1], scale_log2, -base));
        s[mt][nt][2 * half] = p0;
        s[mt][nt][2 * half + 1] = p1;
        sums[nt] = p0 + p1;
      }
#pragma unroll
      for (int width = 1; width < Tr::kNTiles; width *= 2)
#pragma unroll
        for (int nt = 0; nt + width < Tr::kNTiles; nt += 2 * width) sums[nt] += sums[nt + width];
      st.row_sum[mt][half] = fmaf(st.row_sum[mt][half], alpha, sums[0]);
#pragma unroll
      for (int dt = 0; dt < Tr::kDTiles; ++dt) {
        st.o[mt][dt][2 * half] *= alpha;
        st.o[mt][dt][2 * half + 1] *= alpha;
      }
    }
}

// P as the A operand of P V: the S accumulators of two n8 tiles are exactly an m16k16 A
// fragment once packed.  [m16 tile][k16 step of the keys][4]
using PFrags = u32[Tr::kMTiles][Tr::kBlockN / 16][4];

__device__ __forceinline__ void pack_p(const float (&p)[Tr::kMTiles][Tr::kNTiles][4], PFrags& a) {
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt)
#pragma unroll
    for (int kk = 0; kk < Tr::kBlockN / 16; ++kk) {
      a[mt][kk][0] = cp::from_float2(p[mt][2 * kk][0], p[mt][2 * kk][1], T());
      a[mt][kk][1] = cp::from_float2(p[mt][2 * kk][2], p[mt][2 * kk][3], T());
      a[mt][kk][2] = cp::from_float2(p[mt][2 * kk + 1][0], p[mt][2 * kk + 1][1], T());
      a[mt][kk][3] = cp::from_float2(p[mt][2 * kk + 1][2], p[mt][2 * kk + 1][3], T());
    }
}

// O += P V.
__device__ __forceinline__ void pv_tile(const PFrags& a, WarpState& st, u32 s_v, const LaneOffsets& lo) {
#pragma unroll
  for (int kk = 0; kk < Tr::kBlockN / 16; ++kk) {
#pragma unroll
    for (int dp = 0; dp < Tr::kHeadDim / 16; ++dp) {
      u32 b[4];  // keys kk*16 .. +15, head dims dp*16 .. +15, transposed to k-major
      cp::ldmatrix_x4_trans(b, s_v + kk * 16 * Tr::kRowBytes + step_offset(lo.v, dp));
#pragma unroll
      for (int mt = 0; mt < Tr::kMTiles; ++mt) {
        cp::mma_16816(st.o[mt][2 * dp], a[mt][kk], b[0], b[1], T());
        cp::mma_16816(st.o[mt][2 * dp + 1], a[mt][kk], b[2], b[3], T());
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
  {
    using P = TilePasses<Tr::kBlockN>;
    const int r = threadIdx.x / Tr::kChunks, c = threadIdx.x % Tr::kChunks;  // used when P::kLaneFixed
    src.k_lane = (long long)r * k_row + c * 8;
    src.v_lane = (long long)r * v_row + c * 8;
    src.k_pass = (long long)P::kRowsPerPass * k_row;
    src.v_pass = (long long)P::kRowsPerPass * v_row;
  }

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warp_row0 = warp * Tr::kWarpRows;   // within the tile
  const int row0 = m0 + warp_row0;              // within the sequence
  const int row_last = min(row0 + Tr::kWarpRows, length_q) - 1;
  const bool warp_active = row0 < length_q;     // a warp past the sequence's end only loads
  const LaneOffsets lo = lane_offsets(warp_row0, lane);

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

  // Prologue: Q, then the first kAhead key tiles, one cp.async group each.
  load_q_tile(s_q, q + (long long)head * q_head, q_row, q_start + m0, m_end - m0, total_q);
  cp::cp_async_commit();
  int hole_bits = 0;  // bit s: this thread met a hole in the tile now in stage s
#pragma unroll
  for (int s = 0; s < Tr::kAhead; ++s) {
    if (s < num_tiles)
      hole_bits |= load_kv_tile(s_kv + 2 * s * Tr::kKVBytes, s_kv + (2 * s + 1) * Tr::kKVBytes,
                                s_loadable + s * Tr::kBlockN, src, (tile_first - s) * Tr::kBlockN) << s;
    cp::cp_async_commit();
  }

  // Q_IN_REGS: the Q group, committed first, has landed once at most the kAhead key groups
  // after it are pending; after the barrier every thread's part of the tile is visible.  The
  // fragments then stay in registers; the Q tile in shared memory is not read again.
  QFrags qf;
  if constexpr (Tr::kQInRegs) {
    cp::cp_async_wait<Tr::kAhead>();
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < Tr::kKSteps; ++kk)
#pragma unroll
      for (int mt = 0; mt < Tr::kMTiles; ++mt)
        cp::ldmatrix_x4(qf[Tr::kQInRegs ? mt : 0][Tr::kQInRegs ? kk : 0],
                        s_q + mt * 16 * Tr::kRowBytes + step_offset(lo.q, kk));
  }

  // PINGPONG: this warp is one of the late half; it holds P of the previous tile (if it saw
  // that tile) and runs its P V at the start of the next iteration, or after the loop.
  // Every path through an iteration writes `p` after that use (zeros where the warp does not
  // see the tile), so `p` is dead, and takes no registers, during Q K^T and the softmax.
  const bool late = Tr::kPingPong && warp >= Tr::kWarps / 2;
  PFrags p;
  bool late_pending = false;  // P of the previous tile (stage (stage + kStages - 1) % kStages) is in p

  for (int it = 0; it < num_tiles; ++it) {
    const int stage = it % Tr::kStages;
    const int n0 = (tile_first - it) * Tr::kBlockN;
    // Wait for this tile; the barrier also frees the stage that no warp reads any more.
    cp::cp_async_wait<Tr::kAhead - 1>();
    const bool hole = __syncthreads_or((hole_bits >> stage) & 1);

    if (Tr::kPingPong && late_pending)                                            // O += P V, late
      pv_tile(p, st, s_kv + (2 * ((stage + Tr::kStages - 1) % Tr::kStages) + 1) * Tr::kKVBytes, lo);

    // Does this warp see any key of the tile?  (A warp past the sequence's end only loads.)
    const bool visible = warp_active &&
                         (window_right < 0 || n0 <= row_last + offset + window_right) &&
                         (window_left < 0 || n0 + Tr::kBlockN - 1 >= row0 + offset - window_left);
    const u32 s_k = s_kv + 2 * stage * Tr::kKVBytes, s_v = s_k + Tr::kKVBytes;
    float s[Tr::kMTiles][Tr::kNTiles][4];
    if (visible) qk_tile(s, qf, s_q, s_k, lo);                                   // S = Q K^T

    // Prefetch the tile kAhead ahead into the stage freed by the barrier (computed kStages -
    // kAhead iterations ago).  Issued after the QK^T mma instructions, so that its address
    // arithmetic fills issue slots while the tensor cores drain them; every thread takes part.
    {
      const int ahead = it + Tr::kAhead, ps = ahead % Tr::kStages;
      hole_bits &= ~(1 << ps);
      if (ahead < num_tiles)
        hole_bits |= load_kv_tile(s_kv + 2 * ps * Tr::kKVBytes, s_kv + (2 * ps + 1) * Tr::kKVBytes,
                                  s_loadable + ps * Tr::kBlockN, src, (tile_first - ahead) * Tr::kBlockN) << ps;
      cp::cp_async_commit();
    }

    late_pending = false;
    if (!visible) {
      if constexpr (Tr::kPingPong) {
#pragma unroll
        for (int mt = 0; mt < Tr::kMTiles; ++mt)
#pragma unroll
          for (int kk = 0; kk < Tr::kBlockN / 16; ++kk)
#pragma unroll
            for (int e = 0; e < 4; ++e) p[mt][kk][e] = 0u;
      }
      continue;
    }
    // Does the tile straddle one of this warp's bounds?  (Under causal masking: only the tiles
    // on the diagonal, and a sequence's last, partial key tile.)
    const bool needs_mask = hole || n0 + Tr::kBlockN > length_k ||
                            (window_right >= 0 && n0 + Tr::kBlockN - 1 > row0 + offset + window_right) ||
                            (window_left >= 0 && n0 < row_last + offset - window_left);
    if (mods) apply_score_mods(s, softmax_scale, softcap, slope, row0, offset, n0, lane);
    if (needs_mask)
      apply_mask(s, row0, offset, n0, length_k, window_left, window_right, hole,
                 s_loadable + stage * Tr::kBlockN, lane);
    online_softmax(s, st, scale_log2);                                           // P = softmax(S)
    pack_p(s, p);
    if (late) {
      late_pending = true;
    } else {
      pv_tile(p, st, s_v, lo);                                                   // O += P V
    }
  }
  if (Tr::kPingPong && late_pending)  // the last tile's V is still in its stage: nothing rewrites it
    pv_tile(p, st, s_kv + (2 * ((num_tiles - 1) % Tr::kStages) + 1) * Tr::kKVBytes, lo);
  cp::cp_async_wait<0>();  // no copy may still target shared memory when the CTA exits

  if (warp_active)
    store_output(st, out_head, out_row, lse, lse_base, q_start, row0, length_q, total_q, scale_log2, lane);
}
