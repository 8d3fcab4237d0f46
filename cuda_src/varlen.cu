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
// Compile-time parameters (cupy_paged/kernels/varlen.py spells them in the KernelKey):
//   SCALAR_T (__half | __nv_bfloat16), HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES,
//   MIN_BLOCKS (CTAs per SM the register allocation must allow), SMEM_BYTES (the dynamic shared
//   memory the host computes for the shape; Traits checks it against its own layout).
// Everything else (causal/window, softcap, ALiBi, LSE, paged or not, block size) is a
// run-time argument, so one specialization serves all of them.
//
// The per-tile overhead is kept small: ldmatrix addresses are one per-lane base XOR a compile-time
// step (no per-use swizzle arithmetic); a full contiguous key tile is copied with one pointer step
// per pass and no predicates, a full paged one with unconditional block-table loads; the prefetch
// of the next tile is issued after S = Q K^T, while the tensor cores drain it; the row max and sum
// are tree reductions.  Paged K/V, both kernels: a full tile's block ids are staged in shared
// memory by 4-byte cp.async copies in the group of the tile kAhead before it, so that no K/V copy
// waits on a dependent block-table load (varlen_common.cuh, load_stage).
//
// Safety: rows past a sequence's end, block ids outside [0, num_blocks), block-table columns
// past its width and cu_seqlens entries outside the arrays are never dereferenced: such keys
// are loaded as zeros and masked out ("holes"), such query rows are neither read nor written
// (every q/out/lse row is checked against [0, total_q), so a negative or decreasing cu_seqlens_q
// cannot move a write outside q's rows; a decreasing range counts as an empty sequence).  One CTA
// per sequence also reports such values to the device error word (check_sequence in
// varlen_common.cuh), at its end, apart from the K/V loop.
#include "common.cuh"
#include "mma.cuh"

namespace varlen {

using cp::u32;
using T = SCALAR_T;

template <int D, int BM, int BN, int WARPS, int STAGES, int MIN_CTAS>
struct Traits {
  static constexpr int kHeadDim = D, kBlockM = BM, kBlockN = BN, kStages = STAGES;
  static constexpr int kMinBlocks = MIN_CTAS;
  static constexpr int kAhead = STAGES - 1;  // key tiles in flight ahead of the one computed
  static constexpr int kThreads = WARPS * 32;
  static constexpr int kCtaThreads = kThreads;  // every thread loads
  static constexpr int kWarpRows = BM / WARPS;  // query rows per warp
  static constexpr int kMTiles = kWarpRows / 16;  // m16 tiles per warp
  static constexpr int kNTiles = BN / 8;          // n8 tiles of S per warp row tile
  static constexpr int kDTiles = D / 8;           // n8 tiles of O
  static constexpr int kChunks = D / 8;           // 16-byte chunks per row of Q, K, V
  using Tile = cp::SmemTile<kChunks>;
  using QTile = Tile;   // the layouts varlen_common.cuh loads into
  using KVTile = Tile;
  static constexpr int kRowBytes = Tile::kRowChunks * 16;
  static constexpr int kKSteps = D / 16;          // k16 steps of Q K^T
  // Shared memory: Q tile, then K and V stages, then one "key is loadable" byte per key per stage,
  // then the paged loader's block-id ring (one int per key per stage: varlen_common.cuh, id_ring).
  static constexpr int kQBytes = Tile::bytes(BM);
  static constexpr int kKVBytes = Tile::bytes(BN);
  static constexpr int kSmemBytes = kQBytes + 2 * STAGES * kKVBytes + STAGES * BN + 4 * STAGES * BN;
  static_assert(D % 16 == 0 && BN % 16 == 0, "head dim and key tile must be multiples of 16");
  static_assert(kWarpRows % 16 == 0 && kMTiles >= 1, "each warp owns whole m16 tiles");
  static_assert(STAGES >= 2, "at least double buffering");
};

using Tr = Traits<HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES, MIN_BLOCKS>;
// The host launches with SMEM_BYTES of dynamic shared memory (Tiles.smem_bytes in
// kernels/varlen.py): it must be this layout's size.
static_assert(Tr::kSmemBytes == SMEM_BYTES, "Tiles.smem_bytes differs from Traits::kSmemBytes");

}  // namespace varlen

#include "varlen_common.cuh"

namespace varlen {

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

// ---------------------------------------------------------------------------- math steps

// Q A-fragments of this warp's rows, from the Q tile in shared memory.
__device__ __forceinline__ void load_q_frags(u32 (&a)[Tr::kMTiles][4], u32 s_q, const LaneOffsets& lo, int kk) {
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt)
    cp::ldmatrix_x4(a[mt], s_q + mt * 16 * Tr::kRowBytes + step_offset(lo.q, kk));
}

// S = Q K^T for this warp's rows and one key tile.
__device__ __forceinline__ void qk_tile(float (&s)[Tr::kMTiles][Tr::kNTiles][4], u32 s_q, u32 s_k,
                                        const LaneOffsets& lo) {
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < Tr::kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
  for (int kk = 0; kk < Tr::kKSteps; ++kk) {
    u32 a[Tr::kMTiles][4];
    load_q_frags(a, s_q, lo, kk);
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

}  // namespace varlen

extern "C" __global__ void __launch_bounds__(varlen::Tr::kThreads, varlen::Tr::kMinBlocks)
    varlen_fwd(VARLEN_FWD_PARAMS) {
  using namespace varlen;
  extern __shared__ __align__(128) unsigned char smem[];
  const u32 s_q = cp::smem_address(smem);
  const u32 s_kv = s_q + Tr::kQBytes;
  unsigned char* s_loadable = smem + Tr::kQBytes + 2 * Tr::kStages * Tr::kKVBytes;

  Task t;
  if (make_task(t, VARLEN_FWD_ARGS)) {  // the CTA's work; then its one exit (check_sequence says why)
    const int m0 = t.m0, length_q = t.length_q, length_k = t.length_k, offset = t.offset;
    const int tile_first = t.tile_first, num_tiles = t.num_tiles;
    const bool mods = t.mods;
    const float slope = t.slope, scale_log2 = t.scale_log2;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warp_row0 = warp * Tr::kWarpRows;   // within the tile
    const int row0 = m0 + warp_row0;              // within the sequence
    const int row_last = min(row0 + Tr::kWarpRows, length_q) - 1;
    const bool warp_active = row0 < length_q;     // a warp past the sequence's end only loads
    const LaneOffsets lo = lane_offsets(warp_row0, lane);

    WarpState st;
    init_state(st);

    int hole_bits = load_prologue(s_q, s_kv, s_loadable, t, q_row, total_q);  // bit s: a hole in stage s

    PFrags p;

    for (int it = 0; it < num_tiles; ++it) {
      const int stage = it % Tr::kStages;
      const int n0 = (tile_first - it) * Tr::kBlockN;
      // Wait for this tile; the barrier also frees the stage that no warp reads any more.
      cp::cp_async_wait<Tr::kAhead - 1>();
      const bool hole = __syncthreads_or((hole_bits >> stage) & 1);

      // Does this warp see any key of the tile?  (A warp past the sequence's end only loads.)
      const bool visible = warp_active &&
                           (window_right < 0 || n0 <= row_last + offset + window_right) &&
                           (window_left < 0 || n0 + Tr::kBlockN - 1 >= row0 + offset - window_left);
      const u32 s_k = s_kv + 2 * stage * Tr::kKVBytes, s_v = s_k + Tr::kKVBytes;
      float s[Tr::kMTiles][Tr::kNTiles][4];
      if (visible) qk_tile(s, s_q, s_k, lo);                                   // S = Q K^T

      // Prefetch the tile kAhead ahead into the stage freed by the barrier.  Issued after the QK^T mma instructions, so that its address
      // arithmetic fills issue slots while the tensor cores drain them; every thread takes part.
      {
        const int ahead = it + Tr::kAhead, ps = ahead % Tr::kStages;
        hole_bits &= ~(1 << ps);
        if (ahead < num_tiles) hole_bits |= load_stage<true>(s_kv, s_loadable, t, ahead);
        cp::cp_async_commit();
      }

      if (!visible) continue;
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
      pv_tile(p, st, s_v, lo);                                                     // O += P V
    }
    cp::cp_async_wait<0>();  // no copy may still target shared memory when the CTA exits

    if (warp_active)
      store_output(st, t.out_head, t.out_row, lse, t.lse_base, t.q_start, row0, length_q, total_q, scale_log2, lane);
  }
  check_inputs(VARLEN_FWD_ARGS);
}
